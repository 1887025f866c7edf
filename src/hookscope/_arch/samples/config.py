"""What a sample input reads from a transformers config: vocabularies, special token ids, image
and audio geometry. Read with ``getattr`` only, so transformers is never imported here.

Composite models keep these facts in sub-configurations (``text_config``, ``vision_config``,
``audio_config`` ...), so every reader looks at the top level first and then where transformers
keeps the part it asks about.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = [
    "image_size",
    "int_field",
    "reserved_token_ids",
    "text_config",
    "token_id",
    "vision_config",
    "vocab_size",
]

# token ids a random text may hold: the ones every tokenizer has. Any other special id of a
# config (an image, video or audio placeholder, a turn marker) would make the model look for
# media or structure that the sample does not have.
_PLAIN_TOKENS = re.compile(r"^_?(pad|bos|eos|unk|sep|cls|mask|decoder_start|forced_bos|forced_eos|sot|eot|blank)_")


def int_field(config: object, *names: str) -> int | None:
    """The first of ``names`` that ``config`` holds as a positive int (a bool is not one)."""
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def text_config(config: object) -> object:
    """The part of ``config`` that describes the text model: ``get_text_config()`` where
    transformers offers it, else ``text_config``, else the config itself."""
    getter = getattr(config, "get_text_config", None)
    if callable(getter):
        try:
            found = getter()
        except (TypeError, ValueError, AttributeError):  # an old or odd config: look by name instead
            found = None
        if found is not None:
            return found
    found = getattr(config, "text_config", None)
    return found if found is not None else config


def vision_config(config: object) -> object | None:
    """The vision tower's config of a composite model, or None."""
    for name in ("vision_config", "vision_tower_config", "visual"):
        found: object = getattr(config, name, None)
        if found is not None and not isinstance(found, (int, str, bool)):
            return found
    return None


def vocab_size(config: object) -> int:
    """The token vocabulary: the config's own, else its text model's; 0 when it has none."""
    own = int_field(config, "vocab_size")
    return own or int_field(text_config(config), "vocab_size") or 0


def token_id(config: object, *names: str) -> int | None:
    """The first special token id among ``names``, at the top level or in the text config
    (ids may be 0, unlike :func:`int_field`)."""
    for part in (config, text_config(config)):
        for name in names:
            value = getattr(part, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                return value
    return None


def reserved_token_ids(config: object) -> list[int]:
    """Special ids a random text must not hold (see ``_PLAIN_TOKENS``), sorted."""
    found: set[int] = set()
    for part in (config, text_config(config)):
        to_dict = getattr(part, "to_dict", None)
        fields: dict[str, Any] = to_dict() if callable(to_dict) else vars(part)
        for name, value in fields.items():
            if not name.endswith(("token_id", "token_index", "token_ids")) or _PLAIN_TOKENS.match(name):
                continue
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, int) and not isinstance(item, bool) and item >= 0:
                    found.add(item)
    return sorted(found)


def image_size(config: object) -> tuple[int, int] | None:
    """The (height, width) a vision config states, or None."""
    size = getattr(config, "image_size", None)
    size = size if size is not None else getattr(config, "resolution", None)  # VQ image tokenizers
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size, size
    if isinstance(size, (list, tuple)) and len(size) >= 2 and all(isinstance(item, int) for item in size[:2]):
        return int(size[0]), int(size[1])
    if isinstance(size, dict) and isinstance(size.get("height"), int) and isinstance(size.get("width"), int):
        return size["height"], size["width"]
    return None

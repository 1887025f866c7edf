"""Which sequence positions of a vision-language model's input hold image tokens.

A vision-language model's text holds one placeholder token per image feature (LLaVA's
``<image>`` repeated, Qwen2-VL's image pads): the language model's blocks see image tokens at
those positions and text tokens elsewhere. ``token_mask="image"`` (``"text"``) of a capture or an
extraction makes its named reductions over dimension 1 (``"mean:1"``, ``"last:1"``, ...) use the
image (text) positions only: the placeholders are where the call's ``input_ids`` equal the
model's image token (``config.image_token_id``, ``image_token_index``, ...); text is every other
real token (its ``attention_mask``, where the call has one).

>>> import torch
>>> class Config: image_token_id = 9
>>> ids = torch.tensor([[1, 9, 9, 4]])
>>> positions_mask(Config(), "image", (), {"input_ids": ids}).tolist()
[[False, True, True, False]]
>>> positions_mask(Config(), "text", (ids,), {"attention_mask": torch.tensor([[1, 1, 1, 0]])}).tolist()
[[True, False, False, False]]
"""

from __future__ import annotations

from typing import Any

import torch

from hookscope._arch.samples.multimodal import image_token
from hookscope.errors import SpecError

__all__ = ["POSITION_WORDS", "positions_mask"]

#: The words ``token_mask=`` (``mask=``) takes for a vision-language model's positions.
POSITION_WORDS = ("image", "text")


def positions_mask(config: object, word: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """The ``(batch, seq)`` mask of a model call's image (``word="image"``) or text positions."""
    placeholder = image_token(config)
    if placeholder is None:
        raise SpecError(
            f"token_mask={word!r} marks a vision-language model's image or text positions, and this model's config "
            "names no image token (image_token_id, image_token_index); use 'auto', a mask keyword, or None"
        )
    ids = kwargs.get("input_ids", args[0] if args else None)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
        raise SpecError(
            f"token_mask={word!r} reads the call's input_ids, and this call has none shaped (batch, seq): pass "
            "input_ids (the positions of image tokens are where they equal the image token)"
        )
    image = ids == placeholder
    if word == "image":
        return image
    real = kwargs.get("attention_mask")
    if isinstance(real, torch.Tensor) and real.shape == ids.shape:
        return ~image & real.bool()
    return ~image

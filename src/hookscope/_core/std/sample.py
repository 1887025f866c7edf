"""A tiny input made from a transformers model's config, for checking a canonical map.

The map of canonical names is checked on one forward (shapes and the residual identities), so a
transformers model needs no input from the user: two short rows of token ids, pixels or audio
features, shaped by its config. Any other model is asked for an example input.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["sample_input"]

_BATCH, _TOKENS = 2, 5


def sample_input(model: nn.Module) -> dict[str, Any] | None:
    """Keyword arguments for one small forward of a transformers ``model``, or None for a model
    without a ``config`` this knows how to feed."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    device, dtype = _placement(model)
    main = getattr(model, "main_input_name", "input_ids")
    inputs: dict[str, Any] = {}
    if main == "input_ids":
        vocab = _text_config(config, "vocab_size")
        if not isinstance(vocab, int):
            return None
        inputs["input_ids"] = _tokens(vocab, _TOKENS, device)
    elif main == "pixel_values":
        size = _text_config(config, "image_size")
        channels = _text_config(config, "num_channels") or 3
        side = size[0] if isinstance(size, (list, tuple)) else size
        if not isinstance(side, int):
            return None
        inputs["pixel_values"] = torch.randn(_BATCH, channels, side, side, generator=_seeded(), dtype=dtype).to(device)
    elif main == "input_features":
        mels = getattr(config, "num_mel_bins", None)
        positions = getattr(config, "max_source_positions", None)
        if not isinstance(mels, int) or not isinstance(positions, int):
            return None
        frames = 2 * positions  # the convolutions halve the frames to max_source_positions
        inputs["input_features"] = torch.randn(_BATCH, mels, frames, generator=_seeded(), dtype=dtype).to(device)
    else:
        return None
    if getattr(config, "is_encoder_decoder", False):
        vocab = getattr(config, "vocab_size", None)
        if not isinstance(vocab, int):
            return None
        inputs["decoder_input_ids"] = _tokens(vocab, _TOKENS - 2, device)
    if "use_cache" in getattr(config, "to_dict", dict)():
        inputs["use_cache"] = False
    return inputs


def _text_config(config: Any, key: str) -> Any:
    value = getattr(config, key, None)
    if value is None and hasattr(config, "text_config"):
        value = getattr(config.text_config, key, None)
    return value


def _tokens(vocab: int, length: int, device: torch.device) -> torch.Tensor:
    """Rows of distinct, non-special-looking ids (3, 4, ...), wrapped into the vocabulary."""
    ids = torch.arange(3, 3 + _BATCH * length).reshape(_BATCH, length) % max(vocab, 1)
    return ids.to(device)


def _seeded() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _placement(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    for parameter in model.parameters():
        if parameter.is_floating_point():
            return parameter.device, parameter.dtype
    return torch.device("cpu"), torch.float32

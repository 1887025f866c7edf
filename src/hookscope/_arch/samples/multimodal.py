"""Image and text together: the pixels of a vision-language model and the image placeholder
tokens its text must hold, one per image feature the vision tower makes.

How many features an image becomes depends on the tower, the projector, pooling and tiling, and
every family computes it differently; the one number they all agree on is the length of what
``get_image_features`` returns, so the sample asks the model (one pass of the vision tower, no
gradients) instead of repeating each family's arithmetic.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hookscope._arch.samples.config import int_field, token_id, vision_config
from hookscope._arch.samples.media import pixel_shape

__all__ = ["GRID_NAMES", "image_feature_count", "image_token", "pixel_inputs", "with_image"]

GRID_NAMES = ("image_grid_thw", "grid_thw")  # a patch encoder's (frames, rows, columns) per image
_IMAGE_TOKEN_NAMES = ("image_token_id", "image_token_index", "img_token_id", "image_token")


def image_token(config: object) -> int | None:
    """The placeholder id a vision-language model's text holds where an image goes, or None."""
    return token_id(config, *_IMAGE_TOKEN_NAMES)


def pixel_inputs(
    config: object, parameters: dict[str, Any], batch: int, generator: torch.Generator, dtype: torch.dtype | None
) -> dict[str, torch.Tensor] | None:
    """``pixel_values`` (and the grid or size tensors a family's forward takes with them) for
    ``batch`` images, or None where the config states no image geometry."""
    grid = next((name for name in GRID_NAMES if name in parameters), None)
    if grid is not None:  # Qwen2-VL and kin: flattened patches plus their grid
        return _patch_inputs(config, grid, batch, generator, dtype)
    shape = pixel_shape(config, batch)
    if shape is None:
        return None
    values = torch.randn(shape, generator=generator)
    inputs = {"pixel_values": values.to(dtype) if dtype is not None else values}
    if "image_sizes" in parameters:
        inputs["image_sizes"] = torch.tensor([list(shape[-2:])] * batch)
    return inputs


def _patch_inputs(
    config: object, grid: str, batch: int, generator: torch.Generator, dtype: torch.dtype | None
) -> dict[str, torch.Tensor] | None:
    vision = vision_config(config) or config
    patch = int_field(vision, "patch_size", "spatial_patch_size")
    merge = int_field(vision, "spatial_merge_size") or int_field(config, "spatial_merge_size") or 1
    channels = int_field(vision, "in_channels", "num_channels", "in_chans") or 3
    temporal = int_field(vision, "temporal_patch_size") or 1
    if patch is None:
        return None
    side = 2 * merge  # the smallest grid that merges to whole tokens: (side / merge) ** 2 = 4 per image
    values = torch.randn((batch * side * side, channels * temporal * patch * patch), generator=generator)
    return {
        "pixel_values": values.to(dtype) if dtype is not None else values,
        grid: torch.tensor([[1, side, side]] * batch),
    }


def image_feature_count(model: nn.Module, inputs: dict[str, torch.Tensor]) -> int:
    """How many placeholder tokens the images in ``inputs`` fill, per batch (one vision pass)."""
    getter = getattr(model, "get_image_features", None)
    if not callable(getter):
        raise TypeError(f"{type(model).__name__} has no get_image_features to count image tokens with")
    with torch.no_grad():
        output = getter(**inputs)
    features: Any = output
    for name in ("pooler_output", "image_embeds", "last_hidden_state"):
        found = getattr(output, name, None)
        if found is not None:
            features = found
            break
    pieces = features if isinstance(features, (list, tuple)) else [features]
    total = sum(piece.numel() // piece.shape[-1] for piece in pieces if isinstance(piece, torch.Tensor))
    batch = (
        int(next(iter(inputs.values())).shape[0]) if "image_grid_thw" not in inputs else len(inputs["image_grid_thw"])
    )
    return int(total) // max(1, batch)


def _variants(inputs: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """The layouts of one image that families take, tried in turn: as made; without its size;
    one image per row as a 5-D ``(batch, images, channels, height, width)`` (Idefics3, SmolVLM);
    a tiled image of 2, 3 or 5 crops beside its size (LLaVA-NeXT's base view plus tiles)."""
    found = [inputs, {key: value for key, value in inputs.items() if key != "image_sizes"}]
    pixels = inputs.get("pixel_values")
    if pixels is not None and pixels.dim() == 4:
        found.append({"pixel_values": pixels[:, None]})
        if "image_sizes" in inputs:
            found.extend(
                {**inputs, "pixel_values": pixels[:, None].expand(-1, tiles, -1, -1, -1).contiguous()}
                for tiles in (2, 3, 5)
            )
    return found


def with_image(
    model: nn.Module,
    config: object,
    tokens: torch.Tensor,
    parameters: dict[str, Any],
    generator: torch.Generator,
    dtype: torch.dtype | None,
) -> dict[str, torch.Tensor] | None:
    """``input_ids`` with one image's placeholders after the first token, plus the pixel inputs;
    None where the model's images cannot be made or counted (the caller keeps text only)."""
    placeholder = image_token(config)
    inputs = pixel_inputs(config, parameters, int(tokens.shape[0]), generator, dtype)
    if placeholder is None or inputs is None:
        return None
    count = 0
    for variant in _variants(inputs):
        try:
            count = image_feature_count(model, variant)
        except Exception:  # a family-specific need (tiles, masks, sizes): try the next, else text only
            continue
        inputs = variant
        break
    if count <= 0:
        return None
    batch = int(tokens.shape[0])
    start = token_id(config, "vision_start_token_id", "boi_token_id", "boi_token_index", "image_start_token_id")
    end = token_id(config, "vision_end_token_id", "eoi_token_id", "eoi_token_index", "image_end_token_id")
    image = [placeholder] * count
    middle = torch.tensor(([start] if start is not None else []) + image + ([end] if end is not None else []))
    ids = torch.cat([tokens[:, :1], middle.expand(batch, -1), tokens[:, 1:]], dim=1)
    if "mm_token_type_ids" in parameters:  # Qwen2-VL's multimodal rotary positions: 1 marks an image token
        inputs["mm_token_type_ids"] = (ids == placeholder).int()
    return {"input_ids": ids, **inputs}

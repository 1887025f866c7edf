"""Token inputs: random text that avoids a config's special placeholders, the start tokens of an
encoder-decoder model's decoder, and the word boxes of a document model."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from hookscope._arch.samples.config import int_field, reserved_token_ids, token_id

__all__ = ["DECODER_LENGTH", "boxes", "decoder_input", "forward_parameters", "random_tokens"]

DECODER_LENGTH = 4  # the decoder input of an encoder-decoder model: a few start tokens


def forward_parameters(model: nn.Module) -> dict[str, inspect.Parameter]:
    """The named parameters of ``model.forward`` (empty where it has no readable signature)."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {name: parameter for name, parameter in parameters.items() if parameter.kind in kinds}


def random_tokens(config: object, vocab: int, size: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Token ids of ``size`` drawn uniformly from ``[0, vocab)`` less the config's reserved ids.

    A model with no reserved ids gets exactly ``torch.randint(0, vocab, size)``; otherwise the
    draw is over the allowed ids and each reserved id is stepped over, so the ids stay uniform.
    """
    reserved = [item for item in reserved_token_ids(config) if item < vocab]
    if len(reserved) >= vocab:
        return torch.randint(0, vocab, size, generator=generator)
    tokens = torch.randint(0, vocab - len(reserved), size, generator=generator)
    for item in reserved:  # ascending: each step keeps the ids below the next reserved one in order
        tokens = tokens + (tokens >= item).long()
    return tokens


def decoder_input(model: nn.Module, config: object, batch: int, length: int) -> dict[str, torch.Tensor]:
    """``decoder_input_ids`` for an encoder-decoder model (T5, BART, Whisper, ...), else nothing.

    Such a model refuses to run on its encoder's input alone, and no shape can supply a second
    input, so the sample gets ``length`` copies of the decoder's start token. Only a model whose
    forward takes ``decoder_input_ids`` gets them.
    """
    if getattr(config, "is_encoder_decoder", False) is not True:
        return {}
    if "decoder_input_ids" not in forward_parameters(model):
        return {}
    generation = getattr(model, "generation_config", None)  # where transformers 5 keeps the start token
    candidates: list[Any] = [
        getattr(config, "decoder_start_token_id", None),
        getattr(generation, "decoder_start_token_id", None),
        getattr(config, "pad_token_id", None),  # what T5 starts its decoder with
        token_id(getattr(config, "decoder", None), "decoder_start_token_id", "bos_token_id", "pad_token_id"),
    ]
    start = next((value for value in candidates if isinstance(value, int) and not isinstance(value, bool)), 0)
    return {"decoder_input_ids": torch.full((batch, length), start, dtype=torch.long)}


def boxes(config: object, size: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Word boxes ``(batch, sequence, 4)`` as ``x0, y0, x1, y1`` with ``x0 <= x1`` and ``y0 <= y1``,
    inside the model's 2-D position table (LayoutLM's 0..1000 page grid)."""
    limit = min(int_field(config, "max_2d_position_embeddings") or 1024, 1001) - 1
    corners = torch.randint(0, limit + 1, (*size, 2, 2), generator=generator)
    low, high = corners.min(dim=-2).values, corners.max(dim=-2).values  # per axis: (x, y)
    return torch.cat([low, high], dim=-1)

"""A sample input for a model: what the command line runs a model on, and what a canonical map
is checked on.

transformers models are recognised by their ``main_input_name`` (read with ``getattr``, so
transformers is never imported here): token models get ``input_ids`` in ``[0, vocab_size)`` (and
encoder-decoder ones a few ``decoder_input_ids`` start tokens), vision models ``pixel_values``,
speech models ``input_features``, each sized by the config when no shape is given; a model with
a ``sample_input(shape, seed=)`` method (the demo's shapes classifier) makes its own; a class may
declare ``example_input_shape``; any other model gets one positional tensor of the given shape.
"""

from __future__ import annotations

import inspect
import operator
from typing import Any

import torch
from torch import nn

from hookscope.errors import SpecError

__all__ = ["DECODER_LENGTH", "DEFAULT_SEQUENCE_LENGTH", "default_input_shape", "sample_input"]

DEFAULT_SEQUENCE_LENGTH = 16
DECODER_LENGTH = 4  # the decoder input of an encoder-decoder model: a few start tokens


def sample_input(
    model: nn.Module, shape: tuple[int, ...] | None = None, *, seed: int = 0, dtype: torch.dtype | None = None
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A random input for ``model`` as ``(args, kwargs)``, for ``model(*args, **kwargs)``.

    ``shape=None`` takes the model's default (see the module docstring), and a model that has
    none is a ``SpecError`` asking for a shape. The values come from a generator seeded with
    ``seed``, so the same call gives the same input; ``dtype`` casts floating values (pixels,
    audio features, a plain tensor), never token ids.

    >>> args, kwargs = sample_input(nn.Linear(4, 2), (2, 4))
    >>> args[0].shape, kwargs
    (torch.Size([2, 4]), {})
    """
    if isinstance(seed, bool) or not hasattr(seed, "__index__") or not -(2**63) <= operator.index(seed) < 2**64:
        raise SpecError(f"seed={seed!r} is not a torch seed; expected a whole number from 0 to 2**64 - 1")
    size = shape if shape is not None else default_input_shape(model)
    if size is None:
        raise SpecError(
            f"no default input for {type(model).__name__}: it declares no example_input_shape and is not a "
            "transformers model of a known input; pass a shape, e.g. hs.sample_input(model, (1, 3, 224, 224))"
        )
    config = getattr(model, "config", None)
    main_input = getattr(model, "main_input_name", None)
    generator = torch.Generator().manual_seed(seed)
    vocab_size = _vocab_size(config)
    if main_input == "input_ids" and vocab_size:
        if len(size) != 2:
            raise SpecError(
                f"input shape {size} has {len(size)} dimensions; {type(model).__name__} takes token ids of "
                "shape batch x sequence, e.g. 1x16"
            )
        tokens = {"input_ids": torch.randint(0, vocab_size, size, generator=generator)}
        return (), {**tokens, **_decoder_input(model, config, size[0], min(DECODER_LENGTH, size[1]))}
    maker = getattr(model, "sample_input", None)
    values = maker(size, seed=seed) if callable(maker) else torch.randn(size, generator=generator)
    if dtype is not None:
        values = values.to(dtype)
    if main_input in ("pixel_values", "input_features"):
        return (), {main_input: values, **_decoder_input(model, config, size[0], DECODER_LENGTH)}
    return (values,), {}


def default_input_shape(model: nn.Module) -> tuple[int, ...] | None:
    """The shape :func:`sample_input` uses when given none, or None where the model says too
    little about itself: a class's ``example_input_shape``; for transformers models, one row of
    ``DEFAULT_SEQUENCE_LENGTH`` tokens (within the position table), one image of the config's
    size, or the audio frames the encoder takes."""
    declared = getattr(type(model), "example_input_shape", None)
    if declared is not None:
        return tuple(declared)
    config = getattr(model, "config", None)
    main_input = getattr(model, "main_input_name", None)
    if main_input == "input_ids" and _vocab_size(config):
        limit = getattr(config, "max_position_embeddings", None)
        return (1, min(DEFAULT_SEQUENCE_LENGTH, limit) if isinstance(limit, int) else DEFAULT_SEQUENCE_LENGTH)
    channels, image_size = getattr(config, "num_channels", None), getattr(config, "image_size", None)
    if main_input == "pixel_values" and isinstance(channels, int) and image_size is not None:
        height, width = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)[:2]
        return (1, channels, int(height), int(width))
    mels, positions = getattr(config, "num_mel_bins", None), getattr(config, "max_source_positions", None)
    if main_input == "input_features" and isinstance(mels, int) and isinstance(positions, int):
        return (1, mels, 2 * positions)  # the encoder's convolutions halve the frames to its positions
    return None


def _vocab_size(config: object) -> int:
    vocab_size = getattr(config, "vocab_size", None)
    return vocab_size if isinstance(vocab_size, int) and vocab_size > 0 else 0


def _decoder_input(model: nn.Module, config: object, batch: int, length: int) -> dict[str, torch.Tensor]:
    """``decoder_input_ids`` for an encoder-decoder model (T5, BART, Whisper, ...), else nothing.

    Such a model refuses to run on its encoder's input alone, and no shape can supply a second
    input, so the sample gets ``length`` copies of the decoder's start token. Only a model whose
    forward takes ``decoder_input_ids`` gets them.
    """
    if getattr(config, "is_encoder_decoder", False) is not True:
        return {}
    try:
        takes = "decoder_input_ids" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        takes = False
    if not takes:
        return {}
    generation = getattr(model, "generation_config", None)  # where transformers 5 keeps the start token
    candidates = (
        getattr(config, "decoder_start_token_id", None),
        getattr(generation, "decoder_start_token_id", None),
        getattr(config, "pad_token_id", None),  # what T5 starts its decoder with
    )
    start = next((value for value in candidates if isinstance(value, int)), 0)
    return {"decoder_input_ids": torch.full((batch, length), start, dtype=torch.long)}

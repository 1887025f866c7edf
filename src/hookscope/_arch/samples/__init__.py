"""A sample input for a model: what the command line runs a model on, what a canonical map is
checked on, and what the zoo sweep runs every transformers architecture on.

transformers models are recognised by their ``main_input_name`` (read with ``getattr``, so
transformers is never imported here): token models get ``input_ids`` in ``[0, vocab_size)`` that
avoid the config's placeholder ids (and encoder-decoder ones a few ``decoder_input_ids`` start
tokens, document models word ``bbox``-es, vision-language models an image with its placeholder
tokens), vision models ``pixel_values``, speech models ``input_features`` or raw ``input_values``,
each sized by the config when no shape is given; a model with a ``sample_input(shape, seed=)``
method (the demo's shapes classifier) makes its own; a class may declare
``example_input_shape``; any other model gets one positional tensor of the given shape.
"""

from __future__ import annotations

import inspect
import operator
from typing import Any

import torch
from torch import nn

from hookscope._arch.samples.config import text_config, vision_config, vocab_size
from hookscope._arch.samples.media import DEFAULT_IMAGE_SIZE, MEDIA_INPUTS, audio_shape, pixel_shape
from hookscope._arch.samples.multimodal import GRID_NAMES, image_token, pixel_inputs, with_image
from hookscope._arch.samples.tokens import DECODER_LENGTH, boxes, decoder_input, forward_parameters, random_tokens
from hookscope.errors import SpecError

__all__ = ["DECODER_LENGTH", "DEFAULT_SEQUENCE_LENGTH", "default_input_shape", "sample_input"]

DEFAULT_SEQUENCE_LENGTH = 16


def sample_input(
    model: nn.Module, shape: tuple[int, ...] | None = None, *, seed: int = 0, dtype: torch.dtype | None = None
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A random input for ``model`` as ``(args, kwargs)``, for ``model(*args, **kwargs)``.

    ``shape=None`` takes the model's default (see the module docstring), and a model that has
    none is a ``SpecError`` asking for a shape. The values come from a generator seeded with
    ``seed``, so the same call gives the same input; ``dtype`` casts floating values (pixels,
    audio features, a plain tensor), never token ids. A transformers model whose forward needs
    an input none of the above makes is a ``SpecError`` naming it.

    >>> args, kwargs = sample_input(nn.Linear(4, 2), (2, 4))
    >>> args[0].shape, kwargs
    (torch.Size([2, 4]), {})
    """
    if isinstance(seed, bool) or not hasattr(seed, "__index__") or not -(2**63) <= operator.index(seed) < 2**64:
        raise SpecError(f"seed={seed!r} is not a torch seed; expected a whole number from 0 to 2**64 - 1")
    size = shape if shape is not None else default_input_shape(model)
    config = getattr(model, "config", None)
    main_input = _main_input(model, config)
    if size is None:
        raise _no_default(model, config, main_input)
    generator = torch.Generator().manual_seed(seed)
    vocab = vocab_size(config)
    if main_input == "input_ids" and vocab:
        if len(size) != 2:
            raise SpecError(
                f"input shape {size} has {len(size)} dimensions; {type(model).__name__} takes token ids of "
                "shape batch x sequence, e.g. 1x16"
            )
        kwargs = _text_inputs(model, config, vocab, size, generator, dtype)
        return (), _checked(model, kwargs)
    parameters = forward_parameters(model) if config is not None else {}
    if main_input == "pixel_values" and shape is None and any(name in parameters for name in GRID_NAMES):
        patches = pixel_inputs(config, parameters, size[0], generator, dtype)  # a patch encoder: rows and grid
        if patches is not None:
            return (), _checked(model, patches)
    maker = getattr(model, "sample_input", None)
    values = maker(size, seed=seed) if callable(maker) else torch.randn(size, generator=generator)
    if dtype is not None:
        values = values.to(dtype)
    if main_input in MEDIA_INPUTS and config is not None:
        kwargs = {main_input: values, **decoder_input(model, config, size[0], DECODER_LENGTH)}
        kwargs.update(_text_companion(model, config, size[0], generator))
        return (), _checked(model, kwargs)
    return (values,), {}


def default_input_shape(model: nn.Module) -> tuple[int, ...] | None:
    """The shape :func:`sample_input` uses when given none, or None where the model says too
    little about itself: a class's ``example_input_shape``; for transformers models, one row of
    ``DEFAULT_SEQUENCE_LENGTH`` tokens (within the position table), one image of the config's
    size, or the audio frames or samples the encoder takes."""
    declared = getattr(type(model), "example_input_shape", None)
    if declared is not None:
        return tuple(declared)
    config = getattr(model, "config", None)
    main_input = _main_input(model, config)
    if config is None or main_input is None:
        return None
    if main_input == "input_ids" and vocab_size(config):
        return (1, _sequence_length(config))
    if main_input == "pixel_values":  # a config that states nothing: an RGB image of the common size
        image = pixel_shape(config) or (1, 3, DEFAULT_IMAGE_SIZE, DEFAULT_IMAGE_SIZE)
        frames = getattr(config, "num_frames", None)  # a video model: batch x frames x channels x H x W
        return (image[0], frames, *image[1:]) if isinstance(frames, int) and frames > 0 else image
    return audio_shape(config, main_input)


def _main_input(model: nn.Module, config: object) -> str | None:
    """The model's ``main_input_name``, except where it is transformers' class default
    ``input_ids`` on a model with no vocabulary whose forward takes ``pixel_values`` (a vision
    tower or image tokenizer that never set its own)."""
    main_input = getattr(model, "main_input_name", None)
    if not isinstance(main_input, str):
        return None
    if main_input == "input_ids" and not vocab_size(config) and "pixel_values" in forward_parameters(model):
        return "pixel_values"
    return main_input


def _sequence_length(config: object) -> int:
    """``DEFAULT_SEQUENCE_LENGTH`` within the smallest position table the config states."""
    limits = [
        getattr(part, name, None)
        for part in (config, text_config(config))
        for name in ("max_position_embeddings", "n_positions")
    ]
    return min([DEFAULT_SEQUENCE_LENGTH, *(limit for limit in limits if isinstance(limit, int) and limit > 0)])


def _text_inputs(
    model: nn.Module,
    config: object,
    vocab: int,
    size: tuple[int, ...],
    generator: torch.Generator,
    dtype: torch.dtype | None,
) -> dict[str, Any]:
    """Token ids and what a token model's forward needs with them: decoder start tokens, word
    boxes, and an image where the model has a vision tower."""
    parameters = forward_parameters(model)
    tokens = random_tokens(config, vocab, size, generator)
    kwargs: dict[str, Any] = {"input_ids": tokens}
    kwargs.update(decoder_input(model, config, size[0], min(DECODER_LENGTH, size[1])))
    if "bbox" in parameters:
        kwargs["bbox"] = boxes(config, size, generator)
    if "pixel_values" in parameters and vision_config(config) is not None:
        image = with_image(model, config, tokens, parameters, generator, dtype)
        if image is None and image_token(config) is None:  # a dual encoder (CLIP): an image beside the text
            image = pixel_inputs(config, parameters, size[0], generator, dtype)
        kwargs.update(image or {})
    return kwargs


def _text_companion(model: nn.Module, config: object, batch: int, generator: torch.Generator) -> dict[str, Any]:
    """Token ids for a model whose main input is an image or audio but whose forward also
    requires text (a captioner, a contrastive pair)."""
    parameter = forward_parameters(model).get("input_ids")
    vocab = vocab_size(config)
    if parameter is None or not _required(parameter) or not vocab:
        return {}
    return {"input_ids": random_tokens(config, vocab, (batch, _sequence_length(config)), generator)}


def _no_default(model: nn.Module, config: object, main_input: object) -> SpecError:
    """The error for a model without a default input: what it takes first, and the fix."""
    name = type(model).__name__
    if config is None or not isinstance(main_input, str):
        return SpecError(
            f"no default input for {name}: it declares no example_input_shape and is not a transformers model "
            "of a known input; pass a shape, e.g. hs.sample_input(model, (1, 3, 224, 224))"
        )
    if main_input in ("input_ids", *MEDIA_INPUTS):
        missing, example = ("vocab_size", "(1, 16)") if main_input == "input_ids" else ("size for it", "(1, 16000)")
        return SpecError(
            f"no default input for {name}: it takes `{main_input}` but its config states no {missing}; pass a "
            f"shape, e.g. hs.sample_input(model, {example})"
        )
    return SpecError(
        f"no default input for {name}: it takes `{main_input}`, which hs.sample_input cannot make (it makes "
        "input_ids, pixel_values, input_features and input_values); pass an example input yourself"
    )


def _required(parameter: inspect.Parameter) -> bool:
    return parameter.default is inspect.Parameter.empty


def _checked(model: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs``, or a ``SpecError`` naming the inputs the forward requires that it lacks."""
    missing = [name for name, parameter in forward_parameters(model).items() if _required(parameter)]
    missing = [name for name in missing if name not in kwargs]
    if missing:
        names = ", ".join(f"`{name}`" for name in missing)
        raise SpecError(
            f"{type(model).__name__}.forward requires {names}, which hs.sample_input cannot make; pass an "
            "example input yourself, e.g. model(**inputs) with inputs from its processor"
        )
    return kwargs

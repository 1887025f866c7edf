"""Per-layer reductions for data-set extraction, aware of padding.

A store keeps one row per input, so a reduction must keep dimension 0 (the batch). On top of
the capture's named reductions (``"mean:1"``, ``"max:1"``, ``"first:1"``, ...) extraction knows
two names for sequences: ``"cls"`` (position 0, written ``first:1``) and ``"last"`` (the last
position, ``last:1``).

Padding: a batch of token sequences of different lengths is padded, and the mean over tokens
of a padded row averages pad positions in; its ``"last"`` token is a pad. When the batch
carries a mask (``attention_mask`` by default), the reductions over dimension 1 of a
``(batch, sequence, ...)`` value use only the positions the mask marks: the mean, sum, norm,
max and min over real tokens, the first and the last real token. A value whose first two
dimensions are not the mask's shape is reduced as it is. The mask is read on the device, with
no host sync.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hookscope._shared.reduce import Reduction, parse_reduction
from hookscope.errors import SpecError

__all__ = ["ALIASES", "TokenMask", "describe_reduction", "extraction_reduction"]

#: Names extraction adds to the capture's reductions.
ALIASES = {"cls": "first:1", "last": "last:1", "first": "first:1"}
_LOW_PRECISION = (torch.float16, torch.bfloat16)


class TokenMask:
    """The current batch's mask of real positions, ``(batch, sequence)`` bool, or ``None``.

    One object is shared by every reduction of an extraction; the pipeline sets ``value``
    before each forward.
    """

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None


def describe_reduction(spec: str | Reduction | None) -> str | None:
    """The text a store records for a reduction: its spec, or a function's name and a hash of its code.

    The hash tells two lambdas (or two edits of one function) apart, so a resumed run with
    another reduction function is refused like one with another named reduction.

    >>> describe_reduction("cls"), describe_reduction(None)
    ('first:1', None)
    >>> describe_reduction(lambda v: v.mean(1)) != describe_reduction(lambda v: v.amax(1))
    True
    """
    if spec is None or isinstance(spec, str):
        return ALIASES.get(spec, spec) if isinstance(spec, str) else None
    sparse = getattr(spec, "sparse_latents", None)  # SparseTopk: its k and encoder tell it apart
    if sparse is not None:  # object addresses differ between runs: left out
        encoder = re.sub(r" at 0x[0-9a-fA-F]+", "", str(describe_reduction(getattr(spec, "encode", None))))
        return f"sparse_topk(k={sparse[0]}, encode={encoder})"
    if isinstance(spec, functools.partial):
        return f"partial({describe_reduction(spec.func)}, args={spec.args!r}, keywords={spec.keywords!r})"
    module = getattr(spec, "__module__", "") or ""
    name = getattr(spec, "__qualname__", type(spec).__qualname__)
    method = vars(type(spec)).get("__call__")  # a callable object: the code of its class's __call__
    code = getattr(spec, "__code__", None) or getattr(method, "__code__", None)
    digest = ""
    if code is not None:
        parts = (code.co_code, repr(code.co_consts).encode(), repr(code.co_names).encode())
        digest = " " + hashlib.blake2b(b"|".join(parts), digest_size=6).hexdigest()
    return f"{module}.{name}{digest}" if module else f"{name}{digest}"


def extraction_reduction(spec: str | Reduction | None, mask: TokenMask) -> Reduction | None:
    """The function a capture applies, for ``spec``; named reductions over dim 1 follow ``mask``.

    >>> mask = TokenMask()
    >>> mean = extraction_reduction("mean:1", mask)
    >>> x = torch.tensor([[[1.0], [3.0], [100.0]]])        # one row, 3 positions, the last a pad
    >>> mean(x).tolist()
    [[34.666...]]
    >>> mask.value = torch.tensor([[True, True, False]])
    >>> mean(x).tolist(), extraction_reduction("last", mask)(x).tolist()
    ([[2.0]], [[3.0]])
    """
    if spec is None or callable(spec):
        return spec
    if not isinstance(spec, str):
        raise SpecError(f"reduce={spec!r} is not usable; expected None, a function tensor -> tensor, or e.g. 'mean:1'")
    text = ALIASES.get(spec, spec)
    name, _, dims_text = text.partition(":")
    plain = parse_reduction(text)  # checks the name and the dimensions, with the capture's messages
    if not dims_text:
        raise SpecError(
            f"reduce={spec!r} reduces every dimension, the batch too; a store keeps one row per input: "
            f"name the dimensions, e.g. '{name}:1'"
        )
    dims = tuple(int(part) for part in dims_text.split(","))
    if 0 in dims:
        raise SpecError(
            f"reduce={spec!r} reduces dimension 0, the batch; a store keeps one row per input: "
            "reduce other dimensions, e.g. 'mean:1'"
        )
    assert plain is not None  # a text spec always makes a function
    if dims != (1,):
        return plain
    return _Masked(plain, _MASKED[name], mask)


@dataclass(frozen=True)
class _Masked:
    """A reduction over dim 1 that uses only the masked positions when the value is a sequence."""

    plain: Reduction
    masked: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    mask: TokenMask

    def __call__(self, value: torch.Tensor) -> torch.Tensor:
        mask = self.mask.value
        if mask is None or not value.is_floating_point() or value.dim() < 2 or value.shape[:2] != mask.shape:
            return self.plain(value)
        return self.masked(value, mask)


def _weights(value: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The value in its accumulation dtype, and the mask as 0/1 weights broadcast over its trailing dims."""
    wide = value.float() if value.dtype in _LOW_PRECISION else value
    shape = (*mask.shape, *([1] * (value.dim() - 2)))
    return wide, mask.to(wide.dtype).reshape(shape)


def _masked_sum(value: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    wide, weights = _weights(value, mask)
    return (wide * weights).sum(dim=1)


def _masked_mean(value: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    wide, weights = _weights(value, mask)
    return (wide * weights).sum(dim=1) / weights.sum(dim=1).clamp_min(1)


def _masked_norm(value: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    wide, weights = _weights(value, mask)
    norm: torch.Tensor = torch.linalg.vector_norm(wide * weights, dim=1)
    return norm


def _masked_extreme(largest: bool) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def extreme(value: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        fill = float("-inf") if largest else float("inf")
        hidden = ~mask.reshape(*mask.shape, *([1] * (value.dim() - 2)))
        picked = value.masked_fill(hidden, fill)
        result = picked.amax(dim=1) if largest else picked.amin(dim=1)
        return result.float() if value.dtype in _LOW_PRECISION else result

    return extreme


def _masked_position(last: bool) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def position(value: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        flags = mask.to(torch.int8)
        # argmax gives the first maximum: the first real position, or counted from the end the last one
        index = mask.shape[1] - 1 - flags.flip(1).argmax(dim=1) if last else flags.argmax(dim=1)
        rows = torch.arange(value.shape[0], device=value.device)
        return value[rows, index]  # advanced indexing copies: no view keeps the whole value alive

    return position


_MASKED: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "mean": _masked_mean,
    "sum": _masked_sum,
    "norm": _masked_norm,
    "max": _masked_extreme(largest=True),
    "min": _masked_extreme(largest=False),
    "first": _masked_position(last=False),
    "last": _masked_position(last=True),
}

"""Named reductions applied to a captured value on its device, before it is kept.

Keeping the mean over tokens instead of every token's vector can shrink a capture a hundredfold,
and doing it on the device inside the hook means the full tensor is never copied anywhere.

A named reduction is ``"<name>"`` (over every dimension) or ``"<name>:<dims>"`` with
comma-separated dimensions, negative ones allowed:

================  ==================================================================
``"mean:1"``      mean over dimension 1 (e.g. tokens of ``(batch, seq, hidden)``)
``"sum:2,3"``     sum over dimensions 2 and 3 (e.g. spatial sum of ``(N, C, H, W)``)
``"max:1"``       maximum (``amax``); ``"min:1"`` the minimum (``amin``)
``"norm:-1"``     Euclidean norm
``"first:1"``     index 0 along dimension 1 (e.g. a CLS token); ``"last:1"`` index -1
================  ==================================================================

Named reductions apply to floating-point tensors only; integer and boolean values (token ids,
masks) are kept as they are. Half-precision values are reduced in float32, so a mean of many
bf16 values does not lose its digits, and the result is float32; ``first`` and ``last`` only
pick values and keep the dtype.

Padding: a batch of token sequences of different lengths is padded, and the mean over tokens
of a padded row averages pad positions in; its last token is a pad. Given a mask of real
positions (``(batch, sequence)``, the model's ``attention_mask``), a named reduction over
dimension 1 of a ``(batch, sequence, ...)`` value uses only the positions it marks: the mean,
sum, norm, max and min over real tokens, the first and the last real token. A value whose first
two dimensions are not the mask's shape is reduced as it is. The mask is read on the device,
with no host sync. ``hs.capture`` and ``hs.extract`` both reduce through :func:`reduce_value`,
so a padded batch gives the same rows in both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hookscope.errors import SpecError

__all__ = ["NAMED_REDUCTIONS", "NamedReduction", "Reduction", "mask_of", "parse_reduction", "reduce_value"]

Reduction = Callable[[torch.Tensor], torch.Tensor]
NAMED_REDUCTIONS = ("mean", "sum", "max", "min", "norm", "first", "last")
_LOW_PRECISION = (torch.float16, torch.bfloat16)


Masked = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class NamedReduction:
    """A named reduction as a function that shows as the text it was made from (``'mean:1'``),
    so a message about it names what the user wrote, not a function's address.

    Called with a ``mask`` of real positions, a reduction over dimension 1 uses only those (see
    the module doc); any other reduction, or a value the mask does not fit, ignores it.

    >>> parse_reduction("mean:1")
    'mean:1'
    >>> x = torch.tensor([[[1.0], [3.0], [100.0]]])        # one row, 3 positions, the last a pad
    >>> real = torch.tensor([[True, True, False]])
    >>> parse_reduction("mean:1")(x).tolist(), parse_reduction("mean:1")(x, real).tolist()
    ([[34.666...]], [[2.0]])
    >>> parse_reduction("last:1")(x, real).tolist()
    [[3.0]]
    """

    __slots__ = ("_apply", "_masked", "spec")

    def __init__(self, spec: str, apply: Reduction, masked: Masked | None = None) -> None:
        self.spec = spec
        self._apply = apply
        self._masked = masked

    def __call__(self, tensor: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if mask is not None and self._masked is not None and _fits(tensor, mask):
            return self._masked(tensor, mask)
        return self._apply(tensor)

    def __repr__(self) -> str:
        return repr(self.spec)


def parse_reduction(spec: str | Reduction | None) -> Reduction | None:
    """Turn ``spec`` into a function ``tensor -> tensor`` (or None for no reduction).

    >>> reduce = parse_reduction("mean:1")
    >>> reduce(torch.ones(2, 5, 3)).shape
    torch.Size([2, 3])
    >>> parse_reduction("first:1")(torch.arange(6.0).reshape(1, 3, 2))
    tensor([[0., 1.]])
    """
    if spec is None:
        return None
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise SpecError(f"reduce={spec!r} is not usable; expected None, a function tensor -> tensor, or e.g. 'mean:1'")
    name, _, dims_text = spec.partition(":")
    if name not in NAMED_REDUCTIONS:
        raise SpecError(
            f"reduce={spec!r} names no reduction; expected one of {', '.join(NAMED_REDUCTIONS)}, "
            "optionally with dimensions, e.g. 'mean:1' or 'sum:2,3'"
        )
    dims = _parse_dims(spec, dims_text)
    masked = _MASKED[name] if dims == (1,) else None
    if name in ("first", "last"):
        if dims is None or len(dims) != 1:
            raise SpecError(f"reduce={spec!r} needs exactly one dimension, e.g. '{name}:1'")
        return NamedReduction(spec, _selector(dims[0], 0 if name == "first" else -1), masked)
    return NamedReduction(spec, _reducer(name, dims), masked)


def reduce_value(reduction: Reduction, value: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``reduction`` applied to ``value``; a named reduction over dimension 1 uses only the real
    positions of ``mask`` (the batch's ``attention_mask``, or None). A function of the user's is
    called as it is, with the value alone."""
    if isinstance(reduction, NamedReduction):
        return reduction(value, mask)
    return reduction(value)


def _parse_dims(spec: str, text: str) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise SpecError(f"reduce={spec!r}: dimensions must be integers separated by commas, e.g. 'mean:1,2'") from None


def _selector(dim: int, index: int) -> Reduction:
    def select(tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_floating_point():
            return tensor
        return tensor.select(dim, index).clone()  # a copy: a view would keep the whole tensor alive

    return select


def _reducer(name: str, dims: tuple[int, ...] | None) -> Reduction:
    def reduce(tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_floating_point():
            return tensor
        wide = torch.float32 if tensor.dtype in _LOW_PRECISION else None  # accumulate without a full copy
        if name == "mean":
            return tensor.mean(dim=dims, dtype=wide)
        if name == "sum":
            return tensor.sum(dim=dims, dtype=wide)
        if name == "norm":
            norm: torch.Tensor = torch.linalg.vector_norm(tensor, dim=dims, dtype=wide)
            return norm
        extreme = tensor.amax(dim=dims or ()) if name == "max" else tensor.amin(dim=dims or ())
        return extreme.to(wide) if wide is not None else extreme

    return reduce


def mask_of(kwargs: dict[str, Any], key: str | None) -> torch.Tensor | None:
    """The mask of real positions in a model call's keyword inputs: ``kwargs[key]`` as bool when it
    is a 2-D tensor, else None (the caller says whether a missing one is an error)."""
    found = kwargs.get(key) if key is not None else None
    return found.bool() if isinstance(found, torch.Tensor) and found.dim() == 2 else None


def _fits(value: torch.Tensor, mask: torch.Tensor) -> bool:
    """True when ``mask`` marks the positions of ``value``'s dimension 1 (a floating sequence value)."""
    return value.is_floating_point() and value.dim() >= 2 and value.shape[:2] == mask.shape


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


def _masked_extreme(largest: bool) -> Masked:
    def extreme(value: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        fill = float("-inf") if largest else float("inf")
        hidden = ~mask.reshape(*mask.shape, *([1] * (value.dim() - 2)))
        picked = value.masked_fill(hidden, fill)
        result = picked.amax(dim=1) if largest else picked.amin(dim=1)
        return result.float() if value.dtype in _LOW_PRECISION else result

    return extreme


def _masked_position(last: bool) -> Masked:
    def position(value: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        flags = mask.to(torch.int8)
        # argmax gives the first maximum: the first real position, or counted from the end the last one
        index = mask.shape[1] - 1 - flags.flip(1).argmax(dim=1) if last else flags.argmax(dim=1)
        rows = torch.arange(value.shape[0], device=value.device)
        return value[rows, index]  # advanced indexing copies: no view keeps the whole value alive

    return position


_MASKED: dict[str, Masked] = {
    "mean": _masked_mean,
    "sum": _masked_sum,
    "norm": _masked_norm,
    "max": _masked_extreme(largest=True),
    "min": _masked_extreme(largest=False),
    "first": _masked_position(last=False),
    "last": _masked_position(last=True),
}

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
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hookscope.errors import SpecError

__all__ = ["NAMED_REDUCTIONS", "NamedReduction", "Reduction", "parse_reduction"]

Reduction = Callable[[torch.Tensor], torch.Tensor]
NAMED_REDUCTIONS = ("mean", "sum", "max", "min", "norm", "first", "last")
_LOW_PRECISION = (torch.float16, torch.bfloat16)


class NamedReduction:
    """A named reduction as a function that shows as the text it was made from (``'mean:1'``),
    so a message about it names what the user wrote, not a function's address.

    >>> parse_reduction("mean:1")
    'mean:1'
    """

    __slots__ = ("_apply", "spec")

    def __init__(self, spec: str, apply: Reduction) -> None:
        self.spec = spec
        self._apply = apply

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
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
    if name in ("first", "last"):
        if dims is None or len(dims) != 1:
            raise SpecError(f"reduce={spec!r} needs exactly one dimension, e.g. '{name}:1'")
        return NamedReduction(spec, _selector(dims[0], 0 if name == "first" else -1))
    return NamedReduction(spec, _reducer(name, dims))


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

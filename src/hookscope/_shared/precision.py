"""Precision health: how much of a tensor a low-precision format loses, counted on the device.

For a tensor and a target format (``bfloat16``, ``float16``, ``float8_e4m3fn``, ``float8_e5m2``;
by default the tensor's own), the tensor is cast to the target the way training casts it (round
to nearest, as ``Tensor.to`` does) and compared with itself:

- **underflow**: non-zero values the cast turns into zero;
- **subnormal**: values the cast keeps only as subnormals (below the smallest normal number,
  with fewer significant bits than the format has);
- **overflow**: finite values from half a step above the largest finite number on, which the
  cast turns into +-inf (float16, e5m2) or clamps to the largest value (e4m3fn saturates);
- **zeros**: values that are zero before the cast (ReLU's zeros are not a precision loss);
- **dynamic range**: ``log2(max |y| / min non-zero |y|)`` of the cast values, the octaves used
  (bfloat16 spans about 254, float16 about 40, e4m3fn about 17).

Everything stays on the device in one small vector per tensor (:func:`raw_precision`) until
:func:`read_precision` reads many at once, so a hook pays a cast and a few reductions, no sync.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hookscope._shared.dtypes import parse_dtype
from hookscope._shared.stats import accumulator
from hookscope._shared.transfer import fetch
from hookscope.errors import SpecError

__all__ = [
    "LOW_PRECISION",
    "Precision",
    "merge_precision",
    "parse_precision",
    "precision_target",
    "raw_precision",
    "read_precision",
]

#: The formats precision health knows; each is a floating dtype of this torch.
LOW_PRECISION = ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")

_FIELDS = ("count", "zeros", "underflow", "subnormal", "overflow", "min_abs", "max_abs")
_MIN = _FIELDS.index("min_abs")  # the counts come before it, the extremes from it


@dataclass(frozen=True)
class Precision:
    """What casting one tensor to ``dtype`` loses; fractions are of the tensor's finite values.

    >>> p = read_precision([raw_precision(torch.tensor([1e-30, 0.0, 1.0, 7e4]), torch.float16)])[0]
    >>> p.underflow, p.overflow, p.zeros
    (0.25, 0.25, 0.25)
    """

    dtype: str
    count: int  # finite values looked at
    zeros: float
    underflow: float
    subnormal: float
    overflow: float
    dynamic_range: float  # log2(max |y| / min non-zero |y|); NaN when no value is non-zero

    def as_dict(self) -> dict[str, float]:
        """The fractions and the range, by name (what a logger writes per layer)."""
        return {
            "zeros": self.zeros,
            "underflow": self.underflow,
            "subnormal": self.subnormal,
            "overflow": self.overflow,
            "dynamic_range": self.dynamic_range,
        }


def precision_target(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """The target format of ``dtype`` (``"bf16"``, ``torch.float16``, ``"fp8"`` for e4m3fn), or None."""
    if dtype is None:
        return None
    if dtype in ("fp8", "float8"):
        return torch.float8_e4m3fn
    parsed: object
    try:
        parsed = parse_dtype(dtype) if isinstance(dtype, str) else dtype
    except SpecError:
        parsed = getattr(torch, dtype, None) if isinstance(dtype, str) else None
    if not isinstance(parsed, torch.dtype) or str(parsed).removeprefix("torch.") not in LOW_PRECISION:
        raise SpecError(
            f"precision={dtype!r} is not a low-precision format; expected one of {', '.join(LOW_PRECISION)} "
            "(or 'bf16', 'fp16', 'fp8')"
        )
    return parsed


def raw_precision(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The counts of :class:`Precision` for ``tensor`` cast to ``dtype``, on the tensor's device:
    a float64 vector (float32 on devices without float64) read later by :func:`read_precision`."""
    target = dtype or tensor.dtype
    if not target.is_floating_point:
        raise SpecError(f"precision health reads floating values; {target} is not a floating format")
    values = tensor.detach().reshape(-1)
    accumulate = accumulator(tensor.device)
    if values.numel() == 0:  # nothing to count: zeros, and no range (amin of nothing is an error)
        empty = torch.zeros(len(_FIELDS), dtype=accumulate, device=tensor.device)
        empty[_MIN] = math.inf  # a fill on the device: no host-made tensor in a hook
        return empty
    x = values if values.dtype == torch.float64 else values.float()
    y = x.to(target).to(x.dtype)
    smallest_normal, overflow_from = _limits(target)
    finite = torch.isfinite(x)  # masks, not indexing: no sync inside a hook
    x_abs, y_abs = x.abs(), y.abs()
    kept = finite & torch.isfinite(y)
    counts = torch.stack(
        [
            finite.sum(),
            (finite & (x == 0)).sum(),
            (finite & (x != 0) & (y == 0)).sum(),
            (finite & (y_abs > 0) & (y_abs < smallest_normal)).sum(),
            (finite & (~torch.isfinite(y) | (x_abs >= overflow_from))).sum(),
        ]
    ).to(x.dtype)
    extremes = torch.stack(
        [torch.where(kept & (y_abs > 0), y_abs, math.inf).amin(), torch.where(kept, y_abs, 0.0).amax()]
    )
    return torch.cat([counts, extremes]).to(accumulate)


def merge_precision(previous: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """Two tensors' :func:`raw_precision` vectors as one (micro-batches of a step): counts add,
    the smallest minimum and the largest maximum; on the device."""
    if previous is None:
        return new
    return torch.cat(
        [previous[:_MIN] + new[:_MIN], torch.minimum(previous[_MIN : _MIN + 1], new[_MIN : _MIN + 1]),
         torch.maximum(previous[_MIN + 1 :], new[_MIN + 1 :])]
    )  # fmt: skip


def read_precision(raws: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype] | None = None) -> list[Precision]:
    """Read many raw vectors with one transfer per device; ``dtypes`` names each one's target."""
    rows = fetch(raws)
    return [parse_precision(row, dtypes[i] if dtypes is not None else None) for i, row in enumerate(rows)]


def parse_precision(row: Sequence[float] | np.ndarray, dtype: torch.dtype | None = None) -> Precision:
    """One :func:`raw_precision` vector, on the host, as :class:`Precision`."""
    values = dict(zip(_FIELDS, (float(v) for v in row), strict=True))
    count = values["count"]
    low, high = values["min_abs"], values["max_abs"]
    return Precision(
        dtype=str(dtype).removeprefix("torch.") if dtype is not None else "",
        count=int(count),
        zeros=_share(values["zeros"], count),
        underflow=_share(values["underflow"], count),
        subnormal=_share(values["subnormal"], count),
        overflow=_share(values["overflow"], count),
        dynamic_range=math.log2(high / low) if 0 < low < math.inf and high > 0 else math.nan,
    )


@functools.cache
def _limits(dtype: torch.dtype) -> tuple[float, float]:
    """The format's smallest normal number, and where rounding stops at its largest finite value:
    half a step above it. Values from there on become +-inf in IEEE formats, and are clamped (not
    rounded) by e4m3fn's saturating cast. Once per format, not once per hook call."""
    info = torch.finfo(dtype)
    top_step = 2.0 ** math.floor(math.log2(info.max)) * info.eps
    return float(info.smallest_normal), float(info.max + top_step / 2)


def _share(part: float, count: float) -> float:
    return part / count if count else math.nan

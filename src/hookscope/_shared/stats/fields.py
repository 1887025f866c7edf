"""The raw statistics vector's fields, the host-side :class:`Stats`, and the choice of fields.

One raw vector per tensor, of :data:`RAW_FIELDS`, is what both paths (the fused kernel and the
torch reductions) produce and what :func:`finalize` turns into :class:`Stats` on the host; the
numeric limits both paths scale at are here too, so that they scale at the same points.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from hookscope.errors import SpecError

__all__ = [
    "CANCELLATION_RATIO",
    "RAW_FIELDS",
    "SCALE_ABOVE",
    "SCALE_BELOW",
    "SCALE_BELOW_F64",
    "STAT_CHOICES",
    "STAT_FIELDS",
    "RawStats",
    "Stats",
    "finalize",
]

RAW_FIELDS = ("min", "max", "mean", "spread", "abs_mean", "zeros", "nan", "posinf", "neginf")
#: What ``stats=`` may choose (a trace's column names); NaN/Inf counts are always kept.
STAT_CHOICES = ("min", "max", "mean", "std", "abs_mean", "zeros", "nonfinite")
STAT_FIELDS = ("count", "min", "max", "mean", "std", "abs_mean", "zero_frac", "nan", "posinf", "neginf")
_MIN, _MAX, _MEAN, _SPREAD, _ABS, _ZEROS, _NAN, _POSINF, _NEGINF = range(len(RAW_FIELDS))

# Shared by the kernel and the torch path, which scale and sum again at the same points.
#: Squares of float64 values past this overflow: they are summed scaled down by a power of two.
SCALE_ABOVE = 2.0**500
#: Squares of float32 values below this underflow (vanishing gradients): summed scaled up.
SCALE_BELOW = 2.0**-50
#: The same for float64 (squares of values near 1e-200 are 0): scaled up below this.
SCALE_BELOW_F64 = 2.0**-400
#: A sum of squares this many times the sum of squared deviations has lost the spread's digits:
#: the values are summed again around their mean.
CANCELLATION_RATIO = 16.0


@dataclass(frozen=True)
class RawStats:
    """The statistics of one tensor before they are read: a count (known on the host), a
    vector of :data:`RAW_FIELDS` on the tensor's device (``spread`` is the root mean square
    deviation from the mean), for integer tensors their exact ``[min, max]`` as int64, and
    which fields were chosen: the vector's others are whatever was cheapest, blanked when read.
    ``offset`` is added to the extremes when they are read (2**63 for uint64, whose extremes
    are kept with the top bit flipped, which maps its order onto int64's)."""

    count: int
    vector: torch.Tensor
    extremes: torch.Tensor | None = None
    kept: tuple[bool, ...] | None = None  # the raw fields chosen (None: all); the others read NaN
    offset: int = 0


@dataclass(frozen=True)
class Stats:
    """Summary statistics of a tensor, on the host.

    ``min``, ``max``, ``mean`` and ``std`` are over all values, so a NaN makes them NaN; the
    ``nan``, ``posinf`` and ``neginf`` counts say what is there. ``min`` and ``max`` of an
    integer tensor are ints, exact at any size. ``std`` is the sample standard
    deviation (``n - 1``), like ``torch.std``. An empty tensor has ``count == 0`` and NaN
    statistics.
    """

    count: int
    min: float | int
    max: float | int
    mean: float
    std: float
    abs_mean: float
    zero_frac: float
    nan: int
    posinf: int
    neginf: int

    @property
    def inf(self) -> int:
        """How many values are +inf or -inf."""
        return self.posinf + self.neginf

    @property
    def finite(self) -> bool:
        """True when no value is NaN or infinite."""
        return self.nan == 0 and self.posinf == 0 and self.neginf == 0

    def to_dict(self) -> dict[str, float | int]:
        """The fields as a plain dict (JSON-ready: NaN stays a float NaN)."""
        return asdict(self)


@dataclass(frozen=True)
class _Wanted:
    """Which raw fields a ``fields`` choice keeps; what to compute follows from them."""

    kept: tuple[bool, ...] = (True,) * len(RAW_FIELDS)

    @staticmethod
    def of(fields: frozenset[str] | None) -> _Wanted:
        if fields is None:
            return _ALL
        unknown = sorted(fields - set(STAT_CHOICES))
        if unknown:
            raise SpecError(f"unknown statistics {unknown}; expected some of {', '.join(STAT_CHOICES)}")
        chosen = ("min", "max", "mean", "std", "abs_mean", "zeros")
        return _Wanted((*(name in fields for name in chosen), True, True, True))

    @property
    def extremes(self) -> bool:
        return self.kept[_MIN] or self.kept[_MAX]

    @property
    def moments(self) -> bool:
        return self.kept[_MEAN] or self.kept[_SPREAD]

    @property
    def magnitude(self) -> bool:
        return self.kept[_ABS]

    @property
    def zeros(self) -> bool:
        return self.kept[_ZEROS]


_ALL = _Wanted()


def finalize(
    counts: Sequence[int], table: np.ndarray[Any, Any], extremes: dict[int, tuple[int, int]] | None = None
) -> list[Stats]:
    """Turn rows of :data:`RAW_FIELDS` (one per tensor, on the host) into :class:`Stats`;
    ``extremes`` gives the exact integer min and max of some rows."""
    n = np.asarray(counts, dtype=np.float64)
    exact = extremes or {}
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        spread = table[:, _SPREAD]
        std = np.where(n > 1, spread * np.sqrt(n / (n - 1)), np.where(n == 1, 0.0, np.nan))
        zero_frac = table[:, _ZEROS] / n
    return [
        Stats(
            count=int(counts[i]),
            min=exact[i][0] if i in exact and not math.isnan(table[i, _MIN]) else float(table[i, _MIN]),
            max=exact[i][1] if i in exact and not math.isnan(table[i, _MAX]) else float(table[i, _MAX]),
            mean=float(table[i, _MEAN]),
            std=float(std[i]),
            abs_mean=float(table[i, _ABS]),
            zero_frac=float(zero_frac[i]),
            nan=int(table[i, _NAN]),
            posinf=int(table[i, _POSINF]),
            neginf=int(table[i, _NEGINF]),
        )
        for i in range(len(counts))
    ]

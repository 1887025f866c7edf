"""How far apart two tensors are, measured on the device and read on the host once.

Per compared pair, :func:`raw_metrics` queues one short vector (sums and maxima) on the
device where the second tensor lives; nothing is read inside a hook. :func:`read_metrics`
reads every vector of a run with one transfer per device and :class:`Metrics` derives what is
shown from it: max and mean |a - b|, relative error ``||a - b|| / ||a||``, cosine similarity and
SQNR in dB. Whether a pair is within tolerance is decided from the maxima, for any tolerance
given later: ``max|a - b| <= atol + rtol * max|a|``.

>>> import torch
>>> m = read_metrics([raw_metrics(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5]))])[0]
>>> m.max_abs, m.mean_abs, round(m.cosine, 4), m.within(rtol=0.3, atol=0.0), m.within(rtol=0.2, atol=0.0)
(0.5, 0.25, 0.9965, True, False)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hookscope.stats import accumulator, flat_values

__all__ = ["Metrics", "raw_metrics", "read_metrics"]

_FIELDS = ("max_abs", "sum_abs", "sum_sq_diff", "sum_sq_a", "sum_sq_b", "dot", "max_a")
_CHUNK = 1 << 18


@dataclass(frozen=True)
class Metrics:
    """The distance between a reference value ``a`` and a compared value ``b``.

    ``relative`` is ``||a - b|| / ||a||`` (L2; infinite when ``a`` is zero and ``b`` is not),
    ``cosine`` the cosine similarity of the flattened values, ``sqnr_db`` the signal-to-
    quantisation-noise ratio ``10 log10(||a||² / ||a - b||²)`` (infinite for equal values).
    A NaN or Inf in either value makes the sums NaN, and :meth:`within` False.
    """

    count: int
    max_abs: float
    mean_abs: float
    relative: float
    cosine: float
    sqnr_db: float
    max_a: float

    @property
    def exact(self) -> bool:
        """True when every value is equal (NaN aside: NaN never is)."""
        return self.max_abs == 0.0

    def within(self, *, rtol: float, atol: float) -> bool:
        """``max|a - b| <= atol + rtol * max|a|``: the tensor's worst element against its scale."""
        return self.max_abs <= atol + rtol * self.max_a  # NaN compares False: never within


def raw_metrics(a: torch.Tensor, b: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Queue the sums of ``a`` against ``b`` (same shape) on ``b``'s device; returns (count, vector).

    Values are compared in the wider of the two dtypes (float32 at least); each chunk's sums
    come from ``dot`` and are added up in float64. On the CPU the values go a quarter of a
    million at a time, while they are in the cache: ten times faster than whole-tensor passes
    on a GPT-2 MLP activation (4.5 against 43 ms for 3 million values, 2 cores).
    """
    common = torch.promote_types(a.dtype, b.dtype)
    common = common if common in (torch.float32, torch.float64) else torch.float32
    left = flat_values(a.detach()).to(device=b.device, dtype=common)
    right = flat_values(b.detach()).to(common)
    total = accumulator(b.device)
    if left.numel() == 0:
        return 0, torch.zeros(len(_FIELDS), dtype=total, device=b.device)
    step = _CHUNK if b.device.type == "cpu" else left.numel()  # one pass of kernels on an accelerator
    parts = []
    for start in range(0, left.numel(), step):
        x, y = left[start : start + step], right[start : start + step]
        difference = y - x
        magnitude = difference.abs()
        parts.append(
            torch.stack(
                [
                    magnitude.amax(),
                    magnitude.sum(),
                    difference.dot(difference),
                    x.dot(x),
                    y.dot(y),
                    x.dot(y),
                    x.abs().amax(),
                ]
            )
        )
    sums = torch.stack(parts).to(total)
    return left.numel(), torch.cat([sums[:, 0].amax()[None], sums[:, 1:6].sum(0), sums[:, 6].amax()[None]])


def read_metrics(raws: Sequence[tuple[int, torch.Tensor]]) -> list[Metrics]:
    """Read many queued vectors, one transfer per device, and derive the metrics."""
    by_device: dict[torch.device, list[int]] = {}
    for index, (_, vector) in enumerate(raws):
        by_device.setdefault(vector.device, []).append(index)
    rows: list[list[float]] = [[] for _ in raws]
    for indices in by_device.values():
        table = torch.stack([raws[i][1] for i in indices]).to(torch.float64).cpu().tolist()
        for i, values in zip(indices, table, strict=True):
            rows[i] = values
    return [_derive(count, values) for (count, _), values in zip(raws, rows, strict=True)]


def _derive(count: int, values: list[float]) -> Metrics:
    max_abs, sum_abs, sum_sq_diff, sum_sq_a, sum_sq_b, dot, max_a = values
    if count == 0:
        return Metrics(0, 0.0, 0.0, 0.0, 1.0, math.inf, 0.0)
    norm_a, norm_b, norm_diff = math.sqrt(sum_sq_a), math.sqrt(sum_sq_b), math.sqrt(sum_sq_diff)
    return Metrics(
        count=count,
        max_abs=max_abs,
        mean_abs=sum_abs / count,
        relative=_ratio(norm_diff, norm_a),
        cosine=_ratio(dot, norm_a * norm_b, both_zero=1.0),
        sqnr_db=_decibels(sum_sq_a, sum_sq_diff),
        max_a=max_a,
    )


def _ratio(top: float, bottom: float, *, both_zero: float = 0.0) -> float:
    if math.isnan(top) or math.isnan(bottom):
        return math.nan
    if bottom == 0.0:
        return both_zero if top == 0.0 else math.inf
    return top / bottom


def _decibels(signal: float, noise: float) -> float:
    if math.isnan(signal) or math.isnan(noise) or math.isinf(signal) or math.isinf(noise):
        return math.nan
    if noise == 0.0:
        return math.inf
    return 10 * math.log10(signal / noise) if signal > 0 else -math.inf

"""Per-site statistics of a store, kept as it is written: count, mean, std, min, max and norms.

Training an SAE or a probe on a store starts with its statistics (the mean to centre, the norm
to scale by), and computing them means reading the whole store once more. So each chunk's
statistics are computed as it is written, from the values as stored, and kept in the manifest
(``_hookscope/stats/<array>``, one element file per chunk, like the checksums); the store's
attributes get the merged ones when it completes (``stats``), so they are there without
reading the data.

A site's rows are read as vectors along their last dimension (a token's activation): a
``(N, seq, d)`` array has ``N * seq`` vectors of ``d`` features, minus the padding where the
store keeps the attention mask; a ``(N,)`` array has ``N`` vectors of one feature.

A chunk's part is ``[count, sum of norms, sum of squared norms, 0, mean (d), M2 (d), min (d),
max (d)]`` in float64 (``M2``: the sum of squared deviations from the mean, per feature). Parts
merge pairwise with Chan et al.'s update, always in chunk order, so the result does not depend
on how many processes wrote the chunks, or in which order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["HEAD", "SiteStats", "chunk_part", "merge", "part_width", "summary", "vectors_of"]

HEAD = 4  # count, sum of norms, sum of squared norms, a spare


def part_width(shape: Sequence[int]) -> int:
    """Floats in one chunk's part for rows of ``shape``."""
    return HEAD + 4 * features(shape)


def features(shape: Sequence[int]) -> int:
    return int(shape[-1]) if len(shape) else 1


def vectors_of(values: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """``values`` ``(rows, *shape)`` as ``(vectors, features)``: padding left out where ``mask``
    ``(rows, seq)`` fits the rows' first dimension."""
    shape = values.shape[1:]
    if not shape:
        return values.reshape(-1, 1)
    if mask is not None and len(shape) >= 2 and shape[0] == mask.shape[1] and mask.shape[0] == values.shape[0]:
        values = values[mask.astype(bool)]
    return values.reshape(-1, shape[-1])


def chunk_part(vectors: np.ndarray) -> np.ndarray:
    """One chunk's part (see the module doc) from its ``(vectors, features)``; values that are
    infinite or NaN make the statistics they enter infinite or NaN, without a warning."""
    with np.errstate(all="ignore"):
        return _chunk_part(vectors)


def _chunk_part(vectors: np.ndarray) -> np.ndarray:
    count, width = vectors.shape
    part = np.zeros(HEAD + 4 * width, dtype=np.float64)
    if count == 0:
        part[HEAD + 2 * width : HEAD + 3 * width] = np.inf
        part[HEAD + 3 * width :] = -np.inf
        return part
    # sums of deviations from the chunk's first vector, in float64: one pass for both moments
    # (not a second one over deviations from the mean, 3x the cost on the writer thread), and
    # M2 = sum(d^2) - sum(d)^2 / n loses only ~1e-16 * ((mean - first) / std)^2 of itself, where
    # plain sums of x would lose ~1e-16 * (mean / std)^2: a feature at 3000 +- 0.5 stays exact
    exact = vectors.astype(np.float64, copy=False)
    norms = np.sqrt(np.einsum("ij,ij->i", exact, exact))
    first = np.where(np.isfinite(exact[0]), exact[0], 0.0)  # an inf there would turn inf - inf into NaN
    # a copy made by astype is ours to shift in place; the caller's float64 values are not
    shifted = exact - first if exact is vectors else np.subtract(exact, first, out=exact)
    sums = shifted.sum(axis=0)
    squares = np.einsum("ij,ij->j", shifted, shifted)
    part[0] = count
    part[1] = norms.sum()
    part[2] = np.square(norms).sum()
    part[HEAD : HEAD + width] = first + sums / count
    part[HEAD + width : HEAD + 2 * width] = np.maximum(squares - sums * (sums / count), 0.0)
    part[HEAD + 2 * width : HEAD + 3 * width] = vectors.min(axis=0)
    part[HEAD + 3 * width :] = vectors.max(axis=0)
    return part


def merge(parts: Sequence[np.ndarray] | np.ndarray) -> np.ndarray:
    """The part of the chunks ``parts``, merged in the order given."""
    merged: np.ndarray | None = None
    with np.errstate(all="ignore"):
        for part in parts:
            merged = np.array(part, dtype=np.float64) if merged is None else _merge_two(merged, np.asarray(part))
    if merged is None:
        raise ValueError("no parts to merge")
    return merged


def _merge_two(left: np.ndarray, right: np.ndarray) -> np.ndarray:
    width = (len(left) - HEAD) // 4
    n_left, n_right = left[0], right[0]
    if n_right == 0:
        return left
    if n_left == 0:
        return np.array(right, dtype=np.float64)
    total = n_left + n_right
    merged = np.empty_like(left)
    merged[0] = total
    merged[1:HEAD] = left[1:HEAD] + right[1:HEAD]
    mean_left, mean_right = left[HEAD : HEAD + width], right[HEAD : HEAD + width]
    delta = mean_right - mean_left
    merged[HEAD : HEAD + width] = mean_left + delta * (n_right / total)
    merged[HEAD + width : HEAD + 2 * width] = (
        left[HEAD + width : HEAD + 2 * width]
        + right[HEAD + width : HEAD + 2 * width]
        + np.square(delta) * (n_left * n_right / total)
    )
    merged[HEAD + 2 * width : HEAD + 3 * width] = np.minimum(
        left[HEAD + 2 * width : HEAD + 3 * width], right[HEAD + 2 * width : HEAD + 3 * width]
    )
    merged[HEAD + 3 * width :] = np.maximum(left[HEAD + 3 * width :], right[HEAD + 3 * width :])
    return merged


@dataclass(frozen=True)
class SiteStats:
    """Statistics of one array of a store, over every stored vector (padding left out).

    ``count`` vectors of ``features`` values; ``mean``, ``std``, ``min``, ``max`` over all their
    values; ``norm_mean`` and ``norm_rms``, the mean and root-mean-square of the vectors' L2
    norms (``norm_rms`` is the scale SAE training divides by). ``feature_mean``, ``feature_std``,
    ``feature_min`` and ``feature_max`` are per feature (``(features,)`` arrays).

    Example::

        stats = hs.open_store("feats.zarr").stats["h.5"]
        centred = (batch - torch.from_numpy(stats.feature_mean).float()) / stats.norm_rms
    """

    count: int
    features: int
    mean: float
    std: float
    min: float
    max: float
    norm_mean: float
    norm_rms: float
    feature_mean: np.ndarray
    feature_std: np.ndarray
    feature_min: np.ndarray
    feature_max: np.ndarray

    def to_json(self) -> dict[str, Any]:
        """The scalars, as the store's attributes keep them (strict JSON: a NaN or infinite
        statistic is written as the string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"``, as zarr
        writes such fill values)."""
        return {
            key: _json_number(getattr(self, key))
            for key in ("count", "features", "mean", "std", "min", "max", "norm_mean", "norm_rms")
        }

    def __repr__(self) -> str:
        return (
            f"SiteStats(count={self.count:,}, features={self.features}, mean={self.mean:.6g}, std={self.std:.6g}, "
            f"min={self.min:.6g}, max={self.max:.6g}, norm_mean={self.norm_mean:.6g}, norm_rms={self.norm_rms:.6g})"
        )


def _json_number(value: float) -> float | str:
    if math.isfinite(value):
        return value
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


def summary(part: np.ndarray) -> SiteStats:
    """The :class:`SiteStats` of a merged part.

    >>> values = np.array([[1.0, 2.0], [3.0, 6.0]])
    >>> found = summary(merge([chunk_part(values[:1]), chunk_part(values[1:])]))
    >>> found.count, found.mean, found.feature_mean.tolist(), round(found.norm_rms, 9)  # sqrt((5 + 45) / 2)
    (2, 3.0, [2.0, 4.0], 5.0)
    """
    width = (len(part) - HEAD) // 4
    count = int(part[0])
    feature_mean = part[HEAD : HEAD + width]
    feature_m2 = part[HEAD + width : HEAD + 2 * width]
    feature_min = part[HEAD + 2 * width : HEAD + 3 * width]
    feature_max = part[HEAD + 3 * width :]
    if count == 0:
        nan = math.nan
        empty = np.full(width, np.nan)
        return SiteStats(0, width, nan, nan, nan, nan, nan, nan, empty, empty, empty, empty)
    with np.errstate(all="ignore"):
        mean = float(feature_mean.mean())
        # every feature has ``count`` values: the total M2 is theirs plus the spread of their means
        total_m2 = float(feature_m2.sum() + count * np.square(feature_mean - mean).sum())
    return SiteStats(
        count=count,
        features=width,
        mean=mean,
        std=math.sqrt(total_m2 / (count * width)),
        min=float(feature_min.min()),
        max=float(feature_max.max()),
        norm_mean=float(part[1] / count),
        norm_rms=math.sqrt(float(part[2] / count)),
        feature_mean=feature_mean.copy(),
        feature_std=np.sqrt(feature_m2 / count),
        feature_min=feature_min.copy(),
        feature_max=feature_max.copy(),
    )

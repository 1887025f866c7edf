"""Tensor statistics computed where the tensor lives, cheaply, and read on the host once.

Every feature that summarises values -- trace, gradients, extraction, diff -- calls
:func:`raw_stats` on each tensor inside a hook and gets back a short float64 vector on the
tensor's device: no host sync, no ``.item()``. After the forward, :func:`read_stats` stacks the
vectors of one device and moves them to the host in a single transfer, then
:func:`finalize` turns them into :class:`Stats`.

Why not ``torch.var_mean`` and friends: on CPU some reductions cost twenty times a ``sum``
(``var_mean``, ``count_nonzero`` of a float tensor, ``isfinite().all()``), and a hook runs on
every module of the model. The raw vector is built from the cheap ones:

==========  ===============================================================================
field       how
==========  ===============================================================================
min, max    one ``aminmax``
mean,       ``sum`` and ``dot`` of the values minus a shift, which makes the variance exact
spread      even when the mean dwarfs the spread (fp16 values around 300); kept as the mean
            and the root mean square deviation, never as sums, so values near float64's
            largest (three of 1e308) give their mean, not inf
abs_mean    free when all values have one sign (post-ReLU), else the mean of ``|x|``
zeros       free when 0 lies outside [min, max]; else ``min |x|`` says whether any is there,
            and only then are they counted (``sum(sign(x))`` of the others)
nan, inf    free when min and max are finite (NaN and Inf propagate into them), else counted
==========  ===============================================================================

Integer tensors keep their exact min and max beside the vector (int64 past 2**53 would round
in float64; uint64 past 2**63 is kept with its top bit flipped, in order, and read back exactly).
Float64 values past 2**500, whose squares would overflow, and below 2**-400 (float32 below
2**-50), whose squares would underflow, are scaled by a power of two (exactly) while they are summed.

An expanded view (a stride-0 dimension, ``x.expand(...)``) repeats each value of the tensor it
was made from the same number of times: min, max, mean, spread and mean ``|x|`` are that
tensor's, and the counts scale. So its statistics are computed on that tensor (see
:func:`unexpanded`) and never allocate the view's logical size.

The shortcuts need to *look* at min and max, which on an accelerator would be a host sync per
tensor. So there are two strategies: on the CPU the tensor already lives on the host, reading a
scalar is a memory read, and the shortcuts are taken ("branching"); on any other device every
field is computed unconditionally by kernels queued on the stream, and nothing is read until
:func:`read_stats`. Both agree to about 1e-5 relative, counts exactly (tests run both on CPU).

Half types (float16, bfloat16) are upcast to float32; float64 and integer tensors use float64.
Counts are exact; sums accumulate in the upcast type and are merged in float64.

Statistics of several tensors merge exactly (Chan et al.): :class:`RunningStats` keeps one raw
vector on the device and folds each new tensor in, again without a sync, for statistics over
many batches or steps.

>>> import torch
>>> s = tensor_stats(torch.tensor([[0.0, 1.0], [2.0, -3.0]]))
>>> (s.count, s.min, s.max, s.mean, s.zero_frac, s.finite)
(4, -3.0, 2.0, 0.0, 0.25, True)
>>> round(s.std, 4), s.abs_mean
(2.1602, 1.5)
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from hookscope._core.compat.compiled import is_compiling
from hookscope._core.compat.private import dynamo_errors
from hookscope._shared import fused
from hookscope._shared.fused import CANCELLATION_RATIO, SCALE_ABOVE, SCALE_BELOW, SCALE_BELOW_F64
from hookscope._shared.transfer import fetch
from hookscope.errors import SpecError

__all__ = [
    "RAW_FIELDS",
    "STAT_CHOICES",
    "STAT_FIELDS",
    "RawStats",
    "RunningStats",
    "Scratch",
    "Stats",
    "accumulator",
    "finalize",
    "flat_values",
    "is_measurable",
    "merge_raw",
    "raw_stats",
    "read_stats",
    "tensor_stats",
    "unexpanded",
]

RAW_FIELDS = ("min", "max", "mean", "spread", "abs_mean", "zeros", "nan", "posinf", "neginf")
#: What ``stats=`` may choose (a trace's column names); NaN/Inf counts are always kept.
STAT_CHOICES = ("min", "max", "mean", "std", "abs_mean", "zeros", "nonfinite")
STAT_FIELDS = ("count", "min", "max", "mean", "std", "abs_mean", "zero_frac", "nan", "posinf", "neginf")
_MIN, _MAX, _MEAN, _SPREAD, _ABS, _ZEROS, _NAN, _POSINF, _NEGINF = range(len(RAW_FIELDS))
_HALF_TYPES = (torch.float16, torch.bfloat16)
#: Unsigned types torch has few kernels for (no aminmax, no count_nonzero): widened first.
_WIDENED_UNSIGNED = (torch.uint16, torch.uint32, torch.uint64)
_UINT64_OFFSET = 1 << 63  # uint64 extremes are kept as int64 with the top bit flipped
_CHUNK_BYTES = 4 << 20  # reduce a few MiB at a time, while they are in the cache


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


def is_measurable(tensor: torch.Tensor) -> bool:
    """True when :func:`raw_stats` can summarise ``tensor``: real or boolean values, in memory.

    Complex, sparse, quantized and ``meta`` tensors (weights not loaded yet) are described by
    shape and dtype only. Nested tensors are measured over all their components' values.
    """
    return (
        (tensor.layout == torch.strided or tensor.is_nested)
        and not tensor.is_complex()
        and not tensor.is_quantized
        and tensor.device.type != "meta"
    )


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """A ``DTensor``'s whole value (FSDP2's sharded parameters and gradients), other tensors as they are.

    Reading a shard's values would give this rank's part under the whole tensor's count, with
    no error. Gathering is a collective: every rank of the tensor's mesh must ask for it too.
    """
    distributed = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(distributed, "DTensor", None) if distributed is not None else None
    if dtensor is not None and isinstance(tensor, dtensor):
        return tensor.full_tensor()  # type: ignore[no-any-return]
    return tensor


def raw_stats(
    tensor: torch.Tensor,
    *,
    branching: bool | None = None,
    scratch: Scratch | None = None,
    fields: frozenset[str] | None = None,
) -> RawStats:
    """Summarise ``tensor`` on its own device, without reading anything back to the host.

    ``branching`` picks the strategy (see the module doc); the default takes shortcuts on the
    CPU only. ``scratch`` lends a reusable work buffer (for |x|), so that measuring every
    activation of a model does not allocate, and page-fault, a fresh one each time.
    ``fields`` (of :data:`STAT_CHOICES`; None: all) are the statistics wanted: the others read
    NaN and, where they would cost a pass of their own, are not computed (the fused CPU kernel
    gets them all from its one read anyway). NaN and Inf counts are always kept. Raises
    ``SpecError`` for a tensor :func:`is_measurable` refuses.
    """
    if not is_measurable(tensor):
        raise SpecError(
            f"cannot summarise a {tensor.dtype} tensor on {tensor.device} ({tensor.layout}); expected a strided "
            "tensor of numbers (floating, integer or bool)"
        )
    base, repeats = unexpanded(full_value(tensor.detach()))
    source = flat_values(base)
    count = source.numel() * repeats
    if count == 0:  # filled on the device: a host-made tensor would be a copy, i.e. a sync
        empty = torch.full((len(RAW_FIELDS),), math.nan, dtype=accumulator(source.device), device=source.device)
        empty[_ZEROS:] = 0.0
        return RawStats(0, empty)
    if branching is None:  # torch.compile traces kernels only: the CPU shortcuts read values back
        branching = source.device.type == "cpu" and not is_compiling()
    wanted = _Wanted.of(fields)
    part = fused.measure(source) if branching else None
    if part is not None:  # one read of the values (float32, bfloat16, float64 on the CPU)
        row = [part.low, part.high, part.mean, part.spread, part.abs_mean, part.zeros, 0.0, 0.0, 0.0]
        vector = torch.tensor(row, dtype=torch.float64)
    elif branching:
        vector = _branching(_as_vector(source), scratch, wanted)
    else:
        vector = _device_path(source)(source, wanted)
    if repeats > 1:  # every value of the expanded view's source appears `repeats` times
        vector[_ZEROS:].mul_(repeats)
    kept = None if wanted is _ALL else wanted.kept
    extremes, offset = _exact_extremes(base) if wanted.extremes else (None, 0)
    return RawStats(count, vector, extremes, kept, offset)


def unexpanded(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The tensor an expanded view repeats (its stride-0 dimensions cut to size 1), and how many
    times each of its values appears in the view; other tensors as they are, once.

    Flattening an expanded view copies it to its logical size (a ``(1,)`` tensor expanded to
    ``(2**28,)`` is 1 GiB), whereas its values are those of the small tensor. Not while
    torch.compile traces: there the strides may be symbolic, and the compiled kernels read an
    expanded input without copying it anyway.

    >>> base, repeats = unexpanded(torch.arange(3.0).expand(1000, 3))
    >>> base.shape, repeats
    (torch.Size([1, 3]), 1000)
    """
    if tensor.is_nested or tensor.layout != torch.strided or is_compiling():
        return tensor, 1
    repeats = 1
    for size, stride in zip(tensor.shape, tensor.stride(), strict=True):
        if stride == 0 and size > 1:
            repeats *= size
    if repeats == 1:
        return tensor, 1
    cut = [size if stride != 0 else min(size, 1) for size, stride in zip(tensor.shape, tensor.stride(), strict=True)]
    return tensor.as_strided(cut, tensor.stride()), repeats


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


def _exact_extremes(tensor: torch.Tensor) -> tuple[torch.Tensor | None, int]:
    """``[min, max]`` of an integer tensor as int64, on its device, and the offset to add when
    they are read; None for other dtypes."""
    if tensor.is_floating_point() or tensor.dtype == torch.bool:
        return None, 0
    values, offset = flat_values(tensor), 0
    if values.dtype == torch.uint64:  # flipping the top bit keeps the order and fits int64
        values, offset = values.view(torch.int64) ^ -_UINT64_OFFSET, _UINT64_OFFSET
    elif values.dtype in _WIDENED_UNSIGNED:
        values = values.to(torch.int64)
    low, high = torch.aminmax(values)
    return torch.stack([low, high]).to(torch.int64), offset


def tensor_stats(tensor: torch.Tensor) -> Stats:
    """The :class:`Stats` of one tensor, read at once (a convenience outside hooks)."""
    return read_stats([raw_stats(tensor)])[0]


def read_stats(raws: Sequence[RawStats]) -> list[Stats]:
    """Read many raw vectors with one device-to-host transfer per device (and one more for the
    exact extremes of integer tensors, when there are any); keeps the order."""
    if not raws:
        return []
    table = np.stack(fetch([raw.vector for raw in raws]))  # one transfer per device
    for i, raw in enumerate(raws):
        if raw.kept is not None:  # fields not chosen: whatever was cheapest was left there
            table[i, ~np.asarray(raw.kept)] = math.nan
    extremes: dict[int, tuple[int, int]] = {}
    with_extremes = [i for i, raw in enumerate(raws) if raw.extremes is not None and raw.count]
    for device in {raws[i].vector.device for i in with_extremes}:
        mine = [i for i in with_extremes if raws[i].vector.device == device]
        pairs = torch.stack([raws[i].extremes for i in mine]).cpu().tolist()  # type: ignore[misc]
        extremes.update(
            {
                i: (int(low) + raws[i].offset, int(high) + raws[i].offset)
                for i, (low, high) in zip(mine, pairs, strict=True)
            }
        )
    return finalize([raw.count for raw in raws], table, extremes)


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


def merge_raw(a: RawStats, b: RawStats) -> RawStats:
    """The raw statistics of two tensors taken together (Chan's parallel formula), on the device.

    Means are weighted and spreads combined with ``hypot``, so nothing is squared that could
    overflow: merging many batches stays exact in float64, also for values near its largest.
    """
    if a.count == 0:
        return b
    if b.count == 0:
        return a
    x, y = a.vector, b.vector.to(device=a.vector.device, dtype=a.vector.dtype)
    na, nb = float(a.count), float(b.count)
    n = na + nb
    half_delta = y[_MEAN] / 2 - x[_MEAN] / 2  # halves: the difference of two huge means stays finite
    merged = x + y  # the counts add up
    merged[_MIN] = torch.minimum(x[_MIN], y[_MIN])
    merged[_MAX] = torch.maximum(x[_MAX], y[_MAX])
    merged[_MEAN] = x[_MEAN] * (na / n) + y[_MEAN] * (nb / n)
    merged[_ABS] = x[_ABS] * (na / n) + y[_ABS] * (nb / n)
    between = half_delta * (2 * math.sqrt(na * nb) / n)  # the factor is at most 1
    spread = torch.hypot(torch.hypot(x[_SPREAD] * math.sqrt(na / n), y[_SPREAD] * math.sqrt(nb / n)), between)
    known = (
        torch.isfinite(x[_MEAN]) & torch.isfinite(y[_MEAN]) & torch.isfinite(x[_SPREAD]) & torch.isfinite(y[_SPREAD])
    )
    merged[_SPREAD] = torch.where(known, spread, torch.full_like(spread, math.nan))  # hypot(nan, inf) is inf
    extremes = None
    if a.extremes is not None and b.extremes is not None and a.offset == b.offset:  # else: min/max of the vector
        other = b.extremes.to(a.extremes.device)
        extremes = torch.stack([torch.minimum(a.extremes[0], other[0]), torch.maximum(a.extremes[1], other[1])])
    return RawStats(a.count + b.count, merged, extremes, a.kept, a.offset if extremes is not None else 0)


class Scratch:
    """Work buffers lent to :func:`raw_stats`: one per device and dtype, grown to the largest
    piece reduced at once (at most a chunk, 4 MiB, on the CPU) and kept until this object is
    dropped (a trace keeps one for its lifetime)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def like(self, values: torch.Tensor) -> torch.Tensor:
        """A flat buffer with as many elements as ``values``, same device and dtype (contents undefined)."""
        key = (values.device, values.dtype)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < values.numel():
            buffer = torch.empty(values.numel(), dtype=values.dtype, device=values.device)
            self._buffers[key] = buffer
        return buffer[: values.numel()]


class RunningStats:
    """Statistics of many tensors (batches, steps), folded in on the device as they come.

    ``update`` queues a few kernels and never syncs; ``result()`` reads once.

    >>> running = RunningStats()
    >>> for batch in torch.arange(10.0).split(3):
    ...     running.update(batch)
    >>> s = running.result()
    >>> s.count, s.mean, round(s.std, 4) == round(torch.arange(10.0).std().item(), 4)
    (10, 4.5, True)
    """

    def __init__(self) -> None:
        self._raw: RawStats | None = None

    def update(self, tensor: torch.Tensor) -> None:
        """Fold the values of ``tensor`` in."""
        self.add(raw_stats(tensor))

    def add(self, raw: RawStats) -> None:
        """Fold in raw statistics already computed (e.g. in a hook)."""
        self._raw = raw if self._raw is None else merge_raw(self._raw, raw)

    @property
    def count(self) -> int:
        """How many values have been folded in."""
        return 0 if self._raw is None else self._raw.count

    @property
    def raw(self) -> RawStats | None:
        """The combined raw statistics, still on the device (None before the first update)."""
        return self._raw

    def result(self) -> Stats:
        """Read the combined statistics (one transfer)."""
        if self._raw is None:
            raise SpecError("no values yet: call update(tensor) first")
        return read_stats([self._raw])[0]


# -- the two strategies ------------------------------------------------------------------------


def accumulator(device: torch.device) -> torch.dtype:
    """The dtype sums accumulate in on ``device``: float64, or float32 where there is none."""
    return torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64


def flat_values(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's values as one flat tensor; a nested tensor's components one after the other."""
    if not tensor.is_nested:
        return tensor.reshape(-1)
    parts = [component.reshape(-1) for component in tensor.unbind()]
    return torch.cat(parts) if parts else torch.empty(0, dtype=tensor.dtype, device=tensor.device)


def _as_vector(tensor: torch.Tensor) -> torch.Tensor:
    """A flat floating view (or copy) to reduce: float32 for half and float32, float64 else."""
    tensor = flat_values(tensor)
    if tensor.dtype in _HALF_TYPES or tensor.dtype == torch.bool:
        tensor = tensor.to(torch.float32)
    elif not tensor.is_floating_point():
        tensor = tensor.to(accumulator(tensor.device))
    elif tensor.dtype not in (torch.float32, torch.float64):
        tensor = tensor.to(torch.float32)  # float8 and other exotic types
    return tensor.reshape(-1)


def _work(values: torch.Tensor, scratch: Scratch | None) -> torch.Tensor:
    return scratch.like(values) if scratch is not None else torch.empty_like(values)


def _branching(values: torch.Tensor, scratch: Scratch | None, wanted: _Wanted = _ALL) -> torch.Tensor:
    """CPU strategy: read min/max (a memory read here, not a sync) and skip what they settle.

    The values are taken in chunks of a few MiB, each reduced by every statistic while it is
    still in the cache (about 40% faster than whole-tensor passes on a ResNet-50's activations),
    and the chunks are merged in float64 (Chan, with weights and ``hypot`` as in
    :func:`merge_raw`), which also keeps long float32 sums accurate.
    """
    step = max(_CHUNK_BYTES // values.element_size(), 1)
    low, high, count, mean, spread, abs_mean, zeros = math.inf, -math.inf, 0, 0.0, 0.0, 0.0, 0.0
    # Last chunk first: the end of a tensor just written is the part still in the cache.
    chunks = reversed(torch.split(values, step)) if values.numel() > step else (values,)
    for chunk in chunks:
        part = _chunk_stats(chunk, scratch, wanted)
        if part is None:
            return _unconditional(values, wanted)  # NaN or Inf: count them exactly, the slow way
        lo, hi, n, chunk_mean, chunk_spread, chunk_abs, chunk_zeros = part
        low, high = min(low, lo), max(high, hi)
        if count == 0:
            mean, spread, abs_mean = chunk_mean, chunk_spread, chunk_abs
        else:
            total = count + n
            weight_old, weight_new = count / total, n / total
            between = (chunk_mean / 2 - mean / 2) * (2 * math.sqrt(count * n) / total)
            spread = math.hypot(spread * math.sqrt(weight_old), chunk_spread * math.sqrt(weight_new), between)
            mean = mean * weight_old + chunk_mean * weight_new
            abs_mean = abs_mean * weight_old + chunk_abs * weight_new
        count += n
        zeros += chunk_zeros
    return torch.tensor([low, high, mean, spread, abs_mean, zeros, 0.0, 0.0, 0.0], dtype=torch.float64)


def _chunk_stats(
    values: torch.Tensor, scratch: Scratch | None, wanted: _Wanted = _ALL
) -> tuple[float, float, int, float, float, float, float] | None:
    """``(min, max, n, mean, spread, mean |x|, zeros)`` of one chunk, or None if it holds a NaN or Inf.

    float64 values past 2**500 are reduced scaled down by a power of two, exactly, so that
    their squares do not overflow, and tiny values scaled up, so that they do not underflow;
    the results are scaled back.
    """
    low, high = (float(v) for v in torch.aminmax(values))
    if not (math.isfinite(low) and math.isfinite(high)):
        return None
    n = values.numel()
    scale = 1.0
    largest = max(-low, high)
    huge = values.dtype == torch.float64 and largest > SCALE_ABOVE
    below = SCALE_BELOW_F64 if values.dtype == torch.float64 else SCALE_BELOW
    tiny = 0.0 < largest < below and low != high
    if huge or tiny:
        scale = 2.0 ** (math.frexp(largest)[1] - 1)  # 2**1023 at most: itself finite
        original, values = values, values / scale
        mean, m2, abs_sum, _ = _moments(values, low / scale, high / scale, scratch, wanted)
        zeros = float(n - torch.count_nonzero(original)) if wanted.zeros else 0.0  # tiny values may read as 0
        return low, high, n, mean * scale, math.sqrt(m2 / n) * scale, abs_sum / n * scale, zeros
    mean, m2, abs_sum, zeros = _moments(values, low, high, scratch, wanted)
    return low, high, n, mean * scale, math.sqrt(m2 / n) * scale, abs_sum / n * scale, zeros


def _moments(
    values: torch.Tensor, low: float, high: float, scratch: Scratch | None, wanted: _Wanted = _ALL
) -> tuple[float, float, float, float]:
    """``(mean, M2, sum |x|, zeros)`` of finite values whose min and max are known; what is not
    ``wanted`` is skipped where it would cost a pass (and reads 0)."""
    n = values.numel()
    if low == high:  # a constant: exact, no sums needed
        return low, 0.0, abs(low) * n, float(n) if low == 0.0 else 0.0
    if not wanted.moments:
        return 0.0, 0.0, *_magnitude_and_zeros(values, low, high, None, scratch, wanted)
    total = float(values.sum())
    squares = float(torch.dot(values, values))
    if not (math.isfinite(total) and math.isfinite(squares)):  # finite values whose sums overflowed float32
        wide = values.to(torch.float64)
        total, squares = float(wide.sum()), float(torch.dot(wide, wide))
    mean = total / n
    m2 = squares - total * mean
    if squares > CANCELLATION_RATIO * max(m2, 0.0) and squares > 0.0:
        # the spread is tiny next to the mean: sum again around the mean
        centred = torch.sub(values, mean, out=_work(values, scratch))
        offset, spread = float(centred.sum()), float(torch.dot(centred, centred))
        if not (math.isfinite(offset) and math.isfinite(spread)):  # |x - mean| overflowed float32
            wide = values.to(torch.float64) - mean
            offset, spread = float(wide.sum()), float(torch.dot(wide, wide))
        mean += offset / n
        m2 = spread - offset * offset / n
    return mean, max(m2, 0.0), *_magnitude_and_zeros(values, low, high, mean * n, scratch, wanted)


def _magnitude_and_zeros(
    values: torch.Tensor, low: float, high: float, total: float | None, scratch: Scratch | None, wanted: _Wanted
) -> tuple[float, float]:
    """``(sum |x|, zeros)`` of finite values; ``total`` is their sum when known (None: not summed)."""
    n = values.numel()
    if low > 0.0 or high < 0.0:  # no zeros, one sign: |x| sums to |sum|
        if not wanted.magnitude:
            return 0.0, 0.0
        return abs(total if total is not None else float(values.sum(dtype=torch.float64))), 0.0
    if low == 0.0 or high == 0.0:  # one sign with zeros (after a ReLU): sum(sign(x)) counts the others
        if total is None and wanted.magnitude:
            total = float(values.sum(dtype=torch.float64))
        zeros = n - abs(float(torch.sign(values, out=_work(values, scratch)).sum())) if wanted.zeros else 0.0
        return abs(total or 0.0), zeros
    if not (wanted.magnitude or wanted.zeros):
        return 0.0, 0.0
    magnitude = torch.abs(values, out=_work(values, scratch))  # both signs: |x| once
    abs_sum = 0.0
    if wanted.magnitude:
        abs_sum = float(magnitude.sum())
        if not math.isfinite(abs_sum):  # finite values whose |x| sum overflowed float32
            abs_sum = float(magnitude.sum(dtype=torch.float64))
    zeros = 0.0
    if wanted.zeros and float(magnitude.amin()) == 0.0:
        zeros = n - float(torch.sign(magnitude, out=magnitude).sum())
    return abs_sum, zeros


def _unconditional_of(source: torch.Tensor, wanted: _Wanted) -> torch.Tensor:
    """:func:`_unconditional` of a flat tensor of any measurable dtype (upcast inside, so that a
    compiled version fuses the upcast into its one read)."""
    return _unconditional(_as_vector(source), wanted)


#: Devices whose statistics run as one compiled kernel per tensor (Triton on CUDA); elsewhere,
#: and while the model itself is being compiled, the same function runs op by op.
COMPILED_DEVICES = {"cuda"}
_COMPILED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_compiled: Any = None  # the compiled _unconditional_of, made on first use
_compile_failed: str | None = None  # why compiling failed, once: from then on op by op
_COMPILING = os.environ.get("HOOKSCOPE_COMPILED_STATS", "1") != "0"


def _device_path(source: torch.Tensor) -> Any:
    """``_unconditional_of``, compiled for floating tensors on the devices of :data:`COMPILED_DEVICES`.

    ``torch.compile`` fuses the upcast and every reduction into one kernel that reads the
    tensor once (instead of about twelve kernels, each a pass); ``dynamic=True`` makes one
    compiled version serve every size, and inductor's cache keeps it across processes. Nothing
    in it reads a value back, so the forward stays free of host syncs. It always computes every
    field (one read either way) and under ``no_grad``, so that one graph per dtype serves every
    call; a single value, integers and booleans (token ids, masks) go op by op.
    """
    global _compiled
    if (
        source.device.type not in COMPILED_DEVICES
        or source.dtype not in _COMPILED_DTYPES
        or source.numel() < 2
        or _compile_failed is not None
        or is_compiling()
        or not _COMPILING
    ):
        return _unconditional_of
    if _compiled is None:
        _compiled = torch.compile(_unconditional_of, dynamic=True, fullgraph=True)
    return _guarded


def _guarded(source: torch.Tensor, wanted: _Wanted) -> torch.Tensor:
    """The compiled statistics (every field: those not ``wanted`` are blanked when read).

    Where the compiler stack fails (no Triton, no C compiler), the same ops run one by one from
    then on, with one warning that says why; past dynamo's recompile limit, this call alone does.
    Errors of the values or the device (out of memory, an asynchronous CUDA error) are raised.
    """
    global _compile_failed
    limit_hit, dynamo_failed = dynamo_errors()
    try:
        with torch.no_grad():
            vector: torch.Tensor = _compiled(source, _ALL)
    except limit_hit:
        return _unconditional_of(source, wanted)
    except (dynamo_failed, ImportError) as error:
        _compile_failed = f"{type(error).__name__}: {error}"
        warnings.warn(
            f"hookscope: statistics on {source.device.type} could not be compiled ({_compile_failed}); "
            "computing them op by op (slower, same values). Set HOOKSCOPE_COMPILED_STATS=0 to skip compiling.",
            RuntimeWarning,
            stacklevel=2,
        )
        return _unconditional_of(source, wanted)
    return vector


def _unconditional(values: torch.Tensor, wanted: _Wanted = _ALL) -> torch.Tensor:
    """Device strategy: every wanted field from kernels queued on the stream; nothing is read back."""
    accumulate = accumulator(values.device)
    n = values.numel()
    unknown = torch.full((), math.nan, dtype=accumulate, device=values.device)
    low = high = mean = spread = abs_mean = zeros = unknown
    original = values  # counted as they are: scaling could round tiny values to 0, or 1e308 to inf
    scale = None
    if wanted.extremes or values.dtype == torch.float64:
        low, high = torch.aminmax(values)
    if values.dtype == torch.float64 and (wanted.moments or wanted.magnitude):
        # finite values past 2**500 or below 2**-400 are summed scaled by a power of two (exact);
        # float32 needs none: its squares are taken in float64
        largest = torch.maximum(-low, high)
        power = torch.ldexp(torch.ones_like(largest), torch.frexp(largest).exponent - 1)
        outside = (largest > SCALE_ABOVE) | ((largest < SCALE_BELOW_F64) & (largest > 0))
        scale = torch.where(outside & torch.isfinite(largest), power, torch.ones_like(largest))
        values = values / scale
    if wanted.moments:
        first = values[0]
        # Centre on the first value, unless it is not finite or so large that x - shift could overflow.
        usable = torch.isfinite(first) & (first.abs() < torch.finfo(values.dtype).max / 2**20)
        shift = torch.where(usable, first, torch.zeros_like(first)).to(accumulate)
        centred = values - shift.to(values.dtype)
        centred_sum = centred.sum(dtype=accumulate)  # wide sums: finite values cannot overflow them
        squares = torch.linalg.vector_norm(centred, 2, dtype=accumulate).square()  # dot stops at 2**31 values
        mean = shift + centred_sum / n
        spread = torch.sqrt(torch.clamp(squares - centred_sum * centred_sum / n, min=0.0) / n)
        spread = torch.where(torch.isfinite(squares), spread, torch.full_like(spread, math.nan))
    if wanted.magnitude:
        abs_mean = torch.linalg.vector_norm(values, 1, dtype=accumulate) / n
    if scale is not None:
        wide = scale.to(accumulate)
        mean, spread, abs_mean = mean * wide, spread * wide, abs_mean * wide
    if wanted.zeros:
        zeros = torch.count_nonzero(original == 0)
    fields = [
        low,
        high,
        mean,
        spread,
        abs_mean,
        zeros,
        torch.count_nonzero(torch.isnan(original)),
        torch.count_nonzero(original == math.inf),
        torch.count_nonzero(original == -math.inf),
    ]
    return torch.stack([field.to(accumulate) for field in fields])

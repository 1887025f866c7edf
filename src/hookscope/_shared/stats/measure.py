"""Raw statistics of a tensor on its device, read on the host once, merged exactly.

:func:`raw_stats` picks the path (the fused kernel, the torch path on the CPU, the accelerator
path), :func:`read_stats` moves many vectors in one transfer per device, :func:`merge_raw` and
:class:`RunningStats` fold tensors together without a sync.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import numpy as np
import torch

from hookscope._core.compat.compiled import is_compiling
from hookscope._shared.stats import kernel
from hookscope._shared.stats.compiled import _device_path
from hookscope._shared.stats.fields import (
    _ABS,
    _ALL,
    _MAX,
    _MEAN,
    _MIN,
    _SPREAD,
    _ZEROS,
    RAW_FIELDS,
    RawStats,
    Stats,
    _Wanted,
    finalize,
)
from hookscope._shared.stats.torch_path import Scratch, _as_vector, _branching, accumulator, flat_values
from hookscope._shared.transfer import fetch
from hookscope.errors import SpecError

__all__ = [
    "RunningStats",
    "full_value",
    "is_measurable",
    "merge_raw",
    "raw_stats",
    "read_stats",
    "tensor_stats",
    "unexpanded",
]

#: Unsigned types torch has few kernels for (no aminmax, no count_nonzero): widened first.
_WIDENED_UNSIGNED = (torch.uint16, torch.uint32, torch.uint64)
_UINT64_OFFSET = 1 << 63  # uint64 extremes are kept as int64 with the top bit flipped


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
    part = kernel.measure(source) if branching else None
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

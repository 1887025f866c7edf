"""Tensor statistics computed where the tensor lives, cheaply, and read on the host once.

The package: ``fields`` (the raw vector, :class:`Stats`, the choice of fields), ``kernel`` (the
fused C kernel's binding, ``fused_stats.c``), ``torch_path`` (the same statistics from torch
reductions), ``compiled`` (the accelerator path as one compiled kernel), ``measure`` (picks the
path per tensor, reads, merges).

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

from hookscope._shared.stats.fields import RAW_FIELDS, STAT_CHOICES, STAT_FIELDS, RawStats, Stats, finalize
from hookscope._shared.stats.measure import (
    RunningStats,
    full_value,
    is_measurable,
    merge_raw,
    raw_stats,
    read_stats,
    tensor_stats,
    unexpanded,
)
from hookscope._shared.stats.torch_path import Scratch, accumulator, flat_values

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
    "full_value",
    "is_measurable",
    "merge_raw",
    "raw_stats",
    "read_stats",
    "tensor_stats",
    "unexpanded",
]

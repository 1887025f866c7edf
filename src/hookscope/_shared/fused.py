"""The fused statistics kernel (``fused_stats.c``): every CPU statistic in one read of a tensor.

Why a compiled kernel: torch computes min and max, sums, sums of squares, ``|x|`` and zero
counts as five or six reductions, each a pass over the values and a parallel region of torch's
thread pool. Over the ~200 activations of a ResNet-50 that is about a thousand regions per
forward; on a machine where another process holds a core, each one waits for a descheduled
thread. The kernel reads each value once, in the calling thread (no region at all), with SIMD
lanes (AVX2 where the CPU has it).

Why C through ctypes, not numba or a torch extension: it builds with the package in about a
second wherever a C compiler is (``setup.py``, optional), needs no headers and no JIT warm-up, and
ctypes lets go of the GIL while it runs. Where it was not built (no compiler), or for a dtype it
does not read (float16, integers, bool), :mod:`hookscope._shared.stats` uses torch reductions, and
the results agree (the tests run both).

>>> import torch
>>> part = measure(torch.tensor([1.0, 0.0, -2.0, 3.0])) if available() else None
>>> part is None or (part.low, part.high, part.zeros, part.mean, part.abs_mean)
(-2.0, 3.0, 1.0, 0.5, 1.5)
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hookscope._core.compat.compiled import is_compiling
from hookscope._core.compat.private import is_zero_tensor

__all__ = ["FusedPart", "all_finite", "available", "enabled", "measure", "use_fused"]

# Shared with the torch path (``stats``), which scales and sums again at the same points.
#: Squares of float64 values past this overflow: they are summed scaled down by a power of two.
SCALE_ABOVE = 2.0**500
#: Squares of float32 values below this underflow (vanishing gradients): summed scaled up.
SCALE_BELOW = 2.0**-50
#: The same for float64 (squares of values near 1e-200 are 0): scaled up below this.
SCALE_BELOW_F64 = 2.0**-400
#: A sum of squares this many times the sum of squared deviations has lost the spread's digits:
#: the values are summed again around their mean.
CANCELLATION_RATIO = 16.0
_ENTRY_POINTS = {
    torch.float32: "hookscope_stats_f32",
    torch.bfloat16: "hookscope_stats_bf16",
    torch.float64: "hookscope_stats_f64",
}
_Kernel = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_double, ctypes.c_void_p)


@dataclass(frozen=True)
class FusedPart:
    """The statistics of one tensor of finite values, read in one pass."""

    low: float
    high: float
    zeros: float
    mean: float
    spread: float  # root mean square deviation from the mean
    abs_mean: float


def _load() -> ctypes.CDLL | None:
    """The built library, or None (not built, or ``HOOKSCOPE_FUSED_STATS=0``)."""
    if os.environ.get("HOOKSCOPE_FUSED_STATS", "1") == "0":
        return None
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"_fused_stats{suffix}"
        if path.exists():
            try:
                return ctypes.CDLL(str(path))
            except OSError:  # built for another platform, or damaged: torch reductions it is
                return None
    return None


def _entry_points(
    library: ctypes.CDLL | None,
) -> tuple[dict[torch.dtype, Any], dict[torch.dtype, Any], Any, Any]:
    """The library's functions: statistics and finiteness by dtype, the helper and team settings.
    All empty where it is missing, or built from another version of the source (a symbol missing)."""
    if library is None:
        return {}, {}, None, None
    int_call = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)
    try:
        stats = {dtype: _Kernel((name, library)) for dtype, name in _ENTRY_POINTS.items()}
        finite = {
            dtype: _Kernel((name.replace("_stats_", "_finite_"), library)) for dtype, name in _ENTRY_POINTS.items()
        }
        return stats, finite, int_call(("hookscope_set_helpers", library)), int_call(("hookscope_use_team", library))
    except AttributeError:  # a stale build: rebuild with `pip install -e .` (or any make target)
        return {}, {}, None, None


_KERNELS, _FINITE, _set_helpers, _use_team = _entry_points(_load())
_use = bool(_KERNELS)
_helpers = -1  # the thread count the library was set up for; -1: not yet


def _match_torch_threads() -> None:
    """As many threads reading as torch computes with: torch's own OpenMP team where torch runs
    on one (its threads are awake right after the op that made the tensor), else helper
    threads of the kernel's for all but the calling one."""
    global _helpers
    threads = torch.get_num_threads()
    if threads == _helpers or _set_helpers is None or _use_team is None:
        return
    team = bool(torch.backends.openmp.is_available()) and bool(_use_team(threads))  # type: ignore[no-untyped-call]
    _set_helpers(0 if team else threads - 1)
    _helpers = threads


def available() -> bool:
    """True when the kernel was built and loaded (``HOOKSCOPE_FUSED_STATS=0`` turns it off)."""
    return bool(_KERNELS)


def enabled() -> bool:
    """True when statistics use the kernel now (see :func:`use_fused`)."""
    return _use


def use_fused(on: bool) -> bool:
    """Use the kernel (when available) or torch reductions from now on; returns the previous choice.

    For comparing the two paths: min, max and counts agree exactly; the kernel's sums are
    closer to float64 (the torch path's float32 sums drift by up to ~1e-5 relative in the std
    of values whose mean dwarfs their spread).
    """
    global _use
    previous, _use = _use, on and available()
    return previous


def measure(values: torch.Tensor) -> FusedPart | None:
    """One pass over a CPU tensor's values; None when the kernel cannot say (the caller uses torch).

    None for a dtype the kernel does not read, a tensor whose values are not plain memory (a
    tensor subclass, a lazily negated or zero tensor), when the kernel is off, and when a value
    is NaN or infinite (they are counted exactly elsewhere) or a sum overflowed (float32 values
    past ~1e19).
    """
    readable = _readable(_KERNELS, values)
    if readable is None:
        return None
    kernel, flat = readable
    part = _read(kernel, flat)
    below = SCALE_BELOW_F64 if flat.dtype == torch.float64 else SCALE_BELOW
    tiny = 0.0 < max(-part.low, part.high) < below if part is not None else False
    if part is None or not tiny or part.low == part.high:
        return part
    # Divided by a power of two (exact), the largest |x| lands in [0.5, 1); its inverse could
    # overflow (2**1073 for float64's smallest subnormal).
    scale = 2.0 ** math.frexp(max(-part.low, part.high))[1]
    scaled = _read(kernel, flat / scale)
    if scaled is None:
        return None
    return FusedPart(
        low=part.low,
        high=part.high,
        zeros=part.zeros,  # scaling up keeps every non-zero value non-zero
        mean=scaled.mean * scale,
        spread=scaled.spread * scale,
        abs_mean=scaled.abs_mean * scale,
    )


def all_finite(values: torch.Tensor) -> bool | None:
    """Whether every value of a CPU tensor is finite, from its exponent bits alone (no sum that
    could overflow); None when the kernel cannot say (see :func:`measure`).

    >>> all_finite(torch.tensor([1.0, float("inf")])) if available() else False
    False
    """
    readable = _readable(_FINITE, values)
    if readable is None:
        return None
    kernel, flat = readable
    out = (ctypes.c_double * 8)()
    kernel(flat.data_ptr(), flat.numel(), 0.0, ctypes.addressof(out))
    return out[7] == 0.0


def _readable(kernels: dict[torch.dtype, Any], values: torch.Tensor) -> tuple[Any, torch.Tensor] | None:
    """The kernel for ``values`` and their flat, contiguous memory; None when the kernel cannot read them
    (also while torch.compile traces: it cannot trace a ctypes call, and the ops it traces are fused anyway)."""
    kernel = kernels.get(values.dtype) if _use else None
    if kernel is None or values.device.type != "cpu" or values.numel() == 0 or is_compiling() or not _plain(values):
        return None
    _match_torch_threads()
    flat = values.reshape(-1)
    return kernel, flat if flat.is_contiguous() else flat.contiguous()


def _plain(values: torch.Tensor) -> bool:
    """True when ``values`` are plain memory the kernel may read through ``data_ptr()``."""
    return (
        type(values) in (torch.Tensor, torch.nn.Parameter)
        and not values.is_neg()
        and not is_zero_tensor(values)
        and values.data_ptr() != 0
    )


def _read(kernel: Any, flat: torch.Tensor) -> FusedPart | None:
    """One pass of ``kernel`` over a flat, contiguous tensor (again around the mean when needed)."""
    n = flat.numel()
    out = (ctypes.c_double * 8)()  # what the kernel writes; [7] is the finiteness check's
    kernel(flat.data_ptr(), n, math.nan, ctypes.addressof(out))
    low, high, centred, squares, magnitude, zeros, shift, _ = out
    if not all(map(math.isfinite, (low, high, centred, squares, magnitude))):
        return None
    if flat.dtype == torch.float64 and max(-low, high) > SCALE_ABOVE:
        return None
    m2 = squares - centred * centred / n
    if squares > CANCELLATION_RATIO * max(m2, 0.0):
        # the shift lay far from the mean next to the spread: sum again around the mean
        kernel(flat.data_ptr(), n, shift + centred / n, ctypes.addressof(out))
        _, _, centred, squares, _, _, shift, _ = out
        if not (math.isfinite(centred) and math.isfinite(squares)):
            return None
        m2 = squares - centred * centred / n
    return FusedPart(
        low=low,
        high=high,
        zeros=zeros,
        mean=shift + centred / n,
        spread=math.sqrt(max(m2, 0.0) / n),
        abs_mean=magnitude / n,
    )

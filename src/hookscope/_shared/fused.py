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

import torch

__all__ = ["FusedPart", "available", "enabled", "measure", "use_fused"]

_FLOAT64_SCALE_ABOVE = 2.0**500  # squares of larger values overflow: the torch path scales them
# A sum of squared deviations this many times the spread's lost digits: sum again around the mean.
_CANCELLATION_RATIO = 16.0
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


_LIBRARY = _load()
_KERNELS = {dtype: _Kernel((name, _LIBRARY)) for dtype, name in _ENTRY_POINTS.items()} if _LIBRARY else {}
_set_helpers = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)(("hookscope_set_helpers", _LIBRARY)) if _LIBRARY else None
_use = bool(_KERNELS)
_helpers = -1  # the helper threads asked of the library; -1: none asked yet


def _match_torch_threads() -> None:
    """As many threads reading as torch computes with: helpers for all but the calling one."""
    global _helpers
    wanted = max(torch.get_num_threads() - 1, 0)
    if wanted != _helpers and _set_helpers is not None:
        _set_helpers(wanted)
        _helpers = wanted


def available() -> bool:
    """True when the kernel was built and loaded (``HOOKSCOPE_FUSED_STATS=0`` turns it off)."""
    return bool(_KERNELS)


def enabled() -> bool:
    """True when statistics use the kernel now (see :func:`use_fused`)."""
    return _use


def use_fused(on: bool) -> bool:
    """Use the kernel (when available) or torch reductions from now on; returns the previous choice.

    For comparing the two paths; the results agree to float32 rounding, counts exactly.
    """
    global _use
    previous, _use = _use, on and available()
    return previous


def measure(values: torch.Tensor) -> FusedPart | None:
    """One pass over a CPU tensor's values; None when the kernel cannot say (the caller uses torch).

    None for a dtype the kernel does not read, when the kernel is off, and when a value is NaN or
    infinite (they are counted exactly elsewhere) or a sum overflowed (float32 values past ~1e19).
    """
    kernel = _KERNELS.get(values.dtype) if _use else None
    if kernel is None or values.device.type != "cpu" or values.numel() == 0:
        return None
    _match_torch_threads()
    flat = values.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    n = flat.numel()
    out = (ctypes.c_double * 7)()
    kernel(flat.data_ptr(), n, math.nan, ctypes.addressof(out))
    low, high, centred, squares, magnitude, zeros, shift = out
    if not all(map(math.isfinite, (low, high, centred, squares, magnitude))):
        return None
    if values.dtype == torch.float64 and max(-low, high) > _FLOAT64_SCALE_ABOVE:
        return None
    m2 = squares - centred * centred / n
    if squares > _CANCELLATION_RATIO * max(m2, 0.0):
        # the shift lay far from the mean next to the spread: sum again around the mean
        kernel(flat.data_ptr(), n, shift + centred / n, ctypes.addressof(out))
        _, _, centred, squares, _, _, shift = out
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

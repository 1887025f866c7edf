"""The fused statistics kernel's binding (``fused_stats.c``): every CPU statistic in one read of a tensor.

Why a compiled kernel: torch computes min and max, sums, sums of squares, ``|x|`` and zero
counts as five or six reductions, each a pass over the values and a parallel region of torch's
thread pool. Over the ~200 activations of a ResNet-50 that is about a thousand regions per
forward; on a machine where another process holds a core, each one waits for a descheduled
thread. The kernel reads each value once, in the calling thread (no region at all), with SIMD
lanes (AVX-512 or AVX2 where the CPU has them); tensors of :data:`TEAM_MIN_VALUES` and more are
read with torch's OpenMP team instead while that has been the faster way (timed as it reads: the
team is quick on a quiet machine and waits a time slice per tensor beside a busy process).

Why C through ctypes, not numba or a torch extension: it builds with the package in about a
second wherever a C compiler is (``setup.py``, optional), needs no headers and no JIT warm-up, and
ctypes lets go of the GIL while it runs. It uses no Python C API, so it is a plain shared library
(``_fused_stats.so``) that serves every Python. Its interface version and layout constants are
read from the library itself (:data:`ABI_VERSION` must match; :data:`BLOCK_VALUES`,
:data:`SEGMENT_VALUES`, :data:`TEAM_MIN_VALUES`). Where it was not built (no compiler), was built
from another version of the source, or for a dtype it does not read (float16, integers, bool),
:mod:`hookscope._shared.stats.torch_path` computes the same statistics with torch reductions,
and the results agree (the tests run both); :func:`statistics_path` says which runs.

>>> import torch
>>> part = measure(torch.tensor([1.0, 0.0, -2.0, 3.0])) if available() else None
>>> part is None or (part.low, part.high, part.zeros, part.mean, part.abs_mean)
(-2.0, 3.0, 1.0, 0.5, 1.5)
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hookscope._core.compat.compiled import is_compiling
from hookscope._core.compat.private import is_zero_tensor
from hookscope._shared.stats.fields import CANCELLATION_RATIO, SCALE_ABOVE, SCALE_BELOW, SCALE_BELOW_F64

__all__ = [
    "ABI_VERSION",
    "BLOCK_VALUES",
    "SEGMENT_VALUES",
    "TEAM_MIN_VALUES",
    "FusedPart",
    "all_finite",
    "available",
    "enabled",
    "measure",
    "statistics_path",
    "team_threads",
    "use_fused",
]

#: The kernel interface this module speaks (``hookscope_abi_version`` in ``fused_stats.c``).
ABI_VERSION = 3

_ENTRY_POINTS = {
    torch.float32: "hookscope_stats_f32",
    torch.bfloat16: "hookscope_stats_bf16",
    torch.float64: "hookscope_stats_f64",
}
_Kernel = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_double, ctypes.c_void_p)
_UseTeam = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_int64)
_TeamChoice = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)
_LongReads = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_int, ctypes.c_int)
_LIBRARY = "_fused_stats" + (".dylib" if sys.platform == "darwin" else ".dll" if sys.platform == "win32" else ".so")


@dataclass(frozen=True)
class FusedPart:
    """The statistics of one tensor of finite values, read in one pass."""

    low: float
    high: float
    zeros: float
    mean: float
    spread: float  # root mean square deviation from the mean
    abs_mean: float


def _load() -> tuple[ctypes.CDLL | None, str]:
    """The built library, or None and why not (not built, ``HOOKSCOPE_FUSED_STATS=0``, stale)."""
    if os.environ.get("HOOKSCOPE_FUSED_STATS", "1") == "0":
        return None, "turned off: HOOKSCOPE_FUSED_STATS=0"
    path = Path(__file__).parent / _LIBRARY
    if not path.exists():
        return None, "not built: no C compiler when hookscope was installed"
    try:
        library = ctypes.CDLL(str(path))
    except OSError as error:  # built for another platform, or damaged: torch reductions it is
        return None, f"not loadable: {error}"
    try:
        version = ctypes.c_int32.in_dll(library, "hookscope_abi_version").value
    except ValueError:
        version = 0
    if version != ABI_VERSION:  # a stale build: rebuild with `pip install -e .` (or any make target)
        return None, f"stale: built with interface {version}, expected {ABI_VERSION}; reinstall hookscope"
    return library, ""


def _constant(library: ctypes.CDLL | None, name: str) -> int:
    """One of the library's layout constants (``hookscope_<name>``); 0 without the library."""
    return int(ctypes.c_int64.in_dll(library, f"hookscope_{name}").value) if library is not None else 0


def _entry_points(
    library: ctypes.CDLL | None,
) -> tuple[dict[torch.dtype, Any], dict[torch.dtype, Any], Any, Any, Any]:
    """The library's functions: statistics and finiteness by dtype, the team setting, and for
    tests the team choice (``hookscope_team_choice``: 0 the faster way, 1 always the team, 2 never)
    and the count of long reads made each way (``hookscope_long_reads(kind, shared)``); all empty
    without it."""
    if library is None:
        return {}, {}, None, None, None
    stats = {dtype: _Kernel((name, library)) for dtype, name in _ENTRY_POINTS.items()}
    finite = {dtype: _Kernel((name.replace("_stats_", "_finite_"), library)) for dtype, name in _ENTRY_POINTS.items()}
    return (
        stats,
        finite,
        _UseTeam(("hookscope_use_team", library)),
        _TeamChoice(("hookscope_team_choice", library)),
        _LongReads(("hookscope_long_reads", library)),
    )


_library, _missing = _load()
#: Values per float32 partial sum: the lanes' sums go to float64 after each block.
BLOCK_VALUES = _constant(_library, "block_values")
#: Values per segment, the unit torch's OpenMP team shares (read last first).
SEGMENT_VALUES = _constant(_library, "segment_values")
#: Tensors with fewer values are read by the calling thread alone; longer ones alone or with torch's
#: OpenMP team, whichever has been reading faster (see ``fused_stats.c``: a parallel region waits for
#: every thread of the team, also one another process holds off its core).
TEAM_MIN_VALUES = _constant(_library, "team_min_values")
_OUT_FIELDS = _constant(_library, "out_fields")
_KERNELS, _FINITE, _use_team, _team_choice, _long_reads = _entry_points(_library)
_use = bool(_KERNELS)
_threads = -1  # the thread count the library was set up for; -1: not yet
_team = 0  # the threads of torch's OpenMP team that may read long tensors; 0: the calling thread alone


def _match_torch_threads() -> None:
    """Let torch's OpenMP team, of as many threads as torch computes with, read the longest
    tensors where that is faster, when torch runs on GNU OpenMP; else every tensor is read by the
    calling thread."""
    global _threads, _team
    threads = torch.get_num_threads()
    if threads == _threads or _use_team is None:
        return
    shared = _use_team(threads if torch.backends.openmp.is_available() else 0, 0)  # type: ignore[no-untyped-call]
    _threads, _team = threads, threads if shared else 0


def team_threads() -> int:
    """How many threads of torch's OpenMP team read a tensor of :data:`TEAM_MIN_VALUES` values or
    more, where that reads faster than the calling thread alone; 0 where every tensor is read by
    the calling thread (no kernel, torch not on GNU OpenMP, or one thread). Follows
    ``torch.set_num_threads`` as the kernel does.

    >>> team_threads() >= 0
    True
    """
    _match_torch_threads()
    return _team


def statistics_path() -> str:
    """Which path computes CPU statistics in this process, in one line (``hookscope info`` prints it).

    >>> statistics_path().startswith(("fused C kernel", "torch reductions"))
    True
    """
    if _use:
        return f"fused C kernel ({_LIBRARY}, interface {ABI_VERSION}, blocks of {BLOCK_VALUES} values)"
    if available():
        return "torch reductions (fused C kernel turned off: use_fused(False))"
    return f"torch reductions (fused C kernel {_missing})"


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
    out = (ctypes.c_double * _OUT_FIELDS)()
    if kernel(flat.data_ptr(), flat.numel(), 0.0, ctypes.addressof(out)) != 0:
        return None
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
    out = (ctypes.c_double * _OUT_FIELDS)()  # what the kernel writes; [7] is the finiteness check's
    if kernel(flat.data_ptr(), n, math.nan, ctypes.addressof(out)) != 0:
        return None
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

"""Keep a long run's resident memory at what it holds alive, where the C allocator lets us (glibc).

A long extraction frees large activation blocks after every forward while other threads (the
writer, zarr's codec threads) allocate and free buffers in between. glibc raises its mmap
threshold as large blocks are freed, so later ones come from heaps that keep freed pages
resident; measured on GPT-2, a run of 1,000 batches then sits 10-30% above a short one although
nothing more is alive. :class:`ResidentWatch` notices that drift (one read of
``/proc/self/statm`` per batch) and calls ``malloc_trim(0)``, which hands free pages back to the
operating system. Trimming every batch would cost the page faults of re-touching them (about 5%
of a GPT-2 forward here); trimming only on drift costs that rarely.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from collections.abc import Callable
from pathlib import Path

__all__ = ["ResidentWatch", "release_free_memory", "resident_bytes"]

_STATM = Path("/proc/self/statm")
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@functools.cache
def _trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    trim = getattr(libc, "malloc_trim", None)  # glibc only: musl and macOS have no such call
    return trim if callable(trim) else None


def release_free_memory() -> bool:
    """Return the allocator's free pages to the operating system; False where there is no way to.

    >>> isinstance(release_free_memory(), bool)
    True
    """
    trim = _trim()
    if trim is None:
        return False
    trim(0)
    return True


def resident_bytes() -> int | None:
    """This process's resident memory now (Linux), else None."""
    try:
        return int(_STATM.read_text().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


class ResidentWatch:
    """Trims free memory when the resident size drifts ``margin`` above what it was after ``settle`` checks.

    >>> watch = ResidentWatch()
    >>> watch.check()   # once per batch, from any thread
    False
    """

    def __init__(self, margin: float = 1.10, settle: int = 4) -> None:
        self.margin = margin
        self.settle = settle
        self.baseline = 0
        self.checks = 0
        self.trims = 0

    def check(self) -> bool:
        """Trim if the drift is past the margin; True when it trimmed."""
        resident = resident_bytes()
        if resident is None or _trim() is None:
            return False
        self.checks += 1
        if self.checks <= self.settle:  # the first batches set the level: caches and buffers fill up
            self.baseline = max(self.baseline, resident)
            return False
        if resident <= self.baseline * self.margin:
            return False
        release_free_memory()
        self.trims += 1
        after = resident_bytes() or resident
        self.baseline = max(self.baseline, after)  # what a trim cannot give back is alive: the new level
        return True

"""hookscope's one malloc policy: keep freed memory for the next forward, hand back only drift.

The policy, in one place, for the whole process (glibc only; elsewhere nothing is changed):

1. **Keep** (:func:`keep_freed_memory`, at the end of a capture's pass). A capture that keeps
   every activation frees a lot of memory at once when it is dropped; glibc's defaults hand it
   back to the operating system, and the next forward faults it in again page by page.
2. **Trim on drift** (:class:`ResidentWatch`, once per batch of a long ``hs.extract``). A long run
   whose resident memory creeps above the level it settled at, with nothing more alive, gets
   ``malloc_trim(0)``: the rare trim costs less than the drift.

Both are off with ``HOOKSCOPE_MALLOC=default`` (``steady``, or unset: on), and both use the one
C library found by :func:`_glibc`. They do not fight: keeping raises the trim *threshold*, which
decides what ``free`` returns at once, while a trim is an explicit call made only when resident
memory drifted past a margin.

**Keep, in numbers.** Measured on ResNet-50 (batch 8 x 224², 185 leaf modules, 1.2 GiB kept, 2
CPU cores): 229,000-244,000 minor page faults per captured forward (224,000 for hand-written
hooks keeping ``output.detach()``) against 41,000-61,000 for a plain one; a capture cost 1.25x a
plain forward in a quiet run. With the settings below, once warm, no forward takes a page fault
at all, and ``bench/bench_capture.py`` read 1.069x plain (1.066x hand hooks; median of 10 rounds
on a machine busy with other jobs, where the fault counts are the firmer figure).

The first time a pass of a capture ends holding at least :data:`MIN_BYTES` of host memory,
hookscope calls glibc's ``mallopt`` twice:

- ``M_MMAP_THRESHOLD`` = 32 MiB, the highest value glibc's own dynamic threshold reaches
  (blocks up to that size come from the heap, whose freed memory can be reused, instead of
  fresh ``mmap`` regions that are unmapped again when freed);
- ``M_TRIM_THRESHOLD`` = twice the bytes kept, at most ``2**31 - 1`` (2 GiB, the largest
  finite value ``mallopt`` takes): freeing one capture's values no longer trims the heap.
  A later capture holding more raises it again (never lowers it).

So the process keeps up to about twice its largest capture's size (never more than 2 GiB) of
freed memory resident at the top of its heap. Values larger than 32 MiB each still come from
``mmap`` and are faulted in fresh every pass. Why not something else: a reusable arena still
pays a copy of every kept value (0.11-0.31 s for 1.2 GiB here, 8-20% of the forward) and helps
only a capture reused across passes; ``calls="last"`` or ``reduce`` keep less but change what is
kept; the ``MALLOC_*_`` environment variables must be set before the process starts.

**Trim on drift, in numbers.** A long extraction frees large activation blocks after every
forward while other threads (the writer, zarr's codec threads) allocate and free buffers in
between; on GPT-2 a run of 1,000 batches sat 10-30% above a short one with nothing more alive.
Trimming every batch would cost the page faults of re-touching the pages (about 5% of a GPT-2
forward here); trimming only on drift (one read of ``/proc/self/statm`` per batch) costs that rarely.

**Safety.** The ``mallopt`` settings are process-wide and cannot be read back, and setting any
of them turns glibc's dynamic thresholds off for the rest of the process. Hence hookscope
changes nothing where the C library is not glibc (musl, macOS, Windows), for captures that keep
less than :data:`MIN_BYTES` (64 MiB, what glibc's dynamic thresholds keep resident anyway),
where the process was started with its own malloc settings (``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_TOP_PAD_``, ``MALLOC_MMAP_MAX_`` or those tunables in
``GLIBC_TUNABLES``), or with ``HOOKSCOPE_MALLOC=default``.

>>> state = allocator_state()
>>> sorted(state)
['mmap_threshold', 'skipped', 'trim_threshold']
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hookscope._shared.units import format_bytes
from hookscope.errors import SpecError

__all__ = [
    "ENV",
    "MIN_BYTES",
    "ResidentWatch",
    "allocator_state",
    "check_setting",
    "describe",
    "keep_freed_memory",
    "release_free_memory",
    "resident_bytes",
    "would_change",
]

#: The opt-out: ``HOOKSCOPE_MALLOC=default`` leaves glibc's malloc alone (no settings, no trims).
ENV = "HOOKSCOPE_MALLOC"
_CHOICES = {"steady": True, "default": False}

#: Captures keeping less host memory than this leave the allocator as it is.
MIN_BYTES = 64 << 20

#: glibc's ``M_MMAP_THRESHOLD``, ``M_TRIM_THRESHOLD`` (``malloc.h``).
_M_MMAP_THRESHOLD = -3
_M_TRIM_THRESHOLD = -1
_MMAP_THRESHOLD = 32 << 20  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: where the dynamic threshold stops
_INT_MAX = (1 << 31) - 1  # mallopt's value is a C int

#: Settings the user may have given glibc at start-up, as environment variables or tunables.
_USER_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
_USER_TUNABLES = ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold", "glibc.malloc.top_pad")

_STATM = Path("/proc/self/statm")
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


# -- the C library, found once ------------------------------------------------------------------


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library this process runs on when it is glibc, else None (the one lookup).

    ``CDLL(None)`` is the running process's own symbols (``find_library`` would start a
    subprocess, and could name another libc than the one loaded); ``gnu_get_libc_version``
    tells glibc apart, whose ``mallopt`` numbers and ``malloc_trim`` this module relies on.
    """
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") else None


def _function(name: str, argtypes: tuple[Any, ...]) -> Callable[..., int] | None:
    libc = _glibc()
    function = getattr(libc, name, None) if libc is not None else None
    if function is None:
        return None
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function  # type: ignore[no-any-return]


@functools.cache
def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``mallopt``, or None where the C library is not glibc."""
    return _function("mallopt", (ctypes.c_int, ctypes.c_int))


@functools.cache
def _trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None (musl and macOS have no such call)."""
    return _function("malloc_trim", (ctypes.c_size_t,))


# -- the setting ----------------------------------------------------------------------------------


def check_setting() -> bool:
    """Read ``HOOKSCOPE_MALLOC``: True unless it says ``default``; a value that is neither
    ``steady`` nor ``default`` is refused with the fix (checked when a capture is made).

    >>> check_setting() in (True, False)
    True
    """
    value = os.environ.get(ENV, "steady").strip().lower() or "steady"
    if value not in _CHOICES:
        raise SpecError(
            f"{ENV}={os.environ[ENV]!r} is not a choice: use {ENV}=default to leave the C allocator's settings "
            f"alone, or {ENV}=steady (the default) to let captures keep freed memory for the next forward"
        )
    return _CHOICES[value]


def _opted_out() -> str | None:
    """Why ``HOOKSCOPE_MALLOC`` says to leave the allocator alone, or None."""
    try:
        return None if check_setting() else f"{ENV}=default"
    except SpecError:  # changed to a wrong value since the capture was made: a pass's end never raises for it
        return f"{ENV}={os.environ.get(ENV)!r} is not a choice"


# -- keep: the thresholds ---------------------------------------------------------------------------


class _State:
    """What hookscope did to the allocator in this process (changed under ``lock``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.trim_threshold = 0  # 0: never set by hookscope
        self.mmap_threshold = 0
        self.skipped: str | None = None  # why nothing is set, once decided for good


_STATE = _State()


def _user_settings() -> str | None:
    """The malloc settings the process was started with, named, or None."""
    given = [name for name in _USER_VARIABLES if name in os.environ]
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    given += [name for name in _USER_TUNABLES if name in tunables]
    return ", ".join(given) or None


def _skip_reason() -> str | None:
    """Why hookscope must leave the thresholds alone, for good, or None."""
    opted_out = _opted_out()
    if opted_out is not None:
        return opted_out
    user = _user_settings()
    if user is not None:
        return f"the process was started with its own malloc settings ({user})"
    if _mallopt() is None:
        return "the C library is not glibc"
    return None


def would_change(nbytes: int) -> bool:
    """Whether holding ``nbytes`` could still change a setting: False once it is settled for that
    size (or for good), so a pass's end need not count its host bytes again."""
    state = _STATE
    return nbytes >= MIN_BYTES and state.skipped is None and state.trim_threshold < min(_INT_MAX, 2 * nbytes)


def keep_freed_memory(nbytes: int) -> bool:
    """Let the process keep about ``2 * nbytes`` of freed heap memory resident (at most 2 GiB);
    called at the end of a capture's pass with the host bytes it holds. True when it changed
    a setting now; cheap when there is nothing to do (every pass after the first).

    >>> keep_freed_memory(0)   # a small capture changes nothing
    False
    """
    if not would_change(nbytes):
        return False
    wanted = min(_INT_MAX, 2 * nbytes)
    state = _STATE
    with state.lock:
        if state.skipped is not None or state.trim_threshold >= wanted:
            return False
        state.skipped = _skip_reason()
        mallopt = _mallopt()
        if state.skipped is not None or mallopt is None:
            return False
        if not state.mmap_threshold:
            # First: a refused threshold leaves glibc's dynamic thresholds on, and then nothing is changed.
            if mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) != 1:
                state.skipped = "glibc refused M_MMAP_THRESHOLD"
                return False
            state.mmap_threshold = _MMAP_THRESHOLD
        if mallopt(_M_TRIM_THRESHOLD, wanted) != 1:
            state.skipped = "glibc refused M_TRIM_THRESHOLD"
            return False
        state.trim_threshold = wanted
        return True


def allocator_state() -> dict[str, Any]:
    """What hookscope set in this process: ``mmap_threshold`` and ``trim_threshold`` in bytes
    (0: not set), and ``skipped``, why nothing is set (None while it may still be)."""
    state = _STATE
    with state.lock:
        return {
            "mmap_threshold": state.mmap_threshold,
            "trim_threshold": state.trim_threshold,
            "skipped": state.skipped,
        }


def describe() -> str:
    """The policy as it stands in this process, in one line (``hookscope info`` prints it).

    >>> describe().startswith(("glibc keeps", "steady", "left to the C library"))
    True
    """
    state = allocator_state()
    if state["trim_threshold"]:
        return (
            f"glibc keeps up to {format_bytes(state['trim_threshold'])} of freed memory for the next forward "
            f"(M_TRIM_THRESHOLD; blocks up to {format_bytes(state['mmap_threshold'])} from the heap), set by a "
            "capture; hs.extract trims freed memory when resident memory drifts past 10% of its level"
        )
    reason = state["skipped"] or _skip_reason()
    if reason is not None:
        return f"left to the C library's defaults: {reason}"
    return (
        f"steady ({ENV}=default turns it off): a capture that ends holding {format_bytes(MIN_BYTES)} or more "
        "lets glibc keep about twice that of freed memory (at most 2 GiB) for the next forward; hs.extract "
        "trims freed memory when resident memory drifts past 10% of its level; nothing set yet"
    )


# -- trim on drift -------------------------------------------------------------------------------


def release_free_memory() -> bool:
    """Return the allocator's free pages to the operating system; False where there is no way to
    (not glibc) or ``HOOKSCOPE_MALLOC=default`` says not to.

    >>> isinstance(release_free_memory(), bool)
    True
    """
    trim = _trim()
    if trim is None or _opted_out() is not None:
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
        self._off = _opted_out() is not None  # read once: a run keeps the policy it started with

    def check(self) -> bool:
        """Trim if the drift is past the margin; True when it trimmed."""
        if self._off:
            return False
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

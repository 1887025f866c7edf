"""Keep the memory a capture freed resident for the next one, where glibc's malloc lets us.

Why: a capture that keeps every activation holds a lot of memory until it is dropped. With
glibc's default settings, freeing that much at once hands it back to the operating system
(the free top of the heap is trimmed above a threshold of at most 64 MiB), and the next
forward faults the same amount in again, page by page, zero-filled. Measured on ResNet-50
(batch 8 x 224², 185 leaf modules, 1.2 GiB kept, 2 CPU cores): 229,000-244,000 minor page
faults per captured forward (224,000 for hand-written hooks keeping ``output.detach()``)
against 41,000-61,000 for a plain one; a capture cost 1.25x a plain forward in a quiet run.
With the setting below, once warm, no forward takes a page fault at all (0 for plain, hand
hooks and hookscope alike), and ``bench/bench_capture.py`` read 1.069x plain (1.066x hand
hooks; median of 10 rounds on a machine busy with other jobs, where the per-round ratios
spread from 0.5 to 2.6 and the fault counts are the firmer figure).

What: the first time a pass of a capture ends holding at least :data:`MIN_BYTES` of host
memory, hookscope calls glibc's ``mallopt`` twice, for the whole process:

- ``M_MMAP_THRESHOLD`` = 32 MiB, the highest value glibc's own dynamic threshold reaches
  (blocks up to that size come from the heap, whose freed memory can be reused, instead of
  fresh ``mmap`` regions that are unmapped again when freed);
- ``M_TRIM_THRESHOLD`` = twice the bytes kept, at most ``2**31 - 1`` (2 GiB, the largest
  finite value ``mallopt`` takes): freeing one capture's values no longer trims the heap.
  A later capture holding more raises it again (never lowers it).

So the process keeps up to about twice its largest capture's size (never more than 2 GiB) of
freed memory resident at the top of its heap, for itself, instead of returning it at once;
free memory below the top is kept by glibc as it always is. ``malloc_trim`` still returns all
of it (``hs.extract``'s writer does when resident memory drifts: see ``_shared.memory``).

Why this and not something else:

- a reusable arena (copying each pass's values into the previous pass's buffers) still pays
  a copy of every kept value: copying 1.2 GiB into resident buffers took 0.11-0.31 s here,
  8-20% of the forward, where this setting costs nothing per pass; and it would help only a
  capture object reused across passes, not a new ``hs.capture`` per forward;
- ``calls="last"`` or ``reduce`` keep less, but change what is kept: they stay choices;
- the ``MALLOC_*_`` environment variables do the same but must be set before the process
  starts, by every user; a library cannot set them.

Safety: the settings are process-wide and cannot be read back, and setting any of them turns
glibc's dynamic thresholds off for the rest of the process (glibc has no way to turn them back
on). Hence hookscope changes nothing

- where the C library is not glibc (musl, macOS, Windows: there is no ``mallopt`` to call);
- for captures that keep less than :data:`MIN_BYTES` (64 MiB, what glibc's dynamic thresholds
  keep resident anyway);
- where the process was started with its own malloc settings (``MALLOC_MMAP_THRESHOLD_``,
  ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_TOP_PAD_``, ``MALLOC_MMAP_MAX_`` or those tunables in
  ``GLIBC_TUNABLES``): the user chose;
- with ``HOOKSCOPE_MALLOC=default`` in the environment (the opt-out; ``HOOKSCOPE_MALLOC=steady``
  or unset: the behaviour above).

Values larger than 32 MiB each still come from ``mmap`` and are faulted in fresh every pass.

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
from typing import Any

from hookscope.errors import SpecError

__all__ = ["ENV", "MIN_BYTES", "allocator_state", "check_setting", "keep_freed_memory", "would_change"]

#: The opt-out: ``HOOKSCOPE_MALLOC=default`` leaves glibc's malloc settings alone.
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


class _State:
    """What hookscope did to the allocator in this process (changed under ``lock``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.trim_threshold = 0  # 0: never set by hookscope
        self.mmap_threshold = 0
        self.skipped: str | None = None  # why nothing is set, once decided for good


_STATE = _State()


@functools.cache
def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``mallopt``, or None where the C library is not glibc."""
    try:  # the C library the process runs on (find_library would start a subprocess)
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    if libc is None or not hasattr(libc, "gnu_get_libc_version"):  # glibc only: its settings' numbers are glibc's
        return None
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return None
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return mallopt  # type: ignore[no-any-return]


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


def _user_settings() -> str | None:
    """The malloc settings the process was started with, named, or None."""
    given = [name for name in _USER_VARIABLES if name in os.environ]
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    given += [name for name in _USER_TUNABLES if name in tunables]
    return ", ".join(given) or None


def _skip_reason() -> str | None:
    """Why hookscope must leave the allocator alone, for good, or None."""
    try:
        if not check_setting():
            return f"{ENV}=default"
    except SpecError:  # changed to a wrong value since the capture was made: a pass's end never raises for it
        return f"{ENV}={os.environ.get(ENV)!r} is not a choice"
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

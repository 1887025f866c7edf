"""Per-call wall time and peak CUDA memory, read without a host sync inside the forward.

On the CPU a call's time is ``perf_counter`` around it: the work is done when the hook runs.
On CUDA the hooks record events on the current stream and the times are read after the
forward, with one synchronisation, so the measurement does not serialise the model.

Peak memory is PyTorch's allocator counter (``max_memory_allocated``), which has one global
peak per device. Nested calls each need their own peak, so :class:`PeakMemory` resets the
counter when a call starts and folds each finished call's peak into its parent's running
maximum: a parent's peak includes its children's. The counter is allocator bookkeeping on the
host: reading and resetting it does not sync with the device.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["CallClock", "PeakMemory"]


@dataclass
class _Timing:
    start: float = 0.0
    end: float = 0.0
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None


class CallClock:
    """Starts and stops a timer per call; :meth:`read` returns milliseconds after the pass."""

    def __init__(self) -> None:
        self._timings: list[_Timing] = []

    def start(self, device: torch.device | None) -> int:
        """Begin timing a call that runs on ``device``; returns a token for :meth:`stop`."""
        timing = _Timing()
        if device is not None and device.type == "cuda":
            begin = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            begin.record()
            timing.events = (begin, end)
        timing.start = time.perf_counter()
        self._timings.append(timing)
        return len(self._timings) - 1

    def stop(self, token: int, *, excluded: float = 0.0) -> None:
        """End the call's timer; ``excluded`` seconds (hookscope's own measuring inside the call)
        are taken out of a wall-clock time. CUDA times include the measuring kernels."""
        timing = self._timings[token]
        timing.end = time.perf_counter() - excluded
        if timing.events is not None:
            timing.events[1].record()

    def read(self, token: int) -> float:
        """The call's time in milliseconds (CUDA: device time; call after :meth:`synchronize`)."""
        timing = self._timings[token]
        if timing.events is not None:
            return float(timing.events[0].elapsed_time(timing.events[1]))
        return (timing.end - timing.start) * 1e3

    def synchronize(self) -> None:
        """Wait for the recorded CUDA events (once, after the forward)."""
        for timing in self._timings:
            if timing.events is not None:
                timing.events[1].synchronize()

    def clear(self) -> None:
        """Forget the calls of the previous pass."""
        self._timings.clear()


@dataclass
class _Frame:
    baseline: int
    peak: int = 0


class PeakMemory:
    """The rise of peak memory during each call, for nested calls, from one global counter.

    ``read_allocated``, ``read_peak`` and ``reset_peak`` default to PyTorch's CUDA allocator
    functions for ``device``; any other counter with the same three operations works too.
    """

    def __init__(
        self,
        device: torch.device | int | None = None,
        *,
        read_allocated: Callable[[], int] | None = None,
        read_peak: Callable[[], int] | None = None,
        reset_peak: Callable[[], None] | None = None,
    ) -> None:
        self._allocated = read_allocated or (lambda: torch.cuda.memory_allocated(device))
        self._peak = read_peak or (lambda: torch.cuda.max_memory_allocated(device))
        self._reset = reset_peak or (lambda: torch.cuda.reset_peak_memory_stats(device))
        self._stack: list[_Frame] = []

    def enter(self) -> None:
        """A call starts: the enclosing call keeps the peak so far, the counter restarts."""
        if self._stack:
            self._stack[-1].peak = max(self._stack[-1].peak, self._peak())
        self._reset()
        now = self._allocated()
        self._stack.append(_Frame(baseline=now, peak=now))

    def exit(self) -> int:
        """A call ends: returns how far memory rose above its start, in bytes."""
        frame = self._stack.pop()
        peak = max(frame.peak, self._peak())
        if self._stack:
            self._stack[-1].peak = max(self._stack[-1].peak, peak)
        return max(peak - frame.baseline, 0)

    def clear(self) -> None:
        """Forget open calls (a pass cut short)."""
        self._stack.clear()

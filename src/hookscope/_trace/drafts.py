"""A forward pass's drafts: the rows, leaves and queued statistics a :class:`Tracer` gathers.

What the hooks fill in while a pass runs, before any statistic is read: each call's
:class:`_Draft` with its :class:`_Leaf` s, the pass's :class:`_Pass` and, once it ended, its
:class:`_FinishedPass`. Kept apart from the hooks in ``recorder`` because these are plain
records with no behaviour of their own: the recorder writes them, ``Tracer._build`` reads them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from hookscope._shared.call_recorder import OpenCall, Watched
from hookscope._shared.histogram import RawHistogram
from hookscope._shared.identity import SeenTensors
from hookscope._shared.stats import RawStats
from hookscope._trace.rows import CallStatus
from hookscope._trace.timing import CallClock

__all__: list[str] = []


@dataclass
class _Leaf:
    path: str
    shape: tuple[int, ...]
    dtype: str
    device: str
    stats_index: int | None
    source: str | None


@dataclass(frozen=True)
class _FinishedPass:
    state: _Pass
    model_name: str
    seconds: float
    failure: int | None  # the innermost call the exception the forward ended with went through
    done: list[torch.cuda.Event]  # recorded after the last statistic on each CUDA stream used


def _record_done(streams: set[torch.cuda.Stream]) -> list[torch.cuda.Event]:
    """An event on each CUDA stream statistics were queued on: no sync, just a marker."""
    events = []
    for stream in streams:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream)
        events.append(event)
    return events


@dataclass(eq=False)
class _Module(Watched):
    params: int  # its own parameters, counted once at attach time


@dataclass(eq=False)
class _Draft(OpenCall[_Module]):
    order: int
    depth: int
    parent: int | None
    inputs: list[_Leaf]
    outputs: list[_Leaf] = field(default_factory=list)
    finished: int | None = None
    status: CallStatus = "ok"
    error: BaseException | None = None  # what went through the call, when it raised
    cuda: torch.device | None = None  # the call's CUDA device, for its timer and memory counter
    timer: int | None = None
    measured_before: float = 0.0  # the pass's measuring time when the call's timer started
    peak_bytes: int | None = None
    op: str = ""  # an op site's row: the op within its module call ("softmax#0", "attn.pattern#0")


class _Pass:
    """Everything one forward pass accumulates; a new pass starts from a clean one."""

    def __init__(self) -> None:
        self.rows: list[_Draft] = []
        self.raws: list[RawStats] = []
        self.histograms: list[RawHistogram] = []  # one per raw statistic, when histograms are on
        self.seen: SeenTensors[tuple[int | None, str | None]] = SeenTensors()
        self.finished = 0
        self.clock = CallClock()
        self.started = time.perf_counter()
        self.measuring = 0.0  # seconds spent measuring, taken out of the calls' times
        self.streams: set[torch.cuda.Stream] = set()  # CUDA streams statistics were queued on
        self.entropy: list[tuple[str, torch.Tensor]] = []  # router entropies queued (experts=True)

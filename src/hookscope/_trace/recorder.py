"""The :class:`Tracer`: hooks that record one row per module call, with statistics read once per pass.

Two hooks per traced module, those of a :class:`~hookscope._shared.call_recorder.CallRecorder`:
when a call begins its row takes the inputs, depth, parent and timer; when it returns, the
outputs; a call an exception went through is marked as raised, so a forward that raises still
closes every row. Statistics are
queued on the device by :func:`~hookscope._shared.stats.raw_stats` and read with one transfer per
device when the pass ends; a tensor seen earlier in the pass (a container's output is its last
child's, a module's input an earlier module's output) is not measured twice. The records a pass
fills in are ``drafts``'; ``trace()`` and ``tracing()`` are ``api``'s.

With ``ops=``, an :class:`~hookscope._arch.op_selectors.OpSelectors` watches the op sites'
modules and each selected op call becomes a row as it returns, under the row of its module's
call (the innermost open one: a module's own code runs while none of its children does),
measured the same way; an attention sub-site's row measures the value computed from the kernel
call (:func:`~hookscope._capture.attention_values`).
"""

from __future__ import annotations

import re
import time
import weakref
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from hookscope._arch.plan import plan_sites
from hookscope._arch.std import select_std
from hookscope._capture import attention_values
from hookscope._core.attach import HookGroup
from hookscope._core.compat.compiled import is_compiling
from hookscope._core.names import ROOT_LABEL, named_modules
from hookscope._core.op_sites import OpPattern
from hookscope._core.params import count, own_count
from hookscope._core.plan import attach_plan
from hookscope._core.select import Selector, ensure_module
from hookscope._core.sites import Site
from hookscope._core.tree import call_leaves, flatten_tensors
from hookscope._shared.call_recorder import Args, CallRecorder, Handled, Kwargs
from hookscope._shared.dtypes import dtype_name
from hookscope._shared.histogram import raw_histogram, read_histograms
from hookscope._shared.shapes import shape_of
from hookscope._shared.stats import Scratch, is_measurable, raw_stats, read_stats
from hookscope._trace.drafts import _Draft, _FinishedPass, _Leaf, _Module, _Pass, _record_done
from hookscope._trace.experts import RouterEntropy, experts_patterns, read_entropy
from hookscope._trace.options import TraceOptions
from hookscope._trace.result import Trace
from hookscope._trace.rows import LeafWhat, TensorInfo, TraceRow
from hookscope._trace.timing import CallClock, PeakMemory
from hookscope._version import __version__
from hookscope.errors import SpecError

__all__ = ["Tracer"]


class Tracer(CallRecorder[_Module, _Draft]):
    """Hooks that record a :class:`Trace` of every forward pass; made by :func:`tracing`.

    ``tracer.trace`` is the latest pass's trace (also after a forward that raised: its rows
    stop where the exception went through, and ``trace.failure`` is the innermost such call).
    With ``passes="all"``, ``tracer.passes`` holds every pass's trace, in order. The forwards
    traced are those of the thread that made the tracer; other threads' pass through untraced.
    """

    feature = "trace"

    def __init__(
        self,
        model: nn.Module,
        *,
        layers: Selector | Sequence[Selector] | None = None,
        options: TraceOptions | None = None,
        **opts: Any,
    ) -> None:
        ensure_module(model)
        options = TraceOptions.build(options, opts)
        self.options = options
        self._model = weakref.ref(model)
        self._stats = bool(options.stats)
        self._stat_fields = options.stat_fields
        self._bins = options.bins
        self._input_stats = self._stats and options.input_stats
        self._timing = options.timing
        self._memory = options.memory
        self._pass = _Pass()
        self._peaks: dict[int, PeakMemory] = {}
        self._scratch = Scratch()  # one |x| buffer for every tensor measured, not one allocation each
        self._keep_passes = options.passes == "all"
        # The latest pass, or with passes="all" every one: a _FinishedPass until first looked at.
        self._kept: list[_FinishedPass | Trace] = []
        self._selected = _modules(model, layers)
        # every op of the traced modules (no selector can be left unfired), or the selectors given
        self._check_ops = options.ops is not True
        patterns = _every_op(self._selected, layers) if options.ops is True else options.op_patterns
        if options.experts:
            patterns = [*patterns, *experts_patterns(self._selected)]
        plan = plan_sites(model, None, "module", owner="trace", error=SpecError, patterns=patterns or ())
        self._ops = plan.ops
        if self._ops is not None:  # an op site's module is traced too: its call is the op rows' parent
            self._selected = _union(model, self._selected, self._ops.modules)
        self._total_params = count(p for _, m in self._selected for p in m.parameters(recurse=False))
        attach_plan(
            plan,
            lambda _counted: self._record(model),  # the op modules are traced, so counted already
            lambda ops: ops.attach(model, self._op_row, lambda call: True, self._attention_rows),
            self.remove,  # hs.remove_all(model) also lets go of the buffer
        )
        self._entropy: RouterEntropy | None = None
        if options.experts:
            try:
                traced = {name for name, _ in self._selected}
                self._entropy = RouterEntropy(model, lambda: self._tracker.shared and self._tracker.foreign(), traced)
            except BaseException:
                self.remove()
                raise

    def _record(self, model: nn.Module) -> HookGroup:
        """The recorder's hooks on every traced module (its constructor attaches them)."""
        super().__init__(model, self._selected)
        return self._group

    # -- calls (told by the recorder's hooks) -------------------------------------------------------

    def watch(self, name: str, module: nn.Module) -> _Module:
        """A traced module's name, class and own parameter count, found once."""
        return _Module(name, type(module).__name__, own_count(module))

    def open_call(self, site: _Module, call: int, handled: Handled, args: Args, kwargs: Kwargs) -> _Draft:
        """Open the call's row: its place in the tree, its inputs, its timer."""
        state = self._pass
        leaves = call_leaves(args, kwargs)
        draft = self._draft(site, call, handled, leaves)
        device = draft.cuda = _cuda_device(leaves) if self._timing or self._memory else None
        if self._memory and device is not None:
            self._peak_memory(device).enter()
        if self._timing and not is_compiling():  # one fused graph under torch.compile: no per-call times
            draft.measured_before = state.measuring
            draft.timer = state.clock.start(device)
        state.rows.append(draft)
        return draft

    def _draft(
        self, site: _Module, call: int, handled: Handled, leaves: list[tuple[str, torch.Tensor]], **more: Any
    ) -> _Draft:
        """A new row inside the innermost open call, its inputs measured."""
        state, opened = self._pass, self.opened
        parent = opened[-1] if opened else None
        return _Draft(
            site,
            call,
            handled,
            order=len(state.rows),
            depth=len(opened),
            parent=None if parent is None else parent.order,
            inputs=[self._leaf(state, path, t, self._input_stats, None) for path, t in leaves],
            **more,
        )

    def close_call(self, draft: _Draft, output: Any) -> None:
        """The call returned: stop its timer and memory counter, number it in the order calls
        finished, and measure its outputs."""
        state = self._pass
        if draft.timer is not None:
            state.clock.stop(draft.timer, excluded=state.measuring - draft.measured_before)
        if self._memory and draft.cuda is not None:
            draft.peak_bytes = self._peak_memory(draft.cuda).exit()
        draft.finished = state.finished
        state.finished += 1
        site = f"{draft.site.name}#{draft.call}"
        draft.outputs = [self._leaf(state, p, t, self._stats, site) for p, t in flatten_tensors(output, "")]

    def call_raised(self, draft: _Draft, error: BaseException) -> None:
        """An exception went through the call: closed as one that returned nothing, marked as
        raised, and keeping the error until the pass ends (to find where the forward failed)."""
        self.close_call(draft, None)
        draft.status, draft.error = "raised", error

    # -- op calls (told by the op watcher, after the op ran) ------------------------------------------

    def _op_row(self, name: str, call: int, op: str, args: Args, kwargs: Kwargs, output: Any) -> None:
        """A row for one selected op call, under the row of its module's call."""
        self._add_op_row(name, call, op, "op", call_leaves(args, kwargs), flatten_tensors(output, ""))

    def _attention_rows(
        self, name: str, call: int, index: int, kinds: list[str], args: Args, kwargs: Kwargs, output: Any
    ) -> None:
        """A row per attention sub-site of one kernel call: the value computed from the call."""
        leaves = call_leaves(args, kwargs)
        counts = self._ops.head_counts(name) if self._ops is not None else None
        for kind, value, _ in attention_values(kinds, args, kwargs, output, detach=True, counts=counts):
            self._add_op_row(name, call, f"attn.{kind}#{index}", "attention", leaves, [("", value)])

    def _add_op_row(
        self,
        name: str,
        call: int,
        op: str,
        class_name: str,
        inputs: list[tuple[str, torch.Tensor]],
        outputs: list[tuple[str, torch.Tensor]],
    ) -> None:
        state = self._pass
        draft = self._draft(_Module(name, class_name, 0), call, None, inputs, finished=state.finished, op=op)
        state.finished += 1
        site = str(Site(name, call, op=op))
        draft.outputs = [self._leaf(state, path, t, self._stats, site) for path, t in outputs]
        state.rows.append(draft)

    def _leaf(self, state: _Pass, path: str, tensor: torch.Tensor, measure: bool, producer: str | None) -> _Leaf:
        known = state.seen.get(tensor)
        if known is not None:
            index, source = known
            if index is None and measure and is_measurable(tensor):
                index = self._measure(state, tensor)
                state.seen.put(tensor, (index, source))
        else:
            index, source = None, None
            if measure and is_measurable(tensor):
                index = self._measure(state, tensor)
            if producer is not None or index is not None:
                state.seen.put(tensor, (index, producer))
        dtype = dtype_name(tensor.dtype)
        return _Leaf(path, shape_of(tensor), dtype, str(tensor.device), index, source)

    def _measure(self, state: _Pass, tensor: torch.Tensor) -> int:
        timed = self._timing and not is_compiling()
        began = time.perf_counter() if timed else 0.0
        state.raws.append(raw_stats(tensor, scratch=self._scratch, fields=self._stat_fields))
        if self._bins:
            state.histograms.append(raw_histogram(tensor, bins=self._bins))
        if timed:
            state.measuring += time.perf_counter() - began
        if tensor.is_cuda:
            state.streams.add(torch.cuda.current_stream(tensor.device))
        return len(state.raws) - 1

    def _peak_memory(self, device: torch.device) -> PeakMemory:
        index = device.index or 0
        if index not in self._peaks:
            self._peaks[index] = PeakMemory(index)
        return self._peaks[index]

    # -- passes (told by the recorder) --------------------------------------------------------------

    def start_pass(self, module: nn.Module) -> None:
        """A new forward pass: forget the previous one's drafts."""
        self._pass = _Pass()
        if self._entropy is not None:
            self._entropy.take()  # a cut-short pass's values
        for peaks in self._peaks.values():
            peaks.clear()
        if self._ops is not None:
            self._ops.start()

    def end_pass(self, module: nn.Module, error: BaseException | None) -> None:
        """Keep the finished pass; its statistics are read when the trace is first looked at.

        Reading here would be a host sync inside the model's last hook; deferring it keeps the
        whole forward free of syncs, so the first read happens after ``model(x)`` returned.
        """
        state = self._pass
        if self._entropy is not None:
            state.entropy = self._entropy.take()
        raised = [draft.order for draft in state.rows if error is not None and draft.error is error]
        for draft in state.rows:
            draft.error = None  # the traceback would keep the forward's activations alive
        finished = _FinishedPass(
            state,
            type(module).__name__,
            time.perf_counter() - state.started,
            max(raised) if raised else None,
            _record_done(state.streams),
        )
        self._kept = [*self._kept, finished] if self._keep_passes else [finished]
        if self._ops is not None and self._check_ops and error is None:
            self._ops.check(self._tracker.counts(), lambda call: True)  # an op selector that never fired

    def abandon_pass(self) -> None:
        """The previous pass was cut short (KeyboardInterrupt): drop it."""
        self._pass = _Pass()

    def _freeze(self, draft: _Draft, stats: list[Any], histograms: list[Any], clock: CallClock | None) -> TraceRow:
        def info(leaf: _Leaf, what: LeafWhat) -> TensorInfo:
            index = leaf.stats_index
            measured, histogram = (None, None) if index is None else (stats[index], histograms[index])
            return TensorInfo(leaf.path, leaf.shape, leaf.dtype, leaf.device, measured, leaf.source, histogram, what)

        return TraceRow(
            order=draft.order,
            depth=draft.depth,
            name=draft.site.name,
            class_name=draft.site.class_name,
            call=draft.call,
            params=draft.site.params,
            inputs=tuple(info(leaf, "input") for leaf in draft.inputs),
            outputs=tuple(info(leaf, "output") for leaf in draft.outputs),
            parent=draft.parent,
            finished=draft.finished,
            status=draft.status if draft.finished is not None else "raised",
            time_ms=None if clock is None or draft.timer is None or draft.finished is None else clock.read(draft.timer),
            peak_bytes=draft.peak_bytes,
            op=draft.op,
        )

    # -- reading and lifetime -----------------------------------------------------------------------

    @property
    def trace(self) -> Trace:
        """The :class:`Trace` of the latest forward pass (its statistics are read on first access)."""
        latest = self.latest
        if latest is None:
            where = ", on this thread: forwards on other threads pass through untraced" if self._tracker.shared else ""
            raise SpecError(f"no forward pass has been traced yet: call the model inside the tracing() block{where}")
        return latest

    @property
    def latest(self) -> Trace | None:
        """The latest pass's :class:`Trace`, or None before the first forward."""
        return self._read(len(self._kept) - 1) if self._kept else None

    @property
    def passes(self) -> list[Trace]:
        """With ``passes="all"``, the :class:`Trace` of every forward pass, in order (a
        generation loop: the prefill, then one per new token; a forward that raised too, its
        ``failure`` set); otherwise the latest one's. Statistics are read on first access."""
        return [self._read(index) for index in range(len(self._kept))]

    def _read(self, index: int) -> Trace:
        kept = self._kept[index]
        if isinstance(kept, _FinishedPass):  # the rows hold what is needed; let the device vectors go
            kept = self._kept[index] = self._build(kept)
        return kept

    def _build(self, finished: _FinishedPass) -> Trace:
        """Read every statistic of a pass at once (one transfer per device) and make its rows."""
        state = finished.state
        meta: dict[str, Any] = {
            "hookscope": __version__,
            "torch": torch.__version__,
            "model": finished.model_name,
            "wall_ms": finished.seconds * 1e3,
            "stats": self._stats if self._stat_fields is None else sorted(self._stat_fields),
            "timing": self._timing,
            "params": self._total_params,
            "histogram_bins": self._bins,
        }
        try:
            for event in finished.done:
                event.synchronize()  # the statistics were queued on the forward's streams
            stats: list[Any] = read_stats(state.raws)
            if state.entropy:
                meta["router_entropy"] = read_entropy(state.entropy)
            histograms: list[Any] = read_histograms(state.histograms) if self._bins else [None] * len(stats)
            if self._timing:
                state.clock.synchronize()
        except RuntimeError as error:  # a device that failed in the forward (a device-side assert)
            stats = histograms = [None] * len(state.raws)
            meta["stats_error"] = f"{type(error).__name__}: {error}"
        clock = state.clock if self._timing and "stats_error" not in meta else None  # unread times: none
        rows = [self._freeze(draft, stats, histograms, clock) for draft in state.rows]
        return Trace(_with_self_time(rows), model=self._model(), meta=meta, failure=finished.failure)

    def remove(self) -> None:
        """Remove every hook of this tracer; the traces stay readable. Safe to call twice."""
        self._scratch = Scratch()  # let go of the work buffer
        try:
            if self._ops is not None:
                self._ops.remove()
            if getattr(self, "_entropy", None) is not None:
                self._entropy.remove()  # type: ignore[union-attr]
        finally:
            super().remove()

    def __repr__(self) -> str:
        state = "live" if self.live else "removed"
        return f"<Tracer of {len(self._selected)} modules, {state}>"


def _modules(model: nn.Module, layers: Selector | Sequence[Selector] | None) -> list[tuple[str, nn.Module]]:
    if layers is None:
        return named_modules(model)
    if isinstance(layers, (list, tuple)) and not layers:
        raise SpecError("layers=[] traces nothing; leave layers=None to trace every module")
    return select_std(model, layers)  # a union, each module once, in model order ("std:" names too)


def _every_op(traced: list[tuple[str, nn.Module]], layers: Selector | Sequence[Selector] | None) -> list[OpPattern]:
    """``ops=True``: a selector of every op of each traced module (of every module: ``*`` and the root)."""
    if layers is None:
        every = [OpPattern(ROOT_LABEL)]
        return [*every, OpPattern("*")] if len(traced) > 1 else every
    return [OpPattern(f"re:^{re.escape(name)}$" if name else ROOT_LABEL) for name, _ in traced]


def _union(
    model: nn.Module, traced: list[tuple[str, nn.Module]], more: list[tuple[str, nn.Module]]
) -> list[tuple[str, nn.Module]]:
    """The traced modules and ``more``, each once, in model order."""
    chosen = {id(module) for _, module in (*traced, *more)}
    return [(name, module) for name, module in named_modules(model) if id(module) in chosen]


def _cuda_device(leaves: list[tuple[str, torch.Tensor]]) -> torch.device | None:
    for _, tensor in leaves:
        if tensor.device.type == "cuda":
            return tensor.device
    return None


def _with_self_time(rows: list[TraceRow]) -> list[TraceRow]:
    """Fill ``self_ms``: a call's time minus the time of the traced calls directly inside it."""
    if all(row.time_ms is None for row in rows):
        return rows
    children: dict[int, float] = {}
    for row in rows:
        if row.parent is not None and row.time_ms is not None:
            children[row.parent] = children.get(row.parent, 0.0) + row.time_ms
    return [
        row if row.time_ms is None else replace(row, self_ms=max(row.time_ms - children.get(row.order, 0.0), 0.0))
        for row in rows
    ]

"""The training monitor's one recorder: per-call activation measures and gradients, step by step.

One :class:`~hookscope._shared.call_recorder.CallRecorder` serves ``hs.monitor`` and its preset
``hs.watch_grads``, so both follow its rules (the thread rule among them: another thread's
forward passes by unrecorded, a ``DataParallel`` replica is refused with
:class:`~hookscope.errors.ConcurrentPassError`). What it measures is a
:class:`~hookscope._monitor.measures.Measures`.

Gradients come from tensor hooks, not module backward hooks: a call's inputs that require grad
are hooked when it opens, its outputs when it closes. Full backward hooks wrap a module's inputs
and outputs in a custom autograd function, which breaks on in-place ops ("... is a view and is
being modified inplace") and never sees tensors inside dataclass outputs; a tensor hook works
for any tensor autograd tracks. A tensor's hook receives the gradient of the loss with respect
to that tensor, from all its uses: for a module's output that is its ``grad_output``, for its
input its ``grad_input`` as ``torch.autograd.grad`` would give it. Each tensor gets **one**
hook whatever is measured of its gradient (statistics, precision): a tensor that is one
module's output and the next one's input, or a layer's output whose precision is counted too,
is hooked once.

Each gradient is summarised on its device inside the hook; nothing is read until the step is,
all at once.

Limits: a tensor hook on a view that is later changed in place does not fire (autograd
rebases the view), so such a site has no record; and hooks fire for every backward through a
tensor, so a second ``torch.autograd.grad`` over the same graph (a gradient penalty) adds its
gradients to the step's statistics.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from hookscope._core.attach import WrapSpec
from hookscope._core.live_hooks import remove_through
from hookscope._core.names import call_label
from hookscope._core.tracker import in_backward
from hookscope._core.tree import call_leaves, flatten_tensors
from hookscope._monitor.measures import Kept, Measures, first_floating, measure_output
from hookscope._monitor.records import GradRecord, GradWhat, MonitorStep
from hookscope._monitor.replay import Replay, checkpoint_context
from hookscope._shared.call_recorder import Args, CallRecorder, Handled, Kwargs, OpenCall, Watched
from hookscope._shared.identity import SeenTensors
from hookscope._shared.precision import merge_precision, raw_precision
from hookscope._shared.stats import RawStats, Stats, full_value, is_measurable, merge_raw, raw_stats, read_stats

__all__ = ["DEAD_UNIT_TYPES", "Read", "Recorded", "TrainingRecorder"]

# Activations whose output is exactly zero for a dead unit (nn.Threshold only with value 0).
DEAD_UNIT_TYPES: tuple[type[nn.Module], ...] = (nn.ReLU, nn.ReLU6, nn.Threshold)

#: How a step's on-device gradient statistics are read: by default on their own
#: (:func:`~hookscope._shared.stats.read_stats`); ``hs.monitor`` reads them with its own numbers.
Read = Callable[[Sequence[RawStats]], list[Stats]]


@dataclass(eq=False)
class _Module(Watched):
    watches_units: bool  # a ReLU-like activation: its dead units are looked for
    unhooked: _Open | None = None  # the draft of each call left unhooked (no grad, or hooked already)


@dataclass(eq=False)
class _Open(OpenCall[_Module]):
    sequence: int  # when the call started in the forward
    inputs: list[tuple[str, int]]  # (path, slot) of the inputs that require grad


@dataclass
class _Call:
    name: str
    class_name: str
    call: int
    sequence: int  # when the call started in the forward: records come out in forward order
    outputs: list[tuple[str, int]]  # (path, slot)
    inputs: list[tuple[str, int]] = field(default_factory=list)


class Recorded:
    """What one training step accumulates between two steps: the calls and the gradients that
    arrived (by slot: one per tensor hooked), and each layer's activation measures."""

    def __init__(self) -> None:
        self.calls: list[_Call] = []
        self.raws: dict[int, RawStats] = {}  # slot -> statistics of the gradient that arrived
        self.precision: dict[int, torch.Tensor] = {}  # slot -> what the format loses of that gradient
        self.precise: set[int] = set()  # slots whose gradient's precision is counted (layer outputs)
        self.fired: list[int] = []  # slots in the order their gradients arrived (backward order)
        self.slots = 0
        self.seen: SeenTensors[int] = SeenTensors()
        self.layers: dict[str, Kept] = {}  # layer name -> its activation measures
        self.alive: dict[tuple[str, int], torch.Tensor] = {}  # ReLU-like outputs: channels ever non-zero
        self.sequence = 0  # watched calls started in this step's forwards
        self.replay = Replay()
        self.handles: list[RemovableHandle] = []  # hooks on leaf tensors, which outlive the step
        self.closed = False

    def close(self) -> None:
        """No more gradients for this step; hooks left on leaf tensors come off."""
        self.closed = True
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    @property
    def has_calls(self) -> bool:
        """Whether a watched call's gradient was hooked in this step."""
        return bool(self.calls)


class TrainingRecorder(CallRecorder[_Module, _Open]):
    """The hooks of a training monitor: one draft per watched call, :class:`Measures` taken of
    its output when it closes and of its gradients in one tensor hook per tensor.

    :meth:`record_next` says whether the next step records (``every=N``: on the others every
    hook returns after one check); :meth:`close_step` ends a step and :meth:`read` reads it.
    """

    feature: ClassVar[str] = "monitor"

    def __init__(
        self,
        model: nn.Module,
        layers: Sequence[tuple[str, nn.Module]],
        measures: Measures,
        *,
        parameters: Sequence[tuple[str, nn.Parameter]] = (),
        dead_window: int = 5,
        wraps: Sequence[WrapSpec] = (),
    ) -> None:
        self.measures = measures
        self._parameters = list(parameters)  # those whose gradients :meth:`read` records
        self._dead_window = dead_window
        self._pass_grad = True
        self._pass_checkpointed = False
        self._current = Recorded()
        self._recording = True
        self._dead: dict[tuple[str, int], deque[torch.Tensor]] = {}
        #: A watched layer ran a training forward since :meth:`close_step` (an evaluation's does not count).
        self.ran = False
        super().__init__(model, layers, wraps=wraps)
        remove_through(self._group, self.remove)  # hs.remove_all(model) also takes the step's tensor hooks off

    # -- calls (told by the recorder's hooks) ---------------------------------------------------

    def watch(self, name: str, module: nn.Module) -> _Module:
        """A watched module, and the one draft its unhooked calls share."""
        units = isinstance(module, DEAD_UNIT_TYPES) and getattr(module, "value", 0) == 0
        site = _Module(name, type(module).__name__, units)
        site.unhooked = _Open(site, 0, None, -1, [])
        return site

    def open_call(self, site: _Module, call: int, handled: Handled, args: Args, kwargs: Kwargs) -> _Open | None:
        """Hook the call's inputs that require grad: before the module runs, so that a module
        changing its input in place (``ReLU(inplace=True)``) leaves ``grad_input`` its own."""
        step = self._current
        if not torch.is_grad_enabled():
            if not in_backward() and (context := self._no_grad_context()) is not None:
                step.replay.skip(context, id(site), step.sequence, call)  # re-run in backward
            step.sequence += 1
            return site.unhooked
        if in_backward():  # a checkpoint re-running its block inside the backward
            context = checkpoint_context() if step.replay.waiting else None  # non-reentrant: no walk
            claimed = None if context is None else step.replay.claim(context, id(site))
            if claimed is None:
                return site.unhooked  # non-reentrant re-run: hooked in the forward already
            sequence, call = claimed
        else:
            sequence = step.sequence
            step.sequence += 1
        inputs = []
        if self.measures.grads:
            inputs = [(path, self._hook(step, t)) for path, t in call_leaves(args, kwargs) if t.requires_grad]
        return _Open(site, call, handled, sequence, inputs)

    def close_call(self, draft: _Open, output: Any) -> None:
        """Measure the output, hook the outputs that require grad (once each), note which units
        of a ReLU-like output were alive."""
        site = draft.site
        if draft is site.unhooked:
            return
        step = self._current
        measures = self.measures
        if measures.of_outputs and (tensor := first_floating(output)) is not None and tensor.numel():
            kept = step.layers.setdefault(site.name, Kept())
            measure_output(kept, tensor, measures)
            if measures.precision is not None and tensor.requires_grad:
                slot = self._hook(step, tensor)
                step.precise.add(slot)
                kept.grad_slots.append(slot)
        if not measures.grads:
            return
        outputs = [(path, self._hook(step, t)) for path, t in flatten_tensors(output, "") if t.requires_grad]
        if outputs or draft.inputs:
            step.calls.append(_Call(site.name, site.class_name, draft.call, draft.sequence, outputs, draft.inputs))
        if site.watches_units and isinstance(output, torch.Tensor):
            _note_alive(step, (site.name, draft.call), output)

    def _hook(self, step: Recorded, tensor: torch.Tensor) -> int:
        """The tensor's slot in the step: its one hook, registered the first time it is seen,
        takes every measure of its gradient (statistics; precision where its slot is marked)."""
        slot = step.seen.get(tensor)
        if slot is not None:
            return slot
        slot = step.slots
        step.slots += 1
        step.seen.put(tensor, slot)
        stats, target = self.measures.grads, self.measures.precision

        def on_grad(grad: torch.Tensor) -> None:
            if step.closed or not is_measurable(grad):
                return  # a step already read, or a sparse gradient
            if stats:
                raw = raw_stats(grad)
                step.raws[slot] = merge_raw(step.raws[slot], raw) if slot in step.raws else raw
                step.fired.append(slot)
            if slot in step.precise and grad.numel():
                step.precision[slot] = merge_precision(step.precision.get(slot), raw_precision(grad, target))

        handle = tensor.register_hook(on_grad)  # type: ignore[no-untyped-call]
        if tensor.is_leaf:  # a parameter or an input passed in: its hooks would stay after the step
            step.handles.append(handle)
        return slot

    # -- passes (told by the recorder) ----------------------------------------------------------

    def skips_pass(self) -> bool:
        """Only the steps not recorded: a checkpointed block recomputing in backward is where
        a reentrant checkpoint's gradients are hooked, so recomputations are recorded. A pass
        with grad notes that a training forward ran (a step with none is refused)."""
        if torch.is_grad_enabled():
            self.ran = True
        return not self._recording

    def start_pass(self, module: nn.Module) -> None:
        """A forward begins. One that begins without grad is looked at once: inside a reentrant
        checkpoint (``checkpoint(model, x)``), or plain evaluation, whose calls need no stack walk."""
        self._pass_grad = torch.is_grad_enabled()
        self._pass_checkpointed = not self._pass_grad and checkpoint_context() is not None

    def _no_grad_context(self) -> int | None:
        """The reentrant checkpoint a call made without grad runs in, walking the stack only where
        one can be: a no-grad call inside a forward that had grad, or a checkpointed forward."""
        return checkpoint_context() if self._pass_grad or self._pass_checkpointed else None

    # -- steps ----------------------------------------------------------------------------------

    @property
    def recording(self) -> bool:
        """Whether the step under way records."""
        return self._recording

    def record_next(self, record: bool) -> None:
        """Record the next step, or let its hooks return at once (from the next call on)."""
        self._recording = record
        self.skipping = not record

    def close_step(self) -> Recorded:
        """End the step under way: what it recorded (gradients arriving later are not)."""
        step, self._current = self._current, Recorded()
        self.opened.clear()  # calls open now began in the step that ends here
        self.ran = False
        step.close()
        return step

    def has_parameter_grads(self) -> bool:
        """Whether a watched parameter holds a gradient."""
        return any(p.grad is not None for _, p in self._parameters)

    def read(self, step: Recorded, index: int, read: Read | None = None) -> MonitorStep:
        """The step's gradient records (and dead units), numbered ``index``: one entry per site;
        the same site in several micro-batches (gradient accumulation, several backward passes
        before the step ends) merges into one set of statistics."""
        order = {slot: rank for rank, slot in enumerate(dict.fromkeys(step.fired))}
        sites: dict[tuple[str, int, str, str], tuple[str, RawStats, int | None]] = {}
        merged: dict[tuple[str, int, str, str], set[int]] = {}
        for call in sorted(step.calls, key=lambda c: c.sequence):  # forward order, re-runs included
            kinds: tuple[tuple[GradWhat, list[tuple[str, int]]], ...] = (
                ("grad_output", call.outputs),
                ("grad_input", call.inputs),
            )
            for what, leaves in kinds:
                for path, slot in leaves:
                    if slot not in step.raws:
                        continue  # no gradient reached this tensor
                    key = (call.name, call.call, what, path)
                    if slot in merged.setdefault(key, set()):
                        continue  # one tensor (a parameter passed in) seen by several micro-batches: once
                    merged[key].add(slot)
                    known = sites.get(key)
                    raw = step.raws[slot] if known is None else merge_raw(known[1], step.raws[slot])
                    sites[key] = (call.class_name, raw, order.get(slot) if known is None else known[2])
        params = self._parameter_stats()
        stats = (read or read_stats)([raw for _, raw, _ in sites.values()])
        records = [
            GradRecord.of(index, name, class_name, call, what, path, measured, order=rank)  # type: ignore[arg-type]
            for ((name, call, what, path), (class_name, _, rank)), measured in zip(sites.items(), stats, strict=True)
        ]
        records += [GradRecord.of_parameter(index, name, grad, weight) for name, grad, weight in params]
        return MonitorStep(index, records, self._update_dead(step))

    def _parameter_stats(self) -> list[tuple[str, Stats, float]]:
        """``(name, Stats of the gradient, weight norm)`` of every watched parameter with a gradient."""
        named = [(n, p) for n, p in self._parameters if p.grad is not None and is_measurable(p.grad)]
        if not named:
            return []
        grads = read_stats([raw_stats(p.grad) for _, p in named])  # type: ignore[arg-type]
        by_device: dict[torch.device, list[int]] = {}
        for i, (_, parameter) in enumerate(named):
            by_device.setdefault(parameter.device, []).append(i)
        norms = [0.0] * len(named)
        for indices in by_device.values():  # one read per device
            # A sharded (FSDP2) weight's norm is a partial one per rank: full_value sums them (one
            # all-reduce per sharded parameter; the gradients' statistics gather each whole gradient).
            values = torch.stack([full_value(torch.linalg.vector_norm(named[i][1].detach().float())) for i in indices])
            for i, value in zip(indices, values.tolist(), strict=True):
                norms[i] = value
        return [(name, g, w) for (name, _), g, w in zip(named, grads, norms, strict=True)]

    def _update_dead(self, step: Recorded) -> dict[str, list[int]]:
        for key in [key for key in self._dead if key not in step.alive]:
            del self._dead[key]  # a call that did not run this step: its window starts over
        for key, alive in step.alive.items():
            window = self._dead.get(key)
            if window is None or (window and window[-1].shape != alive.shape):
                window = self._dead[key] = deque(maxlen=self._dead_window)  # new, or its width changed
            window.append(alive)
        dead = {}
        for (name, call), window in self._dead.items():
            if len(window) == self._dead_window:
                ever = torch.stack(list(window)).any(0)
                channels = (~ever).nonzero().flatten().tolist()
                if channels:
                    dead[f"{call_label(name, call)}"] = channels
        return dead

    # -- lifetime -------------------------------------------------------------------------------

    def remove(self) -> None:
        """Remove the hooks. What the open step caught so far is kept for a last read; gradients
        arriving after this are not recorded."""
        self._current.close()
        super().remove()


def _note_alive(step: Recorded, key: tuple[str, int], output: torch.Tensor) -> None:
    """OR into the step which channels of a ReLU-like output were non-zero for some sample."""
    if output.dim() < 2:
        return
    channel = 1 if output.dim() >= 4 else output.dim() - 1  # NCHW: dim 1; (N, C) and (N, T, C): last
    with torch.no_grad():
        alive = output.detach().ne(0).movedim(channel, -1).reshape(-1, output.shape[channel]).any(0)
    known = step.alive.get(key)
    step.alive[key] = alive if known is None or known.shape != alive.shape else known | alive

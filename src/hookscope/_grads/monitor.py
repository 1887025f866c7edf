"""``watch_grads()``: gradient statistics per module call and per parameter, step after step.

Activation gradients come from tensor hooks, not module backward hooks: a forward hook
registers ``register_hook`` on each output (and input) tensor that requires grad. Full backward
hooks wrap a module's inputs and outputs in a custom autograd function, which breaks on in-place
ops ("... is a view and is being modified inplace") and never sees tensors inside dataclass
outputs; a tensor hook works for any tensor autograd tracks. A tensor's hook receives the
gradient of the loss with respect to that tensor, from all its uses: for a module's output
that is its ``grad_output``, for its input its ``grad_input`` as ``torch.autograd.grad`` would
give it. A tensor that is one module's output and the next one's input is hooked once.

Each gradient is summarised on its device by :func:`hookscope._shared.stats.raw_stats` inside the hook;
nothing is read until :meth:`GradMonitor.step`, which reads the whole step at once.

Limits: a tensor hook on a view that is later changed in place does not fire (autograd
rebases the view), so such a site has no record; and hooks fire for every backward through a
tensor, so a second ``torch.autograd.grad`` over the same graph (a gradient penalty) adds its
gradients to the step's statistics.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from hookscope._arch.std import select_std
from hookscope._core.attach import remove_through
from hookscope._core.names import call_label, named_modules, named_parameters
from hookscope._core.select import Selector, ensure_module, given_selectors
from hookscope._core.tracker import in_backward
from hookscope._core.tree import call_leaves, flatten_tensors
from hookscope._grads.records import GradRecord, GradStep, GradWhat
from hookscope._grads.replay import Replay, checkpoint_context
from hookscope._grads.summary import GradSummary, summarise
from hookscope._shared.call_recorder import Args, CallRecorder, Handled, Kwargs, OpenCall, Watched
from hookscope._shared.identity import SeenTensors
from hookscope._shared.stats import RawStats, Stats, full_value, is_measurable, merge_raw, raw_stats, read_stats
from hookscope.errors import SpecError, UnsupportedModelError

__all__ = ["DEAD_UNIT_TYPES", "GradMonitor", "watch_grads"]

# Activations whose output is exactly zero for a dead unit (nn.Threshold only with value 0).
DEAD_UNIT_TYPES: tuple[type[nn.Module], ...] = (nn.ReLU, nn.ReLU6, nn.Threshold)


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


class _Step:
    """What one training step accumulates between two ``monitor.step()`` calls."""

    def __init__(self) -> None:
        self.calls: list[_Call] = []
        self.raws: dict[int, RawStats] = {}  # slot -> statistics of the gradient that arrived
        self.fired: list[int] = []  # slots in the order their gradients arrived (backward order)
        self.slots = 0
        self.seen: SeenTensors[int] = SeenTensors()
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


class GradMonitor(CallRecorder[_Module, _Open]):
    """Gradient statistics of a model over a training loop; made by :func:`watch_grads`.

    Call :meth:`step` once per optimiser step, after ``loss.backward()`` and before
    ``optimizer.zero_grad()``; it reads the step's statistics (a few transfers, none inside a
    hook) and appends them to :attr:`records`. ``every=N`` records every N-th step only: on the
    others the monitor's hooks return after one check (the call counter still counts).
    """

    feature = "watch_grads"

    def __init__(
        self,
        model: nn.Module,
        selectors: tuple[Selector, ...],
        *,
        params: bool,
        activations: bool,
        every: int,
        dead_window: int,
    ) -> None:
        ensure_module(model)
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise SpecError(f"every={every!r} is not a positive whole number of steps; 1 records every step")
        if not isinstance(dead_window, int) or isinstance(dead_window, bool) or dead_window < 1:
            raise SpecError(f"dead_window={dead_window!r} is not a positive number of steps")
        if not (params or activations):
            raise SpecError("params=False and activations=False watch nothing; keep at least one")
        self._params = params
        self._activations = activations
        self._every = every
        self._dead_window = dead_window
        self._selected = _modules(model, selectors)
        self._parameters = _parameters(model, self._selected, whole=not selectors)
        if params:
            _refuse_offloaded(self._parameters)
        self._pass_grad = True
        self._pass_checkpointed = False
        self._step_index = 0
        self._current = _Step()
        self._recording = True
        self._records: list[GradStep] = []
        self._dead: dict[tuple[str, int], deque[torch.Tensor]] = {}
        self._written = -1  # the last step sent to TensorBoard
        super().__init__(model, self._selected if activations else [])
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
        inputs = [(path, self._watch(step, t)) for path, t in call_leaves(args, kwargs) if t.requires_grad]
        return _Open(site, call, handled, sequence, inputs)

    def close_call(self, draft: _Open, output: Any) -> None:
        """Hook the outputs that require grad; note which units of a ReLU-like output were alive."""
        site = draft.site
        if draft is site.unhooked:
            return
        step = self._current
        outputs = [(path, self._watch(step, t)) for path, t in flatten_tensors(output, "") if t.requires_grad]
        if outputs or draft.inputs:
            step.calls.append(_Call(site.name, site.class_name, draft.call, draft.sequence, outputs, draft.inputs))
        if site.watches_units and isinstance(output, torch.Tensor):
            _note_alive(step, (site.name, draft.call), output)

    def _watch(self, step: _Step, tensor: torch.Tensor) -> int:
        slot = step.seen.get(tensor)
        if slot is not None:
            return slot
        slot = step.slots
        step.slots += 1
        step.seen.put(tensor, slot)

        def on_grad(grad: torch.Tensor) -> None:
            if step.closed or not is_measurable(grad):
                return  # a step already read, or a sparse gradient
            raw = raw_stats(grad)
            step.raws[slot] = merge_raw(step.raws[slot], raw) if slot in step.raws else raw
            step.fired.append(slot)

        handle = tensor.register_hook(on_grad)  # type: ignore[no-untyped-call]
        if tensor.is_leaf:  # a parameter or an input passed in: its hooks would stay after the step
            step.handles.append(handle)
        return slot

    # -- passes (told by the recorder) ----------------------------------------------------------

    def skips_pass(self) -> bool:
        """Only the steps ``every`` skips: a checkpointed block recomputing in backward is where
        a reentrant checkpoint's gradients are hooked, so recomputations are recorded."""
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

    def step(self, *, read_with: Callable[[Sequence[RawStats]], list[Stats]] | None = None) -> GradStep | None:
        """Close the current step: read its statistics and append them to :attr:`records`.

        Returns the step's :class:`GradStep`, or None on a step ``every`` skips and on a step
        in which no watched module ran with grad and no watched parameter has a gradient.
        ``read_with`` reads the step's on-device statistics instead of
        :func:`~hookscope._shared.stats.read_stats` (``hs.monitor`` reads them in the same
        transfer as its own numbers); it is not called on a step that records nothing.
        """
        step, index = self._current, self._step_index
        self._current = _Step()
        self._step_index += 1
        recorded = self._recording
        self.record_next(self._step_index % self._every == 0)  # from the next call on, not only the next pass
        self.opened.clear()  # calls open now began in the step that ends here
        step.close()
        if not recorded or not (step.calls or (self._params and any(p.grad is not None for _, p in self._parameters))):
            return None
        result = self._read(step, index, read_with or read_stats)
        self._records.append(result)
        return result

    def record_next(self, record: bool) -> None:
        """Record the next step, or let its hooks return at once: for a caller (``hs.monitor``)
        that decides itself which steps to log, instead of ``every``."""
        self._recording = record
        self.skipping = not record

    def _read(self, step: _Step, index: int, read: Callable[[Sequence[RawStats]], list[Stats]]) -> GradStep:
        # One entry per site; the same site in several micro-batches (gradient accumulation,
        # several backward passes before step()) merges into one set of statistics.
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
        params = self._parameter_stats() if self._params else []
        stats = read([raw for _, raw, _ in sites.values()])
        records = [
            GradRecord.of(index, name, class_name, call, what, path, measured, order=rank)  # type: ignore[arg-type]
            for ((name, call, what, path), (class_name, _, rank)), measured in zip(sites.items(), stats, strict=True)
        ]
        records += [GradRecord.of_parameter(index, name, grad, weight) for name, grad, weight in params]
        dead = self._update_dead(step)
        return GradStep(index, records, dead)

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

    def _update_dead(self, step: _Step) -> dict[str, list[int]]:
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

    # -- reading --------------------------------------------------------------------------------

    @property
    def records(self) -> list[GradStep]:
        """Every recorded step, oldest first."""
        return list(self._records)

    @property
    def history(self) -> Any:
        """Steps x layers of the gradient norm with respect to each call's output, as pandas.

        :meth:`history_of` gives any other statistic or kind.
        """
        return self.history_of()

    def history_of(self, metric: str = "norm", what: str = "grad_output") -> Any:
        """A pandas DataFrame, steps x layers, of one statistic (``norm``, ``mean_abs``, ``max_abs``,
        ``nan``, ``inf``; ``ratio`` with ``what="param"``). Columns are the records' ``column`` names."""
        from hookscope._grads.records import history_frame

        return history_frame(self._records, metric, what)

    def summary(
        self, *, vanishing: float = 1e-4, exploding: float = 1e3, growth: float = 10.0, window: int = 5
    ) -> GradSummary:
        """Flag vanishing, exploding and non-finite gradients and dead units.

        The thresholds and their defaults are in :mod:`hookscope._grads.summary`.
        """
        return summarise(self._records, vanishing=vanishing, exploding=exploding, growth=growth, window=window)

    def to_tensorboard(self, writer: Any) -> None:
        """Write the steps recorded since the last call to a ``SummaryWriter`` as scalars.

        Call it after ``monitor.step()`` (every step or now and then): each step is written
        once, tagged ``grads/grad_output/<module>#<call>/norm``, ``grads/param/<name>/ratio``, ...
        """
        from hookscope._grads.sinks import write_tensorboard

        self._written = write_tensorboard(self._records, writer, after=self._written)

    # -- lifetime -------------------------------------------------------------------------------

    def remove(self) -> None:
        """Remove the hooks. What the open step caught so far is kept for a last :meth:`step`;
        gradients arriving after this are not recorded."""
        self._current.close()
        super().remove()

    def __repr__(self) -> str:
        state = "live" if self.live else "removed"
        return f"<GradMonitor of {len(self._selected)} modules: {len(self._records)} steps recorded, {state}>"

    def _repr_html_(self) -> str:
        """The latest step's gradient norms (a row with NaN/Inf marked), then the summary, for Jupyter."""
        from hookscope._shared.tables import Column, Table

        columns = [Column("layer"), Column("what"), *(Column(h, "right") for h in ("norm", "mean |g|", "max |g|"))]
        table = Table([*columns, Column("nan/inf", "right")], title=repr(self), notes=str(self.summary()).splitlines())
        for r in self._records[-1].records if self._records else ():
            cells = (f"{r.norm:.4g}", f"{r.mean_abs:.4g}", f"{r.max_abs:.4g}", f"{r.nan}/{r.inf}")
            table.add(r.column, r.what, *cells, bad=bool(r.nan or r.inf))
        return table.html()


def _note_alive(step: _Step, key: tuple[str, int], output: torch.Tensor) -> None:
    """OR into the step which channels of a ReLU-like output were non-zero for some sample."""
    if output.dim() < 2:
        return
    channel = 1 if output.dim() >= 4 else output.dim() - 1  # NCHW: dim 1; (N, C) and (N, T, C): last
    with torch.no_grad():
        alive = output.detach().ne(0).movedim(channel, -1).reshape(-1, output.shape[channel]).any(0)
    known = step.alive.get(key)
    step.alive[key] = alive if known is None or known.shape != alive.shape else known | alive


def _modules(model: nn.Module, selectors: tuple[Selector, ...]) -> list[tuple[str, nn.Module]]:
    if not selectors:
        return [(name, module) for name, module in named_modules(model) if name]
    return select_std(model, list(selectors))  # a union, each module once, in model order ("std:" names too)


def _refuse_offloaded(parameters: list[tuple[str, nn.Parameter]]) -> None:
    """accelerate's offloaded parameters sit on ``meta``; each forward makes new ones, whose
    gradients never reach the model's: parameter records would silently never appear."""
    offloaded = [name for name, parameter in parameters if parameter.is_meta]
    if offloaded:
        shown = ", ".join(repr(name) for name in offloaded[:3]) + (" ..." if len(offloaded) > 3 else "")
        raise UnsupportedModelError(
            f"{len(offloaded)} watched parameters are on the meta device ({shown}): not loaded, or offloaded by "
            "accelerate (cpu_offload, a device map), which replaces them at every forward, so no gradient ever "
            "reaches them; watch activation gradients with params=False, or train a model whose weights are loaded"
        )


def _parameters(
    model: nn.Module, selected: list[tuple[str, nn.Module]], *, whole: bool
) -> list[tuple[str, nn.Parameter]]:
    """The parameters watched: the whole model's, or those inside the selected modules (each once)."""
    if whole:
        return named_parameters(model)
    seen: set[int] = set()
    chosen = []
    for module_name, module in selected:
        for name, parameter in module.named_parameters(prefix=module_name):
            if id(parameter) not in seen:
                seen.add(id(parameter))
                chosen.append((name, parameter))
    return chosen


def watch_grads(
    model: nn.Module,
    *selectors: Selector,
    layers: Selector | Sequence[Selector] | None = None,
    params: bool = True,
    activations: bool = True,
    every: int = 1,
    dead_window: int = 5,
) -> GradMonitor:
    """Watch gradients of ``model`` (or of the modules the selectors pick) across training steps.

    The modules are chosen by selectors, positionally or as ``layers=``; by default every one.

    Per module call, statistics of the gradient with respect to each output (``grad_output``)
    and input (``grad_input``): norm, mean |g|, max |g|, NaN/Inf counts; per parameter, its
    gradient's statistics and ``|g| / |w|``. Call ``monitor.step()`` after each ``backward()``.

    Example::

        with hs.watch_grads(model) as monitor:
            for x, y in loader:
                loss_fn(model(x), y).backward()
                monitor.step()
                optimizer.step(); optimizer.zero_grad()
        print(monitor.summary())
        monitor.history              # steps x layers, pandas
    """
    chosen = given_selectors(selectors, layers, feature="watch_grads")
    return GradMonitor(model, chosen, params=params, activations=activations, every=every, dead_window=dead_window)

"""``watch_grads()``: gradient statistics per module call and per parameter, step after step.

Activation gradients come from tensor hooks, not module backward hooks: a forward hook
registers ``register_hook`` on each output (and input) tensor that requires grad. Full backward
hooks wrap a module's inputs and outputs in a custom autograd function, which breaks on in-place
ops ("... is a view and is being modified inplace") and never sees tensors inside dataclass
outputs; a tensor hook works for any tensor autograd tracks. A tensor's hook receives the
gradient of the loss with respect to that tensor, from all its uses: for a module's output
that is its ``grad_output``, for its input its ``grad_input`` as ``torch.autograd.grad`` would
give it. A tensor that is one module's output and the next one's input is hooked once.

Each gradient is summarised on its device by :func:`hookscope.stats.raw_stats` inside the hook;
nothing is read until :meth:`GradMonitor.step`, which reads the whole step at once.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hookscope.calltrace.identity import SeenTensors
from hookscope.core.attach import HookGroup, HookSpec
from hookscope.core.select import Selector, ensure_module, select
from hookscope.core.sites import CallTracker
from hookscope.core.tree import flatten_tensors
from hookscope.errors import SpecError
from hookscope.grads.records import GradRecord, GradStep, GradWhat
from hookscope.grads.summary import GradSummary, summarise
from hookscope.stats import RawStats, merge_raw, raw_stats, read_stats

__all__ = ["DEAD_UNIT_TYPES", "GradMonitor", "watch_grads"]

# Activations whose output is exactly zero for a dead unit.
DEAD_UNIT_TYPES: tuple[type[nn.Module], ...] = (nn.ReLU, nn.ReLU6, nn.Threshold)


def _in_backward() -> bool:
    """True while autograd runs a backward pass (a checkpointed block recomputing its forward)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


@dataclass
class _Call:
    name: str
    class_name: str
    call: int
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
        self.alive: dict[str, torch.Tensor] = {}  # dead-unit modules: channels that were ever non-zero
        self.inputs: dict[tuple[int, int], list[tuple[str, int]]] = {}  # (module id, call) -> input slots
        self.recorded: set[tuple[int, int]] = set()  # calls recorded in a forward (not a recomputation)


class GradMonitor:
    """Gradient statistics of a model over a training loop; made by :func:`watch_grads`.

    Call :meth:`step` once per optimiser step, after ``loss.backward()`` and before
    ``optimizer.zero_grad()``; it reads the step's statistics (one transfer per device) and
    appends them to :attr:`records`. ``every=N`` records every N-th step only: on the others
    the hooks return at once.
    """

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
        if not isinstance(dead_window, int) or dead_window < 1:
            raise SpecError(f"dead_window={dead_window!r} is not a positive number of steps")
        if not (params or activations):
            raise SpecError("params=False and activations=False watch nothing; keep at least one")
        self._model = weakref.ref(model)
        self._params = params
        self._activations = activations
        self._every = every
        self._dead_window = dead_window
        self._selected = _modules(model, selectors)
        self._tracker = CallTracker()
        self._step_index = 0
        self._current = _Step()
        self._recording = True
        self._records: list[GradStep] = []
        self._dead: dict[str, deque[torch.Tensor]] = {}
        self._written = -1  # the last step sent to TensorBoard
        specs = []
        if activations:
            for name, module in self._selected:
                specs.append(HookSpec(name, module, "forward_pre", self._pre_hook(), fitted=True))
                specs.append(
                    HookSpec(name, module, "forward", self._forward_hook(name, module), always_call=True, fitted=True)
                )
        self._group = HookGroup(model, specs, owner="watch_grads", tracker=self._tracker, restore_mode=False)

    # -- hooks ----------------------------------------------------------------------------------

    def _pre_hook(self) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        current = self._tracker.current

        def before_forward(module: nn.Module, args: tuple[Any, ...]) -> None:
            # Inputs are hooked before the module runs: a module that changes its input in place
            # (ReLU(inplace=True)) must not turn grad_input into the gradient of its output.
            if not self._recording or not torch.is_grad_enabled():
                return  # not a recorded step, or no autograd (a reentrant checkpoint's first forward)
            step, key = self._current, (id(module), current(module))
            if _in_backward() and key in step.recorded:
                return  # a checkpointed block recomputing a call already hooked in its forward
            step.recorded.add(key)
            step.inputs[key] = [
                (path, self._watch(step, t))
                for i, arg in enumerate(args)
                for path, t in flatten_tensors(arg, f"[{i}]")
                if t.requires_grad
            ]

        return before_forward

    def _forward_hook(self, name: str, module: nn.Module) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
        current, class_name = self._tracker.current, type(module).__name__
        watches_units = isinstance(module, DEAD_UNIT_TYPES)

        def after_forward(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            step = self._current
            inputs = step.inputs.pop((id(module), current(module)), None)
            if inputs is None or output is None:
                return  # not recorded, or the call raised
            outputs = [(path, self._watch(step, t)) for path, t in flatten_tensors(output) if t.requires_grad]
            if outputs or inputs:
                step.calls.append(_Call(name, class_name, current(module), outputs, inputs))
            if watches_units and isinstance(output, torch.Tensor):
                _note_alive(step, name, output)

        return after_forward

    def _watch(self, step: _Step, tensor: torch.Tensor) -> int:
        slot = step.seen.get(tensor)
        if slot is not None:
            return slot
        slot = step.slots
        step.slots += 1
        step.seen.put(tensor, slot)

        def on_grad(grad: torch.Tensor) -> None:
            if step is not self._current:
                return  # a backward of a step already closed, or after remove()
            raw = raw_stats(grad)
            step.raws[slot] = merge_raw(step.raws[slot], raw) if slot in step.raws else raw
            step.fired.append(slot)

        tensor.register_hook(on_grad)  # type: ignore[no-untyped-call]
        return slot

    # -- steps ----------------------------------------------------------------------------------

    def step(self) -> GradStep | None:
        """Close the current step: read its statistics and append them to :attr:`records`.

        Returns the step's :class:`GradStep`, or None on a step ``every`` skips.
        """
        step, index = self._current, self._step_index
        self._current = _Step()
        self._step_index += 1
        recorded = self._recording
        self._recording = self._step_index % self._every == 0
        if not recorded:
            return None
        result = self._read(step, index)
        self._records.append(result)
        return result

    def _read(self, step: _Step, index: int) -> GradStep:
        # One entry per site; the same site in several micro-batches (gradient accumulation,
        # several backward passes before step()) merges into one set of statistics.
        order = {slot: rank for rank, slot in enumerate(dict.fromkeys(step.fired))}
        sites: dict[tuple[str, int, str, str], tuple[str, RawStats, int | None]] = {}
        for call in step.calls:
            kinds: tuple[tuple[GradWhat, list[tuple[str, int]]], ...] = (
                ("grad_output", call.outputs),
                ("grad_input", call.inputs),
            )
            for what, leaves in kinds:
                for path, slot in leaves:
                    if slot not in step.raws:
                        continue  # no gradient reached this tensor
                    key = (call.name, call.call, what, path)
                    known = sites.get(key)
                    raw = step.raws[slot] if known is None else merge_raw(known[1], step.raws[slot])
                    sites[key] = (call.class_name, raw, order.get(slot) if known is None else known[2])
        params = self._parameter_stats() if self._params else []
        stats = read_stats([raw for _, raw, _ in sites.values()])
        records = [
            GradRecord.of(index, name, class_name, call, what, path, measured, order=rank)  # type: ignore[arg-type]
            for ((name, call, what, path), (class_name, _, rank)), measured in zip(sites.items(), stats, strict=True)
        ]
        records += [GradRecord.of_parameter(index, name, grad, weight) for name, grad, weight in params]
        dead = self._update_dead(step)
        return GradStep(index, records, dead)

    def _parameter_stats(self) -> list[tuple[str, Any, float]]:
        """``(name, Stats of the gradient, weight norm)`` of every parameter with a gradient."""
        named = [
            (f"{module_name}.{name}" if module_name else name, parameter)
            for module_name, module in self._selected
            for name, parameter in module.named_parameters(recurse=False)
            if parameter.grad is not None
        ]
        if not named:
            return []
        grads = read_stats([raw_stats(p.grad) for _, p in named])  # type: ignore[arg-type]
        norms = torch.stack([torch.linalg.vector_norm(p.detach().float()) for _, p in named]).tolist()
        return [(name, g, w) for (name, _), g, w in zip(named, grads, norms, strict=True)]

    def _update_dead(self, step: _Step) -> dict[str, list[int]]:
        for name, alive in step.alive.items():
            window = self._dead.setdefault(name, deque(maxlen=self._dead_window))
            window.append(alive)
        dead = {}
        for name, window in self._dead.items():
            if len(window) == self._dead_window:
                ever = torch.stack(list(window)).any(0)
                channels = (~ever).nonzero().flatten().tolist()
                if channels:
                    dead[name] = channels
        return dead

    # -- reading --------------------------------------------------------------------------------

    @property
    def records(self) -> list[GradStep]:
        """Every recorded step, oldest first."""
        return list(self._records)

    def history(self, metric: str = "norm", what: str = "grad_output") -> Any:
        """A pandas DataFrame, steps x layers, of one statistic (``norm``, ``mean_abs``, ``max_abs``)."""
        from hookscope.grads.records import history_frame

        return history_frame(self._records, metric, what)

    def summary(
        self, *, vanishing: float = 1e-4, exploding: float = 1e3, growth: float = 10.0, window: int = 5
    ) -> GradSummary:
        """Flag vanishing, exploding and non-finite gradients and dead units.

        The thresholds and their defaults are in :mod:`hookscope.grads.summary`.
        """
        return summarise(self._records, vanishing=vanishing, exploding=exploding, growth=growth, window=window)

    def to_tensorboard(self, writer: Any) -> None:
        """Write the steps recorded since the last call to a ``SummaryWriter`` as scalars.

        Call it after ``monitor.step()`` (every step or now and then): each step is written
        once, tagged ``grads/grad_output/<module>#<call>/norm``, ``grads/param/<name>/ratio``, ...
        """
        from hookscope.grads.sinks import write_tensorboard

        self._written = write_tensorboard(self._records, writer, after=self._written)

    # -- lifetime -------------------------------------------------------------------------------

    @property
    def live(self) -> bool:
        """True until the hooks have been removed."""
        return self._group.live

    def remove(self) -> None:
        """Remove the hooks; the records stay. Tensor hooks of a forward not yet backpropagated do nothing."""
        self._current = _Step()
        self._group.remove()

    def __enter__(self) -> GradMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _note_alive(step: _Step, name: str, output: torch.Tensor) -> None:
    """OR into the step which channels of a ReLU-like output were non-zero for some sample."""
    if output.dim() < 2:
        return
    channel = 1 if output.dim() >= 4 else output.dim() - 1  # NCHW: dim 1; (N, C) and (N, T, C): last
    with torch.no_grad():
        alive = output.detach().ne(0).movedim(channel, -1).reshape(-1, output.shape[channel]).any(0)
    step.alive[name] = step.alive[name] | alive if name in step.alive else alive


def _modules(model: nn.Module, selectors: tuple[Selector, ...]) -> list[tuple[str, nn.Module]]:
    if not selectors:
        return [(name, module) for name, module in model.named_modules() if name]
    seen: set[int] = set()
    chosen = []
    for name, module in select(model, list(selectors)):
        if id(module) not in seen:
            seen.add(id(module))
            chosen.append((name, module))
    return chosen


def watch_grads(
    model: nn.Module,
    *selectors: Selector,
    params: bool = True,
    activations: bool = True,
    every: int = 1,
    dead_window: int = 5,
) -> GradMonitor:
    """Watch gradients of ``model`` (or of the modules the selectors pick) across training steps.

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
        monitor.history()            # steps x layers, pandas
    """
    return GradMonitor(model, selectors, params=params, activations=activations, every=every, dead_window=dead_window)

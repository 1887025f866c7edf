"""``hs.monitor``: gradient and activation statistics, precision health and a NaN/Inf tripwire for
a training loop, in two lines: ``with hs.monitor(model, ...) as mon:`` and ``mon.step()``.

It composes what exists: :func:`hookscope.watch_grads` for gradients (per layer and per parameter),
:func:`hookscope.detect_nonfinite` for the forward's first NaN/Inf, and its own forward hooks
(:mod:`~hookscope._monitor.watch`) for activation statistics and precision health. Attaching is once;
a step costs nothing on the host until :meth:`Monitor.step`, which reads the step with a few
transfers on a logged step and none on the others (``every=N``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from hookscope._arch.std import known_std_map, select_std
from hookscope._core.attach import Scoped, WrapSpec, remove_through
from hookscope._core.compat.offload import ensure_loaded
from hookscope._core.names import named_modules, named_parameters
from hookscope._core.select import Selector, ensure_module
from hookscope._grads import GradMonitor, GradStep, watch_grads
from hookscope._monitor.evidence import note as _note
from hookscope._monitor.evidence import save_evidence
from hookscope._monitor.labels import UniqueLabels
from hookscope._monitor.params import ParamNorms
from hookscope._monitor.scale import LossScale, unscaled
from hookscope._monitor.sinks import Failures, as_sink, close_all, sink_error, write_all
from hookscope._monitor.watch import LayerRead, LayerWatch
from hookscope._shared.histogram import Histogram
from hookscope._shared.precision import precision_target
from hookscope._shared.stats import RAW_FIELDS, RawStats, Stats, finalize
from hookscope._shared.transfer import fetch
from hookscope._trace import NonFiniteDetector, detect_nonfinite
from hookscope.errors import HookscopeError, NonFiniteError, SpecError, StdMapError

__all__ = ["Monitor", "MonitorFlag", "MonitorStep", "monitor"]


@dataclass(frozen=True)
class MonitorFlag:
    """Something a step showed that deserves a look: ``"layer blocks.3 loses 4.1% of its gradient
    to underflow in bfloat16 (step 12)"``."""

    step: int
    layer: str
    kind: str  # "grad_underflow", "act_underflow", "grad_overflow", "act_overflow", "grad_nonfinite"
    value: float
    message: str

    def __str__(self) -> str:
        return self.message


@dataclass
class MonitorStep:
    """One logged step: its index, every scalar by name, and its flags.

    Every gradient in it is as the step's backward left it: the activations' (``grad/``) and the
    parameters' (``param_grad/``) alike, before any clipping or optimiser step, after DDP's
    all-reduce, and divided by the loss scale where a GradScaler is known (``grad_scaler=``; the
    callbacks find the Trainer's): the gradients of the loss itself, whose scale is logged as
    ``grad/loss_scale``. The transformers Trainer's logged ``grad_norm`` is the norm of the same
    gradients: ``sqrt(sum of param_grad/norm**2)``. The gradients' precision fractions are of the
    gradients as the backward held them, scaled: what the format keeps of them.
    """

    step: int
    scalars: dict[str, float]
    flags: list[MonitorFlag] = field(default_factory=list)
    grads: GradStep | None = None
    histograms: dict[str, Histogram] = field(default_factory=dict)  # by logged layer name, on request


class Monitor(Scoped):
    """The hooks of :func:`monitor`; ``step()`` once per optimiser step, after the backward.

    ``note`` says why the layers are not the blocks a transformers model should have (its
    canonical names could not be made: it watches its modules with parameters), else None.
    """

    def __init__(
        self,
        model: nn.Module,
        layers: Selector | Sequence[Selector] | None,
        *,
        grads: bool,
        params: bool,
        activations: bool,
        precision: str | torch.dtype | None,
        tripwire: bool,
        every: int,
        sinks: Sequence[Any],
        names: str,
        flag_above: float,
        histograms: bool = False,
        trip_dir: str | os.PathLike[str] | None = None,
        start: int = 0,
        grad_scaler: Any = None,
    ) -> None:
        ensure_module(model)
        self._scale = LossScale(grad_scaler, model)
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise SpecError(f"every={every!r} is not a positive whole number of steps; 1 logs every step")
        if names not in ("std", "modules"):
            raise SpecError(f"names={names!r}: expected 'std' (canonical names where the model has them) or 'modules'")
        self._trip_dir = None if trip_dir is None else Path(trip_dir)
        self._last_batch: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        self.tripped: NonFiniteError | None = None
        self._model_ref = model
        self._target = precision_target(precision)
        self._every = every
        self._flag_above = flag_above
        self._tripwire_on = tripwire
        self._index = start
        self._stepped = False
        self._chosen, self.note, unmapped = _layers(model, layers)
        std = names == "std" and not unmapped  # a map that failed for the layers is not made again
        named = _logged_names(model, self._chosen) if std else {n: n for n, _ in self._chosen}
        # Names as the core spells them: below a DDP or torch.compile wrapper, without its segment;
        # one per module, and one per module call (a module named "fc#1" is not fc's second call).
        shown = UniqueLabels(mark="~")
        self._names = {module: shown.claim(module, name or "(root)") for module, name in named.items()}
        self._labels = UniqueLabels(mark="~")
        for module, name in self._names.items():
            self._labels.claim((module, 0), name)
        self._params = [(n, p) for n, p in named_parameters(model) if p.requires_grad] if params else []
        self._sinks = [as_sink(sink) for sink in sinks]
        # Sinks made here from paths are closed with the monitor; objects the caller passed are the caller's.
        self._owned_sinks = [made for made, given in zip(self._sinks, sinks, strict=True) if made is not given]
        self.steps: list[MonitorStep] = []
        self._grads: GradMonitor | None = None
        self._tripwire: NonFiniteDetector | None = None
        self._param_norms: ParamNorms | None = None
        self._watch = LayerWatch(model, self._chosen, activations, self._target, histograms)
        self._watch.recording = start % every == 0
        parts: list[Any] = []
        try:
            # The wrapper of the model's call sees the batch of a forward trip; a compiled model
            # (its forward is Dynamo's) would run eagerly inside one, so it goes without.
            wraps = () if hasattr(model, "_orig_mod") else (WrapSpec("", model, "call", self._guarded),)
            self._group = self._watch.attach(*wraps)
            parts.append(self._watch)
            if self._params:  # the parameters' hooks are the layer hooks' group's: removed with it
                self._param_norms = ParamNorms(model, self._params, self._group)
                self._param_norms.recording = self._watch.recording
            if grads:
                chosen = [name for name, _ in self._chosen]
                self._grads = watch_grads(model, layers=chosen, params=False, activations=True)
                self._grads.record_next(start % every == 0)  # which steps record is the monitor's call
                parts.append(self._grads)
            if tripwire:
                self._tripwire = detect_nonfinite(model)
                parts.append(self._tripwire)
        except BaseException:
            for part in parts:
                part.remove()
            raise
        for part in parts[1:]:
            remove_through(part._group, self.remove)
        remove_through(self._group, self.remove)

    def step(self, step: int | None = None) -> MonitorStep | None:
        """Close the training step: read it (on a logged step), write the scalars to the sinks,
        and raise :class:`~hookscope.NonFiniteError` if a gradient held a NaN/Inf (the tripwire).

        ``step`` numbers the step as the loop does (a Trainer's ``global_step``); by default the
        monitor counts from 0. Returns the :class:`MonitorStep`, or None on a step ``every`` skips.
        """
        if self.tripped is not None:
            return None  # the run stopped at the trip; its hooks are gone
        self._refuse_an_empty_step()
        if step is not None:
            self._index = step
        index = self._index
        self._index += 1
        logged = self._watch.recording  # what this step's hooks did: its numbers are read, never carried over
        self._watch.recording = self._index % self._every == 0  # hooks of the next step
        if self._param_norms is not None:
            self._param_norms.recording = self._watch.recording
        if not logged:
            if self._grads is not None:
                self._grads.step()  # closes the skipped step (its hooks returned at once)
                self._grads.record_next(self._watch.recording)
            if self._param_norms is not None:
                self._param_norms.skip()
            return None
        norms, parse_norms = self._param_norms.take(index) if self._param_norms is not None else ([], None)
        vectors, parse = self._watch.collect()
        own = [*vectors, *norms]
        rows: list[Any] = []
        scale = self._scale.factor()

        def read_with_ours(raws: Sequence[RawStats]) -> list[Stats]:  # one transfer for everything
            rows.extend(fetch([raw.vector for raw in raws] + own))
            return finalize([raw.count for raw in raws], unscaled(_table(rows[: len(raws)]), scale))

        grad_step = None
        if self._grads is not None:
            grad_step = self._grads.step(read_with=read_with_ours)
            self._grads.record_next(self._watch.recording)
            if grad_step is not None:  # numbered as this monitor numbers its steps
                grad_step = dataclasses.replace(
                    grad_step, step=index, records=[dataclasses.replace(r, step=index) for r in grad_step.records]
                )
        if not rows:  # no gradient was recorded: our own numbers alone
            rows.extend(fetch(own))
        mine = rows[len(rows) - len(own) :]
        layers = parse(mine[: len(vectors)])
        scalars = self._scalars(layers, grad_step)
        if parse_norms is not None:
            scalars.update(self._parameter_scalars(parse_norms(mine[len(vectors) :]), scale))
        if self._scale.scaler is not None:
            scalars["grad/loss_scale"] = scale
        shown = {self._names.get(n, n): read.histogram for n, read in layers.items() if read.histogram is not None}
        result = MonitorStep(index, scalars, self._flags(index, layers), grad_step, shown)
        self.steps.append(result)
        found = None if grad_step is None else self._nonfinite(index, grad_step)
        if found is not None and self._scale.scaler is not None:
            result.flags.append(found[1])  # the scaler's business: it skips the step and lowers its scale
            found = None
        elif found is not None and not self._tripwire_on:
            result.flags.append(found[1])  # tripwire=False: a flag, and the run goes on
        # Every sink gets the step, a NaN step most of all; what failed is raised after.
        failures = write_all(self._sinks, index, scalars, {f"act/{name}": h for name, h in shown.items()})
        failed = sink_error(failures, len(self._sinks), index) if failures else None
        if found is not None and self._tripwire_on:
            trip = found[0]
            if failed is not None:
                _note(trip, str(failed))
            self._trip(trip)
            raise trip
        if failed is not None:
            raise failed
        return result

    def _refuse_an_empty_step(self) -> None:
        """A step after the hooks came off, or with no training forward or backward since the
        last, would log stale gradients (or nothing) under a new step number: refused."""
        if not self.live:
            raise SpecError(
                "mon.step() on a monitor that was removed (its with block ended, or remove() was called): nothing is "
                "recorded any more; call step() inside the with block, once per optimiser step"
            )
        ran = self._watch.ran or (self._param_norms is not None and self._param_norms.backward_seen)
        if not ran:
            since = "the last step()" if self._stepped else "the monitor was attached"
            raise SpecError(
                f"mon.step() found no training forward or backward of the watched model since {since}: call it once "
                "per optimiser step, after the backward (a second call would log the same gradients again as a new "
                "step)"
            )
        self._stepped = True
        self._watch.ran = False

    # -- the tripwire ------------------------------------------------------------------------------

    def _guarded(self, inner: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Around the model's call: keep a reference to the batch (for the trip's files), and on
        a forward NaN/Inf name the step, keep the evidence and, if asked, let go of every hook."""
        if torch.is_grad_enabled():  # a training forward, not an evaluation's
            self._last_batch = (args, kwargs)
            self._scale.check_forward()
        try:
            return inner(*args, **kwargs)
        except NonFiniteError as error:
            if error.step is None:
                error.step = self._index
            self._trip(error)
            raise

    def _trip(self, error: NonFiniteError) -> None:
        if self.tripped is not None:
            return
        self.tripped = error
        self.remove(during=error)  # the run stops here; a loop the monitor does not enclose (a Trainer's) keeps no hook
        if self._trip_dir is not None and self._last_batch is not None:
            saved = save_evidence(self._model_ref, self._trip_dir, error, *self._last_batch)
            _note(error, f"hookscope kept the batch and a trace of it: {', '.join(map(str, saved))}")

    def _scalars(self, layers: dict[str, LayerRead], grad_step: GradStep | None) -> dict[str, float]:
        scalars: dict[str, float] = {}
        for name, read in layers.items():
            shown = self._names.get(name, name)
            if read.stats is not None:
                scalars[f"act/mean_abs/{shown}"] = read.stats.abs_mean
                scalars[f"act/max_abs/{shown}"] = max(abs(read.stats.min), abs(read.stats.max))
                scalars[f"act/std/{shown}"] = read.stats.std
            for side, measured in (("act", read.act_precision), ("grad", read.grad_precision)):
                if measured is not None:
                    for metric, value in measured.as_dict().items():
                        scalars[f"precision/{side}/{metric}/{shown}"] = value
        for record in grad_step.records if grad_step is not None else []:
            if record.what == "grad_output" and record.path in ("", "[0]"):
                label = self._call_label(record.module, record.call)
                scalars[f"grad/norm/{label}"] = record.norm
                scalars[f"grad/max_abs/{label}"] = record.max_abs
        return scalars

    def _call_label(self, module: str, call: int) -> str:
        """``blocks.3`` for a module's first call, ``blocks.3#1`` for its second; never another's name."""
        shown = self._names.get(module, module)
        return self._labels.claim((module, call), shown if call == 0 else f"{shown}#{call}")

    @staticmethod
    def _parameter_scalars(norms: dict[str, tuple[float, float]], scale: float) -> dict[str, float]:
        scalars: dict[str, float] = {}
        for name, (grad_norm, weight_norm) in norms.items():
            scalars[f"param_grad/norm/{name}"] = grad_norm / scale
            scalars[f"param_grad/ratio/{name}"] = grad_norm / scale / weight_norm if weight_norm else math.nan
        return scalars

    def _flags(self, index: int, layers: dict[str, LayerRead]) -> list[MonitorFlag]:
        flags = []
        for name, read in layers.items():
            shown = self._names.get(name, name)
            for side, measured in (("act", read.act_precision), ("grad", read.grad_precision)):
                if measured is None:
                    continue
                noun = "gradient" if side == "grad" else "output"
                for kind, value, loss in (
                    ("underflow", measured.underflow, "underflow"),
                    ("overflow", measured.overflow, "overflow"),
                ):
                    if value > self._flag_above:
                        flags.append(
                            MonitorFlag(
                                index, shown, f"{side}_{kind}", value,
                                f"layer {shown} loses {100 * value:.1f}% of its {noun} to {loss} in "
                                f"{measured.dtype} (step {index})",
                            )
                        )  # fmt: skip
        return flags

    def _nonfinite(self, index: int, grad_step: GradStep) -> tuple[NonFiniteError, MonitorFlag] | None:
        """The first gradient (in backward order) holding a NaN/Inf: the tripwire's error, and
        the flag that stands for it with ``tripwire=False``."""
        bad = [r for r in grad_step.records if r.what != "param" and not r.finite]
        if not bad:
            return None
        first = min(bad, key=lambda r: math.inf if r.order is None else r.order)
        shown = self._call_label(first.module, first.call)
        error = NonFiniteError(
            f"step {index}: the gradient of {self._names.get(first.module, first.module)!r} ({first.class_name}, call "
            f"{first.call}) holds {first.nan} NaN and {first.inf} Inf values, the first in backward order; the layers "
            "after it in the forward got finite gradients",
            module=first.module,
            call=first.call,
            what=first.what,
            path=first.path,
            nan=first.nan,
            step=index,
        )
        flag = MonitorFlag(
            index, shown, "grad_nonfinite", float(first.nan + first.inf),
            f"the gradient of {shown} holds {first.nan} NaN and {first.inf} Inf values (step {index}), the first in "
            "backward order; "
            + (
                "the GradScaler skips this step and lowers its scale"
                if self._scale.scaler is not None
                else "tripwire=False lets the run go on"
            ),
        )  # fmt: skip
        return error, flag

    def remove(self, *, during: BaseException | None = None) -> None:
        """Remove every hook and close the sinks made from paths (a sink object passed in is
        left open: its owner closes it). Safe to call twice.

        Every sink is closed whatever the others do; those that fail raise one
        :class:`~hookscope.SinkError` after, or, given ``during`` (an error already on its way
        out), are added to it as a note instead.
        """
        failures = self._let_go()
        if failures:
            failed = sink_error(failures, len(failures), None)
            if during is None:
                raise failed
            _note(during, str(failed))

    def _let_go(self) -> Failures:
        try:
            for part in (self._tripwire, self._grads):
                if part is not None:
                    part.remove()
            self._watch.remove()
        finally:
            owned, self._owned_sinks = self._owned_sinks, []
            failures = close_all(owned)
        return failures

    def __exit__(self, *exc_info: object) -> bool | None:
        error = exc_info[1] if len(exc_info) > 1 and isinstance(exc_info[1], BaseException) else None
        if isinstance(error, NonFiniteError) and error.step is None:
            error.step = self._index  # a forward NaN: name the step it came in
        if error is not None:
            self._group.note_failure(error)
        self.remove(during=error)
        return None


def _table(rows: list[Any]) -> np.ndarray:
    """Rows of :data:`~hookscope._shared.stats.RAW_FIELDS` as one table (possibly empty)."""
    return np.stack(rows) if rows else np.empty((0, len(RAW_FIELDS)))


def _layers(
    model: nn.Module, layers: Selector | Sequence[Selector] | None
) -> tuple[list[tuple[str, nn.Module]], str | None, bool]:
    """The layers given, or by default the blocks (``std:blocks.*``) where the model has a map,
    else every module that holds parameters of its own; and a note where a transformers model,
    which should have a map, fell back (a warning too: its logs are named unlike its family's);
    and whether the map failed."""
    if layers is not None:
        return select_std(model, layers), None, False
    try:
        return select_std(model, "std:blocks.*"), None, False
    except HookscopeError as error:
        mapped = hasattr(model, "config")  # a transformers model: its map should resolve
        if mapped and not isinstance(error, StdMapError):
            raise  # the error says why it does not, and what to pass
        owners = [(n, m) for n, m in named_modules(model) if n and any(True for _ in m.parameters(recurse=False))]
        if not owners:
            raise SpecError("the model holds no parameters of its own modules: name the layers to monitor") from None
        if not mapped:
            return owners, None, True
        note = (
            f"hs.monitor: no canonical names for {type(model).__name__} ({error}); it watches the {len(owners)} "
            "modules with parameters of their own, under their module names; pass layers= to choose others"
        )
        warnings.warn(note, UserWarning, stacklevel=4)
        return owners, note, True


def _logged_names(model: nn.Module, chosen: list[tuple[str, nn.Module]]) -> dict[str, str]:
    """Module name -> canonical name where the map names the module itself (``blocks.3``)."""
    try:
        std = known_std_map(model)
    except HookscopeError:  # a StdMapError among them: module names, as the layers fell back to
        return {name: name for name, _ in chosen}
    by_module = {site.module: name for name, site in std.items() if site.kind == "module" and site.module}
    return {name: by_module.get(name, name) for name, _ in chosen}


def monitor(
    model: nn.Module,
    layers: Selector | Sequence[Selector] | None = None,
    *,
    grads: bool = True,
    params: bool = True,
    activations: bool = True,
    precision: str | torch.dtype | None = None,
    tripwire: bool = True,
    every: int = 1,
    sinks: Sequence[Any] = (),
    names: str = "std",
    flag_above: float = 0.01,
    histograms: bool = False,
    trip_dir: str | os.PathLike[str] | None = None,
    start: int = 0,
    grad_scaler: Any = None,
) -> Monitor:
    """Watch a training loop: per-layer gradient and activation statistics, per-parameter gradient
    norms, precision health, and a NaN/Inf tripwire; logged to sinks once per logged step.

    Args:
        layers: the layers to watch (selectors); default the blocks (``std:blocks.*``), or every
            module with parameters of its own for a model without a canonical map.
        grads, params, activations: gradient statistics per layer, per parameter, and activation
            statistics per layer (``act/mean_abs``, ``act/max_abs``, ``act/std``).
        precision: ``"bf16"``, ``"fp16"``, ``"fp8"`` (e4m3fn), ``"float8_e5m2"``: what that format
            loses of each layer's output and of its gradient, per step (underflow, subnormal,
            overflow fractions and the dynamic range in octaves), flagged above ``flag_above``.
        tripwire: stop at the first NaN/Inf: in the forward, ``model(x)`` raises
            :class:`~hookscope.NonFiniteError` naming the module; in the backward, ``step()`` does,
            naming the first gradient in backward order, with ``error.step``. A trip takes every
            hook off before the error leaves, so a loop the monitor does not enclose (a
            Trainer's) keeps none. Under ``torch.compile`` a forward trip is not seen until the
            ``with`` block (or the callback's end) removes the hooks, and keeps no evidence:
            check a run that trips eagerly. ``tripwire=False`` raises neither: a NaN/Inf
            gradient becomes a ``grad_nonfinite`` flag of the step, and the run goes on. So does
            one under a known ``grad_scaler``: an overflow is the scaler's to handle (it skips
            the step and lowers its scale).
        every: log every N-th step (by the step numbers, from ``start``); other steps' hooks return
            at once and cross to the host never. Only forwards under grad count (an evaluation's
            forward between steps does not), and the backward tripwire checks logged steps.
        sinks: paths (``.jsonl``, ``.csv``; closed with the monitor), a TensorBoard
            ``SummaryWriter``, or objects with ``write(step, scalars)`` (left open: their
            owner closes them, so one sink can serve several runs). Every sink gets every
            step; sinks that raise are named after the others wrote, in one
            :class:`~hookscope.SinkError`.
        names: ``"std"`` logs canonical names (``blocks.3``) where the model has them.
        histograms: also a histogram of each layer's output per logged step (64 buckets of a
            sample of at most 32,768 values, counted on the device): ``step.histograms``, and
            the sinks that draw them (TensorBoard, wandb).
        trip_dir: where a trip keeps its evidence: the offending batch and a trace of the model
            on it (every call's shapes and value ranges), named by step.
        start: the number of the first step (a resumed run's), for the logs and ``error.step``.
        grad_scaler: the ``torch.amp.GradScaler`` that scales the loss (fp16): every gradient
            statistic of a step is divided by its scale (``get_scale()``, read once per logged
            step: call ``step()`` before ``scaler.update()``), so the record holds the
            gradients of the loss itself. Under float16 autocast with none given, a warning
            (once) says the gradients may carry a scale.

    Example::

        with hs.monitor(model, precision="bf16", sinks=["metrics.jsonl"]) as mon:
            for batch in loader:
                loss = model(**batch).loss
                loss.backward()
                mon.step()                    # after backward, before zero_grad
                optimizer.step(); optimizer.zero_grad()
        mon.steps[-1].flags                   # "layer blocks.3 loses 4.1% of its gradient to underflow ..."

    ``step()`` is refused (:class:`~hookscope.SpecError`) after the monitor was removed, and
    when no watched layer ran a training forward and no gradient reached a parameter since the
    last ``step()``: a second call after one backward would log the same gradients again.
    """
    ensure_loaded(model)  # a meta model: one line, not torch's error
    return Monitor(
        model, layers, grads=grads, params=params, activations=activations, precision=precision,
        tripwire=tripwire, every=every, sinks=sinks, names=names, flag_above=flag_above,
        histograms=histograms, trip_dir=trip_dir, start=start, grad_scaler=grad_scaler,
    )  # fmt: skip

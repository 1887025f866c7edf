"""``hs.monitor``: gradient and activation statistics, precision health and a NaN/Inf tripwire for
a training loop, in two lines: ``with hs.monitor(model, ...) as mon:`` and ``mon.step()``.

One recorder (:class:`~hookscope._monitor.recorder.TrainingRecorder`) takes every per-layer
measure, of activations when a call closes and of gradients in one tensor hook per tensor;
parameter gradient norms are read when each backward ends (:mod:`~hookscope._monitor.params`);
:func:`hookscope.detect_nonfinite` is the forward's tripwire. Attaching is once; a step costs
nothing on the host until :meth:`Monitor.step`, which reads the step in one transfer on a
logged step and none on the others (``every=N``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from hookscope._core.attach import Scoped, WrapSpec
from hookscope._core.compat.internals import COMPILED_MODEL_ATTRIBUTE
from hookscope._core.compat.offload import ensure_loaded
from hookscope._core.live_hooks import remove_through
from hookscope._core.names import named_parameters
from hookscope._core.select import Selector, ensure_module, given_selectors
from hookscope._monitor.evidence import note as _note
from hookscope._monitor.evidence import save_evidence
from hookscope._monitor.findings import Findings
from hookscope._monitor.labels import UniqueLabels
from hookscope._monitor.layers import chosen_layers, logged_names
from hookscope._monitor.measures import Measures, collect
from hookscope._monitor.options import MonitorOptions
from hookscope._monitor.params import ParamNorms
from hookscope._monitor.recorder import TrainingRecorder
from hookscope._monitor.records import MonitorStep
from hookscope._monitor.scale import LossScale, unscaled
from hookscope._monitor.sinks import Failures, as_sink, close_all, sink_error, write_all
from hookscope._shared.options import with_options
from hookscope._shared.stats import RAW_FIELDS, RawStats, Stats, finalize
from hookscope._shared.transfer import fetch
from hookscope._trace import NonFiniteDetector, detect_nonfinite
from hookscope.errors import NonFiniteError, SpecError

__all__ = ["Monitor", "monitor"]


class Monitor(Scoped):
    """The hooks of :func:`monitor`; ``step()`` once per optimiser step, after the backward.

    ``options`` is the :class:`~hookscope.MonitorOptions` it runs with; ``note`` says why the
    layers are not the blocks a transformers model should have (its canonical names could not be
    made: it watches its modules with parameters), else None.
    """

    def __init__(self, model: nn.Module, layers: Selector | Sequence[Selector] | None, options: MonitorOptions) -> None:
        ensure_module(model)
        self.options = options
        self._scale = LossScale(options.grad_scaler, model)
        self._trip_dir = None if options.trip_dir is None else Path(options.trip_dir)
        self._last_batch: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        self.tripped: NonFiniteError | None = None
        self._model_ref = model
        self._every = options.every
        self._index = options.start
        self._stepped = False
        self._chosen, self.note, unmapped = chosen_layers(model, layers)
        std = options.names == "std" and not unmapped  # a map that failed for the layers is not made again
        named = logged_names(model, self._chosen) if std else {n: n for n, _ in self._chosen}
        # Names as the core spells them: below a DDP or torch.compile wrapper, without its segment;
        # one per module, and one per module call (a module named "fc#1" is not fc's second call).
        shown = UniqueLabels(mark="~")
        self._findings = Findings(
            {m: shown.claim(m, name or "(root)") for m, name in named.items()}, options.flag_above
        )
        self._params = [(n, p) for n, p in named_parameters(model) if p.requires_grad] if options.params else []
        self._sinks = [as_sink(sink) for sink in options.sinks]
        # Sinks made here from paths are closed with the monitor; objects the caller passed are the caller's.
        self._owned_sinks = [made for made, given in zip(self._sinks, options.sinks, strict=True) if made is not given]
        self.steps: list[MonitorStep] = []
        self._tripwire: NonFiniteDetector | None = None
        self._param_norms: ParamNorms | None = None
        measures = Measures(
            grads=options.grads, activations=options.activations, histograms=options.histograms,
            precision=options.target,
        )  # fmt: skip
        # The wrapper of the model's call sees the batch of a forward trip; a compiled model
        # (its forward is Dynamo's) would run eagerly inside one, so it goes without.
        wraps = () if hasattr(model, COMPILED_MODEL_ATTRIBUTE) else (WrapSpec("", model, "call", self._guarded),)
        self._recorder = TrainingRecorder(model, self._chosen, measures, wraps=wraps)
        self._group = self._recorder._group
        self._recorder.record_next(options.start % options.every == 0)
        try:
            if self._params:  # the parameters' hooks are the recorder's group's: removed with it
                self._param_norms = ParamNorms(model, self._params, self._group)
                self._param_norms.recording = self._recorder.recording
            if options.tripwire:
                self._tripwire = detect_nonfinite(model)
                remove_through(self._tripwire._group, self.remove)
        except BaseException:
            self._recorder.remove()
            raise
        remove_through(self._group, self.remove)

    def step(self, step: int | None = None) -> MonitorStep | None:
        """Close the training step: read it (on a logged step), write the scalars to the sinks,
        and raise :class:`~hookscope.NonFiniteError` if a gradient held a NaN/Inf (the tripwire).

        ``step`` numbers the step as the loop does (a Trainer's ``global_step``); by default the
        monitor counts from 0. Returns the :class:`~hookscope.MonitorStep`, or None on a step
        ``every`` skips.
        """
        if self.tripped is not None:
            return None  # the run stopped at the trip; its hooks are gone
        self._refuse_an_empty_step()
        if step is not None:
            self._index = step
        index = self._index
        self._index += 1
        recorder = self._recorder
        logged = recorder.recording  # what this step's hooks did: its numbers are read, never carried over
        recorded = recorder.close_step()
        recorder.record_next(self._index % self._every == 0)  # hooks of the next step
        if self._param_norms is not None:
            self._param_norms.recording = recorder.recording
        if not logged:
            if self._param_norms is not None:
                self._param_norms.skip()
            return None
        norms, parse_norms = self._param_norms.take(index) if self._param_norms is not None else ([], None)
        vectors, parse = collect(recorded.layers, recorded.precision, recorder.measures.precision)
        own = [*vectors, *norms]
        rows: list[Any] = []
        scale = self._scale.factor()

        def read_with_ours(raws: Sequence[RawStats]) -> list[Stats]:  # one transfer for everything
            rows.extend(fetch([raw.vector for raw in raws] + own))
            return finalize([raw.count for raw in raws], unscaled(_table(rows[: len(raws)]), scale))

        grads = recorder.read(recorded, index, read_with_ours) if recorded.has_calls else None
        if not rows:  # no gradient was recorded: our own numbers alone
            rows.extend(fetch(own))
        mine = rows[len(rows) - len(own) :]
        layers = parse(mine[: len(vectors)])
        findings = self._findings
        scalars = findings.scalars(layers, grads)
        if parse_norms is not None:
            scalars.update(findings.parameter_scalars(parse_norms(mine[len(vectors) :]), scale))
        if self._scale.scaler is not None:
            scalars["grad/loss_scale"] = scale
        shown = {findings.shown(n): read.histogram for n, read in layers.items() if read.histogram is not None}
        result = grads if grads is not None else MonitorStep(index, read_grads=False)
        result.scalars, result.flags, result.histograms = scalars, findings.flags(index, layers), shown
        self.steps.append(result)
        scaled = self._scale.scaler is not None
        found = None if grads is None else findings.nonfinite(index, grads, scaled=scaled)
        if found is not None and (scaled or not self.options.tripwire):
            # the scaler's business (it skips the step and lowers its scale), or tripwire=False: a flag
            result.flags.append(found[1])
            found = None
        # Every sink gets the step, a NaN step most of all; what failed is raised after.
        failures = write_all(self._sinks, index, scalars, {f"act/{name}": h for name, h in shown.items()})
        failed = sink_error(failures, len(self._sinks), index) if failures else None
        if found is not None:
            trip = found[0]
            if failed is not None:
                _note(trip, str(failed))
            self._trip(trip)
            raise trip
        if failed is not None:
            raise failed
        return result

    def _repr_html_(self) -> str:
        """The latest logged step (its gradients, or its scalars, and its flags), for Jupyter."""
        title = f"hs.monitor of {len(self._chosen)} layers: {len(self.steps)} steps logged"
        if not self.steps:
            return MonitorStep(-1).table(title=title).html()
        latest = self.steps[-1]
        return latest.table(title=f"{title}; step {latest.step}:").html()

    def _refuse_an_empty_step(self) -> None:
        """A step after the hooks came off, or with no training forward or backward since the
        last, would log stale gradients (or nothing) under a new step number: refused."""
        if not self.live:
            raise SpecError(
                "mon.step() on a monitor that was removed (its with block ended, or remove() was called): nothing is "
                "recorded any more; call step() inside the with block, once per optimiser step"
            )
        ran = self._recorder.ran or (self._param_norms is not None and self._param_norms.backward_seen)
        if not ran:
            since = "the last step()" if self._stepped else "the monitor was attached"
            raise SpecError(
                f"mon.step() found no training forward or backward of the watched model since {since}: call it once "
                "per optimiser step, after the backward (a second call would log the same gradients again as a new "
                "step)"
            )
        self._stepped = True

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
            if self._tripwire is not None:
                self._tripwire.remove()
            self._recorder.remove()
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


@with_options(MonitorOptions)
def monitor(
    model: nn.Module,
    *positional: Any,  # the old form: hs.monitor(model, layers)
    layers: Selector | Sequence[Selector] | None = None,
    options: MonitorOptions | None = None,
    **opts: Any,
) -> Monitor:
    """Watch a training loop: per-layer gradient and activation statistics, per-parameter gradient
    norms, precision health, and a NaN/Inf tripwire; logged to sinks once per logged step.

    Args:
        layers: the layers to watch (selectors); default the blocks (``std:blocks.*``), or every
            module with parameters of its own for a model without a canonical map.
        options: a :class:`~hookscope.MonitorOptions`, whose fields say what each option does;
            or its fields as keywords (``precision="bf16"``, ``every=10``, ...).

    Example::

        with hs.monitor(model, precision="bf16", sinks=["metrics.jsonl"]) as mon:
            for batch in loader:
                loss = model(**batch).loss
                loss.backward()
                mon.step()                    # after backward, before zero_grad
                optimizer.step(); optimizer.zero_grad()
        mon.steps[-1].flags                   # grad_underflow blocks.3: loses 4.1% of its gradient ...

    ``step()`` is refused (:class:`~hookscope.SpecError`) after the monitor was removed, and
    when no watched layer ran a training forward and no gradient reached a parameter since the
    last ``step()``: a second call after one backward would log the same gradients again.
    """
    if len(positional) > 1:
        raise SpecError(f"hs.monitor takes the model and layers=..., not {1 + len(positional)} positional arguments")
    if positional:
        layers = given_selectors(positional, layers, feature="hs.monitor", old_form=True)[0]
    ensure_loaded(model)  # a meta model: one line, not torch's error
    return Monitor(model, layers, MonitorOptions.build(options, opts))

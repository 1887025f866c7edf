"""``watch_grads()``: the training monitor's gradients preset, per module call and per parameter.

:class:`GradMonitor` is the one recorder (:class:`~hookscope._monitor.recorder.TrainingRecorder`)
measuring gradients only (the statistics of every output and input gradient of each watched
call, and of each parameter's gradient), with a history and a summary of what it recorded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from torch import nn

from hookscope._arch.std import select_std
from hookscope._core.names import named_modules, named_parameters
from hookscope._core.select import Selector, ensure_module, given_selectors
from hookscope._monitor.measures import Measures
from hookscope._monitor.recorder import Read, TrainingRecorder
from hookscope._monitor.records import MonitorStep
from hookscope._monitor.summary import GradSummary, summarise
from hookscope._monitor.tags import step_scalars
from hookscope.errors import SpecError, UnsupportedModelError

__all__ = ["GradMonitor", "watch_grads"]


class GradMonitor(TrainingRecorder):
    """Gradient statistics of a model over a training loop; made by :func:`watch_grads`.

    Call :meth:`step` once per optimiser step, after ``loss.backward()`` and before
    ``optimizer.zero_grad()``; it reads the step's statistics (a few transfers, none inside a
    hook) and appends them to :attr:`records`. ``every=N`` records every N-th step only: on the
    others the monitor's hooks return after one check (the call counter still counts).
    """

    feature: ClassVar[str] = "watch_grads"

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
        self._every = every
        self._step_index = 0
        self._records: list[MonitorStep] = []
        self._written = -1  # the last step sent to TensorBoard
        self._selected = _modules(model, selectors)
        parameters = _parameters(model, self._selected, whole=not selectors) if params else []
        _refuse_offloaded(parameters)
        layers = self._selected if activations else []  # parameters only: no module hooks
        super().__init__(model, layers, Measures(grads=activations), parameters=parameters, dead_window=dead_window)

    def step(self, *, read_with: Read | None = None) -> MonitorStep | None:
        """Close the current step: read its statistics and append them to :attr:`records`.

        Returns the step's :class:`~hookscope.GradStep`, or None on a step ``every`` skips and
        on a step in which no watched module ran with grad and no watched parameter has a
        gradient. ``read_with`` reads the step's on-device statistics instead of
        :func:`~hookscope._shared.stats.read_stats`; it is not called on a step that records nothing.
        """
        index, recorded = self._step_index, self.recording
        step = self.close_step()
        self._step_index += 1
        self.record_next(self._step_index % self._every == 0)  # from the next call on, not only the next pass
        if not recorded or not (step.has_calls or self.has_parameter_grads()):
            return None
        result = self.read(step, index, read_with)
        self._records.append(result)
        return result

    # -- reading --------------------------------------------------------------------------------

    @property
    def records(self) -> list[MonitorStep]:
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
        from hookscope._monitor.records import history_frame

        return history_frame(self._records, metric, what)

    def summary(
        self, *, vanishing: float = 1e-4, exploding: float = 1e3, growth: float = 10.0, window: int = 5
    ) -> GradSummary:
        """Flag vanishing, exploding and non-finite gradients and dead units.

        The thresholds and their defaults are in :mod:`hookscope._monitor.summary`.
        """
        return summarise(self._records, vanishing=vanishing, exploding=exploding, growth=growth, window=window)

    def to_tensorboard(self, writer: Any) -> None:
        """Write the steps recorded since the last call to a ``SummaryWriter`` as scalars.

        Call it after ``monitor.step()`` (every step or now and then): each step is written
        once, tagged as ``hs.monitor`` tags its numbers (:mod:`~hookscope._monitor.tags`):
        ``grad/norm/<module>#<call>``, ``grad_input/max_abs/<module>#<call>``,
        ``param_grad/ratio/<name>``, ...
        """
        for index, scalars in step_scalars(self._records, after=self._written):
            for name, value in scalars.items():
                writer.add_scalar(name, value, global_step=index)
            self._written = index

    # -- lifetime -------------------------------------------------------------------------------

    def __repr__(self) -> str:
        state = "live" if self.live else "removed"
        return f"<GradMonitor of {len(self._selected)} modules: {len(self._records)} steps recorded, {state}>"

    def _repr_html_(self) -> str:
        """The latest step's gradient norms (a row with NaN/Inf marked), then the summary, for Jupyter."""
        latest = self._records[-1] if self._records else MonitorStep(-1)
        return latest.table(title=repr(self), notes=str(self.summary()).splitlines()).html()


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

    The modules are chosen by ``layers=`` (selectors); by default every one. Selectors given
    positionally still work, with a ``FutureWarning``.

    Per module call, statistics of the gradient with respect to each output (``grad_output``)
    and input (``grad_input``): norm, mean ``|g|``, max ``|g|``, NaN/Inf counts; per parameter, its
    gradient's statistics and ``|g| / |w|``. Call ``monitor.step()`` after each ``backward()``.
    It is :func:`hookscope.monitor`'s recorder measuring gradients only: the same hooks, steps,
    flags and tags.

    Example::

        with hs.watch_grads(model) as monitor:
            for x, y in loader:
                loss_fn(model(x), y).backward()
                monitor.step()
                optimizer.step(); optimizer.zero_grad()
        print(monitor.summary())
        monitor.history              # steps x layers, pandas
    """
    chosen = given_selectors(selectors, layers, feature="hs.watch_grads", old_form=True)
    return GradMonitor(model, chosen, params=params, activations=activations, every=every, dead_window=dead_window)

"""What a logged step of ``hs.monitor`` says: its scalars (in the one tag scheme of
:mod:`~hookscope._monitor.tags`) and its flags, from the numbers read."""

from __future__ import annotations

import math

from hookscope._monitor.labels import UniqueLabels
from hookscope._monitor.measures import LayerRead
from hookscope._monitor.records import MonitorFlag, MonitorStep
from hookscope._monitor.tags import tag
from hookscope.errors import NonFiniteError

__all__ = ["Findings"]


class Findings:
    """The names a monitor logs its layers under, and the step's scalars and flags in them.

    ``names`` maps module names to the names shown (canonical where the model has them); a
    module's later call is shown ``blocks.3#1``, never another module's name.
    """

    def __init__(self, names: dict[str, str], flag_above: float) -> None:
        self.names = names
        self._flag_above = flag_above
        self._labels = UniqueLabels(mark="~")
        for module, name in names.items():
            self._labels.claim((module, 0), name)

    def shown(self, module: str) -> str:
        return self.names.get(module, module)

    def call_label(self, module: str, call: int) -> str:
        """``blocks.3`` for a module's first call, ``blocks.3#1`` for its second; never another's name."""
        shown = self.shown(module)
        return self._labels.claim((module, call), shown if call == 0 else f"{shown}#{call}")

    def scalars(self, layers: dict[str, LayerRead], grad_step: MonitorStep | None) -> dict[str, float]:
        scalars: dict[str, float] = {}
        for name, read in layers.items():
            shown = self.shown(name)
            if read.stats is not None:
                scalars[tag("act", "mean_abs", shown)] = read.stats.abs_mean
                scalars[tag("act", "max_abs", shown)] = max(abs(read.stats.min), abs(read.stats.max))
                scalars[tag("act", "std", shown)] = read.stats.std
            for side, measured in (("act", read.act_precision), ("grad", read.grad_precision)):
                if measured is not None:
                    for metric, value in measured.as_dict().items():
                        scalars[tag("precision", f"{side}/{metric}", shown)] = value
        for record in grad_step.records if grad_step is not None else []:
            if record.what == "grad_output" and record.path in ("", "[0]"):
                label = self.call_label(record.module, record.call)
                scalars[tag("grad", "norm", label)] = record.norm
                scalars[tag("grad", "max_abs", label)] = record.max_abs
        return scalars

    @staticmethod
    def parameter_scalars(norms: dict[str, tuple[float, float]], scale: float) -> dict[str, float]:
        scalars: dict[str, float] = {}
        for name, (grad_norm, weight_norm) in norms.items():
            scalars[tag("param_grad", "norm", name)] = grad_norm / scale
            scalars[tag("param_grad", "ratio", name)] = grad_norm / scale / weight_norm if weight_norm else math.nan
        return scalars

    def flags(self, index: int, layers: dict[str, LayerRead]) -> list[MonitorFlag]:
        flags = []
        for name, read in layers.items():
            shown = self.shown(name)
            for side, measured in (("act", read.act_precision), ("grad", read.grad_precision)):
                if measured is None:
                    continue
                noun = "gradient" if side == "grad" else "output"
                for kind, value in (("underflow", measured.underflow), ("overflow", measured.overflow)):
                    if value > self._flag_above:
                        detail = f"loses {100 * value:.1f}% of its {noun} to {kind} in {measured.dtype}"
                        flags.append(MonitorFlag(f"{side}_{kind}", shown, (index,), detail, value))  # type: ignore[arg-type]
        return flags

    def nonfinite(
        self, index: int, grad_step: MonitorStep, *, scaled: bool
    ) -> tuple[NonFiniteError, MonitorFlag] | None:
        """The first gradient (in backward order) holding a NaN/Inf: the tripwire's error, and
        the flag that stands for it with ``tripwire=False`` (or a GradScaler's step, ``scaled``)."""
        bad = [r for r in grad_step.records if r.what != "param" and not r.finite]
        if not bad:
            return None
        first = min(bad, key=lambda r: math.inf if r.order is None else r.order)
        shown = self.call_label(first.module, first.call)
        message = (
            f"step {index}: the gradient of {self.shown(first.module)!r} ({first.class_name}, call {first.call}) "
            f"holds {first.nan} NaN and {first.inf} Inf values, the first in backward order; the layers after it in "
            "the forward got finite gradients"
        )
        error = NonFiniteError(
            message, module=first.module, call=first.call, what=first.what, path=first.path, nan=first.nan,
            step=index,
        )  # fmt: skip
        then = "the GradScaler skips this step and lowers its scale" if scaled else "tripwire=False lets the run go on"
        detail = f"its gradient holds {first.nan} NaN and {first.inf} Inf values, the first in backward order; {then}"
        return error, MonitorFlag("grad_nonfinite", shown, (index,), detail, float(first.nan + first.inf))

"""The one tag scheme of every number the monitor logs: ``<kind>/<metric>/<name>``.

Every sink (JSON lines, CSV, TensorBoard, wandb, MLflow) and both forms of the monitor
(``hs.monitor``'s steps, ``GradMonitor.to_tensorboard``) name a scalar this way, so switching
or adding a sink never renames a metric:

==============  ==========================================  ===============================
kind            metrics                                     name
==============  ==========================================  ===============================
``act``         ``mean_abs``, ``max_abs``, ``std``          the layer (``blocks.3``)
``precision``   ``act|grad/<underflow, overflow, ...>``     the layer
``grad``        ``norm``, ``mean_abs``, ``max_abs``, ...    a call's output (``blocks.3``,
                                                            ``h.0#1``, ``h.0#0:output[0]``)
``grad_input``  the same                                    a call's input
``param_grad``  ``norm``, ``ratio``, ...                    the parameter (``0.weight``)
==============  ==========================================  ===============================

Histograms are tagged ``act/<layer>``; the loss scale ``grad/loss_scale``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hookscope._monitor.records import GradWhat, MonitorStep

__all__ = ["KINDS", "step_scalars", "tag"]

#: The kind a gradient record is logged under.
KINDS: dict[GradWhat, str] = {"grad_output": "grad", "grad_input": "grad_input", "param": "param_grad"}


def tag(kind: str, metric: str, name: str) -> str:
    """``<kind>/<metric>/<name>``: the one spelling of a logged number.

    >>> tag("grad", "norm", "blocks.3")
    'grad/norm/blocks.3'
    """
    return f"{kind}/{metric}/{name}"


def step_scalars(steps: Sequence[MonitorStep], *, after: int) -> list[tuple[int, dict[str, float]]]:
    """The finite numbers of each recorded step after step ``after``, tagged: per record ``norm``,
    ``mean_abs``, ``max_abs``, and ``ratio`` for parameters; NaN/Inf counts when there are any."""
    found = []
    for step in steps:
        if step.step <= after:
            continue
        scalars: dict[str, float] = {}
        for record in step.records:
            values = {"norm": record.norm, "mean_abs": record.mean_abs, "max_abs": record.max_abs}
            if record.ratio is not None:
                values["ratio"] = record.ratio
            if not record.finite:
                values |= {"nan": float(record.nan), "inf": float(record.inf)}
            for metric, value in values.items():
                if math.isfinite(value):
                    scalars[tag(KINDS[record.what], metric, record.column)] = value
        found.append((step.step, scalars))
    return found

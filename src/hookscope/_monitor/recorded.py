"""The recorded steps of whatever a caller hands a plot or the report: either monitor or a list.

``hs.watch_grads`` keeps its steps as ``.records``, ``hs.monitor`` as ``.steps``; both hold
:class:`~hookscope._monitor.records.MonitorStep`, so every reader of a gradient history takes
either monitor, or the steps themselves, through this one function.
"""

from __future__ import annotations

from collections.abc import Sequence

from hookscope._monitor.grads import GradMonitor
from hookscope._monitor.monitor import Monitor
from hookscope._monitor.records import MonitorStep
from hookscope.errors import SpecError

Recorded = GradMonitor | Monitor | Sequence[MonitorStep]


def recorded_steps(source: object, *, argument: str) -> list[MonitorStep]:
    """The steps ``source`` recorded, oldest first; a clear error for anything else or for none.

    ``argument`` names the parameter in the messages (``"grads="``, ``"grad_flow's source"``).
    """
    if isinstance(source, GradMonitor):
        steps = list(source.records)
    elif isinstance(source, Monitor):
        steps = list(source.steps)
    elif isinstance(source, Sequence) and not isinstance(source, str | bytes):
        steps = list(source)
        strangers = sorted({type(step).__name__ for step in steps if not isinstance(step, MonitorStep)})
        if strangers:
            raise SpecError(
                f"{argument} holds {', '.join(strangers)}; expected an hs.monitor or hs.watch_grads "
                "monitor, or its steps (monitor.steps, grad_monitor.records)"
            )
    else:
        raise SpecError(
            f"{argument} is a {type(source).__name__}; expected an hs.monitor or hs.watch_grads monitor, "
            "or its steps (monitor.steps, grad_monitor.records)"
        )
    if not steps:
        raise SpecError(f"{argument} holds no recorded step yet: call monitor.step() after each backward pass")
    return steps

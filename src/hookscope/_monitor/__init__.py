"""The training monitor: gradients, activations, precision health and first NaN/Inf, logged.

One recorder (``recorder``: a :class:`~hookscope._shared.call_recorder.CallRecorder` taking the
``measures``) serves ``hs.monitor`` (``monitor``: sinks, parameter norms, the tripwire) and its
gradients preset ``hs.watch_grads`` (``grads``). ``records`` holds the one step and flag types,
``summary`` flags a gradient history, ``recorded`` reads either monitor's steps, ``tags`` is the
one naming of every logged number, ``sinks`` writes each logged step's scalars (JSON lines, CSV,
TensorBoard, wandb, MLflow, or any ``write``), ``options`` is the one declaration of the
monitor's options.
"""

from hookscope._monitor.grads import GradMonitor, watch_grads
from hookscope._monitor.monitor import Monitor, monitor
from hookscope._monitor.options import MonitorOptions
from hookscope._monitor.recorded import Recorded, recorded_steps
from hookscope._monitor.records import GradRecord, MonitorFlag, MonitorStep
from hookscope._monitor.sinks import CsvSink, JsonLinesSink, MLflowSink, Sink, TensorBoardSink, WandbSink
from hookscope._monitor.summary import GradSummary, summarise

#: ``watch_grads``' names for the one flag and step types (the same classes).
GradFlag = MonitorFlag
GradStep = MonitorStep

__all__ = [
    "CsvSink",
    "GradFlag",
    "GradMonitor",
    "GradRecord",
    "GradStep",
    "GradSummary",
    "JsonLinesSink",
    "MLflowSink",
    "Monitor",
    "MonitorFlag",
    "MonitorOptions",
    "MonitorStep",
    "Recorded",
    "Sink",
    "TensorBoardSink",
    "WandbSink",
    "monitor",
    "recorded_steps",
    "summarise",
    "watch_grads",
]

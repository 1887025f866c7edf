"""Monitor: a training loop's gradients, activations, precision health and first NaN/Inf, logged.

``monitor`` composes ``watch_grads`` and ``detect_nonfinite`` with its own layer hooks (``watch``);
``sinks`` writes each logged step's scalars (JSON lines, CSV, TensorBoard, or any ``write``).
"""

from hookscope._monitor.monitor import Monitor, MonitorFlag, MonitorStep, monitor
from hookscope._monitor.sinks import CsvSink, JsonLinesSink, MLflowSink, Sink, TensorBoardSink, WandbSink

__all__ = [
    "CsvSink",
    "JsonLinesSink",
    "MLflowSink",
    "Monitor",
    "MonitorFlag",
    "MonitorStep",
    "Sink",
    "TensorBoardSink",
    "WandbSink",
    "monitor",
]

"""Where a training monitor's steps go: each sink takes every logged step.

Give them to :func:`hookscope.monitor` (``sinks=[...]``) or to the Trainer and Lightning
callbacks. A sink that fails does not keep a step from the others; the failures are raised
together after the step (:class:`~hookscope.SinkError`). Optional libraries (tensorboard,
wandb, mlflow) are imported when a sink of theirs is made, with the install line if missing.

>>> import tempfile
>>> from pathlib import Path
>>> from hookscope import sinks
>>> sink = sinks.JsonLinesSink(Path(tempfile.mkdtemp()) / "steps.jsonl")
>>> isinstance(sink, sinks.Sink)
True
>>> sink.close()
"""

from __future__ import annotations

from hookscope._monitor import CsvSink, JsonLinesSink, MLflowSink, Sink, TensorBoardSink, WandbSink
from hookscope._shared.names import own_exports, public_dir

__all__ = ["CsvSink", "JsonLinesSink", "MLflowSink", "Sink", "TensorBoardSink", "WandbSink"]

own_exports(__name__)


def __dir__() -> list[str]:
    """``__all__``, the dunders and public submodules, not the imports: what tab completion offers."""
    return public_dir(__name__)

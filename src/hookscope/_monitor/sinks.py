"""Where a monitor's scalars go: one ``write(step, scalars)`` per logged step, and ``close()``.

Every sink gets the same flat ``{name: value}`` dict with stable names (``grad/norm/blocks.3``,
``act/mean_abs/blocks.3``, ``precision/grad/underflow/blocks.3``), so switching or adding a sink
never renames a metric. Files are appended and flushed per step: a run that dies keeps what it logged.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from hookscope._shared.histogram import Histogram
from hookscope._shared.optional import require
from hookscope.errors import SpecError

__all__ = ["CsvSink", "JsonLinesSink", "MLflowSink", "Sink", "TensorBoardSink", "WandbSink", "as_sink"]


@runtime_checkable
class Sink(Protocol):
    """Anything with ``write(step, scalars)`` (and optionally ``close()``) is a sink."""

    def write(self, step: int, scalars: dict[str, float]) -> None: ...


class JsonLinesSink:
    """One JSON object per logged step: ``{"step": 7, "grad/norm/blocks.0": 0.12, ...}``; NaN as
    null, infinities as ``"inf"``/``"-inf"``.

    >>> import tempfile, json
    >>> path = Path(tempfile.mkdtemp()) / "m.jsonl"
    >>> sink = JsonLinesSink(path); sink.write(0, {"a": 1.0, "b": float("nan")}); sink.close()
    >>> json.loads(path.read_text())
    {'step': 0, 'a': 1.0, 'b': None}
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def write(self, step: int, scalars: dict[str, float]) -> None:
        row = {"step": step, **{k: _json_number(v) for k, v in scalars.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _json_number(value: float) -> float | str | None:
    """JSON has no NaN or infinity: NaN is null, +-inf the strings ``"inf"`` and ``"-inf"``."""
    if math.isnan(value):
        return None
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


class CsvSink:
    """Long format, one row per scalar: ``step,name,value``; any set of names fits one header.

    >>> import tempfile
    >>> path = Path(tempfile.mkdtemp()) / "m.csv"
    >>> sink = CsvSink(path); sink.write(3, {"grad/norm/fc": 0.5}); sink.close()
    >>> path.read_text().splitlines()
    ['step,name,value', '3,grad/norm/fc,0.5']
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fresh = not self.path.exists() or self.path.stat().st_size == 0
        self._file = self.path.open("a", encoding="utf-8", newline="")
        self._writer = csv.writer(self._file)
        if fresh:
            self._writer.writerow(["step", "name", "value"])

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self._writer.writerows([step, name, value] for name, value in scalars.items())
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """``writer.add_scalar(name, value, step)`` for each scalar (a ``SummaryWriter`` or a log dir)."""

    def __init__(self, writer: Any) -> None:
        if isinstance(writer, (str, os.PathLike)):
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(os.fspath(writer))
        if not callable(getattr(writer, "add_scalar", None)):
            raise SpecError(f"TensorBoardSink takes a SummaryWriter or a log directory, not {type(writer).__name__}")
        self.writer = writer

    def write(self, step: int, scalars: dict[str, float]) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def write_histograms(self, step: int, histograms: dict[str, Histogram]) -> None:
        """Each histogram as TensorBoard's own (its buckets and bounds as counted)."""
        for name, histogram in histograms.items():
            if not histogram.counted:
                continue
            edges = histogram.edges
            counts, middles = np.asarray(histogram.counts), (edges[:-1] + edges[1:]) / 2
            self.writer.add_histogram_raw(
                name, min=histogram.low, max=histogram.high, num=histogram.counted,
                sum=float((counts * middles).sum()), sum_squares=float((counts * middles**2).sum()),
                bucket_limits=edges[1:].tolist(), bucket_counts=list(histogram.counts), global_step=step,
            )  # fmt: skip
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """``run.log(scalars, step=step)`` into a Weights & Biases run: the one given, the active
    one (``wandb.run``), or one this sink starts with ``wandb.init(**init)`` and finishes on close.

    Works offline (``WANDB_MODE=offline``): the run's files hold the history and summary.
    """

    def __init__(self, run: Any = None, **init: Any) -> None:
        wandb = require("wandb", purpose="WandbSink", extra="wandb")
        self._owned = run is None and wandb.run is None
        self.run = run if run is not None else (wandb.run if wandb.run is not None else wandb.init(**init))

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)  # commits the step (its histograms were logged first)

    def write_histograms(self, step: int, histograms: dict[str, Histogram]) -> None:
        """Each histogram as a ``wandb.Histogram`` of its buckets."""
        wandb = require("wandb", purpose="WandbSink", extra="wandb")
        shown = {
            name: wandb.Histogram(np_histogram=(list(h.counts), h.edges.tolist()))
            for name, h in histograms.items()
            if h.counted
        }
        self.run.log(shown, step=step, commit=False)

    def close(self) -> None:
        if self._owned:
            self.run.finish()


class MLflowSink:
    """``mlflow.log_metrics(scalars, step=step)`` into the active MLflow run (one this sink starts
    with ``mlflow.start_run(**start)`` when none is active, and ends on close). Names keep their
    ``/``; ``#`` (a module's later call) becomes ``_call``, and any other character MLflow
    refuses becomes ``_``."""

    def __init__(self, **start: Any) -> None:
        self._mlflow = require("mlflow", purpose="MLflowSink", extra="mlflow", package="mlflow-skinny")
        self._owned = self._mlflow.active_run() is None
        self.run = self._mlflow.active_run() or self._mlflow.start_run(**start)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        clean = {_mlflow_name(name): value for name, value in scalars.items() if math.isfinite(value)}
        self._mlflow.log_metrics(clean, step=step, run_id=self.run.info.run_id)

    def close(self) -> None:
        active = self._mlflow.active_run()
        if self._owned and active is not None and active.info.run_id == self.run.info.run_id:
            self._mlflow.end_run()


def _mlflow_name(name: str) -> str:
    """A metric name MLflow takes: letters, digits, ``_ - . / :`` and spaces; no empty last part.

    >>> _mlflow_name("act/mean_abs/in+proj#1"), _mlflow_name("act/mean_abs/")
    ('act/mean_abs/in_proj_call1', 'act/mean_abs/root')
    """
    cleaned = re.sub(r"[^\w\-./ :]", "_", name.replace("#", "_call"))
    return cleaned + "root" if cleaned.endswith("/") else cleaned


def as_sink(given: Any) -> Sink:
    """A sink from what the user gave: a sink, a path ending in ``.jsonl``/``.json``/``.csv``, or a
    ``SummaryWriter``."""
    if isinstance(given, (str, os.PathLike)):
        suffix = Path(given).suffix.lower()
        if suffix in (".jsonl", ".json"):
            return JsonLinesSink(given)
        if suffix == ".csv":
            return CsvSink(given)
        raise SpecError(
            f"sink {os.fspath(given)!r}: a file sink ends in .jsonl or .csv; for TensorBoard pass a SummaryWriter "
            "or hs.TensorBoardSink(log_dir)"
        )
    if callable(getattr(given, "add_scalar", None)):
        return TensorBoardSink(given)
    if isinstance(given, Sink):
        return given
    raise SpecError(
        f"sink {given!r}: expected a path (.jsonl, .csv), a SummaryWriter, or an object with write(step, scalars)"
    )

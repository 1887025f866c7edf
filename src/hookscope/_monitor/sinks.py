"""Where a monitor's scalars go: one ``write(step, scalars)`` per logged step, and ``close()``.

Every sink gets the same flat ``{name: value}`` dict with stable names (``grad/norm/blocks.3``,
``act/mean_abs/blocks.3``, ``precision/grad/underflow/blocks.3``), so switching or adding a sink
never renames a metric. Files are appended and flushed per step: a run that dies keeps what it logged.
Every sink is given every step and every close (:func:`write_all`, :func:`close_all`): one that
raises (a full disk, a tracking server down) keeps no other from it, and the failures are raised
after, together (:func:`sink_error`).
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from hookscope._monitor.labels import UniqueLabels
from hookscope._shared.credentials import scrub
from hookscope._shared.histogram import Histogram
from hookscope._shared.optional import require
from hookscope.errors import SinkError, SpecError

__all__ = [
    "CsvSink",
    "JsonLinesSink",
    "MLflowSink",
    "Sink",
    "TensorBoardSink",
    "WandbSink",
    "as_sink",
    "close_all",
    "sink_error",
    "write_all",
]


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
            tensorboard = require(
                "torch.utils.tensorboard", purpose="TensorBoardSink", extra="tensorboard", package="tensorboard"
            )
            writer = tensorboard.SummaryWriter(os.fspath(writer))
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
    with ``mlflow.start_run(**start)`` when none is active, and ends on close).

    Where the run is kept is MLflow's tracking URI: for local use MLflow 3 recommends, and
    defaults to, a SQLite store (``mlflow.set_tracking_uri("sqlite:///mlflow.db")``), which needs
    ``sqlalchemy`` and ``alembic`` beside ``mlflow-skinny`` (``pip install 'hookscope[mlflow]'``
    installs all three); its older ``./mlruns`` file store is refused unless
    ``MLFLOW_ALLOW_FILE_STORE=true``.

    Names keep their ``/``; ``#`` (a module's later call) becomes ``_call``, and any other
    character MLflow refuses becomes ``_``. Two names that would clean to one (``x+1`` and
    ``x_1``) stay two metrics: a name MLflow takes as it is keeps it, the other gets ``-2``
    (``renamed`` lists them), the same at every step.
    """

    def __init__(self, **start: Any) -> None:
        self._mlflow = require("mlflow", purpose="MLflowSink", extra="mlflow", package="mlflow-skinny")
        self._names = UniqueLabels(mark="-")
        self._owned = self._mlflow.active_run() is None
        self.run = self._mlflow.active_run() or self._start(start)

    def _start(self, start: dict[str, Any]) -> Any:
        uri = str(self._mlflow.get_tracking_uri())
        if uri.startswith("sqlite:"):  # mlflow-skinny leaves the database's packages out
            for module in ("sqlalchemy", "alembic"):
                require(module, purpose=f"MLflowSink on the SQLite store {uri}", extra="mlflow")
        try:
            return self._mlflow.start_run(**start)
        except self._mlflow.exceptions.MlflowException as error:
            if "MLFLOW_ALLOW_FILE_STORE" not in str(error):
                raise
            raise SpecError(
                f"MLflow refuses its file store {uri} (MLflow 3 keeps it for old runs only): "
                "mlflow.set_tracking_uri('sqlite:///mlflow.db'), the local store MLflow recommends, or set "
                "MLFLOW_ALLOW_FILE_STORE=true to keep the file store"
            ) from error

    def write(self, step: int, scalars: dict[str, float]) -> None:
        for name in scalars:  # names MLflow takes as they are first: they keep their own spelling
            if _mlflow_name(name) == name:
                self._names.claim(name, name)
        finite = {name: value for name, value in scalars.items() if math.isfinite(value)}
        clean = {self._names.claim(name, _mlflow_name(name)): value for name, value in finite.items()}
        self._mlflow.log_metrics(clean, step=step, run_id=self.run.info.run_id)

    @property
    def renamed(self) -> dict[str, str]:
        """The metric names whose MLflow spelling another name had already: name -> the spelling logged."""
        return {str(name): spelling for name, spelling in self._names.renamed.items()}

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


def describe(sink: Any) -> str:
    """A sink as an error names it: its class, and its file where it writes one."""
    path = getattr(sink, "path", None)
    where = f"({os.fspath(path)!r})" if isinstance(path, (str, os.PathLike)) else ""
    return f"{type(sink).__name__}{where}"


Failures = list[tuple[Any, str, BaseException]]


def write_all(sinks: Sequence[Any], step: int, scalars: dict[str, float], histograms: dict[str, Histogram]) -> Failures:
    """Give every sink every part of the step (its histograms first, to the sinks that draw
    them, then its scalars): a part that raises keeps neither another sink nor the same sink's
    other part from the step. Returns the failures, for the caller to raise."""
    failures: Failures = []
    for sink in sinks:
        write_histograms = getattr(sink, "write_histograms", None)
        if histograms and callable(write_histograms):
            try:
                write_histograms(step, histograms)
            except Exception as error:
                failures.append((sink, f"{describe(sink)} (histograms)", error))
        try:
            sink.write(step, scalars)
        except Exception as error:
            failures.append((sink, describe(sink), error))
    return failures


def close_all(sinks: Sequence[Any]) -> Failures:
    """Close every sink that has a ``close()``, whatever the others do; returns the failures."""
    failures: Failures = []
    for sink in sinks:
        close = getattr(sink, "close", None)
        if not callable(close):
            continue
        try:
            close()
        except Exception as error:
            failures.append((sink, describe(sink), error))
    return failures


def sink_error(failures: Failures, total: int, step: int | None) -> SinkError:
    """One error naming each failed sink (the first failure as its cause); the sinks' own error
    texts are quoted without credentials (a tracking URI ``http://user:SECRET@host``)."""
    what = f"failed to write step {step}; the other sinks have it" if step is not None else "failed to close"
    each = _scrubbed("; ".join(f"{shown}: {type(error).__name__}: {error}" for _, shown, error in failures))
    failed = len({id(sink) for sink, _, _ in failures})
    error = SinkError(
        f"{failed} of {total} sinks {what} ({each}); free the disk or fix the sink, or drop it from sinks=",
        step=step,
        failures=tuple(failures),
    )
    error.__cause__ = failures[0][2]
    return error


def _scrubbed(text: str) -> str:
    """``text`` without the credentials written into URLs it holds, by the package's one scrubbing."""
    return scrub(text, ())


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
            "or hookscope.sinks.TensorBoardSink(log_dir)"
        )
    if callable(getattr(given, "add_scalar", None)):
        return TensorBoardSink(given)
    if isinstance(given, Sink):
        return given
    raise SpecError(
        f"sink {given!r}: expected a path (.jsonl, .csv), a SummaryWriter, or an object with write(step, scalars)"
    )

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
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from hookscope.errors import SpecError

__all__ = ["CsvSink", "JsonLinesSink", "Sink", "TensorBoardSink", "as_sink"]


@runtime_checkable
class Sink(Protocol):
    """Anything with ``write(step, scalars)`` (and optionally ``close()``) is a sink."""

    def write(self, step: int, scalars: dict[str, float]) -> None: ...


class JsonLinesSink:
    """One JSON object per logged step: ``{"step": 7, "grad/norm/blocks.0": 0.12, ...}``; NaN as null.

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
        row = {"step": step, **{k: (v if math.isfinite(v) else None) for k, v in scalars.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


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

    def close(self) -> None:
        self.writer.close()


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

"""A progress line for long extractions: rows done of the total, rows/s, ETA, bytes written.

Shown by rank 0 only, on standard error, by default only when that is a terminal. rich is
imported when a line is shown, never otherwise.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

from hookscope._shared.units import format_bytes

__all__ = ["ExtractProgress"]


class ExtractProgress:
    """``with ExtractProgress(total, enabled, ...) as bar: bar.advance(rows)``; silent when disabled."""

    def __init__(self, total: int | None, *, enabled: bool | None, label: str, written: Callable[[], int]) -> None:
        self.total = total
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.label = label
        self.written = written
        self.rows = 0
        self.started = time.perf_counter()
        self._progress: Any = None
        self._task: Any = None

    def __enter__(self) -> ExtractProgress:
        self.started = time.perf_counter()
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("rows · {task.fields[speed]} rows/s · ETA"),
                TimeRemainingColumn(),
                TextColumn("· {task.fields[written]} written"),
                console=Console(stderr=True),
            )
            self._progress.start()
            self._task = self._progress.add_task(self.label, total=self.total, speed="-", written="0 B")
        return self

    def advance(self, rows: int) -> None:
        """``rows`` more rows have been run (rows a resumed store had already are not counted)."""
        self.rows += rows
        if self._progress is not None:
            self._progress.update(
                self._task, advance=rows, speed=f"{self.rate:,.0f}", written=format_bytes(self.written())
            )

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    @property
    def rate(self) -> float:
        """Rows run per second so far."""
        return self.rows / self.elapsed if self.elapsed > 0 else 0.0

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self._progress is not None:
            self._progress.update(self._task, written=format_bytes(self.written()))  # the last chunks landed since
            self._progress.stop()

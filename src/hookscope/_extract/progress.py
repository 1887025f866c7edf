"""Progress of a long extraction: rows done of the total, rows/s, ETA, bytes written.

Shown by rank 0 only, on standard error. By default (``progress=None``) only when that is a
terminal, as a rich bar; rich is imported when a bar is shown, never otherwise. Asked for
explicitly (``progress=True``, ``--progress``) while standard error is not a terminal (a log
file, a CI job, a pipe), it is written as plain lines instead, without colours or cursor
movement: one every ``HOOKSCOPE_PROGRESS_INTERVAL`` seconds (default 10) and one at the end::

    extract → feats.zarr: 1,024/10,000 rows (10%), 512 rows/s, ETA 0:00:17, 12.3 MiB written
"""

from __future__ import annotations

import datetime
import math
import os
import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, TextIO

from hookscope._shared.units import format_bytes
from hookscope.errors import SpecError

__all__ = ["INTERVAL_VARIABLE", "PLAIN_INTERVAL", "ExtractProgress", "plain_interval"]

#: Seconds between two plain progress lines, unless ``HOOKSCOPE_PROGRESS_INTERVAL`` says otherwise.
PLAIN_INTERVAL = 10.0
#: The environment variable that sets the seconds between plain progress lines (0: every batch).
INTERVAL_VARIABLE = "HOOKSCOPE_PROGRESS_INTERVAL"


def plain_interval() -> float:
    """Seconds between plain progress lines: ``HOOKSCOPE_PROGRESS_INTERVAL``, else 10.

    >>> plain_interval() >= 0
    True
    """
    text = os.environ.get(INTERVAL_VARIABLE, "").strip()
    if not text:
        return PLAIN_INTERVAL
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 0:
        raise SpecError(
            f"{INTERVAL_VARIABLE}={text!r} is not a number of seconds; expected one >= 0 (e.g. 10, or 0 for a "
            f"line per batch): set it so, or unset it for the default {PLAIN_INTERVAL:g}"
        )
    return seconds


def _clock(seconds: float) -> str:
    """``0:00:17``: whole seconds as hours, minutes and seconds."""
    return str(datetime.timedelta(seconds=round(seconds)))


class ExtractProgress:
    """``with ExtractProgress(total, enabled, ...) as bar: bar.advance(rows)``; silent when disabled.

    ``enabled=None`` shows a bar when standard error is a terminal; ``True`` shows it there too,
    and writes plain lines (at most one per ``interval`` seconds, and one at the end) anywhere else.

    >>> import io
    >>> out = io.StringIO()
    >>> bar = ExtractProgress(8, enabled=True, label="extract → f.zarr", written=lambda: 1536, interval=0, stream=out)
    >>> with bar:
    ...     bar.advance(4)
    >>> [line.split(", ")[0] for line in out.getvalue().splitlines()], out.getvalue().endswith("1.5 KiB written\\n")
    (['extract → f.zarr: 4/8 rows (50%)', 'extract → f.zarr: 4/8 rows (50%)'], True)
    """

    def __init__(
        self,
        total: int | None,
        *,
        enabled: bool | None,
        label: str,
        written: Callable[[], int],
        interval: float | None = None,
        stream: TextIO | None = None,
    ) -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        terminal = _is_terminal(self.stream)
        self.enabled = terminal if enabled is None else enabled
        self.plain = self.enabled and not terminal  # asked for where no bar can be drawn: lines
        self.interval = (plain_interval() if interval is None else interval) if self.plain else PLAIN_INTERVAL
        self.label = label
        self.written = written
        self.rows = 0
        self.started = time.perf_counter()
        self._shown = self.started  # when the last plain line was written
        self._progress: Any = None
        self._task: Any = None

    def __enter__(self) -> ExtractProgress:
        self.started = self._shown = time.perf_counter()
        if self.plain:
            return self
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
        if self.plain:
            now = time.perf_counter()
            if now - self._shown >= self.interval:
                self._shown = now
                self._write(self._line())
        elif self._progress is not None:
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

    def _line(self, end: str | None = None) -> str:
        """One plain line: rows of the total, the rate, the ETA (or ``end``: how it ended), bytes written."""
        rate = self.rate
        parts = [f"{self.rows:,} rows"]
        if self.total:
            parts = [f"{self.rows:,}/{self.total:,} rows ({100 * self.rows // self.total}%)"]
        parts.append(f"{rate:,.0f} rows/s")
        if end is not None:
            parts.append(f"{end} {_clock(self.elapsed)}")
        elif self.total:
            parts.append(f"ETA {_clock((self.total - self.rows) / rate)}" if rate > 0 else "ETA -")
        parts.append(f"{format_bytes(self.written())} written")
        return f"{self.label}: {', '.join(parts)}"

    def _write(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self.plain:  # the last line, after the last chunks landed
            self._write(self._line(end="done in" if error is None else "stopped after"))
        elif self._progress is not None:
            self._progress.update(self._task, written=format_bytes(self.written()))  # the last chunks landed since
            self._progress.stop()


def _is_terminal(stream: TextIO) -> bool:
    """True when ``stream`` is a terminal (a closed or odd stream is not)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False

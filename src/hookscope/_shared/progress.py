"""Progress of a long loop (an extraction's rows, a patching sweep's cells) where the user can see it.

One class, :class:`Progress`, picks where and how to show it, once, when the loop starts:

- **a terminal** (standard error is a TTY): a rich bar redrawn in place; rich is imported only
  then. ``NO_COLOR`` (any value) draws it without colours, as rich reads that variable.
- **a notebook** (a Jupyter kernel runs this process): one HTML line under the cell, replaced in
  place through ``IPython.display`` at most five times a second; no colour, no widget library.
  By default it appears once the loop has run for a second, so a quick call leaves no trace.
- **anything else** (a log file, a CI job, a pipe): by default nothing; asked for
  (``progress=True``) plain lines without colours or carriage returns, one every
  ``HOOKSCOPE_PROGRESS_INTERVAL`` seconds (default 10) and one at the end::

      extract → feats.zarr: 1,024/10,000 rows (10%), 512 rows/s, ETA 0:00:17, 12.3 MiB written

``progress=False`` shows nothing anywhere.
"""

from __future__ import annotations

import datetime
import html
import importlib
import math
import os
import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, Literal, TextIO

from hookscope.errors import SpecError

__all__ = ["INTERVAL_VARIABLE", "NOTEBOOK_DELAY", "PLAIN_INTERVAL", "Progress", "in_notebook", "plain_interval"]

#: Seconds between two plain progress lines, unless ``HOOKSCOPE_PROGRESS_INTERVAL`` says otherwise.
PLAIN_INTERVAL = 10.0
#: The environment variable that sets the seconds between plain progress lines (0: every batch).
INTERVAL_VARIABLE = "HOOKSCOPE_PROGRESS_INTERVAL"
#: Seconds a loop runs before a notebook shows its progress by default (``progress=True``: at once).
NOTEBOOK_DELAY = 1.0
_NOTEBOOK_EVERY = 0.2  # seconds between two redraws of the notebook's line

Mode = Literal["off", "bar", "notebook", "plain"]


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


def in_notebook() -> bool:
    """True when a Jupyter kernel runs this process (IPython is never imported to find out).

    >>> in_notebook()
    False
    """
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and getattr(shell, "kernel", None) is not None


def _clock(seconds: float) -> str:
    """``0:00:17``: whole seconds as hours, minutes and seconds."""
    return str(datetime.timedelta(seconds=round(seconds)))


class Progress:
    """``with Progress(total, enabled, label=..., unit=...) as bar: bar.advance(n)``; silent when off.

    ``enabled=None`` shows a bar on a terminal and a line in a notebook (after
    :data:`NOTEBOOK_DELAY`); ``True`` shows them too (the notebook's at once), and writes plain
    lines anywhere else; ``False`` shows nothing. ``extra`` adds a last part to each line (an
    extraction's bytes written), read when a line is drawn.

    >>> import io
    >>> out = io.StringIO()
    >>> with Progress(40, enabled=True, label="patch_sweep", unit="cells", interval=0, stream=out) as bar:
    ...     bar.advance(10)
    >>> out.getvalue().splitlines()[0].split(", ")[0]
    'patch_sweep: 10/40 cells (25%)'
    """

    def __init__(
        self,
        total: int | None,
        *,
        enabled: bool | None,
        label: str,
        unit: str,
        extra: Callable[[], str] | None = None,
        interval: float | None = None,
        stream: TextIO | None = None,
    ) -> None:
        self.total = total
        self.label = label
        self.unit = unit
        self.extra = extra
        self.stream = stream if stream is not None else sys.stderr
        self.mode = self._mode(enabled, stream is None)
        self.eager = enabled is True  # a notebook shows asked-for progress at once
        self.interval = (plain_interval() if interval is None else interval) if self.mode == "plain" else PLAIN_INTERVAL
        self.done = 0
        self.started = time.perf_counter()
        self._shown = self.started  # when the last plain line or notebook redraw was made
        self._progress: Any = None
        self._task: Any = None
        self._display: Any = None

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def plain(self) -> bool:
        return self.mode == "plain"

    def _mode(self, enabled: bool | None, standard: bool) -> Mode:
        if enabled is False:
            return "off"
        if _is_terminal(self.stream):
            return "bar"
        if standard and in_notebook():  # the cell's output, not a stream the caller chose
            return "notebook"
        return "plain" if enabled else "off"

    def __enter__(self) -> Progress:
        self.started = self._shown = time.perf_counter()
        if self.mode == "bar":
            self._start_bar()
        elif self.mode == "notebook" and self.eager:
            self._draw_notebook()
        return self

    def _start_bar(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        columns = [
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn(f"{self.unit} · {{task.fields[speed]}} {self.unit}/s · ETA"),
            TimeRemainingColumn(),
        ]
        if self.extra is not None:
            columns.append(TextColumn("· {task.fields[extra]}"))
        self._progress = Progress(*columns, console=Console(file=self.stream))
        self._progress.start()
        self._task = self._progress.add_task(self.label, total=self.total, speed="-", extra=self._extra())

    def advance(self, count: int) -> None:
        """``count`` more units are done (units a resumed run had done already are not counted)."""
        self.done += count
        if self.mode == "bar":
            self._progress.update(self._task, advance=count, speed=f"{self.rate:,.0f}", extra=self._extra())
        elif self.mode in ("plain", "notebook"):
            now = time.perf_counter()
            if self.mode == "plain" and now - self._shown >= self.interval:
                self._shown = now
                self._write(self._line())
            elif self.mode == "notebook" and now - self._shown >= _NOTEBOOK_EVERY and self._notebook_due(now):
                self._shown = now
                self._draw_notebook()

    def _notebook_due(self, now: float) -> bool:
        """Whether the notebook's line is drawn now: once shown or asked for, or after the delay."""
        return self._display is not None or self.eager or now - self.started >= NOTEBOOK_DELAY

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    @property
    def rate(self) -> float:
        """Units done per second so far."""
        return self.done / self.elapsed if self.elapsed > 0 else 0.0

    def _extra(self) -> str:
        return self.extra() if self.extra is not None else ""

    def _line(self, end: str | None = None) -> str:
        """One plain line: done of the total, the rate, the ETA (or ``end``: how it ended), ``extra``."""
        rate, unit = self.rate, self.unit
        parts = [f"{self.done:,} {unit}"]
        if self.total:
            parts = [f"{self.done:,}/{self.total:,} {unit} ({100 * self.done // self.total}%)"]
        parts.append(f"{rate:,.0f} {unit}/s")
        if end is not None:
            parts.append(f"{end} {_clock(self.elapsed)}")
        elif self.total:
            parts.append(f"ETA {_clock((self.total - self.done) / rate)}" if rate > 0 else "ETA -")
        if self.extra is not None:
            parts.append(self.extra())
        return f"{self.label}: {', '.join(parts)}"

    def html(self, end: str | None = None) -> str:
        """The notebook's line: a ``<progress>`` element (where the total is known) and :meth:`_line`, escaped.

        >>> Progress(4, enabled=False, label="<x>", unit="rows").html()
        '<div><progress value="0" max="4"></progress> &lt;x&gt;: 0/4 rows (0%), 0 rows/s, ETA -</div>'
        """
        bar = f'<progress value="{self.done}" max="{self.total}"></progress> ' if self.total else ""
        return f"<div>{bar}{html.escape(self._line(end))}</div>"

    def _draw_notebook(self, end: str | None = None) -> None:
        # Imported by name: IPython is there whenever a notebook is, but not an install extra, and its
        # annotations vary by version; the two names used are typed Any here.
        ipython_display: Any = importlib.import_module("IPython.display")
        shown = ipython_display.HTML(self.html(end))
        if self._display is None:
            self._display = ipython_display.display(shown, display_id=True)
        else:
            self._display.update(shown)

    def _write(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        end = "done in" if error is None else "stopped after"
        if self.mode == "plain":  # the last line, after the last of the work landed
            self._write(self._line(end=end))
        elif self.mode == "bar":
            self._progress.update(self._task, extra=self._extra())  # what landed since the last batch
            self._progress.stop()
        elif self.mode == "notebook" and self._display is not None:
            self._draw_notebook(end=end)


def _is_terminal(stream: TextIO) -> bool:
    """True when ``stream`` is a terminal (a closed or odd stream is not)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False

"""Progress of a long extraction: rows done of the total, rows/s, ETA, bytes written.

Shown by rank 0 only, where :class:`~hookscope._shared.progress.Progress` decides: a bar on a
terminal, a line in a notebook, plain lines elsewhere when asked for (``progress=True``,
``--progress``), one every ``HOOKSCOPE_PROGRESS_INTERVAL`` seconds (default 10) and one at the end::

    extract → feats.zarr: 1,024/10,000 rows (10%), 512 rows/s, ETA 0:00:17, 12.3 MiB written
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TextIO

from hookscope._shared.progress import INTERVAL_VARIABLE, PLAIN_INTERVAL, Progress, plain_interval
from hookscope._shared.units import format_bytes

__all__ = ["INTERVAL_VARIABLE", "PLAIN_INTERVAL", "ExtractProgress", "plain_interval"]


class ExtractProgress(Progress):
    """``with ExtractProgress(total, enabled, ...) as bar: bar.advance(rows)``; silent when disabled.

    ``enabled=None`` shows a bar when standard error is a terminal (a line in a notebook); ``True``
    shows it there too, and writes plain lines (at most one per ``interval`` seconds, and one at
    the end) anywhere else.

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
        super().__init__(
            total,
            enabled=enabled,
            label=label,
            unit="rows",
            extra=lambda: f"{format_bytes(written())} written",
            interval=interval,
            stream=stream,
        )
        self.written = written

    @property
    def rows(self) -> int:
        """Rows run so far."""
        return self.done

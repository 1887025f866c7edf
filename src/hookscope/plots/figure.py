"""The one way plots make a figure: pyplot-free, so nothing opens a window or touches global state."""

from __future__ import annotations

import math
from typing import Any

from hookscope.errors import MissingDependencyError

__all__ = ["grid", "literal", "new_figure", "short_label"]


def new_figure(width: float, height: float) -> Any:
    """A pyplot-free ``Figure`` (no window, no global state), or a clear error without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise MissingDependencyError("plots need matplotlib: pip install 'hookscope[plots]'") from error
    return Figure(figsize=(width, height), layout="constrained")


def grid(fig: Any, panels: int, columns: int) -> list[Any]:
    """``panels`` axes in rows of ``columns``; the grid's spare cells get no axes at all, so a
    figure holds exactly one axes per panel (plus a colour bar where there is one)."""
    columns = max(1, min(columns, panels))
    rows = math.ceil(panels / columns)
    return [fig.add_subplot(rows, columns, index + 1) for index in range(panels)]


def short_label(text: str, limit: int = 28) -> str:
    """A label that fits under a panel: the end of a long dotted name, which is the specific part."""
    return literal(text if len(text) <= limit else "…" + text[-(limit - 1) :])


def literal(text: str) -> str:
    """``text`` as matplotlib shows it verbatim: a ``$`` in a module name does not start math.

    >>> literal("cost$")
    'cost\\\\$'
    """
    return text.replace("$", "\\$")

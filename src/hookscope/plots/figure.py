"""The one way plots make a figure: pyplot-free, so nothing opens a window or touches global state."""

from __future__ import annotations

import math
from typing import Any

from hookscope._shared.optional import require

__all__ = ["depth_figure", "grid", "label_layers", "literal", "new_figure", "short_label"]

_MAX_WIDTH = 16.0  # inches: past this, a wider figure only makes a heavier image
_MAX_TICKS = 48  # layer names under an axis; a deeper model names every k-th layer


def new_figure(width: float, height: float) -> Any:
    """A pyplot-free ``Figure`` (no window, no global state), or a clear error without matplotlib."""
    figure = require("matplotlib.figure", purpose="hs.plots", extra="plots")
    return figure.Figure(figsize=(width, height), layout="constrained")


def depth_figure(layers: int, height: float, *, per_layer: float = 0.22) -> Any:
    """A figure with one column per layer, as wide as the layers need up to a cap: for 900
    layers an uncapped width made a 2.6 MB PNG where the capped one is 0.46 MB."""
    return new_figure(min(max(6.0, per_layer * layers + 2.5), _MAX_WIDTH), height)


def label_layers(ax: Any, names: list[str], *, limit: int = 24, fontsize: float = 6) -> None:
    """Layer names (shortened to ``limit``) as x tick labels at 0, 1, ...; every k-th of them
    when there are many."""
    stride = max(1, math.ceil(len(names) / _MAX_TICKS))
    positions = list(range(0, len(names), stride))
    ax.set_xticks(positions, [short_label(names[i], limit) for i in positions], rotation=90, fontsize=fontsize)


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
    """``text`` as matplotlib shows it verbatim: a ``$`` in a module name does not start math,
    and a lone surrogate (a name made from undecodable bytes), which matplotlib's font code
    cannot take, is shown as its escape ``\\udcff``.

    >>> literal("cost$"), literal("x" + chr(0xDCFF))
    ('cost\\\\$', 'x\\\\udcff')
    """
    shown = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return shown.replace("$", "\\$")

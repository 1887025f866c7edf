"""Plots of the methods' results: a patching grid as a heatmap, a logit lens as a table of tokens."""

from __future__ import annotations

from typing import Any

import numpy as np

from hookscope.errors import SpecError
from hookscope.plots.figure import grid, literal, new_figure, short_label

__all__ = ["effects", "lens"]

_MAX_PANELS = 16


def effects(result: Any, *, title: str | None = None, cmap: str = "RdBu", panels: str = "site") -> Any:
    """A patching result (:class:`hookscope.methods.Effects`) as a heatmap: sites down, positions
    across, on a colour scale centred on 0 (blue: the patch moves the metric toward the clean run's,
    red: away from it). By head, one panel per site (``panels="site"``, heads down) or per head (``"head"``).

    Example::

        hs.plots.effects(hs.methods.patch_sweep(model, clean, corrupted, metric=m)).savefig("sweep.png")
    """
    values = result.values.double().numpy()
    dims, coords = tuple(result.dims), result.coords
    finite = values[np.isfinite(values)]
    high = float(np.abs(finite).max()) if finite.size else 1.0
    high = high if high > 0 else 1.0
    planes: list[tuple[Any, np.ndarray]]
    if len(dims) == 2:
        planes = [(None, values)]
        rows_dim = dims[0]
    else:
        if panels not in ("site", "head"):
            raise SpecError(f"panels={panels!r}: expected 'site' or 'head'")
        axis = dims.index(panels)
        if values.shape[axis] > _MAX_PANELS:
            raise SpecError(f"{values.shape[axis]} {panels}s make too many panels; plot a slice of the result")
        planes = [(coords[panels][i], np.take(values, i, axis=axis)) for i in range(values.shape[axis])]
        rows_dim = "head" if panels == "site" else "site"
    positions = [str(p) for p in coords["position"]]
    row_labels = [literal(short_label(str(r))) for r in coords[rows_dim]]
    columns = 1 if len(planes) == 1 else min(4, len(planes))
    width = min(16.0, (1.5 + 0.35 * len(positions)) * columns + 1.5)
    height = min(16.0, (0.8 + 0.25 * len(row_labels)) * -(-len(planes) // columns) + 0.8)
    fig = new_figure(width, height)
    axes = grid(fig, len(planes), columns)
    image = None
    for ax, (label, plane) in zip(axes, planes, strict=True):
        image = ax.imshow(plane, cmap=cmap, vmin=-high, vmax=high, aspect="auto", interpolation="nearest")
        ax.set_xticks(range(len(positions)), positions, fontsize=6)
        ax.set_yticks(range(len(row_labels)), row_labels, fontsize=6)
        ax.set_xlabel("position", fontsize=7)
        ax.set_ylabel(rows_dim, fontsize=7)
        if label is not None:
            ax.set_title(literal(str(label)), fontsize=7)
    fig.colorbar(image, ax=axes, label="normalised effect")
    fig.suptitle(literal(title or f"{result.method} ({result.direction}) of {result.metric}"), fontsize=9)
    return fig


def lens(result: Any, *, row: int = 0, title: str | None = None) -> Any:
    """A logit lens (:class:`hookscope.methods.Lens`): layers down, positions across; each cell
    shows the top token, coloured by its probability.

    Example::

        hs.plots.lens(hs.methods.logit_lens(model, ids, decode=tokenizer.decode)).savefig("lens.png")
    """
    probs = result.probs()[:, row]
    best, ids = probs.max(-1)
    layers, positions = best.shape
    fig = new_figure(min(16.0, 2.0 + 0.9 * positions), min(16.0, 1.2 + 0.35 * layers))
    ax = fig.add_subplot(1, 1, 1)
    image = ax.imshow(best.numpy(), cmap="Blues", vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
    for i in range(layers):
        for j in range(positions):
            shown = literal(result.token(int(ids[i, j]))[:8])
            color = "black" if float(best[i, j]) < 0.6 else "white"
            ax.text(j, i, shown, ha="center", va="center", fontsize=6, color=color)
    ax.set_yticks(range(layers), [literal(short_label(name)) for name in result.layers], fontsize=6)
    ax.set_xticks(range(positions), [str(p) for p in range(positions)], fontsize=6)
    ax.set_xlabel("position")
    ax.set_title(literal(title or "logit lens: top token per layer and position"), fontsize=9)
    fig.colorbar(image, ax=ax, label="probability")
    return fig

"""Where two models part, along depth: the error of every compared site on a log axis."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from hookscope.errors import SpecError
from hookscope.plots.figure import depth_figure, label_layers

if TYPE_CHECKING:
    from hookscope._diff.result import Diff

__all__ = ["diff_profile"]


def diff_profile(diff: Diff, *, leaves_only: bool = True) -> Any:
    """Relative error and max ``|a - b|`` of each site along depth (log scale), SQNR below.

    Sites run left to right in the order b made its outputs. Exactly equal sites sit on the
    bottom edge as open circles (a log axis has no zero); sites that could not be compared
    (differing shapes) are red crosses; a dashed line marks the first divergence.
    ``leaves_only`` leaves out containers, whose output repeats their last child's.

    Example::

        hs.plots.diff_profile(hs.diff.dtypes(model, x, torch.bfloat16)).savefig("bf16.png")
    """
    containers = {row.name.rpartition(".")[0] for row in diff.rows if row.name} if leaves_only else set()
    rows = [row for row in diff.rows if not (leaves_only and (row.name in containers or row.name == ""))] or list(
        diff.rows
    )
    if not rows:
        raise SpecError("this diff compared no site: nothing to draw")
    position = np.arange(len(rows))
    relative = np.array([math.nan if r.metrics is None else r.metrics.relative for r in rows], dtype=float)
    max_abs = np.array([math.nan if r.metrics is None else r.metrics.max_abs for r in rows], dtype=float)
    sqnr = np.array([math.nan if r.metrics is None else r.metrics.sqnr_db for r in rows], dtype=float)
    fig = depth_figure(len(rows), 6.0)
    top, bottom = fig.subplots(2, 1, sharex=True)
    positive = np.concatenate([relative[relative > 0], max_abs[max_abs > 0]])
    floor = float(positive[np.isfinite(positive)].min()) / 10 if np.isfinite(positive).any() else 1e-12
    for values, label, colour in ((relative, "relative error", "#08519c"), (max_abs, "max |a-b|", "#e6550d")):
        top.plot(position, np.where(values > 0, values, np.nan), marker="o", markersize=3, label=label, color=colour)
    exact = [i for i, r in enumerate(rows) if r.metrics is not None and r.metrics.exact and r.note is None]
    if exact:
        top.scatter(
            exact, [floor] * len(exact), facecolors="none", edgecolors="#31a354", label="exactly equal", zorder=3
        )
    broken = [i for i, r in enumerate(rows) if r.metrics is None or r.note]
    if broken:
        top.scatter(broken, [floor] * len(broken), marker="x", color="red", label="not comparable", zorder=3)
    top.set_yscale("log")
    top.set_ylim(bottom=floor / 2)
    top.set_ylabel("error (log)")
    divergence = diff.first_divergence()
    if divergence is not None and divergence.row in rows:
        for ax in (top, bottom):
            ax.axvline(rows.index(divergence.row), color="#555", linestyle="--", linewidth=1)
    top.legend(loc="best", fontsize=7)
    top.set_title(f"a against b along depth ({len(rows)} sites)", fontsize=9)
    bottom.plot(position, np.where(np.isfinite(sqnr), sqnr, np.nan), marker="o", markersize=3, color="#756bb1")
    bottom.set_ylabel("SQNR (dB)")
    label_layers(bottom, [row.site for row in rows])
    return fig

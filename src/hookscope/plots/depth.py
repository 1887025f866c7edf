"""How value ranges grow or shrink through the model: statistics of each layer's output along depth."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from hookscope._shared.options import renamed
from hookscope.errors import SpecError
from hookscope.plots.figure import depth_figure, label_layers

if TYPE_CHECKING:
    from hookscope._core.select import Selector
    from hookscope._trace.result import Trace

__all__ = ["layer_stats"]


def layer_stats(
    trace: Trace,
    layers: Selector | Sequence[Selector] | None = None,
    *,
    sites: Selector | Sequence[Selector] | None = None,
) -> Any:
    """Mean, std, min and max of each layer's output along depth, in two panels.

    The top panel shows the range (min to max, light), mean ± std (dark) and the mean; the
    bottom one the std and mean ``|x|`` on a log axis, where growth or decay by orders of magnitude
    reads as a slope. A layer whose output held a NaN or Inf is marked with a red cross.
    ``layers`` picks them (a selector, formerly ``sites``; default: every leaf module's call).

    Example::

        hs.plots.layer_stats(hs.trace(model, x)).savefig("layer_stats.png")
    """
    if trace.meta.get("stats") is False:
        raise SpecError("this trace was taken with stats=False: nothing was measured; trace again with stats=True")
    layers = renamed(layers, sites, new_name="layers", old_name="sites", where="hs.plots.layer_stats")
    rows = trace.measured_leaves(layers)
    if not rows:
        raise SpecError("no layer of this trace has measured outputs to draw")
    stats = [row.stats for row in rows]
    position = np.arange(len(rows))

    def column(field: str) -> np.ndarray:
        return np.array([getattr(s, field) for s in stats], dtype=float)

    mean, std, low, high, magnitude = (column(f) for f in ("mean", "std", "min", "max", "abs_mean"))
    fig = depth_figure(len(rows), 6.0)
    top, bottom = fig.subplots(2, 1, sharex=True)
    top.fill_between(position, _finite(low), _finite(high), color="#c6dbef", label="min to max", step=None)
    top.fill_between(position, mean - std, mean + std, color="#6baed6", label="mean ± std")
    top.plot(position, mean, color="#08519c", marker="o", markersize=3, label="mean")
    extremes, spreads = _finite(np.concatenate([low, high])), _finite(std)
    if np.isfinite(extremes).any() and np.isfinite(spreads).any():  # all NaN: nothing to scale by
        typical = max(float(np.nanmedian(spreads)), 1e-6)
        if np.nanmax(np.abs(extremes)) > 100 * typical:
            top.set_yscale("symlog", linthresh=typical)
    bad = [i for i, row in enumerate(rows) if row.output_finite is False]
    if bad:
        top.scatter(bad, np.zeros(len(bad)), marker="x", color="red", zorder=3, label="NaN/Inf")
    top.set_ylabel("output value")
    top.legend(loc="best", fontsize=7)
    top.set_title(f"layer statistics along depth ({len(rows)} layers)", fontsize=9)
    for values, label, colour in ((std, "std", "#e6550d"), (magnitude, "mean |x|", "#31a354")):
        bottom.plot(position, np.where(values > 0, values, np.nan), marker="o", markersize=3, label=label, color=colour)
    bottom.set_yscale("log")
    bottom.set_ylabel("scale (log)")
    bottom.legend(loc="best", fontsize=7)
    label_layers(bottom, [row.site for row in rows])
    return fig


def _finite(values: np.ndarray) -> np.ndarray:
    return np.where(np.isfinite(values), values, np.nan)

"""What the layers computed: feature-map grids of conv-like outputs, and value histograms per layer."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hookscope._shared.histogram import DEFAULT_BINS, Histogram
from hookscope._shared.options import renamed
from hookscope._shared.thinning import DEFAULT_MAX_SITES, spread
from hookscope.errors import SpecError
from hookscope.plots.figure import grid, literal, new_figure, short_label

if TYPE_CHECKING:
    from hookscope._core.select import Selector
    from hookscope._trace.result import Trace

__all__ = ["feature_maps", "histogram_grid", "histograms"]

_HISTOGRAM_COLUMNS = 4


def feature_maps(
    value: torch.Tensor | np.ndarray,
    max_channels: int = 32,
    *,
    sample: int = 0,
    title: str | None = None,
    cmap: str = "viridis",
) -> Any:
    """A grid of a conv-like output's channels, the most active first, on one shared colour bar.

    ``value`` is ``(C, H, W)`` or ``(N, C, H, W)`` (``sample`` picks the item of the batch),
    e.g. ``cache["conv1"]``. Channels are ordered by their mean activation, highest first, and
    at most ``max_channels`` are drawn; each panel is titled with its channel index. One colour
    scale spans every panel, so a dim channel looks dim.

    Example::

        with hs.capture(model, "conv1") as cache:
            model(images)
        hs.plots.feature_maps(cache["conv1"], max_channels=16).savefig("conv1.png")
    """
    maps = _channel_maps(value, sample)
    if max_channels < 1:
        raise SpecError(f"max_channels={max_channels}; expected at least 1")
    activity = np.nan_to_num(maps.mean(axis=(1, 2)), nan=-np.inf)
    order = np.argsort(-activity, kind="stable")[:max_channels]
    shown = maps[order]
    finite = shown[np.isfinite(shown)]
    low, high = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    columns = math.ceil(math.sqrt(len(order)))
    rows = math.ceil(len(order) / columns)
    fig = new_figure(1.3 * columns + 1.2, 1.3 * rows + 0.6)
    axes = grid(fig, len(order), columns)
    image = None
    for ax, channel, plane in zip(axes, order, shown, strict=True):
        image = ax.imshow(plane, cmap=cmap, vmin=low, vmax=high if high > low else low + 1e-12)
        ax.set_title(f"ch {int(channel)}", fontsize=7)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.colorbar(image, ax=axes, shrink=0.8)
    count = maps.shape[0]
    fig.suptitle(
        (literal(title) + ": " if title else "") + f"{len(order)} of {count} channels, most active first", fontsize=9
    )
    return fig


def histograms(
    source: Trace | Mapping[str, torch.Tensor] | Sequence[tuple[str, Histogram]],
    layers: Selector | Sequence[str] | None = None,
    *,
    bins: int = DEFAULT_BINS,
    log: bool = False,
    max_sites: int = DEFAULT_MAX_SITES,
    sites: Selector | Sequence[str] | None = None,
) -> Any:
    """The distribution of values per layer: one panel per site, in the model's order.

    ``source`` is a trace taken with ``histograms=True`` (its histograms were counted on the
    device) or a capture (``Cache``, or any mapping of names to tensors: the values are
    counted here), or ``(label, Histogram)`` pairs already counted, drawn as given. ``layers``
    (formerly ``sites``) picks what to draw: a selector for a trace, keys for a capture;
    by default every layer with values, thinned to ``max_sites`` spread from first to last.
    ``log=True`` puts the counts on a log axis, where a few outliers stay visible.

    Example::

        t = hs.trace(model, x, histograms=True)
        hs.plots.histograms(t, layers="layer*", log=True).savefig("histograms.png")
    """
    layers = renamed(layers, sites, new_name="layers", old_name="sites", where="hs.plots.histograms")
    if isinstance(source, (list, tuple)):
        if layers is not None:
            raise SpecError("layers= picks from a trace or a capture; (label, Histogram) pairs are drawn as given")
        return histogram_grid(source, log=log)
    traced = _is_trace(source)
    named = _trace_histograms(source, layers) if traced else _cache_histograms(source, layers, bins)  # type: ignore[arg-type]
    if not named:
        raise SpecError("no values to draw: the chosen sites hold no tensor with a finite value")
    return histogram_grid(spread(named, max_sites) if sites is None else named, log=log)


def histogram_grid(named: Sequence[tuple[str, Histogram]], *, log: bool = False) -> Any:
    """One panel per ``(label, histogram)``, four to a row: what :func:`histograms` draws."""
    if not named:
        raise SpecError("no histograms to draw")
    fig = new_figure(
        2.6 * min(_HISTOGRAM_COLUMNS, len(named)) + 0.4, 1.9 * math.ceil(len(named) / _HISTOGRAM_COLUMNS) + 0.5
    )
    axes = grid(fig, len(named), _HISTOGRAM_COLUMNS)
    for ax, (label, histogram) in zip(axes, named, strict=True):
        _draw_histogram(ax, histogram, log)
        ax.set_title(short_label(label), fontsize=7)
        ax.tick_params(which="both", labelsize=6)
    fig.suptitle("value distributions" + (" (log counts)" if log else ""), fontsize=9)
    return fig


def _channel_maps(value: torch.Tensor | np.ndarray, sample: int) -> np.ndarray:
    array = value.detach().float().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value, float)
    if array.ndim == 4:
        if not -array.shape[0] <= sample < array.shape[0]:
            raise SpecError(f"sample={sample} is outside the batch of {array.shape[0]}")
        array = array[sample]
    if array.ndim != 3:
        raise SpecError(
            f"feature maps need a (C, H, W) or (N, C, H, W) value; got shape {tuple(array.shape)}; "
            "for other outputs draw hs.plots.histograms instead"
        )
    return array


def _is_trace(source: object) -> bool:
    return hasattr(source, "rows") and hasattr(source, "first_nonfinite")


def _trace_histograms(trace: Trace, sites: Selector | Sequence[str] | None) -> list[tuple[str, Histogram]]:
    if not trace.meta.get("histogram_bins"):
        raise SpecError(
            "this trace holds statistics, not histograms: take it with hs.trace(model, x, histograms=True), "
            "or pass a capture of the layers"
        )
    rows = trace.rows if sites is None else trace.select(sites)  # type: ignore[arg-type]
    named = []
    for row in rows:
        main = row.output
        if row.name and main is not None and main.histogram is not None and main.histogram.counted:
            named.append((row.site, main.histogram))
    return named


def _cache_histograms(
    cache: Mapping[str, torch.Tensor], sites: Sequence[str] | None, bins: int
) -> list[tuple[str, Histogram]]:
    if isinstance(sites, str):
        sites = [sites]
    keys = list(cache) if sites is None else list(sites)
    named = []
    for key in keys:
        tensor = cache[key]
        if not isinstance(tensor, torch.Tensor) or tensor.is_complex() or tensor.layout != torch.strided:
            continue
        values = tensor.detach().reshape(-1).to(torch.float64).cpu().numpy()
        values = values[np.isfinite(values)]
        if values.size:
            counts, edges = np.histogram(values, bins=bins)
            bounds = float(edges[0]), float(edges[-1])
            named.append((key, Histogram(*bounds, tuple(int(c) for c in counts), tensor.numel())))
    return named


def _draw_histogram(ax: Any, histogram: Histogram, log: bool) -> None:
    low, high = histogram.low, histogram.high
    if high > low:
        ax.stairs(np.asarray(histogram.counts), histogram.edges, fill=True, color="#3182bd")
    else:  # one value only: one bar of a visible width
        ax.bar([low], [histogram.counted], width=max(abs(low) * 0.05, 1e-3), color="#3182bd")
    if log:
        ax.set_yscale("log")
    else:
        ax.set_yticks([])  # counts depend on the sample size; the shape is what matters
    if histogram.counted < histogram.total:
        ax.text(
            0.98,
            0.95,
            f"{histogram.counted:,} of {histogram.total:,}",
            transform=ax.transAxes,
            ha="right",
            va="top",
            fontsize=5,
            color="#555",
        )

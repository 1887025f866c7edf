"""Gradient plots: the flow through the layers at one step, and norms over steps."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from hookscope._monitor.recorded import Recorded, recorded_steps
from hookscope._monitor.records import MonitorStep as GradStep
from hookscope.errors import SpecError
from hookscope.plots.figure import depth_figure, label_layers, literal, new_figure

__all__ = ["grad_flow", "grad_history"]

_MAX_LINES = 8


def _steps(source: Recorded) -> list[GradStep]:
    return recorded_steps(source, argument="the plot's source")


def grad_flow(source: Recorded, *, step: int | None = None, what: str = "grad_output") -> Any:
    """Mean and max ``|g|`` per layer at one recorded step (the latest by default), log scale.

    Layers run left to right in forward order; a layer whose gradient held a NaN/Inf is marked
    with a red cross at the top. ``what`` is ``grad_output`` (default), ``grad_input`` or
    ``param``.

    Example::

        grad_flow(monitor).savefig("grad_flow.png")
    """
    steps = _steps(source)
    chosen = steps[-1] if step is None else next((s for s in steps if s.step == step), None)
    if chosen is None:
        raise SpecError(f"step {step} was not recorded; recorded steps: {[s.step for s in steps][:20]}")
    records = [r for r in chosen.of(what) if r.path in ("", "[0]") or r.what == "param"]  # type: ignore[arg-type]
    if not records:
        raise SpecError(f"step {chosen.step} has no {what} records; try what='param' or 'grad_output'")
    labels = [record.column for record in records]
    positions = list(range(len(records)))
    fig = depth_figure(len(records), 4.5, per_layer=0.28)
    ax = fig.add_subplot()
    finite = [r.finite for r in records]
    ax.bar(positions, [_positive(r.max_abs) for r in records], color="#9ecae1", label="max |g|")
    ax.bar(positions, [_positive(r.mean_abs) for r in records], color="#3182bd", label="mean |g|")
    ax.set_yscale("log")
    shown = [v for r in records for v in (r.mean_abs, r.max_abs) if math.isfinite(v) and v > 0]
    top = max(shown, default=1.0)
    ax.set_ylim(min(shown, default=top) / 2, top * 2)  # zeros and NaN are left out, not drawn at 1e-45
    bad = [p for p, ok in zip(positions, finite, strict=True) if not ok]
    if bad:
        ax.scatter(bad, [top] * len(bad), marker="x", color="red", zorder=3, label="NaN/Inf")
    label_layers(ax, labels, limit=48, fontsize=7)
    ax.set_ylabel("|gradient|")
    ax.set_title(f"gradient flow ({what}), step {chosen.step}")
    ax.legend(loc="best", fontsize=8)
    return fig


def grad_history(
    source: Recorded,
    *,
    layers: str | Sequence[str] | None = None,
    metric: str = "norm",
    what: str = "grad_output",
) -> Any:
    """One line per layer: ``metric`` (``norm``, ``mean_abs``, ``max_abs``, ``ratio``) over the
    recorded steps, log scale. ``layers`` names them as a capture's keys do (``"fc"``,
    ``"h.0#0"``, ``"h.0:output[0]"``), or by parameter name with ``what="param"``
    (``"fc.weight"``); by default up to 8 spread evenly from first to last. A name that was not
    recorded raises :class:`~hookscope.SiteNotFoundError` naming the closest ones."""
    from hookscope._monitor.records import history_frame, named_columns

    frame = history_frame(_steps(source), metric, what)
    if frame.empty:
        raise SpecError(f"no {what} records to plot")
    columns = list(frame.columns)
    if layers is None:
        stride = max(1, math.ceil(len(columns) / _MAX_LINES))
        chosen = columns[::stride]
    else:
        if isinstance(layers, str):
            layers = [layers]
        chosen = list(dict.fromkeys(named_columns(_steps(source), layers, what)))
    fig = new_figure(7.0, 4.5)
    ax = fig.add_subplot()
    for column in chosen:
        values = frame[column].where(frame[column] > 0)  # zeros cannot sit on a log axis: gaps
        ax.plot(frame.index, values, marker="o", markersize=3, label=literal(column))
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.set_title(f"{what} {metric} over steps")
    ax.legend(loc="best", fontsize=7)
    return fig


def _positive(value: float) -> float:
    return value if math.isfinite(value) and value > 0 else math.nan  # no bar

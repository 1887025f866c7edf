"""What each part of a report shows, as plain data for the template (every string escaped there)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from hookscope._core.names import module_label
from hookscope._core.params import count, own_count
from hookscope._monitor import GradStep
from hookscope._shared.dtypes import dtype_name
from hookscope._shared.shapes import format_shape
from hookscope._shared.stats import Stats
from hookscope._shared.units import format_number
from hookscope._trace import TensorInfo, Trace, TraceRow

__all__ = ["COLUMNS", "Column", "details", "feature_map_rows", "overview", "param_rows", "table_rows"]

_MAX_CLASSES = 12


@dataclass(frozen=True)
class Column:
    """A column of the trace table: its key, header, and how it sorts (``num`` or ``text``)."""

    key: str
    label: str
    type: str


COLUMNS = (
    Column("order", "#", "num"),
    Column("name", "module", "text"),
    Column("class", "class", "text"),
    Column("call", "call", "num"),
    Column("shape", "output", "text"),
    Column("dtype", "dtype", "text"),
    Column("min", "min", "num"),
    Column("max", "max", "num"),
    Column("mean", "mean", "num"),
    Column("std", "std", "num"),
    Column("zeros", "zeros", "num"),
    Column("nonfinite", "NaN/Inf", "num"),
    Column("params", "params", "num"),
)


def overview(model: nn.Module, trace: Trace) -> dict[str, Any]:
    """The model card: classes, parameter counts, dtypes, devices, and the root call's tensors."""
    parameters = list(model.parameters())
    classes: Counter[str] = Counter()
    params_by_class: Counter[str] = Counter()
    modules = list(model.modules())
    for module in modules:
        name = type(module).__name__
        classes[name] += 1
        params_by_class[name] += own_count(module)
    ranked = classes.most_common(_MAX_CLASSES)
    root = next((row for row in trace.rows if row.name == ""), None)
    wall = trace.meta.get("wall_ms")
    return {
        "model_class": type(model).__name__,
        "params": count(parameters),
        "trainable": count(p for p in parameters if p.requires_grad),
        "param_dtypes": ", ".join(sorted({dtype_name(p.dtype) for p in parameters})) or "none",
        "devices": ", ".join(sorted({str(p.device) for p in parameters})) or "none",
        "modules": len(modules),
        "modules_called": len({row.name for row in trace.rows}),
        "calls": len(trace.rows),
        "mode": "training" if model.training else "eval",
        "wall_ms": f"{wall:.1f} ms with tracing" if isinstance(wall, float) else "",
        "inputs": [_tensor_card(info) for info in (root.inputs if root else ())],
        "outputs": [_tensor_card(info) for info in (root.outputs if root else ())],
        "classes": [{"name": n, "count": c, "params": params_by_class[n]} for n, c in ranked],
        "more_classes": max(0, len(classes) - _MAX_CLASSES),
    }


def table_rows(trace: Trace) -> list[dict[str, Any]]:
    """One entry per call: its cells (text and sort key) and whether it held a NaN/Inf."""
    return [_table_row(row) for row in trace.rows]


def details(trace: Trace) -> list[dict[str, Any]]:
    """What a row shows when it is opened: every input and output tensor, and a histogram."""
    return [
        {
            "site": row.site,
            "cls": row.class_name,
            "params": row.params,
            "status": row.status,
            "inputs": [_tensor_detail(info) for info in row.inputs],
            "outputs": [_tensor_detail(info) for info in row.outputs],
            "histogram": _histogram(row),
        }
        for row in trace.rows
    ]


def feature_map_rows(rows: Sequence[TraceRow]) -> list[TraceRow]:
    """The calls whose main output is conv-like: floating ``(N, C, H, W)`` with a real picture."""
    chosen = []
    for row in rows:
        main = row.output
        if main is None or main.stats is None or not main.dtype.startswith(("float", "bfloat")):
            continue
        if len(main.shape) == 4 and main.shape[2] >= 3 and main.shape[3] >= 3 and row.name:
            chosen.append(row)
    return chosen


def param_rows(step: GradStep) -> list[dict[str, Any]]:
    """One entry per parameter gradient of ``step``, in the model's order."""
    return [
        {
            "name": record.path,
            "norm": format_number(record.norm),
            "ratio": format_number(record.ratio),
            "max_abs": format_number(record.max_abs),
            "bad": not record.finite,
        }
        for record in step.of("param")
    ]


def _tensor_card(info: TensorInfo) -> dict[str, str]:
    return {"leaf": info.label, "shape": format_shape(info.shape), "dtype": info.dtype}


def _table_row(row: TraceRow) -> dict[str, Any]:
    main = row.output
    stats = row.stats
    bad = row.output_finite is False or row.status == "raised"
    nonfinite = None if stats is None else stats.nan + stats.inf
    indent = "  " * row.depth
    cells = [
        _cell(str(row.order), row.order, "num"),
        _cell(indent + module_label(row.name), None, "name"),
        _cell(row.class_name),
        _cell(str(row.call), row.call, "num"),
        _cell("" if main is None else format_shape(main.shape)),
        _cell("" if main is None else main.dtype),
        *(_stat_cell(stats, field) for field in ("min", "max", "mean", "std")),
        _cell("" if stats is None else f"{stats.zero_frac:.1%}", None if stats is None else stats.zero_frac, "num"),
        _cell("" if nonfinite is None else str(nonfinite), nonfinite, "num"),
        _cell(f"{row.params:,}" if row.params else "", row.params, "num"),
    ]
    return {"cells": cells, "bad": bad, "search": f"{module_label(row.name)} {row.class_name}".lower()}


def _cell(text: str, sort: float | None = None, cls: str = "") -> dict[str, Any]:
    key: float | str | None = sort
    if isinstance(sort, float) and not math.isfinite(sort):  # as JavaScript's parseFloat spells them
        key = None if math.isnan(sort) else ("Infinity" if sort > 0 else "-Infinity")  # NaN: sorts as missing
    return {"text": text, "sort": key, "cls": cls}


def _stat_cell(stats: Stats | None, field: str) -> dict[str, Any]:
    value = None if stats is None else float(getattr(stats, field))
    return _cell(format_number(value), value, "num")


def _tensor_detail(info: TensorInfo) -> dict[str, Any]:
    stats = info.stats
    measured = (
        {}
        if stats is None
        else {
            "min": format_number(stats.min),
            "max": format_number(stats.max),
            "mean": format_number(stats.mean),
            "std": format_number(stats.std),
            "abs_mean": format_number(stats.abs_mean),
            "zeros": f"{stats.zero_frac:.1%}",
            "nan": stats.nan,
            "inf": stats.inf,
        }
    )
    return {
        "leaf": info.label,
        "shape": format_shape(info.shape),
        "dtype": info.dtype,
        "device": info.device,
        "source": info.source,
        "stats": measured,
    }


def _histogram(row: TraceRow) -> dict[str, Any] | None:
    main = row.output
    histogram = None if main is None else main.histogram
    if histogram is None or not histogram.counted:
        return None
    return {
        "low": histogram.low,
        "high": histogram.high,
        "counts": list(histogram.counts),
        "counted": histogram.counted,
        "total": histogram.total,
    }

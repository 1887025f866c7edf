"""How a :class:`~hookscope._trace.result.Trace` looks: its table's columns and cells, flat records.

The table is drawn as text, HTML or for rich by :mod:`hookscope._shared.tables`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from hookscope._shared.shapes import format_shape
from hookscope._shared.stats import Stats
from hookscope._shared.tables import Column, Table
from hookscope._shared.units import format_bytes, format_number
from hookscope._trace.rows import NonFiniteRow, TensorInfo, TraceRow
from hookscope.errors import SpecError


class Trace(Protocol):
    """What drawing reads of a :class:`~hookscope._trace.result.Trace`: its rows, meta and verdicts.

    A protocol rather than the class, so that this module (which the class draws itself with)
    does not import it back.
    """

    rows: list[TraceRow]
    meta: dict[str, Any]

    @property
    def failure(self) -> TraceRow | None: ...

    def first_nonfinite(self) -> NonFiniteRow | None: ...


__all__ = ["COLUMNS", "flat_record", "footer", "leaf_records", "table"]

_MAX_LEAVES_SHOWN = 2


def _shapes(infos: Sequence[TensorInfo], *, keyword: bool) -> str:
    shown = []
    for info in infos[:_MAX_LEAVES_SHOWN]:
        text = format_shape(info.shape)
        if keyword and info.path.startswith("['"):  # a keyword input: name it
            text = f"{info.path[2:].split(chr(39), 1)[0]}={text}"
        shown.append(text)
    more = len(infos) - _MAX_LEAVES_SHOWN
    return ", ".join(shown) + (f" +{more}" if more > 0 else "")


def _stat(field: str) -> Callable[[TraceRow], str]:
    def cell(row: TraceRow) -> str:
        stats = row.stats
        return "" if stats is None or stats.count == 0 else format_number(getattr(stats, field))

    return cell


def _zeros(row: TraceRow) -> str:
    stats = row.stats
    return "" if stats is None or stats.count == 0 else f"{100 * stats.zero_frac:.1f}%"


def _nonfinite(row: TraceRow) -> str:
    counts = [(info.stats.nan, info.stats.inf) for info in row.outputs if info.stats is not None]
    nan, inf = sum(c[0] for c in counts), sum(c[1] for c in counts)
    if not counts:
        return ""
    return "-" if nan == inf == 0 else f"{nan:,}/{inf:,}"


def _module(row: TraceRow, repeated: set[str]) -> str:
    label = row.called_as(numbered=row.name in repeated)  # an op site's row: its module's, then the op
    if row.status == "raised":
        label += " !"
    return "  " * row.depth + label


# key: (header, cell, right-aligned)
COLUMNS: dict[str, tuple[str, Callable[[TraceRow], str], bool]] = {
    "order": ("#", lambda row: str(row.order), True),
    "module": ("module", lambda row: row.called_as(numbered=False), False),  # indented by _module below
    "class": ("class", lambda row: row.class_name, False),
    "call": ("call", lambda row: str(row.call), True),
    "inputs": ("inputs", lambda row: _shapes(row.inputs, keyword=True), False),
    "outputs": ("outputs", lambda row: _shapes(row.outputs, keyword=False), False),
    "dtype": ("dtype", lambda row: row.output.dtype if row.output is not None else "", False),
    "device": ("device", lambda row: row.output.device if row.output is not None else "", False),
    "params": ("params", lambda row: f"{row.params:,}" if row.params else "", True),
    "min": ("min", _stat("min"), True),
    "max": ("max", _stat("max"), True),
    "mean": ("mean", _stat("mean"), True),
    "std": ("std", _stat("std"), True),
    "abs_mean": ("mean|x|", _stat("abs_mean"), True),
    "zeros": ("zeros", _zeros, True),
    "nonfinite": ("nan/inf", _nonfinite, True),
    "time": ("ms", lambda row: "" if row.time_ms is None else f"{row.time_ms:.3f}", True),
    "self_time": ("self ms", lambda row: "" if row.self_ms is None else f"{row.self_ms:.3f}", True),
    "memory": ("peak mem", lambda row: "" if row.peak_bytes is None else format_bytes(row.peak_bytes), True),
}
_STAT_COLUMNS = ("min", "max", "mean", "std", "abs_mean", "zeros", "nonfinite")


def default_columns(rows: Sequence[TraceRow], stats: object = True) -> list[str]:
    """What a table shows unless told: statistics when there are any (those ``stats``, the trace's
    ``meta["stats"]``, chose), time and memory when measured."""
    columns = ["order", "module", "class", "inputs", "outputs", "dtype", "params"]
    if any(row.stats is not None for row in rows):
        chosen = set(stats) | {"nonfinite"} if isinstance(stats, (list, tuple)) else set(_STAT_COLUMNS)
        columns += [column for column in _STAT_COLUMNS if column in chosen]
    if any(row.time_ms is not None for row in rows):
        columns += ["time", "self_time"]
    if any(row.peak_bytes is not None for row in rows):
        columns.append("memory")
    return columns


def _columns(rows: Sequence[TraceRow], columns: Sequence[str] | None, stats: object) -> list[str]:
    if columns is None:
        return default_columns(rows, stats)
    chosen = [columns] if isinstance(columns, str) else list(columns)
    unknown = [key for key in chosen if key not in COLUMNS]
    if unknown or not chosen:
        raise SpecError(f"columns {unknown or chosen!r}: expected keys among {', '.join(COLUMNS)}")
    return chosen


def _cells(trace: Trace, rows: Sequence[TraceRow], keys: list[str]) -> list[list[str]]:
    counts: dict[str, int] = {}
    for row in trace.rows:
        if not row.op:  # a module called once keeps its plain name, whatever ops it ran
            counts[row.name] = counts.get(row.name, 0) + 1
    repeated = {name for name, n in counts.items() if n > 1}
    return [[_module(row, repeated) if key == "module" else COLUMNS[key][1](row) for key in keys] for row in rows]


def footer(trace: Trace, rows: Sequence[TraceRow]) -> list[str]:
    """The lines under the table: counts, the first non-finite call, a failure."""
    modules = len({row.name for row in trace.rows})
    calls = len(trace.rows)
    shown = f"{len(rows)} of {calls} calls shown" if len(rows) != calls else f"{calls} calls"
    ops = sum(1 for row in trace.rows if row.op)
    shown += f" ({ops} op call{'' if ops == 1 else 's'})" if ops else ""
    params = trace.meta.get("params", sum({r.name: r.params for r in trace.rows if not r.op}.values()))
    lines = [f"{shown} · {modules} modules · {params:,} parameters"]
    culprit = trace.first_nonfinite() if any(row.output_finite is False for row in trace.rows) else None
    if culprit is not None and culprit.from_input:
        lines.append(f"first NaN/Inf: no call made it; it came in with {culprit.label} of {culprit.site}")
    elif culprit is not None:
        lines.append(f"first NaN/Inf: made by {culprit.site} ({culprit.class_name}) from finite inputs")
    failure = trace.failure
    if failure is not None:
        lines.append(f"the forward raised in {failure.site} ({failure.class_name}); rows marked ! did not return")
    return lines


def table(trace: Trace, rows: Sequence[TraceRow], columns: Sequence[str] | None) -> Table:
    """``rows`` as a :class:`~hookscope._shared.tables.Table`, the footer as its notes; rows
    with NaN/Inf outputs or that raised are marked (red on a console, tinted in HTML)."""
    keys = _columns(rows, columns, trace.meta.get("stats", True))
    headers = [Column(COLUMNS[key][0], "right" if COLUMNS[key][2] else "left") for key in keys]
    shown = Table(headers, notes=footer(trace, rows))
    for row, cells in zip(rows, _cells(trace, rows, keys), strict=True):
        shown.add(*cells, bad=row.output_finite is False or row.status == "raised")
    return shown


def _stats_columns(stats: Stats | None) -> dict[str, Any]:
    fields = ("count", "min", "max", "mean", "std", "abs_mean", "zero_frac", "nan", "posinf", "neginf")
    return {field: (None if stats is None else getattr(stats, field)) for field in fields}


def flat_record(row: TraceRow) -> dict[str, Any]:
    """One call as a flat dict: identity, shapes as text, the main output's statistics, timing."""
    main = row.output
    return {
        "order": row.order,
        "depth": row.depth,
        "name": row.name,
        "class": row.class_name,
        "call": row.call,
        "op": row.op,
        "parent": row.parent,
        "finished": row.finished,
        "status": row.status,
        "params": row.params,
        "inputs": "; ".join(info.describe() for info in row.inputs),
        "outputs": "; ".join(info.describe() for info in row.outputs),
        "dtype": None if main is None else main.dtype,
        "device": None if main is None else main.device,
        **_stats_columns(row.stats),
        "time_ms": row.time_ms,
        "self_ms": row.self_ms,
        "peak_bytes": row.peak_bytes,
    }


def leaf_records(rows: Sequence[TraceRow]) -> list[dict[str, Any]]:
    """One dict per output tensor of every call, with where it sat (``what`` and the relative
    ``path``) and its statistics."""
    return [
        {
            "order": row.order,
            "name": row.name,
            "class": row.class_name,
            "call": row.call,
            "op": row.op,
            "what": info.what,
            "path": info.path,
            "shape": format_shape(info.shape),
            "dtype": info.dtype,
            "device": info.device,
            **_stats_columns(info.stats),
        }
        for row in rows
        for info in row.outputs
    ]

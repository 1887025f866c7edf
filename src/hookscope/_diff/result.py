"""``Diff``: per site and call, how far model b's values are from model a's, and where they part."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

from hookscope._core.names import call_label, leaf_label
from hookscope._core.site_index import SiteIndex
from hookscope._core.sites import Site
from hookscope._diff.metrics import Metrics
from hookscope._shared.blame import findings
from hookscope._shared.csv_text import csv_text
from hookscope._shared.files import write_text
from hookscope._shared.optional import require
from hookscope._shared.shapes import format_shape
from hookscope._shared.tables import Column, Table
from hookscope._shared.units import counted, format_number

__all__ = ["Diff", "DiffRow", "Divergence", "LeafDiff"]


@dataclass(frozen=True)
class LeafDiff:
    """One input tensor of a compared call: its metrics, or a note saying why there are none.

    ``path`` is its place relative to the call's input (``"[0]"``, ``"['mask']"``); ``what`` is
    always ``"input"``, and :attr:`label` shows both (``input[0]``).
    """

    path: str
    shape_a: tuple[int, ...] | None
    shape_b: tuple[int, ...] | None
    metrics: Metrics | None
    note: str | None = None
    what: str = "input"

    @property
    def label(self) -> str:
        """The leaf as shown: ``input[0]``, ``input['mask']``."""
        return leaf_label(self.what, self.path)

    def within(self, *, rtol: float, atol: float) -> bool:
        """Compared and within tolerance (a leaf with a note, such as differing shapes, is not)."""
        return self.note is None and self.metrics is not None and self.metrics.within(rtol=rtol, atol=atol)


@dataclass(frozen=True)
class DiffRow:
    """One output tensor of one call, a against b, in the order b's outputs were made.

    ``name`` is the module in a, ``name_b`` in b (they differ when matched by a mapping or
    by order); ``path`` is the leaf's place relative to the output (``""`` for a tensor,
    ``"[0]"``, ``".logits"``), ``what`` is always ``"output"``, and :attr:`label` shows both.
    ``metrics`` is None when the values could not be compared; ``note`` says why (``shapes
    differ``, ``only in a``, ``only in b``). ``inputs`` holds the call's input tensors, to tell
    a layer that made a difference from one that was handed it.
    """

    order: int
    name: str
    name_b: str
    call: int
    class_name: str
    class_b: str
    path: str
    shape: tuple[int, ...] | None
    shape_b: tuple[int, ...] | None
    dtype: str | None
    dtype_b: str | None
    metrics: Metrics | None
    note: str | None
    inputs: tuple[LeafDiff, ...]
    what: str = "output"

    @property
    def label(self) -> str:
        """The leaf as shown: ``output``, ``output[0]``, ``output.logits``."""
        return leaf_label(self.what, self.path)

    @property
    def site(self) -> str:
        """``name#call``, with ``:`` and the :attr:`label` for a leaf of a structured output."""
        base = f"{call_label(self.name, self.call)}"
        return base + (f":{self.label}" if self.path else "")

    def within(self, *, rtol: float, atol: float) -> bool:
        """Compared and within tolerance; a row with a note (differing shapes) is a divergence."""
        return self.note is None and self.metrics is not None and self.metrics.within(rtol=rtol, atol=atol)

    def inputs_within(self, *, rtol: float, atol: float) -> bool | None:
        """True when every input tensor of the call was within tolerance; None when it had none."""
        if not self.inputs:
            return None
        return all(leaf.within(rtol=rtol, atol=atol) for leaf in self.inputs)

    @property
    def input_max_abs(self) -> float | None:
        """The largest max|a - b| over the call's inputs (None without compared inputs)."""
        values = [leaf.metrics.max_abs for leaf in self.inputs if leaf.metrics is not None]
        return max(values) if values else None

    def to_dict(self) -> dict[str, Any]:
        """A flat dict: identity, shapes, the metrics as columns, and the inputs' worst difference."""
        metrics = self.metrics
        return {
            "order": self.order,
            "name": self.name,
            "name_b": self.name_b,
            "call": self.call,
            "class": self.class_name,
            "what": self.what,
            "path": self.path,
            "shape": None if self.shape is None else format_shape(self.shape),
            "shape_b": None if self.shape_b is None else format_shape(self.shape_b),
            "dtype": self.dtype,
            "dtype_b": self.dtype_b,
            "max_abs": None if metrics is None else metrics.max_abs,
            "mean_abs": None if metrics is None else metrics.mean_abs,
            "relative": None if metrics is None else metrics.relative,
            "cosine": None if metrics is None else metrics.cosine,
            "sqnr_db": None if metrics is None else metrics.sqnr_db,
            "input_max_abs": self.input_max_abs,
            "note": self.note,
        }


@dataclass(frozen=True)
class Divergence:
    """Where a and b first part: the row, and whether its inputs still agreed."""

    row: DiffRow
    inputs_within: bool | None
    rtol: float
    atol: float
    inputs_compared: bool = True

    @property
    def introduced(self) -> bool | None:
        """True when this layer's inputs were within tolerance (or it takes none): the layer made
        the difference; False when they already differed; None when inputs were not compared
        (captures taken without ``keep="both"``)."""
        if not self.inputs_compared:
            return None
        return self.inputs_within is not False

    def __str__(self) -> str:
        row, metrics = self.row, self.row.metrics
        what = row.note if metrics is None or row.note else _describe(metrics)
        kind = f" ({row.class_name})" if row.class_name else ""
        where = f"{row.site}{kind}" + (f" = b's {row.name_b}" if row.name_b != row.name else "")
        if not self.inputs_compared:
            cause = "inputs were not compared (capture with keep='both' to compare them)"
        elif self.inputs_within is None:
            cause = "it takes no tensor input"
        elif self.inputs_within:
            cause = "its inputs were within tolerance: this layer introduced the difference"
        else:
            cause = f"its inputs already differed (max|a-b| {_number(row.input_max_abs)}): the difference came in"
        return f"first divergence at {where}: {what}; {cause}"


class Diff(Sequence[DiffRow]):
    """The comparison of two models (or two captures), one row per output tensor of each call.

    ``diff.first_divergence()`` is where they first part; ``print(diff)`` the table;
    :meth:`to_pandas`, and an HTML table in Jupyter. ``only_a`` and ``only_b`` name the calls
    that had no counterpart. Tolerances default to those ``hs.diff`` was given.
    """

    def __init__(
        self,
        rows: list[DiffRow],
        *,
        rtol: float,
        atol: float,
        only_a: list[str],
        only_b: list[str],
        meta: dict[str, Any] | None = None,
    ) -> None:
        self.rows = rows
        self.rtol = rtol
        self.atol = atol
        self.only_a = only_a
        self.only_b = only_b
        self.meta = dict(meta or {})

    def __len__(self) -> int:
        return len(self.rows)

    @overload
    def __getitem__(self, key: int) -> DiffRow: ...
    @overload
    def __getitem__(self, key: slice) -> list[DiffRow]: ...
    @overload
    def __getitem__(self, key: str) -> DiffRow: ...
    def __getitem__(self, key: int | slice | str) -> DiffRow | list[DiffRow]:
        if isinstance(key, str):
            for row in self.rows:
                if key in (row.name, row.site, f"{row.name}#{row.call}"):
                    return row
            return self._by_site(key)
        return self.rows[key]

    def _by_site(self, key: str) -> DiffRow:
        """The row ``key`` names in any spelling a capture's key takes (``"fc:output"``,
        ``"h.0#1:output[0]"``, ``"(root)"``), its first call when it names none; a miss raises
        ``SiteNotFoundError`` with the closest compared names."""
        rows: dict[Site, DiffRow] = {}
        for row in self.rows:
            rows.setdefault(Site(row.name, row.call, "output", row.path), row)
        index = SiteIndex(rows, verb="compared", empty_hint="nothing was compared", default_call="first")
        return rows[index.resolve(key)]

    def __iter__(self) -> Iterator[DiffRow]:
        return iter(self.rows)

    def _tolerance(self, rtol: float | None, atol: float | None) -> tuple[float, float]:
        return (self.rtol if rtol is None else rtol), (self.atol if atol is None else atol)

    def first_divergence(self, *, rtol: float | None = None, atol: float | None = None) -> Divergence | None:
        """The first site, in the order b made its outputs, out of tolerance (None: all within).

        Within means ``max|a - b| <= atol + rtol * max|a|`` for the tensor; a site whose shapes
        differ is out. The result says, by the blame rule of :mod:`hookscope._shared.blame`,
        whether that call's inputs were still within tolerance (this layer introduced the
        difference; also when it takes no tensor) or already differed (it came in). Unlike a
        NaN, a difference that came in is still where the two models part, so it is returned.
        """
        rtol, atol = self._tolerance(rtol, atol)
        found = next(
            findings(
                self.rows,
                output_fine=lambda row: row.within(rtol=rtol, atol=atol),
                inputs_fine=lambda row: row.inputs_within(rtol=rtol, atol=atol) is not False,
            ),
            None,
        )
        if found is None:
            return None
        row = found.call
        inputs = None if not row.inputs else found.introduced  # no tensor input: neither
        return Divergence(row, inputs, rtol, atol, inputs_compared=self.meta.get("inputs", True))

    def within(self, *, rtol: float | None = None, atol: float | None = None) -> bool:
        """True when every compared site is within tolerance and none is missing on either side."""
        return self.first_divergence(rtol=rtol, atol=atol) is None and not self.only_a and not self.only_b

    def records(self) -> list[dict[str, Any]]:
        """One flat dict per row, with ``within`` at the diff's tolerances."""
        return [{**row.to_dict(), "within": row.within(rtol=self.rtol, atol=self.atol)} for row in self.rows]

    def to_pandas(self) -> Any:
        """The :meth:`records` as a ``pandas.DataFrame``."""
        pd = require("pandas", purpose="to_pandas()", extra="pandas")
        return pd.DataFrame.from_records(self.records())

    def to_csv(self, path: str | os.PathLike[str] | None = None) -> str:
        """The :meth:`records` as CSV, one row per site; written to ``path`` (atomically) when given.

        Names are quoted and formula-like text is marked with ``'`` as in ``Trace.to_csv``
        (:mod:`hookscope._shared.csv_text`). Returns the text.

        >>> import torch, hookscope as hs
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> hs.diff(net, net, torch.ones(1, 2)).to_csv().splitlines()[0][:22]
        'order,name,name_b,call'
        """
        text = csv_text(self.records())
        if path is not None:
            write_text(path, text)
        return text

    # -- showing --------------------------------------------------------------------------------

    def _table(self) -> Table:
        """The rows as a :class:`~hookscope._shared.tables.Table`: a row out of tolerance is marked,
        the footer is its notes."""
        renamed = any(row.name_b != row.name for row in self.rows)
        names = ["site", *(["in b"] if renamed else []), "class", "shape"]
        numbers = ["max|a-b|", "mean|a-b|", "rel err", "cosine", "SQNR dB", "in max|a-b|", "ok"]
        columns = [Column("#", "right"), *map(Column, names), *(Column(header, "right") for header in numbers)]
        table = Table(columns, notes=self.footer())
        for row in self.rows:
            metrics = row.metrics
            measured = (
                [row.note or "", "", "", "", ""]
                if metrics is None or row.note
                else [
                    _number(metrics.max_abs),
                    _number(metrics.mean_abs),
                    _number(metrics.relative),
                    f"{metrics.cosine:.6f}" if math.isfinite(metrics.cosine) else _number(metrics.cosine),
                    f"{metrics.sqnr_db:.1f}" if math.isfinite(metrics.sqnr_db) else _number(metrics.sqnr_db),
                ]
            )
            within = row.within(rtol=self.rtol, atol=self.atol)
            cells = [str(row.order), row.site, *([row.name_b] if renamed else []), row.class_name]
            cells += [_shapes(row.shape, row.shape_b), *measured, _number(row.input_max_abs), "yes" if within else "NO"]
            table.add(*cells, bad=not within)
        return table

    def footer(self) -> list[str]:
        """The summary lines under the table."""
        within = sum(row.within(rtol=self.rtol, atol=self.atol) for row in self.rows)
        lines = [f"{counted(len(self.rows), 'site')} compared · {within} within rtol={self.rtol:g}, atol={self.atol:g}"]
        divergence = self.first_divergence()
        if divergence is not None:
            lines.append(str(divergence))
        elif self.only_a or self.only_b:
            lines.append(
                f"NOT within: every compared site is, but {len(self.only_a)} calls of a and {len(self.only_b)} "
                "of b have no counterpart"
            )
        else:
            lines.append("no divergence: every compared site is within tolerance")
        for label, names in (("only in a", self.only_a), ("only in b", self.only_b)):
            if names:
                shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
                lines.append(f"{label}: {shown}")
        return lines

    def table(self) -> str:
        """The aligned table and its footer, as text."""
        return self._table().text()

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        divergence = self.first_divergence()
        if divergence is not None:
            state = f"first divergence at {divergence.row.site}"
        elif self.only_a or self.only_b:  # within() is False: a call with no counterpart is a difference too
            state = f"NOT within: {len(self.only_a)} calls of a and {len(self.only_b)} of b have no counterpart"
        else:
            state = "all within tolerance"
        return (
            f"<Diff of {self.meta.get('a', 'a')} and {self.meta.get('b', 'b')}: {counted(len(self), 'site')}, {state}>"
        )

    def _repr_html_(self) -> str:
        return self._table().html()

    def __rich__(self) -> Any:
        return self._table().rich()


def _describe(metrics: Metrics) -> str:
    return (
        f"max|a-b| {_number(metrics.max_abs)}, relative error {_number(metrics.relative)}, "
        f"SQNR {_number(metrics.sqnr_db)} dB"
    )


def _shapes(a: tuple[int, ...] | None, b: tuple[int, ...] | None) -> str:
    if a == b and a is not None:
        return format_shape(a)
    return f"{'-' if a is None else format_shape(a)} vs {'-' if b is None else format_shape(b)}"


def _number(value: float | None) -> str:
    return format_number(value, digits=3, missing="-")

"""Every table hookscope shows, as plain text, HTML or a rich renderable, from one description.

A trace, a diff, a cache, a layer list, a gradient monitor and a feature store all print as
tables. They go through :class:`Table` so that they share one text format (the trace's: columns
three spaces apart, a rule under the header, notes below) and one escaping rule for HTML: a
module may be named ``<script>``, and no output path forgets to escape it.

rich is imported by :meth:`Table.rich` only, so ``import hookscope`` stays light.
"""

from __future__ import annotations

import html
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from hookscope.errors import SpecError

__all__ = ["Column", "Row", "Table"]

_GAP = "   "  # between columns: as rich's SIMPLE_HEAD box with one space of padding draws it
_RULE = "─"
_BAD_BACKGROUND = "#fdd"


@dataclass(frozen=True)
class Column:
    """One column: its header and on which side its cells line up (numbers: ``"right"``)."""

    header: str
    align: Literal["left", "right"] = "left"


@dataclass(frozen=True)
class Row:
    """The cells of one row, one per column, and whether the row is marked as bad."""

    cells: tuple[str, ...]
    bad: bool = False


@dataclass
class Table:
    """Columns, rows of strings (some marked bad), a title line above and notes below.

    Why one class: six result types print tables; drawn here, they share one layout and one
    escaping rule. A table without rows shows only its title and notes: a header over nothing
    says less than the notes do.

    A cell is always shown on one line: a control character in it (a newline in a module's
    name) is written as its escape, ``\\n``, so it cannot break the alignment.

    >>> table = Table([Column("name"), Column("params", "right")], title="a model", notes=["2 modules"])
    >>> table.add("fc", "1,290")
    >>> table.add("<b>", "0", bad=True)
    >>> print(table.text())
    a model
    name   params
    ─────────────
    fc      1,290
    <b>         0
    2 modules
    >>> '<tr style="background:#fdd"><td style="text-align:left">&lt;b&gt;</td>' in table.html()
    True
    """

    columns: Sequence[Column]
    rows: list[Row] = field(default_factory=list)
    title: str | None = None
    notes: list[str] = field(default_factory=list)

    def add(self, *cells: str, bad: bool = False) -> None:
        """Append a row of one string per column; ``bad`` marks it (red on a console, tinted in HTML)."""
        if len(cells) != len(self.columns):
            raise SpecError(
                f"a row of {len(cells)} cells for a table of {len(self.columns)} columns; give one per column"
            )
        self.rows.append(Row(tuple(_one_line(cell) for cell in cells), bad))

    # -- the three ways to show it ------------------------------------------------------------------

    def text(self) -> str:
        """Plain text: aligned, as wide as its content (never wrapped), no colour.

        The layout is the one rich draws for a ``SIMPLE_HEAD`` table without edges, written
        here without rich so that ``str()`` of a result needs nothing but the standard library.
        """
        lines = [] if self.title is None else [self.title]
        if self.rows:
            headers = tuple(_one_line(column.header) for column in self.columns)
            widths = [max(map(_width, cells)) for cells in zip(headers, *(row.cells for row in self.rows), strict=True)]
            lines.append(self._line(headers, widths))
            lines.append(_RULE * (sum(widths) + len(_GAP) * (len(widths) - 1)))
            lines.extend(self._line(row.cells, widths) for row in self.rows)
        lines.extend(self.notes)
        return "\n".join(lines)

    def _line(self, cells: Sequence[str], widths: Sequence[int]) -> str:
        padded = []
        for cell, width, column in zip(cells, widths, self.columns, strict=True):
            space = " " * (width - _width(cell))
            padded.append(space + cell if column.align == "right" else cell + space)
        return _GAP.join(padded).rstrip()

    def html(self) -> str:
        """An HTML fragment: the title and notes as paragraphs, every cell escaped, bad rows tinted.

        Each cell says its alignment itself, as Jupyter's stylesheet right-aligns every cell;
        runs of spaces are kept (``&nbsp;``), so an indented module name stays indented.
        """
        parts = [] if self.title is None else [f"<p><b>{_html(self.title)}</b></p>"]
        if self.rows:
            aligns = [f' style="text-align:{column.align}"' for column in self.columns]
            head = "".join(f"<th{a}>{_html(c.header)}</th>" for a, c in zip(aligns, self.columns, strict=True))
            body = []
            for row in self.rows:
                tint = f' style="background:{_BAD_BACKGROUND}"' if row.bad else ""
                cells = "".join(f"<td{a}>{_html(cell)}</td>" for a, cell in zip(aligns, row.cells, strict=True))
                body.append(f"<tr{tint}>{cells}</tr>")
            parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>")
        parts.extend(f"<p>{_html(line)}</p>" for line in self.notes)
        return "".join(parts)

    def rich(self) -> Any:
        """A rich renderable for a console: the same table, with bad rows in red.

        Cells go in as ``rich.text.Text``, never as markup: a module named ``[bold]`` is shown
        as it is named.
        """
        from rich import box
        from rich.console import Group
        from rich.table import Table as RichTable
        from rich.text import Text

        parts: list[Any] = [] if self.title is None else [Text(self.title)]
        if self.rows:
            table = RichTable(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
            for column in self.columns:
                table.add_column(Text(column.header), justify=column.align, no_wrap=True)
            for row in self.rows:
                table.add_row(*(Text(cell) for cell in row.cells), style="red" if row.bad else None)
            parts.append(table)
        parts.extend(Text(line) for line in self.notes)
        return Group(*parts)


def _one_line(cell: str) -> str:
    """``cell`` with each non-printable character (newline, tab, escape) written as its escape."""
    if cell.isprintable():
        return cell
    return "".join(char if char.isprintable() else char.encode("unicode_escape").decode("ascii") for char in cell)


def _width(text: str) -> int:
    """Columns a terminal gives ``text``: wide (East Asian) characters two, combining marks none."""
    if text.isascii():
        return len(text)
    return sum(
        0 if unicodedata.combining(char) else 2 if unicodedata.east_asian_width(char) in "WF" else 1 for char in text
    )


def _html(text: str) -> str:
    """``text`` escaped for HTML (quotes too), with runs of spaces kept."""
    return html.escape(text).replace("  ", "&nbsp;&nbsp;")

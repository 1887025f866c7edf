"""The one table every result prints through: text as rich draws it, escaped HTML, marked rows."""

from __future__ import annotations

import copy
import html
import io
import re

import pytest
import torch
from rich import box
from rich.console import Console
from rich.table import Table as RichTable
from torch import nn

import hookscope as hs
from hookscope._shared.tables import Column, Table
from tests.models import track

SCRIPT = "<script>alert(1)</script>"


def make(
    rows: list[tuple[str, ...]],
    *,
    bad: frozenset[int] = frozenset(),
    title: str | None = None,
    notes: tuple[str, ...] = (),
) -> Table:
    """A table of ``#``, ``module`` and ``params`` (numbers right), the rows in ``bad`` marked."""
    table = Table([Column("#", "right"), Column("module"), Column("params", "right")], title=title, notes=list(notes))
    for index, cells in enumerate(rows):
        table.add(*cells, bad=index in bad)
    return table


def drawn_by_rich(headers: list[tuple[str, str]], rows: list[tuple[str, ...]]) -> str:
    """The text the trace printed before tables.py: rich, SIMPLE_HEAD, no edges, lines stripped."""
    table = RichTable(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for header, justify in headers:
        table.add_column(header, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for cells in rows:
        table.add_row(*cells)
    buffer = io.StringIO()
    Console(file=buffer, width=100_000, color_system=None, highlight=False, emoji=False).print(table)
    return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines()).strip("\n")


def rich_lines(renderable: object, *, width: int = 200) -> tuple[str, str]:
    """What a colour terminal shows: the plain text, and the text with its ANSI styles."""
    console = Console(file=io.StringIO(), record=True, width=width, color_system="truecolor", force_terminal=True)
    console.print(renderable)
    return console.export_text(clear=False), console.export_text(styles=True)


# -- text ----------------------------------------------------------------------------------------


def test_text_is_what_rich_draws_for_the_same_table() -> None:
    rows = [("0", "(root)", "0"), ("1", "  conv1", "448"), ("12", "  全結合", "1,290"), ("3", "  café", "")]
    expected = drawn_by_rich([("#", "right"), ("module", "left"), ("params", "right")], rows)
    assert make(rows).text() == expected


def test_columns_align_left_or_right_three_spaces_apart() -> None:
    lines = make([("0", "a", "7"), ("10", "bbbbbbbb", "1,234")]).text().splitlines()
    assert lines == [
        " #   module     params",
        "─" * 22,
        " 0   a               7",
        "10   bbbbbbbb    1,234",
    ]


def test_wide_characters_take_two_columns() -> None:
    lines = make([("0", "全結合", "1"), ("1", "abcdef", "2")]).text().splitlines()
    assert lines[2:] == ["0   全結合        1", "1   abcdef        2"]  # three wide characters: six columns


def test_a_300_character_cell_is_never_wrapped() -> None:
    long = "x" * 300
    lines = make([("0", long, "1")]).text().splitlines()
    assert len(lines) == 3
    assert lines[2] == f"0   {long}        1"  # "params" is six wide
    assert len(lines[1]) == len(lines[2])  # the rule spans the whole table


def test_control_characters_cannot_break_a_row() -> None:
    lines = make([("0", "a\nb\tc", "1")]).text().splitlines()
    assert len(lines) == 3
    assert lines[2] == "0   a\\nb\\tc        1"


def test_title_above_notes_below() -> None:
    text = make([("0", "a", "1")], title="Cache: 1 tensor", notes=("1 call", "first NaN/Inf: none")).text()
    assert text.splitlines() == [
        "Cache: 1 tensor",
        "#   module   params",
        "───────────────────",
        "0   a             1",
        "1 call",
        "first NaN/Inf: none",
    ]


def test_no_rows_shows_title_and_notes_only() -> None:
    table = make([], title="Cache: 0 tensors, 0 B", notes=("nothing kept",))
    assert table.text() == "Cache: 0 tensors, 0 B\nnothing kept"
    assert table.html() == "<p><b>Cache: 0 tensors, 0 B</b></p><p>nothing kept</p>"


def test_a_row_must_fill_every_column() -> None:
    with pytest.raises(ValueError, match="a row of 2 cells for a table of 3 columns"):
        make([("0", "a")])


# -- HTML ----------------------------------------------------------------------------------------


def test_html_escapes_every_cell_header_title_and_note() -> None:
    table = Table([Column(SCRIPT)], title=SCRIPT, notes=[SCRIPT])
    table.add(SCRIPT)
    page = table.html()
    assert "<script>" not in page
    assert page.count(html.escape(SCRIPT)) == 4
    assert "&quot;" in Table([Column("a")], title='say "hi"').html()


def test_html_marks_bad_rows_and_keeps_alignment_and_indentation() -> None:
    page = make([("0", "(root)", "0"), ("1", "  fc", "170")], bad=frozenset({1})).html()
    rows = re.findall(r"<tr[^>]*>.*?</tr>", page)
    assert len(rows) == 3  # the header and two rows
    assert rows[1].startswith("<tr><td")
    assert rows[2].startswith('<tr style="background:#fdd">')
    assert '<td style="text-align:right">170</td>' in rows[2]
    assert '<td style="text-align:left">&nbsp;&nbsp;fc</td>' in rows[2]
    assert '<th style="text-align:right">params</th>' in rows[0]


def test_html_title_and_notes_are_paragraphs_around_the_table() -> None:
    page = make([("0", "a", "1")], title="3 tensors", notes=("one", "two")).html()
    assert page.startswith("<p><b>3 tensors</b></p><table>")
    assert page.endswith("</table><p>one</p><p>two</p>")


# -- rich ----------------------------------------------------------------------------------------


def test_rich_shows_the_same_text_with_bad_rows_red() -> None:
    table = make([("0", "ok", "1"), ("1", "broken", "2")], bad=frozenset({1}), title="a title", notes=("a note",))
    plain, styled = rich_lines(table.rich())
    assert [line.rstrip() for line in plain.splitlines()] == table.text().splitlines()
    red = [line for line in styled.splitlines() if "\x1b[31m" in line]
    assert len(red) == 1
    assert "broken" in red[0]


def test_rich_shows_cells_as_written_not_as_markup() -> None:
    plain, _ = rich_lines(make([("0", "[bold]x[/bold]", "[red]")]).rich())
    assert "[bold]x[/bold]" in plain
    assert "[red]" in plain


def test_rich_does_not_wrap_a_long_cell() -> None:
    plain, _ = rich_lines(make([("0", "y" * 300, "1")]).rich(), width=400)
    assert len(plain.splitlines()) == 3


# -- every result goes through it ----------------------------------------------------------------


def scripted() -> nn.Module:
    model = track(nn.Sequential())
    model.add_module(SCRIPT, nn.Linear(2, 2))
    return model.eval()


@pytest.mark.slow
def test_a_module_named_script_is_escaped_in_every_html_view() -> None:
    model, x = scripted(), torch.randn(1, 2)
    _, cache = hs.run_with_capture(model, x, layers=[SCRIPT])
    pages = {
        "trace": hs.trace(model, x)._repr_html_(),
        "layers": hs.layers(model, x)._repr_html_(),
        "cache": cache._repr_html_(),
        "diff": hs.diff(model, copy.deepcopy(model), x)._repr_html_(),
    }
    for what, page in pages.items():
        assert "<script>" not in page, what
        assert html.escape(SCRIPT) in page, what


@pytest.mark.slow
def test_every_text_view_has_the_trace_layout() -> None:
    model, x = scripted(), torch.randn(1, 2)
    _, cache = hs.run_with_capture(model, x, layers=[SCRIPT])
    texts = {
        "trace": hs.trace(model, x).table(),
        "layers": str(hs.layers(model, x)),
        "cache": repr(cache).split("\n", 1)[1],  # below its title line
        "diff": hs.diff(model, copy.deepcopy(model), x).table(),
    }
    for what, text in texts.items():
        header, rule, *rows = text.splitlines()
        assert set(rule) == {"─"}, what
        assert "   " in header, what  # columns three spaces apart
        assert any(line.startswith(SCRIPT) or f"  {SCRIPT}" in line for line in rows), what

"""Progress where the user looks: a bar on a terminal (without colours under ``NO_COLOR``), a line
replaced in place in a notebook, plain lines without carriage returns elsewhere when asked for,
and nothing when not asked for off a terminal.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope._shared.progress import Progress, in_notebook
from tests.models import track

_COLOUR = re.compile(r"\x1b\[[0-9;]*(?:3[0-9]|9[0-7]|38;[0-9;]+)m")  # an SGR sequence that sets a colour


class Terminal(io.StringIO):
    """A stream that says it is a terminal, as a console's standard error does."""

    def isatty(self) -> bool:
        return True


@pytest.fixture
def colour_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "COLUMNS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")


def run(stream: io.StringIO | None, enabled: bool | None, total: int = 8) -> Progress:
    with Progress(total, enabled=enabled, label="<sweep>", unit="cells", interval=0, stream=stream) as bar:
        for _ in range(total):
            bar.advance(1)
    return bar


@pytest.mark.usefixtures("colour_terminal")
def test_a_terminal_gets_a_bar_drawn_in_place_in_colour() -> None:
    out = Terminal()
    assert run(out, None).mode == "bar"
    text = out.getvalue()
    assert "\x1b[" in text  # drawn with control sequences: redrawn in place, not line after line
    assert _COLOUR.search(text)
    assert "8/8" in text
    assert "<sweep>" in text


@pytest.mark.usefixtures("colour_terminal")
def test_no_color_draws_the_bar_without_colours(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NO_COLOR", "1")
    out = Terminal()
    run(out, True)
    text = out.getvalue()
    assert "8/8" in text
    assert _COLOUR.search(text) is None


def test_off_a_terminal_nothing_unless_asked_for() -> None:
    out = io.StringIO()
    assert run(out, None).mode == "off"
    assert out.getvalue() == ""
    terminal = Terminal()
    assert run(terminal, False).mode == "off"
    assert terminal.getvalue() == ""


def test_asked_for_off_a_terminal_plain_lines_without_animation() -> None:
    out = io.StringIO()
    assert run(out, True).mode == "plain"
    lines = out.getvalue().splitlines()
    assert len(lines) == 9  # one per advance (interval 0) and one at the end
    assert lines[3].startswith("<sweep>: 4/8 cells (50%), ")
    assert lines[-1].startswith("<sweep>: 8/8 cells (100%), ")
    assert ", done in 0:00:0" in lines[-1]
    assert "\r" not in out.getvalue()
    assert "\x1b" not in out.getvalue()


def test_plain_lines_are_spaced_by_the_interval() -> None:
    out = io.StringIO()
    with Progress(100, enabled=True, label="x", unit="rows", interval=3600, stream=out) as bar:
        for _ in range(100):
            bar.advance(1)
    assert len(out.getvalue().splitlines()) == 1  # the end's alone


def test_pytest_is_not_a_notebook() -> None:
    assert in_notebook() is False


class _Texts(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data: str) -> None:
        self.text += data


@pytest.fixture
def notebook(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[list[tuple[dict[str, Any], dict[str, Any]]]]:
    """An IPython shell that says a kernel runs it, its display messages recorded: what a
    Jupyter kernel's shell publishes to the notebook (no history kept, its files in ``tmp_path``)."""
    interactiveshell = pytest.importorskip("IPython.core.interactiveshell")
    from traitlets.config import Config

    monkeypatch.setenv("IPYTHONDIR", str(tmp_path))
    config = Config()
    config.HistoryManager.enabled = False
    shell = interactiveshell.InteractiveShell.instance(config=config)
    published: list[tuple[dict[str, Any], dict[str, Any]]] = []
    monkeypatch.setattr(shell, "kernel", object(), raising=False)
    monkeypatch.setattr(shell.display_pub, "publish", lambda data, metadata=None, **kw: published.append((data, kw)))
    try:
        yield published
    finally:
        interactiveshell.InteractiveShell.clear_instance()


def test_a_notebook_gets_one_line_replaced_in_place(notebook: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
    assert in_notebook()
    bar = run(None, True)  # the standard stream: the cell's output
    assert bar.mode == "notebook"
    first, *later = notebook
    assert first[1]["transient"]["display_id"]
    ids = {kw["transient"]["display_id"] for _, kw in notebook}
    assert len(ids) == 1  # one line, replaced
    assert all(kw.get("update") for _, kw in later)
    parsed = _Texts()
    parsed.feed(notebook[-1][0]["text/html"])
    assert ("progress", {"value": "8", "max": "8"}) in parsed.tags
    assert parsed.text.startswith(" <sweep>: 8/8 cells (100%)")  # escaped in the page, shown as written
    assert "done in" in parsed.text
    assert "&lt;sweep&gt;" in notebook[-1][0]["text/html"]


def test_a_quick_loop_leaves_no_line_in_a_notebook(notebook: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
    assert run(None, None).mode == "notebook"
    assert notebook == []  # shown only once a loop has run a second


def test_a_patching_sweep_reports_its_cells(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOOKSCOPE_PROGRESS_INTERVAL", "0")
    torch.manual_seed(0)
    model = track(nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 10))).eval()
    clean, corrupted = torch.tensor([[1, 2, 3, 4]]), torch.tensor([[1, 5, 6, 4]])
    metric = lambda output: output[:, -1, 3] - output[:, -1, 5]  # noqa: E731
    effects = hs.methods.patch_sweep(model, clean, corrupted, metric=metric, layers=["0"], progress=True)
    lines = capsys.readouterr().err.splitlines()
    # positions 1 and 2 differ; the others write the value already there: no forward for them
    assert lines[-1].startswith("patch_sweep: 2/2 patched cells (100%)")
    assert effects.forwards == 1  # both in one forward of a batch of two
    hs.methods.patch_sweep(model, clean, corrupted, metric=metric, layers=["0"])
    assert capsys.readouterr().err == ""  # by default, not on a captured stream
    with pytest.raises(hs.SpecError, match="progress='yes'"):
        hs.methods.patch_sweep(model, clean, corrupted, metric=metric, layers=["0"], progress="yes")  # type: ignore[arg-type]

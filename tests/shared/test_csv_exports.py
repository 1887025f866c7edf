"""Every CSV hookscope writes: names that hold line breaks stay one cell, and text that a
spreadsheet would run as a formula is marked with a leading ``'``."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import pytest
import torch
from torch import nn

import hookscope as hs
from tests.cli.test_cli import run_cli

NAMES = ["a\rb", "c\nd", '=HYPERLINK("http://x")', "+1", "-2", "@SUM(A1)", "\tlead", "plain,comma", 'say "hi"']


def named_model() -> nn.Sequential:
    model = nn.Sequential()
    for name in NAMES:
        model.add_module(name, nn.Linear(2, 2))
    return model


def expected_cell(name: str) -> str:
    return "'" + name if name[0] in "=+-@\t\r" else name


def rows_of(text: str) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(text, newline="")))


def test_trace_csv_keeps_each_name_in_one_cell_and_marks_formulas(tmp_path: Path) -> None:
    model = named_model()
    text = hs.trace(model, torch.ones(1, 2)).to_csv(tmp_path / "t.csv")
    rows = rows_of(text)
    assert len(rows) == 1 + len(NAMES)  # the model's row, then one per module: no row split in two
    assert [row["name"] for row in rows[1:]] == [expected_cell(name) for name in NAMES]
    assert float(rows[1]["max"]) == pytest.approx(model[0](torch.ones(1, 2)).max().item())
    assert (tmp_path / "t.csv").read_bytes().decode() == text
    assert all(not line.startswith(("=", "+", "-", "@")) for line in text.split("\n"))


def test_numbers_are_written_as_numbers() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    with torch.no_grad():
        model[0].weight.fill_(-1.0)
        model[0].bias.fill_(0.0)
    rows = rows_of(hs.trace(model, torch.ones(1, 2)).to_csv())
    assert rows[1]["min"] == "-2.0"  # a negative number is not text: no quote mark


def test_diff_csv_marks_formulas_and_quotes_line_breaks(tmp_path: Path) -> None:
    model = named_model()
    diff = hs.diff(model, model, torch.ones(1, 2))
    rows = rows_of(diff.to_csv(tmp_path / "d.csv"))
    assert [row["name"] for row in rows if row["name"] != ""] == [expected_cell(name) for name in NAMES]
    assert rows_of((tmp_path / "d.csv").read_bytes().decode()) == rows


def test_cli_trace_and_diff_csv_mark_formulas(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    script = tmp_path / "nets.py"
    script.write_text(
        "from torch import nn\n"
        "def build():\n"
        "    model = nn.Sequential()\n"
        "    model.add_module('=cmd', nn.Linear(2, 2))\n"
        "    model.add_module('a\\rb', nn.Linear(2, 2))\n"
        "    return model\n"
    )
    code, _, _ = run_cli(capsys, "trace", f"{script}:build", "-s", "1x2", "--csv", str(tmp_path / "t.csv"))
    assert code == 0
    code, _, _ = run_cli(
        capsys, "diff", f"{script}:build", f"{script}:build", "-s", "1x2", "--csv", str(tmp_path / "d.csv")
    )
    assert code == 0
    for name in ("t.csv", "d.csv"):
        rows = rows_of((tmp_path / name).read_bytes().decode())
        assert [row["name"] for row in rows if row["name"]] == ["'=cmd", "a\rb"]


def test_effects_csv_marks_formulas_and_keeps_each_site_in_one_row(tmp_path: Path) -> None:
    values = torch.arange(len(NAMES) * 2, dtype=torch.float64).reshape(len(NAMES), 2) - 3
    effects = hs.methods.Effects(
        values, values * 2, ("site", "position"), {"site": NAMES, "position": [0, 5]}, 1.0, 0.0, "patch_sweep"
    )
    rows = rows_of(effects.to_csv(tmp_path / "e.csv"))
    assert len(rows) == 2 * len(NAMES)
    assert [row["site"] for row in rows[::2]] == [expected_cell(name) for name in NAMES]
    assert [float(row["effect"]) for row in rows] == values.reshape(-1).tolist()
    assert [float(row["metric"]) for row in rows] == (values * 2).reshape(-1).tolist()
    assert rows[0]["effect"] == "-3.0"  # a number, not text: no quote mark
    assert rows_of((tmp_path / "e.csv").read_bytes().decode()) == rows


def test_cli_patch_csv_marks_formulas(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    names = ["=cmd", "a\rb", "+1", "-2", "@q", "\tlead"]
    script = tmp_path / "named.py"
    script.write_text(
        "import torch\n"
        "from torch import nn\n"
        f"NAMES = {names!r}\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.emb = nn.Embedding(16, 4)\n"
        "        for name in NAMES:\n"
        "            self.add_module(name, nn.Linear(4, 4))\n"
        "        self.out = nn.Linear(4, 8)\n"
        "    def forward(self, ids):\n"
        "        h = self.emb(ids)\n"
        "        for name in NAMES:\n"
        "            h = getattr(self, name)(h)\n"
        "        return self.out(h)\n"
        "def build():\n"
        "    torch.manual_seed(0)\n"
        "    return Net()\n"
    )
    out = tmp_path / "sweep.csv"
    code, _, err = run_cli(
        capsys, "patch", f"{script}:build", "--clean", "1,2,3;4,5,6", "--corrupted", "1,9,3;4,9,6",
        "-m", "logit_diff:3,4", "--sites", "=cmd,a?b,+1,-2,@q,?lead", "-o", str(out),
    )  # fmt: skip
    assert code == 0, err
    rows = rows_of(out.read_bytes().decode())
    assert len(rows) == len(names) * 3  # one row per cell: a name holding \r splits none
    assert [row["site"] for row in rows[::3]] == [expected_cell(name) for name in names]

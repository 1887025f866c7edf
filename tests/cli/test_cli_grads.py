"""``hookscope grads``: a few synthetic SGD steps, the flagged layers, the gradient-flow plot."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli.test_cli import run_cli

BAD_MLP = """
import torch
from torch import nn


def build():
    torch.manual_seed(0)
    layers = []
    for _ in range(20):
        linear = nn.Linear(16, 16)
        nn.init.normal_(linear.weight, std=0.05)
        layers += [linear, nn.Sigmoid()]
    return nn.Sequential(*layers)
"""


def test_grads_of_the_demo_cnn(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png = tmp_path / "flow.png"
    code, out, err = run_cli(capsys, "grads", "demo:cnn", "-s", "4x3x32x32", "--steps", "2", "--png", str(png))
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "input: (4, 3, 32, 32) float32"
    assert lines[1].startswith("step 0: loss ")
    assert lines[2].startswith("step 1: loss ")
    assert "no gradient problems found in 2 recorded steps" in out
    assert png.stat().st_size > 1000
    assert f"wrote {png}" in out


def test_grads_flags_a_vanishing_mlp(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "mlp.py").write_text(BAD_MLP)
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(capsys, "grads", "mlp.py:build", "-s", "8x16", "--steps", "3")
    assert code == 0, err
    assert "vanishing 0#0: norm below 0.0001 of the largest layer's (steps 0-2)" in out


@pytest.mark.transformers
def test_grads_of_gpt2(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "grads", "hf-config:gpt2?n_layer=2&n_embd=32&n_head=2", "-s", "2x8", "-n", "2")
    assert code == 0, err
    assert out.splitlines()[0] == "input: input_ids (2, 8) int64"
    assert [line.split(":")[0] for line in out.splitlines()[1:3]] == ["step 0", "step 1"]
    assert "2 recorded steps" in out


def test_grads_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "grads", "demo:cnn", "--png", "flow.jpg")
    assert code == 2
    assert "ending in .png" in err
    code, _, _ = run_cli(capsys, "grads", "demo:cnn", "--steps", "0")
    assert code == 2

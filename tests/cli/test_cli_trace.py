"""``hookscope trace``: the table, CSV and JSON files, depth and filter, and a model that raises."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tests.cli.test_cli import run_cli

RAISING = """
import torch
from torch import nn


class Fails(nn.Module):
    def forward(self, x):
        raise ValueError("this layer is broken")


def build():
    return nn.Sequential(nn.Linear(4, 6), nn.Sequential(nn.ReLU(), Fails()), nn.Linear(6, 2))
"""


def test_trace_demo_cnn_with_files(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out_csv, out_json = tmp_path / "t.csv", tmp_path / "t.json"
    code, out, err = run_cli(
        capsys, "trace", "demo:cnn", "--input-shape", "4x3x32x32", "--csv", str(out_csv), "--json", str(out_json)
    )
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "input: (4, 3, 32, 32) float32"
    assert lines[1].split()[:4] == ["#", "module", "class", "inputs"]
    assert "conv1" in out
    assert "[4, 16, 30, 30]" in out
    assert "5 calls · 5 modules · 618 parameters" in out
    rows = list(csv.DictReader(out_csv.read_text().splitlines()))
    assert [row["name"] for row in rows] == ["", "conv1", "relu", "pool", "fc"]
    assert float(rows[2]["min"]) == 0.0
    document = json.loads(out_json.read_text())
    assert [row["name"] for row in document["rows"]] == ["", "conv1", "relu", "pool", "fc"]
    assert f"wrote {out_csv}" in out
    assert f"wrote {out_json}" in out


def test_trace_depth_filter_and_timing(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "trace", "demo:cnn", "--depth", "0")
    assert code == 0
    assert "conv1" not in out
    assert "(root)" in out
    code, out, _ = run_cli(capsys, "trace", "demo:cnn", "--filter", "conv1,fc", "--timing")
    assert code == 0
    assert "conv1" in out
    assert "fc" in out
    assert "relu" not in out
    assert "self ms" in out


@pytest.mark.transformers
def test_trace_gpt2_in_bfloat16(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(
        capsys, "trace", "hf-config:gpt2?n_layer=2&n_embd=32&n_head=2", "-s", "2x8", "--dtype", "bf16", "--depth", "2"
    )
    assert code == 0, err
    assert "input: input_ids (2, 8) int64" in out
    assert "h.1.mlp" in out
    assert "bfloat16" in out
    assert "h.1.mlp.c_fc" not in out


def test_a_model_that_raises_prints_where_and_exits_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "raising.py").write_text(RAISING)
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(capsys, "trace", "raising.py:build", "-s", "3x4", "--csv", "partial.csv")
    assert code == 2  # the model refuses the sample input, as in every other command
    assert "the model refuses the sample input; pass an --input-shape the model accepts" in err
    assert "error: ValueError: this layer is broken" in err
    assert "the forward raised in '1.1' (Fails, call 0) with input[0] [3, 6] float32" in err
    assert "Traceback" not in err
    table = out.splitlines()[3:8]  # input line, header, rule, then one line per call
    assert [line.split()[1:3] for line in table] == [
        ["(root)", "!"],
        ["0", "Linear"],
        ["1", "!"],
        ["1.0", "ReLU"],
        ["1.1", "!"],
    ]
    rows = list(csv.DictReader((tmp_path / "partial.csv").read_text().splitlines()))
    assert [(row["name"], row["status"]) for row in rows] == [
        ("", "raised"),
        ("0", "ok"),
        ("1", "raised"),
        ("1.0", "ok"),
        ("1.1", "raised"),
    ]


def test_a_shape_the_model_refuses_names_the_layer(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "trace", "demo:cnn", "-s", "1x4x8x8")
    assert code == 2
    assert "'conv1' (Conv2d, call 0) with input[0] [1, 4, 8, 8] float32" in err


def test_bad_options_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "trace", "demo:cnn", "--dtype", "int8")
    assert code == 2
    assert "dtype 'int8'" in err
    code, _, err = run_cli(capsys, "trace", "demo:cnn", "--filter", "conv9")
    assert code == 2
    assert "did you mean 'conv1'" in err


MIXTRAL = (
    "hf-config:mixtral/causal-lm?num_hidden_layers=2&hidden_size=32&intermediate_size=64&num_attention_heads=4"
    "&num_key_value_heads=2&num_local_experts=4&vocab_size=100"
)


@pytest.mark.transformers
def test_experts_prints_the_tokens_per_expert_and_a_model_without_experts_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run_cli(capsys, "trace", MIXTRAL, "--experts", "--depth", "0")
    assert code == 0, err
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("model.layers.")}
    for layer in (0, 1):
        row = lines[f"model.layers.{layer}.mlp.experts#0"]
        counts = [int(count) for count in row[4:]]
        assert len(counts) == 4
        assert int(row[1]) == sum(counts) == 16 * 2  # 1 x 16 sample tokens, top-2
    assert "router entropy" in out
    code, out, err = run_cli(capsys, "trace", "demo:cnn", "--experts")
    assert code != 0
    assert "holds no expert rows" in err

"""hookscope train-check: a short monitored run and its health report, against the library."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hookscope.cli import main
from hookscope.cli.app import app

pytestmark = [pytest.mark.transformers, pytest.mark.slow]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

GPT2 = "hf-config:gpt2/causal-lm?n_layer=2&n_embd=32&n_head=2&vocab_size=64&bos_token_id=0&eos_token_id=0"


def test_train_check_prints_the_report_and_logs_every_step(tmp_path: Path) -> None:
    out = tmp_path / "metrics.jsonl"
    result = CliRunner().invoke(
        app, ["train-check", GPT2, "-s", "2x8", "--steps", "4", "--precision", "fp16", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "training health over 4 steps" in result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    for layer in ("blocks.0", "blocks.1"):
        line = next(text for text in result.output.splitlines() if text.startswith(layer))
        first, last = rows[0][f"grad/norm/{layer}"], rows[-1][f"grad/norm/{layer}"]
        assert f"{first:.3g} -> {last:.3g}" in line


def test_train_check_refuses_an_unknown_precision(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["train-check", GPT2, "-s", "2x8", "--steps", "1", "--precision", "fp32"])
    assert done.value.code == 2
    assert "not a low-precision format" in capsys.readouterr().err

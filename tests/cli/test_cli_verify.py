"""``hookscope verify``: the report as a table or JSON, and its exit code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hookscope._capture.cache import Cache
from hookscope.cli import main

GPT2 = "hf-config:gpt2/causal-lm?n_layer=2&n_embd=32&n_head=2&vocab_size=96&bos_token_id=0&eos_token_id=0"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        main(list(argv))
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else 0
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.transformers
def test_a_clean_model_prints_the_table_and_exits_0(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, _ = run(capsys, "verify", GPT2, "--checks", "capture,std", "--out", str(tmp_path / "r.json"))
    assert code == 0, out
    assert "SUPPORTED  capture inputs and outputs" in out
    assert out.strip().splitlines()[-1].startswith("ok: ")
    written = json.loads((tmp_path / "r.json").read_text())
    assert written["ok"] is True
    assert written["model"] == "GPT2LMHeadModel"
    assert {row["check"] for row in written["rows"]} == {"capture inputs and outputs", "std names"}


@pytest.mark.transformers
def test_a_silently_wrong_row_exits_1_and_json_says_why(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    put = Cache._put
    monkeypatch.setattr(
        Cache, "_put", lambda self, site, t, v: None if site.module.endswith("ln_f") else put(self, site, t, v)
    )
    code, out, _ = run(capsys, "verify", GPT2, "--checks", "capture", "--json")
    assert code == 1
    report = json.loads(out)
    assert report["ok"] is False
    assert report["counts"]["SILENTLY_WRONG"] == 1
    assert "values not kept, e.g. transformer.ln_f#0:" in report["rows"][0]["detail"]


@pytest.mark.transformers
def test_an_unknown_check_is_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "verify", GPT2, "--checks", "capture,bogus", "--compile-backend", "none")
    assert code == 2
    assert "names no check ['bogus']" in err

"""The ledger page is a view of the ledger JSON alone: regenerated from a small document, with
the summary by kind and outcome, the failure classes, and a row per model type."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from zoo.ledger import main, merged, outcome, page_path, reason_of, render_page


def _entry(model_type: str, kind: str, failed: str | None = None, reason: str | None = None) -> dict[str, Any]:
    stages = {stage: {"ok": True, "reason": None} for stage in ("build", "input", "forward")}
    if failed is not None:
        for stage in ("build", "input", "forward")[("build", "input", "forward").index(failed) :]:
            stages[stage] = {"ok": False, "reason": "not reached"}
        stages[failed]["reason"] = reason
    return {"model_type": model_type, "kind": kind, "model_class": f"{model_type.title()}Model", "stages": stages}


DOCUMENT = {
    "transformers": "5.0.0",
    "torch": "2.13.0",
    "date": "2026-01-01T00:00:00Z",
    "wall_seconds": 12.5,
    "settings": {"jobs": 1},
    "models": [
        {**_entry("gpt2", "decoder-only"), "parameters": 196864, "verify": {"counts": {"SUPPORTED": 9, "ERROR": 0}}},
        _entry("bert", "encoder-only"),
        _entry("dpt", "vision", "build", "needs a timm backbone (pip install timm)"),
        _entry("fancy", "other", "input", "SpecError: FancyModel.forward requires `past_values`"),
        {"model_type": "hang", "timeout": True, "error": "timed out after 120 s (the sweep's limit)"},
    ],
}


def test_outcomes_and_reasons_name_the_stage_that_stopped_a_model() -> None:
    models = {entry["model_type"]: entry for entry in DOCUMENT["models"]}
    assert [outcome(models[name]) for name in ("gpt2", "dpt", "fancy", "hang")] == [
        "runs",
        "no build",
        "no input",
        "timeout",
    ]
    assert reason_of(models["gpt2"]) is None
    assert reason_of(models["dpt"]) == "needs a timm backbone (pip install timm)"


def test_the_page_summarises_by_kind_and_lists_every_model() -> None:
    page = render_page(DOCUMENT)
    assert page.startswith("# The model zoo\n")  # in the docs toctree, under Reference
    lines = page.splitlines()
    expected = [
        "5 model types in 12.5 s: no build 1, no input 1, runs 2, timeout 1.",  # the summary
        "| decoder-only | 1 | 0 | 0 | 0 | 1 |",  # by kind: runs, no build, no input, timeout, total
        "| needs a library | 1 |",  # the failure classes
        "| input not made | 1 |",
        "| `gpt2` | `Gpt2Model` | 196,864 | runs | SUPPORTED 9 |  |",  # a row per model type
        "| `hang` |  |  | timeout |  | timed out after 120 s (the sweep's limit) |",
    ]
    assert [line for line in expected if line not in lines] == []


def test_the_page_regenerates_from_the_json_alone(tmp_path: Path) -> None:
    ledger = tmp_path / "zoo" / "ledger.json"
    ledger.parent.mkdir()
    ledger.write_text(json.dumps(DOCUMENT))
    assert page_path(ledger) == tmp_path / "zoo.md"
    assert main([str(ledger)]) == 0
    assert (tmp_path / "zoo.md").read_text() == render_page(DOCUMENT)


def test_a_rerun_replaces_only_its_own_entries_and_is_listed() -> None:
    update = {**DOCUMENT, "date": "2026-01-02T00:00:00Z", "wall_seconds": 3.0, "models": [_entry("dpt", "vision")]}
    document = merged(DOCUMENT, update)
    models = {entry["model_type"]: entry for entry in document["models"]}
    assert sorted(models) == ["bert", "dpt", "fancy", "gpt2", "hang"]
    assert outcome(models["dpt"]) == "runs"
    assert outcome(models["fancy"]) == "no input"
    assert document["date"] == DOCUMENT["date"]
    assert document["updates"] == [{"date": "2026-01-02T00:00:00Z", "wall_seconds": 3.0, "model_types": 1}]
    assert "1 model types were rerun on 2026-01-02T00:00:00Z (3 s)." in render_page(document)


def _verified(model_type: str, kind: str, std: str, extra: list[dict[str, Any]]) -> dict[str, Any]:
    rows = [
        {"check": "capture inputs and outputs", "subject": "every module (9)", "status": "SUPPORTED", "detail": "ok"},
        {"check": "std names", "subject": "resolved", "status": std, "detail": "names"},
        *extra,
    ]
    counts = {status: sum(row["status"] == status for row in rows) for status in ("SUPPORTED", "REFUSED")}
    return {**_entry(model_type, kind), "verify": {"rows": rows, "counts": counts}}


def test_the_verify_section_names_every_wrong_row_and_counts_std_names_by_kind() -> None:
    wrong = {"check": "edit zero", "subject": "h.0", "status": "SILENTLY_WRONG", "detail": "outputs differ | here"}
    document = {
        **DOCUMENT,
        "settings": {"compile_backend": "none"},
        "models": [
            _verified("gpt2", "decoder-only", "SUPPORTED", []),
            _verified("llama", "decoder-only", "REFUSED", [wrong]),
            _verified("vit", "vision", "SUPPORTED", []),
        ],
    }
    lines = render_page(document).splitlines()
    assert "| `llama` | SILENTLY_WRONG | edit zero | outputs differ \\| here |" in lines
    assert "| decoder-only | 1 | 2 |" in lines  # gpt2 resolved; llama's std row was refused
    assert "| vision | 1 | 1 |" in lines
    assert "| all | 2 | 3 |" in lines
    assert any("3 model types verified (the `torch.compile` check was left out" in line for line in lines)
    clean = {**document, "models": document["models"][::2]}
    assert "No row is SILENTLY_WRONG or ERROR." in render_page(clean).splitlines()


def test_a_verify_that_ran_out_of_memory_is_listed_with_its_plan() -> None:
    entry = {**_entry("align", "vision-language"), "parameters": 78566225}
    entry["verify"] = {"error": "out of memory under the sweep's limit"}
    page = render_page({**DOCUMENT, "models": [entry]})
    assert (
        "| `align` | ERROR | verify | out of memory under the sweep's limit: the model ran only at its default" in page
    )
    assert "(78,566,225 parameters)" in page
    assert "plan: shrink this type in zoo/tiny.py |" in page

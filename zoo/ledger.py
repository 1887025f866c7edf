"""The zoo's ledger: one JSON document of every model type's outcome, and the Markdown page
generated from it alone.

    python -m zoo.ledger docs/zoo/ledger.json [--page docs/zoo.md]

The JSON is the record (committed, diffable); the page is a view of it, regenerated without
running any model, so a change of wording never needs a new sweep.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zoo.reasons import reason_class, short_reason
from zoo.verdicts import verdict_lines

__all__ = [
    "KINDS",
    "main",
    "make_ledger",
    "merged",
    "outcome",
    "page_path",
    "read_json",
    "reason_of",
    "render_page",
    "summary_line",
    "write_json",
]

KINDS = ("decoder-only", "encoder-only", "encoder-decoder", "vision", "audio", "vision-language", "other")
_STAGES = ("build", "input", "forward")


def make_ledger(
    results: dict[str, dict[str, Any]], *, wall_seconds: float, settings: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The ledger document: versions, date, the sweep's settings and wall time, and the entries
    sorted by model type."""
    import torch
    import transformers

    return {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "wall_seconds": round(wall_seconds, 1),
        "settings": settings or {},
        "models": [_normalised(results[name]) for name in sorted(results)],
    }


def _normalised(entry: dict[str, Any]) -> dict[str, Any]:
    """An entry with every stage present: a child killed before it reported has none."""
    stages = entry.get("stages") or {}
    out = {"kind": "other", "config_class": None, "model_class": None, "parameters": None, "verify": None, **entry}
    out["stages"] = {stage: stages.get(stage, {"ok": False, "reason": "not reached"}) for stage in _STAGES}
    return out


def merged(earlier: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """``earlier`` with the entries of ``update`` in place of its own for the same types; the
    sweep's date and wall time stay the earlier ones, and the rerun is listed under ``updates``."""
    models = {entry["model_type"]: entry for entry in earlier["models"]}
    models.update({entry["model_type"]: entry for entry in update["models"]})
    rerun = {"date": update["date"], "wall_seconds": update["wall_seconds"], "model_types": len(update["models"])}
    return {
        **earlier,
        "models": [models[name] for name in sorted(models)],
        "updates": [*earlier.get("updates", []), rerun],
    }


def read_json(path: Path) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return document


def write_json(document: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n", encoding="utf-8")


def page_path(json_path: Path) -> Path:
    """Where the page of ``docs/zoo/ledger.json`` goes: ``docs/zoo.md``."""
    return json_path.parent.parent / f"{json_path.parent.name}.md"


def outcome(entry: dict[str, Any]) -> str:
    """``runs`` when the forward succeeded, else the stage that stopped it (``timeout`` and
    ``crashed`` where the child never finished)."""
    stages = entry.get("stages") or {}
    if stages.get("forward", {}).get("ok"):
        return "runs"
    if entry.get("timeout"):
        return "timeout"
    if entry.get("error"):
        return "crashed"
    for stage in _STAGES:
        if not stages.get(stage, {}).get("ok"):
            return f"no {stage}"
    return "runs"


def reason_of(entry: dict[str, Any]) -> str | None:
    """The one line saying why a model type does not run, or None when it does."""
    if entry.get("error"):
        return str(entry["error"])
    stages = entry.get("stages") or {}
    for stage in _STAGES:
        if not stages.get(stage, {}).get("ok"):
            return str(stages.get(stage, {}).get("reason") or "not reached")
    return None


def _failed_stage(entry: dict[str, Any]) -> str | None:
    stages = entry.get("stages") or {}
    return next((stage for stage in _STAGES if not stages.get(stage, {}).get("ok")), None)


def summary_line(document: dict[str, Any]) -> str:
    counts = Counter(outcome(entry) for entry in document["models"])
    parts = ", ".join(f"{name} {counts[name]}" for name in sorted(counts))
    return f"{len(document['models'])} model types in {document['wall_seconds']:g} s: {parts}"


def render_page(document: dict[str, Any]) -> str:
    """The Markdown page: the summary by kind and outcome, the failure classes, then one table
    per kind with a row per model type."""
    models = document["models"]
    lines = [
        "# The model zoo",
        "",
        f"Every model type of transformers {document['transformers']} (torch {document['torch']}), built tiny from "
        "its configuration (two layers, width 64, seeded random weights, nothing downloaded), given "
        "`hs.sample_input(model)` and run once; where it runs, `hs.verify` rates each feature. "
        f"Swept on {document['date']} in {document['wall_seconds']:g} s. "
        "Regenerate this page with `python -m zoo.ledger docs/zoo/ledger.json`; rerun the sweep with `make zoo`.",
        "",
        *_provenance(document),
        "## Summary",
        "",
        f"{summary_line(document)}.",
        "",
        *_summary_table(models),
        "",
        *verdict_lines(models, document.get("settings") or {}, KINDS),
        "## Why a model type does not run",
        "",
        "| reason | model types |",
        "| --- | ---: |",
    ]
    classes = Counter(
        reason_class(reason_of(entry), _failed_stage(entry)) for entry in models if outcome(entry) != "runs"
    )
    lines += [f"| {name} | {count} |" for name, count in sorted(classes.items(), key=lambda item: (-item[1], item[0]))]
    for kind in KINDS:
        rows = [entry for entry in models if _kind(entry) == kind]
        if rows:
            lines += ["", f"## {kind}", "", *_model_table(rows)]
    return "\n".join(lines) + "\n"


def _provenance(document: dict[str, Any]) -> list[str]:
    """Lines for a sweep stopped early and for the model types rerun since, if any."""
    lines = []
    if (document.get("settings") or {}).get("partial"):
        lines.append("This sweep stopped before every model type ran; the missing ones are not listed.")
    for update in document.get("updates", []):
        lines.append(
            f"{update['model_types']} model types were rerun on {update['date']} ({update['wall_seconds']:g} s)."
        )
    return [*lines, ""] if lines else []


def _summary_table(models: list[dict[str, Any]]) -> list[str]:
    outcomes = sorted({outcome(entry) for entry in models}, key=lambda name: (name != "runs", name))
    lines = ["| kind | " + " | ".join(outcomes) + " | total |", "| --- |" + " ---: |" * (len(outcomes) + 1)]
    for kind in KINDS:
        counts = Counter(outcome(entry) for entry in models if _kind(entry) == kind)
        if counts:
            cells = " | ".join(str(counts[name]) for name in outcomes)
            lines.append(f"| {kind} | {cells} | {sum(counts.values())} |")
    return lines


def _kind(entry: dict[str, Any]) -> str:
    kind = entry.get("kind")
    return kind if kind in KINDS else "other"


def _model_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| model type | model class | parameters | result | verify | reason |",
        "| --- | --- | ---: | --- | --- | --- |",
    ]
    for entry in rows:
        parameters = entry.get("parameters")
        cells = [
            f"`{entry['model_type']}`",
            f"`{entry['model_class']}`" if entry.get("model_class") else "",
            f"{parameters:,}" if isinstance(parameters, int) else "",
            outcome(entry),
            _verify_cell(entry.get("verify")),
            _escape(short_reason(reason_of(entry) or "")),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _verify_cell(verify: Any) -> str:
    if not isinstance(verify, dict):
        return ""
    if "error" in verify:
        return "error"
    counts = verify.get("counts") or {}
    return ", ".join(f"{name} {counts[name]}" for name in sorted(counts) if counts[name])


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ").replace("<", "&lt;")


def main(argv: Sequence[str] | None = None) -> int:
    """Regenerate the page from the ledger JSON alone."""
    parser = argparse.ArgumentParser(prog="python -m zoo.ledger", description=__doc__.splitlines()[0])
    parser.add_argument("ledger", type=Path, help="the ledger JSON, e.g. docs/zoo/ledger.json")
    parser.add_argument("--page", type=Path, default=None, help="the page (default: docs/zoo.md beside docs/zoo/)")
    parsed = parser.parse_args(argv)
    document = read_json(parsed.ledger)
    page = parsed.page or page_path(parsed.ledger)
    page.write_text(render_page(document), encoding="utf-8")
    print(f"wrote {page}: {summary_line(document)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

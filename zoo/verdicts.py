"""What ``hs.verify`` said across the zoo: the section of the ledger page that answers "does
hookscope work on these models, and are its numbers right?".

Read from the ledger JSON alone, like the rest of the page: the rows by status over every model
type verified, each SILENTLY_WRONG and ERROR row named with its detail (the ones to fix), and the
model types whose ``std:`` names resolved, by kind.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

__all__ = ["std_resolved", "verdict_lines"]

_STATUSES = ("SUPPORTED", "REFUSED", "SILENTLY_WRONG", "ERROR")


def _rows(entry: dict[str, Any]) -> list[dict[str, Any]]:
    verify = entry.get("verify")
    return list(verify.get("rows") or []) if isinstance(verify, dict) else []


def std_resolved(entry: dict[str, Any]) -> bool:
    """True when the model type's canonical names resolved and matched the raw values."""
    return any(
        row["check"] == "std names" and row["subject"] == "resolved" and row["status"] == "SUPPORTED"
        for row in _rows(entry)
    )


def verdict_lines(models: list[dict[str, Any]], settings: dict[str, Any], kinds: tuple[str, ...]) -> list[str]:
    """The page's section on ``hs.verify``: totals, the rows to fix, ``std:`` coverage by kind."""
    verified = [entry for entry in models if _rows(entry)]
    failed = [entry for entry in models if isinstance(entry.get("verify"), dict) and "error" in entry["verify"]]
    statuses = Counter(row["status"] for entry in verified for row in _rows(entry))
    backend = settings.get("compile_backend", "eager")
    compile_note = (
        "the `torch.compile` check was left out of this sweep (`--compile-backend none`: it is half of verify's "
        "time); the CI sample runs it"
        if str(backend).lower() == "none"
        else f"the `torch.compile` check ran with backend `{backend}`"
    )
    lines = [
        "## What `hs.verify` found",
        "",
        f"{len(verified)} model types verified ({compile_note}): "
        + ", ".join(f"{statuses.get(status, 0)} rows {status}" for status in _STATUSES)
        + ". How to read a row: [Verify](guides/verify.md).",
        "",
    ]
    bad = [(entry, row) for entry in verified for row in _rows(entry) if row["status"] in ("SILENTLY_WRONG", "ERROR")]
    if bad or failed:
        lines += ["| model type | status | check | detail |", "| --- | --- | --- | --- |"]
        lines += [
            f"| `{e['model_type']}` | {row['status']} | {row['check']} | {_cell(_row_plan(e, row))} |" for e, row in bad
        ]
        lines += [f"| `{entry['model_type']}` | ERROR | verify | {_cell(_planned(entry))} |" for entry in failed]
        lines.append("")
    else:
        lines += ["No row is SILENTLY_WRONG or ERROR.", ""]
    lines += [
        "`std:` names resolved and equal to the raw values they name, by kind:",
        "",
        "| kind | std: resolved | verified |",
        "| --- | ---: | ---: |",
    ]
    total = 0
    for kind in kinds:
        of_kind = [
            entry for entry in verified if (entry.get("kind") if entry.get("kind") in kinds else "other") == kind
        ]
        if of_kind:
            resolved = sum(std_resolved(entry) for entry in of_kind)
            total += resolved
            lines.append(f"| {kind} | {resolved} | {len(of_kind)} |")
    lines += [f"| all | {total} | {len(verified)} |", ""]
    return lines


def _row_plan(entry: dict[str, Any], row: dict[str, Any]) -> str:
    """A row's detail, with the plan where the row is the sweep's memory limit, not hookscope."""
    detail = str(row["detail"])
    parameters = entry.get("parameters")
    if "can't allocate memory" in detail and isinstance(parameters, int):
        return (
            f"out of memory under the sweep's limit ({parameters:,} parameters, not shrunk); "
            f"plan: shrink this type in zoo/tiny.py. {detail}"
        )
    return detail


def _planned(entry: dict[str, Any]) -> str:
    """A verify that did not finish, with what to do about it."""
    error = str(entry["verify"]["error"])
    parameters = entry.get("parameters")
    if "out of memory" in error and isinstance(parameters, int):
        return (
            f"{error}: the model ran only at its default size ({parameters:,} parameters), and verify holds every "
            "module's values several times over; plan: shrink this type in zoo/tiny.py"
        )
    return error


def _kind(entry: dict[str, Any], kinds: tuple[str, ...]) -> str:
    kind = entry.get("kind")
    return kind if kind in kinds else "other"


def _cell(text: str) -> str:
    short = text if len(text) <= 300 else text[:297] + "..."
    return short.replace("|", "\\|").replace("\n", " ").replace("<", "&lt;")

"""The zoo's fixed sample in CI: ~25 architectures built tiny, each verified in its own process,
with no row SILENTLY_WRONG or ERROR (the whole sweep runs by hand: ``make zoo``)."""

from __future__ import annotations

import pytest
from zoo.sweep import run_sweep
from zoo.tiny import SAMPLE_TYPES


@pytest.mark.slow
@pytest.mark.transformers
def test_every_architecture_of_the_sample_runs_and_verifies_with_no_wrong_row() -> None:
    results = run_sweep(list(SAMPLE_TYPES), jobs=2, timeout_s=300.0)
    assert sorted(results) == sorted(SAMPLE_TYPES)
    problems = []
    for model_type, entry in sorted(results.items()):
        verify = entry.get("verify")
        if not verify:
            problems.append(f"{model_type}: did not reach verify ({entry.get('error') or entry.get('failed_stage')})")
            continue
        for row in verify["rows"]:
            if row["status"] in ("SILENTLY_WRONG", "ERROR"):
                problems.append(f"{model_type}: {row['status']} {row['check']} {row['subject']}: {row['detail']}")
    assert problems == []
    supported = {model_type for model_type, entry in results.items() if entry["verify"]["counts"]["SUPPORTED"] >= 10}
    assert supported == set(SAMPLE_TYPES)  # every feature ran on every one, not a report of refusals

"""The sweep's runner: one child per model type, killed at its time limit, refused memory past its
limit, and every outcome recorded with a reason (stand-in targets, no model is built)."""

from __future__ import annotations

import time

import pytest
from zoo.ledger import outcome, reason_of
from zoo.sweep import run_sweep

from tests.zoo import workers


@pytest.mark.slow  # waits out its limit
def test_a_child_past_its_time_limit_is_killed_and_the_reason_recorded() -> None:
    started = time.monotonic()
    results = run_sweep(["slow_type"], timeout_s=3.0, target=workers.sleeps, preload=())
    assert time.monotonic() - started < 30  # not the 600 s the target sleeps
    entry = results["slow_type"]
    assert entry["timeout"] is True
    assert entry["stages"]["build"]["ok"] is True  # what it reported before it hung is kept
    assert outcome(entry) == "timeout"
    assert reason_of(entry) == "timed out after 3 s (the sweep's limit)"


def test_entries_come_back_for_every_type_with_several_jobs() -> None:
    results = run_sweep(["a", "b", "c"], jobs=2, target=workers.answers, options={"seed": 3}, preload=())
    assert sorted(results) == ["a", "b", "c"]
    assert all(results[name]["options"] == {"seed": 3} for name in results)


def test_a_child_that_dies_is_recorded_with_its_exit_status() -> None:
    entry = run_sweep(["gone"], target=workers.dies, preload=())["gone"]
    assert outcome(entry) == "crashed"
    assert reason_of(entry) == "exited with status 3"


def test_memory_past_the_limit_is_refused_in_the_child() -> None:
    entry = run_sweep(["big"], target=workers.allocates, memory_gib=1.0, preload=())["big"]
    assert outcome(entry) == "crashed"
    assert reason_of(entry) == "out of memory under the sweep's limit"

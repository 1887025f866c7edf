"""``bench/gpu_check.py`` in its CPU smoke mode: the script a GPU machine runs once, unattended, must not
fail there for a reason a CPU run would have shown. Run as a real process, as on that machine."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"
# The smoke run takes about 25 s on 2 busy CPU cores; the limit leaves room for a slower machine.
TIMEOUT = 240
WORKLOADS = ("gpt2", "resnet50")
# Every method's figure, per workload: ratios to the plain forward or step; extract's is rows/s over the forward's.
METHODS = ("trace", "trace stats=False", "detect_nonfinite", "capture", "watch_grads", "extract")
# The methods with a target, each with one summary row per workload.
TARGETED = ("trace", "detect_nonfinite", "capture", "watch_grads", "extract rows/s")


def environment() -> dict[str, str]:
    """Offline, one OpenMP thread: the tiny models gain nothing from more, and a busy machine loses a lot."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
@pytest.mark.transformers
def test_the_cpu_smoke_run_reports_every_method_of_both_workloads(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    command = [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--threads", "1", "--json", str(out)]
    done = subprocess.run(command, env=environment(), capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "sync check: skipped on the CPU" in done.stdout
    data = json.loads(out.read_text())
    assert data["complete"] is True
    assert data["errors"] == []
    assert data["fused_cpu_kernel"] in (True, False, "n/a")
    for workload in WORKLOADS:
        figures = data["ratios"][workload]
        assert set(figures) == set(METHODS), workload
        for method, value in figures.items():
            assert math.isfinite(value), (workload, method, value)
            assert value > 0, (workload, method, value)
    rows = {row["name"]: row for row in data["summary"]}
    assert set(rows) == {f"{workload} {method}" for workload in WORKLOADS for method in TARGETED}
    for name, row in rows.items():
        assert set(row) == {"name", "value", "target", "better", "unit"}, name
        assert math.isfinite(row["value"]), name
        assert row["value"] > 0, name
        assert row["unit"] == "x"
        assert row["better"] == ("higher" if name.endswith("rows/s") else "lower"), name
        assert row["target"] > 0
    assert rows["gpt2 trace"]["target"] == 1.08
    assert rows["resnet50 trace"]["target"] == 1.15
    assert rows["gpt2 extract rows/s"]["target"] == 0.9

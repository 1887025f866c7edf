"""``bench/summary.py``: the one table of every benchmark figure held to a target, read from the scripts' JSON;
and ``bench/bench_report.py``, whose JSON follows the same convention, run as a real process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SUMMARY = ROOT / "bench" / "summary.py"
TIMEOUT = 600


def environment() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def row(name: str, value: float, target: float, better: str = "lower", unit: str = "x") -> dict[str, object]:
    return {"name": name, "value": value, "target": target, "better": better, "unit": unit}


def summarise(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SUMMARY), *args],
        cwd=ROOT,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def table_line(stdout: str, name: str) -> str:
    """The one line of the final table that names ``name``."""
    found = [line for line in stdout.splitlines() if f"  {name}  " in line]
    assert len(found) == 1, stdout
    return found[0]


def test_from_json_prints_pass_and_miss_for_lower_and_higher_targets(tmp_path: Path) -> None:
    hooks = [row("hooks over raw", 1.02, 1.05), row("trace over plain", 1.40, 1.30)]
    extract = [row("rows/s over forward", 0.95, 0.9, "higher"), row("sweep speed-up", 3.5, 4.0, "higher")]
    (tmp_path / "bench_hooks.json").write_text(json.dumps({"rounds": 10, "summary": hooks}))
    (tmp_path / "bench_extract.json").write_text(json.dumps({"summary": extract}))
    (tmp_path / "bench_report.json").write_text(json.dumps({"summary": [row("report", 2.5, 3.0, unit="s")]}))
    (tmp_path / "bench_capture.json").write_text(json.dumps({"tables": []}))  # no summary key yet

    done = summarise("--from-json", str(tmp_path))

    assert done.returncode == 0, done.stderr  # a MISS reports, it does not fail
    out = done.stdout
    assert table_line(out, "hooks over raw").startswith("bench_hooks.py")
    assert table_line(out, "hooks over raw").endswith("<= 1.050x  PASS")
    assert table_line(out, "trace over plain").endswith("<= 1.300x  MISS")
    assert table_line(out, "rows/s over forward").endswith(">= 0.900x  PASS")
    assert table_line(out, "rows/s over forward").startswith("bench_extract.py")
    assert table_line(out, "sweep speed-up").endswith(">= 4.000x  MISS")
    assert table_line(out, "report").endswith("<= 3.00 s  PASS")
    assert "note: bench_capture.py: no summary in its JSON" in out
    assert out.rstrip().splitlines()[-1] == "3 PASS, 2 MISS"
    # the rows come in the order make bench runs the scripts
    assert out.index("hooks over raw") < out.index("rows/s over forward") < out.index("  report  ")


def test_from_json_only_and_a_malformed_row(tmp_path: Path) -> None:
    (tmp_path / "bench_hooks.json").write_text(json.dumps({"summary": [row("hooks over raw", 1.0, 1.05)]}))
    (tmp_path / "bench_edit.json").write_text(json.dumps({"summary": [{"name": "edit", "value": 1.0}]}))

    only = summarise("--from-json", str(tmp_path), "--only", "hooks")
    assert only.returncode == 0, only.stderr
    assert "bench_edit" not in only.stdout
    assert only.stdout.rstrip().splitlines()[-1] == "1 PASS, 0 MISS"

    both = summarise("--from-json", str(tmp_path))
    assert both.returncode == 1  # a script that broke the convention is named, and fails the run
    assert "FAILED: bench_edit.py: summary[0] lacks target, better, unit" in both.stdout


def test_unknown_script_and_refused_options() -> None:
    unknown = summarise("--only", "nope")
    assert unknown.returncode == 2
    assert "unknown script 'nope'" in unknown.stderr
    check = summarise("--only", "hooks", "--check")
    assert check.returncode == 2
    assert "--check is set by this script" in check.stderr


@pytest.mark.slow
@pytest.mark.transformers
def test_bench_report_quick_writes_a_summary_row_in_seconds(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_report.py"), "--quick", "--json", str(out)],
        cwd=tmp_path,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, done.stderr
    assert "hs.report writing the HTML page" in done.stdout
    (summary,) = json.loads(out.read_text())["summary"]
    assert summary["unit"] == "s"
    assert summary["better"] == "lower"
    assert summary["target"] == 3.0
    assert summary["value"] > 0

"""``hookscope info`` says which path computes CPU statistics: the fused C kernel or torch reductions."""

from __future__ import annotations

import os
import subprocess
import sys

import hookscope.info
from hookscope._shared.stats import kernel


def info_lines(**env: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-m", "hookscope", "info"],
        env=dict(os.environ, **env),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_info_names_the_statistics_path_that_runs() -> None:
    lines = info_lines()
    assert lines[0].startswith("hookscope ")
    expected = "statistics: fused C kernel" if kernel.available() else "statistics: torch reductions"
    assert lines[-1].startswith(expected)
    assert lines[-1] == f"statistics: {hookscope.info.statistics_path()}"


def test_info_says_when_the_kernel_is_turned_off() -> None:
    assert info_lines(HOOKSCOPE_FUSED_STATS="0")[-1] == (
        "statistics: torch reductions (fused C kernel turned off: HOOKSCOPE_FUSED_STATS=0)"
    )


def test_statistics_path_follows_use_fused() -> None:
    previous = kernel.use_fused(False)
    try:
        assert hookscope.info.statistics_path().startswith("torch reductions")
    finally:
        kernel.use_fused(previous)
    assert hookscope.info.statistics_path().startswith("fused C kernel" if previous else "torch reductions")

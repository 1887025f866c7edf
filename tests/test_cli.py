"""The command line: demo, help, exit codes, one-line errors."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hookscope.cli import main
from hookscope.demo.models import SmallCNN
from hookscope.demo.tour import run_tour


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as done:
        main(list(argv))
    out, err = capsys.readouterr()
    code = done.value.code
    return (code if isinstance(code, int) else 0), out, err


def test_no_arguments_prints_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys)
    assert code == 2
    assert "Usage" in out
    assert "demo" in out
    assert "Traceback" not in out + err


def test_unknown_subcommand_exits_2_without_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "frobnicate")
    assert code == 2
    assert "No such command 'frobnicate'" in out + err
    assert "Traceback" not in out + err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "--version")
    assert code == 0
    assert out.startswith("hookscope 0.")


def test_demo_runs_and_saves_conv1_features(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = run_cli(capsys, "demo", "--out", str(tmp_path))
    assert code == 0, err
    saved = np.load(tmp_path / "conv1_features.npy")
    torch.manual_seed(0)
    model = SmallCNN().eval()
    expected = model.conv1(torch.randn(1, 3, 32, 32)).detach().numpy()
    np.testing.assert_array_equal(saved, expected)
    assert "conv1 (Conv2d)" in out
    assert "input (1, 3, 32, 32)" in out
    assert "-> output (1, 16, 30, 30)" in out
    assert "reloaded from disk: identical" in out
    assert "after the with-block: 0 hookscope hooks attached" in out
    assert "after the failed forward: 0 hookscope hooks attached" in out
    assert not list(tmp_path.glob("*.partial")), "no temporary file left behind"


def test_demo_into_an_unwritable_place_is_a_one_line_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    code, _, err = run_cli(capsys, "demo", "--out", str(blocker / "sub"))
    assert code == 1
    assert err.startswith("error: ")
    assert "Traceback" not in err


def test_tour_steps_in_order(tmp_path: Path) -> None:
    lines: list[str] = []
    run_tour(tmp_path, write=lines.append)
    steps = [line.split(".")[0] for line in lines if line[:1].isdigit()]
    assert steps == ["1", "2", "3", "4", "5"]


@pytest.mark.skipif(shutil.which("hookscope", path=os.path.dirname(sys.executable)) is None, reason="not installed")
def test_console_script_without_arguments() -> None:
    script = shutil.which("hookscope", path=os.path.dirname(sys.executable))
    assert script is not None
    done = subprocess.run([script, "bogus"], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2
    assert "Traceback" not in done.stdout + done.stderr


def test_python_dash_m(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "hookscope", "demo", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "conv1_features.npy").exists()

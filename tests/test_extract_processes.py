"""``hookscope extract`` as real processes: killed with SIGKILL and resumed, sharded by torchrun
(2 CPU processes, gloo), and with peak memory that does not grow with the number of rows."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_extract import store_files

NETS = """
import os
import time

import torch
from torch import nn


def build():
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 32))


class Rows(torch.utils.data.Dataset):
    '''Fixed rows; each fetch is logged with the process id and, when SLOW is set, takes a while.'''

    def __init__(self):
        self.x = torch.randn(1024, 64, generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        if os.environ.get("SLOW"):
            time.sleep(0.003)
        with open("fetches.log", "a") as log:
            log.write(f"{os.getpid()}\\n")
        return self.x[index]


def rows():
    return Rows()
"""

RSS = """
import resource
import sys

import torch
from torch import nn

import hookscope as hs
from hookscope.cli.data_specs import RandomRows

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 8192))
data = RandomRows(int(sys.argv[1]), (64,), seed=0)
hs.extract(model, data, "0", sys.argv[2], batch_size=64, progress=False, compression_level=1)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""

TIMEOUT = 240


def environment(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **extra}
    env.pop("SLOW", None)
    env.update(extra)
    return env


def extract_command(out: str = "f.zarr") -> list[str]:
    return [
        "extract",
        "nets.py:build",
        "--data",
        "nets.py:rows",
        "-l",
        "0,2",
        "-o",
        out,
        "-b",
        "16",
        "--chunk-rows",
        "32",
        "--no-progress",
    ]


def folder(tmp_path: Path, name: str) -> Path:
    made = tmp_path / name
    made.mkdir()
    (made / "nets.py").write_text(NETS)
    return made


def hookscope(cwd: Path, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "hookscope", *argv],
        cwd=cwd,
        env=env or environment(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, done.stderr
    return done


def test_killed_with_sigkill_then_resumed_is_bit_identical(tmp_path: Path) -> None:
    whole, killed = folder(tmp_path, "whole"), folder(tmp_path, "killed")
    hookscope(whole, *extract_command())
    done_flags = killed / "f.zarr" / "_hookscope" / "done" / "c"
    with subprocess.Popen(
        [sys.executable, "-m", "hookscope", *extract_command()],
        cwd=killed,
        env=environment(SLOW="1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    ) as running:
        deadline = time.monotonic() + TIMEOUT
        while not (done_flags.is_dir() and len(list(done_flags.iterdir())) >= 3):
            assert running.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.01)
        running.send_signal(signal.SIGKILL)
        running.wait(timeout=TIMEOUT)
    flags = len(list(done_flags.iterdir()))
    assert 3 <= flags < 32, flags  # killed part-way: some chunks recorded, not all
    refused = subprocess.run(
        [sys.executable, "-c", "import hookscope as hs; hs.open_store('f.zarr')"],
        cwd=killed,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert "is incomplete" in refused.stderr
    (killed / "fetches.log").unlink()
    resumed = hookscope(killed, *extract_command())
    assert "wrote 1,024 rows of 2 sites" in resumed.stdout
    fetched = len((killed / "fetches.log").read_text().splitlines())
    assert fetched <= 1024 - 32 * flags + 16, fetched  # done chunks were not fetched again (16: the probe)
    assert store_files(killed / "f.zarr") == store_files(whole / "f.zarr")


def test_torchrun_two_cpu_processes_write_the_same_store_as_one(tmp_path: Path) -> None:
    single, sharded = folder(tmp_path, "single"), folder(tmp_path, "sharded")
    hookscope(single, *extract_command())
    launched = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "hookscope",
            *extract_command(),
        ],
        cwd=sharded,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert launched.stdout.count("wrote 1,024 rows of 2 sites") == 1  # rank 0 reports
    pids = set((sharded / "fetches.log").read_text().split())
    assert len(pids) == 2  # both ranks fetched rows
    assert store_files(sharded / "f.zarr") == store_files(single / "f.zarr")


def test_peak_memory_does_not_grow_with_the_rows(tmp_path: Path) -> None:
    (tmp_path / "rss.py").write_text(RSS)

    def peak(rows: int) -> int:
        done = subprocess.run(
            [sys.executable, "rss.py", str(rows), f"s{rows}.zarr"],
            cwd=tmp_path,
            env=environment(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        assert done.returncode == 0, done.stderr
        return int(done.stdout.split()[-1])

    small, large = peak(256), peak(256 * 20)  # 8 MiB and 160 MiB of features
    assert large <= small * 1.10, (small, large)


@pytest.mark.parametrize("spec", ["nets.py:nothing", "missing.npy", "random:0:4"])
def test_a_data_spec_that_does_not_exist_exits_2(tmp_path: Path, spec: str) -> None:
    where = folder(tmp_path, "bad")
    done = subprocess.run(
        [sys.executable, "-m", "hookscope", "extract", "nets.py:build", "--data", spec, "-l", "0", "-o", "f.zarr"],
        cwd=where,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: data")
    assert "Traceback" not in done.stderr
    assert not (where / "f.zarr").exists()

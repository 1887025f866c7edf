"""``hookscope extract`` as real processes: killed with SIGKILL and resumed, sharded by torchrun
(2 CPU processes, gloo), and with peak memory that does not grow with the number of rows."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.extract.test_extract import store_files

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

NETS = """
import os
import time

import torch
from torch import nn


def build():
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 32))
    model.register_forward_pre_hook(_log_forward)
    return model


def _log_forward(module, args):
    with open("forwards.log", "a") as log:
        log.write(f"{len(args[0])}\\n")


class Rows(torch.utils.data.Dataset):
    '''Fixed rows; each fetch is logged with the process id and, when SLOW is set, takes a while.'''

    def __init__(self):
        self.x = torch.randn(1024, 64, generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        if os.environ.get("SLOW"):
            time.sleep(0.003)
        failing, rank = os.environ.get("FAIL_AT"), os.environ.get("RANK", "0")
        if failing and index == int(failing) and os.environ.get("FAIL_RANK", rank) == rank:
            raise RuntimeError(f"row {index} is unreadable")
        with open("fetches.log", "a") as log:
            log.write(f"{os.getpid()}\\n")
        return self.x[index]


def rows():
    return Rows()
"""

RSS = """
import sys
from pathlib import Path

import torch
from torch import nn

import hookscope as hs
from hookscope.cli.parse.data_specs import RandomRows

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 8192))
data = RandomRows(int(sys.argv[1]), (64,), seed=0)
Path("/proc/self/clear_refs").write_text("5")  # the peak from here on: the extraction's, not the imports'
hs.extract(model, data, sys.argv[2], layers="0", batch_size=64, progress=False, compression_level=1)
print(next(line.split()[1] for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM")))
"""

TIMEOUT = 240


def environment(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in ("SLOW", "FAIL_AT", "FAIL_RANK")}
    return {**env, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **extra}


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


def hookscope(
    cwd: Path, *argv: str, env: dict[str, str] | None = None, torchrun: bool = False, code: int = 0
) -> subprocess.CompletedProcess[str]:
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"] if torchrun else []
    done = subprocess.run(
        [sys.executable, *launcher, "-m", "hookscope", *argv],
        cwd=cwd,
        env=env or environment(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert (done.returncode == 0) if code == 0 else (done.returncode != 0), done.stderr[-3000:]
    return done


def done_chunks(store: Path) -> int:
    """Chunks the manifest records, counted from its element files (not the temporary files of a write)."""
    flags = store / "_hookscope" / "done" / "c"
    return sum(1 for path in flags.iterdir() if path.name.isdigit()) if flags.is_dir() else 0


def test_killed_with_sigkill_then_resumed_is_bit_identical(tmp_path: Path) -> None:
    whole, killed = folder(tmp_path, "whole"), folder(tmp_path, "killed")
    hookscope(whole, *extract_command())
    with subprocess.Popen(
        [sys.executable, "-m", "hookscope", *extract_command()],
        cwd=killed,
        env=environment(SLOW="1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    ) as running:
        deadline = time.monotonic() + TIMEOUT
        while done_chunks(killed / "f.zarr") < 3:
            assert running.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.01)
        running.send_signal(signal.SIGKILL)
        running.wait(timeout=TIMEOUT)
    flags = done_chunks(killed / "f.zarr")
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
    (killed / "forwards.log").unlink()
    resumed = hookscope(killed, *extract_command())
    assert "wrote 1,024 rows of 2 sites" in resumed.stdout
    fetched = len((killed / "fetches.log").read_text().splitlines())
    assert fetched <= 1024 + 16, fetched  # each row read once: done chunks' to check their checksums (16: the probe)
    ran = sum(int(line) for line in (killed / "forwards.log").read_text().splitlines())
    assert ran <= 1024 - 32 * flags + 16, ran  # done chunks were not run again (16: the probe)
    assert store_files(killed / "f.zarr") == store_files(whole / "f.zarr")


def test_torchrun_two_cpu_processes_write_the_same_store_as_one(tmp_path: Path) -> None:
    single, sharded = folder(tmp_path, "single"), folder(tmp_path, "sharded")
    hookscope(single, *extract_command())
    failed = hookscope(sharded, *extract_command(), env=environment(FAIL_AT="600"), code=1)  # one process, stops
    assert "row 600 is unreadable" in failed.stderr
    assert done_chunks(sharded / "f.zarr") == 18  # rows 0..575 landed
    (sharded / "fetches.log").unlink()
    (sharded / "forwards.log").unlink()
    launched = hookscope(sharded, *extract_command(), torchrun=True)  # resumed by two processes
    assert launched.stdout.count("wrote 1,024 rows of 2 sites") == 1  # rank 0 reports
    fetches: dict[str, int] = {}
    for pid in (sharded / "fetches.log").read_text().split():
        fetches[pid] = fetches.get(pid, 0) + 1
    # each rank: the probe, 9 of the 18 done chunks (to check their input rows), 7 of the 14 chunks left
    assert sorted(fetches.values()) == [16 + 9 * 32 + 7 * 32] * 2, fetches
    ran = sum(int(line) for line in (sharded / "forwards.log").read_text().splitlines())
    assert ran == 2 * (16 + 7 * 32), ran  # the model ran only on the chunks left (and each rank's probe)
    assert store_files(sharded / "f.zarr") == store_files(single / "f.zarr")


def test_a_rank_that_fails_makes_every_rank_fail(tmp_path: Path) -> None:
    where = folder(tmp_path, "failing")
    failed = hookscope(where, *extract_command(), env=environment(FAIL_AT="700", FAIL_RANK="1"), torchrun=True, code=1)
    assert "rank 1 of 2 failed writing chunks: RuntimeError: row 700 is unreadable" in failed.stderr
    meta = json.loads((where / "f.zarr" / "zarr.json").read_text())["attributes"]["hookscope"]
    assert meta["state"] == "writing"


def test_peak_memory_does_not_grow_with_the_rows(tmp_path: Path) -> None:
    (tmp_path / "rss.py").write_text(RSS)

    def peak(rows: int) -> int:
        done = subprocess.run(
            [sys.executable, "rss.py", str(rows), f"s{rows}.zarr"],
            cwd=tmp_path,
            # a fixed mmap threshold makes RSS follow live memory; glibc's moving one lets the peak of a longer
            # run drift up with heap fragmentation, leak or not (bench/README.md, bench_extract)
            env=environment(MALLOC_MMAP_THRESHOLD_="65536"),
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

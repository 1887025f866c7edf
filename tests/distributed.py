"""Run a function on 2 CPU processes (gloo) from a test: spawned, a rendezvous file, a result file per rank.

The target must be importable by name in a fresh interpreter (a module-level function of a
module under ``tests/``); it is called as ``target(rank, world, *args)`` after
``init_process_group`` and returns something picklable. Every rank has a deadline for its
collectives and the whole run one for joining, so a rank that dies never hangs the suite.
"""

from __future__ import annotations

import datetime
import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 30  # a rank stuck in a collective (its peer died) gives up after this
JOIN_TIMEOUT_S = 120  # the whole run, spawning and imports included


def _entry(rank: int, world: int, store: str, out: str, target: Callable[..., Any], args: tuple[Any, ...]) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    result: dict[str, Any] = {"rank": rank}
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        try:
            result["value"] = target(rank, world, *args)
        finally:
            dist.destroy_process_group()
    except BaseException as error:  # reported by the parent, with the rank's traceback
        result["error"] = "".join(traceback.format_exception(error))
    with open(Path(out, f"rank{rank}.pkl"), "wb") as file:
        file.write(pickle.dumps(result))
        file.flush()
        os.fsync(file.fileno())
    # The result is on disk: leave without interpreter teardown. Static destructors of the
    # collective backend's worker threads can abort ("terminate called without an active
    # exception") while the interpreter finalises, which would fail a rank that succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(target: Callable[..., Any], tmp_path: Path, *args: Any, world: int = 2) -> list[Any]:
    """``[target's value on rank 0, on rank 1, ...]``; a rank's exception fails the caller with its traceback."""
    store = tmp_path / "rendezvous"  # a FileStore: no port to pick, nothing to race for
    context = mp.start_processes(
        _entry, args=(world, str(store), str(tmp_path), target, args), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    try:
        while not context.join(timeout=0.1):  # raises ProcessExitedException if a rank died hard
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world} ranks still running after {JOIN_TIMEOUT_S}s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    results = [pickle.loads((tmp_path / f"rank{rank}.pkl").read_bytes()) for rank in range(world)]
    failed = [result for result in results if "error" in result]
    if failed:
        raise AssertionError("\n".join(f"rank {r['rank']} raised:\n{r['error']}" for r in failed))
    return [result["value"] for result in results]

"""What ``hs.diff()`` of two models costs in memory and time, against keeping both captures (CPU).

Two GPT-2 models of 12 layers (``GPT2Config(n_layer=12)``, random weights; b is a's copy with one weight of
block 6 changed), input ids 8 x 128, eval mode, ``torch.no_grad()``. Each method runs in a fresh process
with ``MALLOC_MMAP_THRESHOLD_=65536``, so resident memory follows live memory, and reports the peak
resident set (``VmHWM``) after the models are built (the mark is reset then) and the wall time:

- ``forwards``: ``a(x)`` then ``b(x)``, no hooks: the floor;
- ``hs.diff``: ``hs.diff(a, b, x)``, every module's inputs and outputs compared;
- ``two captures``: ``hs.capture`` of every module of a, then of b (outputs only), then each pair compared
  with ``torch`` on the host: what one writes without a streaming diff.

Why: the diff keeps one copy of a's values (on the CPU) and drops each as b's counterpart is compared, so it
should need about one activation set more than the forwards, where two captures hold two. No target: the
numbers go to the README, and ``--json PATH`` writes them with an empty ``summary`` list (nothing to judge).

Run: ``.venv/bin/python bench/bench_diff.py``; ``--layers N``, ``--batch N``; ``--quick`` (2 layers, batch 2).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

METHODS = ("forwards", "hs.diff", "two captures")
FIXED_MMAP = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def child(method: str, n_layer: int, batch: int) -> None:
    """Build both models, reset the peak mark, run ``method``, print peak KiB and seconds."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import GPT2Config, GPT2Model

    import hookscope as hs

    torch.manual_seed(0)
    a = GPT2Model(GPT2Config(n_layer=n_layer)).eval()  # type: ignore[no-untyped-call]
    b = copy.deepcopy(a)
    with torch.no_grad():
        b.h[n_layer // 2].mlp.c_fc.weight[0, 0] += 1.0
    ids = torch.randint(0, 50257, (batch, 128), generator=torch.Generator().manual_seed(0))
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")
    started = time.perf_counter()
    with torch.no_grad():
        if method == "forwards":
            a(ids)
            b(ids)
        elif method == "hs.diff":
            hs.diff(a, b, ids).first_divergence()
        else:
            with hs.capture(a, "*") as first:
                a(ids)
            with hs.capture(b, "*") as second:
                b(ids)
            for key in first.cache:
                x, y = first.cache[key].double(), second.cache[key].double()
                float((x - y).abs().max())
    seconds = time.perf_counter() - started
    peak = next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines() if "VmHWM" in line)
    print(peak, seconds)


def run(method: str, n_layer: int, batch: int) -> tuple[float, float]:
    argv = [sys.executable, __file__, "--child", method, "--layers", str(n_layer), "--batch", str(batch)]
    done = subprocess.run(argv, capture_output=True, text=True, check=True, env={**os.environ, **FIXED_MMAP})
    peak, seconds = done.stdout.split()[-2:]
    return int(peak) / 1024, float(seconds)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12, help="GPT-2 blocks (default 12)")
    parser.add_argument("--batch", type=int, default=8, help="sequences of 128 tokens (default 8)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 layers, batch 2")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON here")
    parser.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    n_layer, batch = (2, 2) if args.quick else (args.layers, args.batch)
    if args.child:
        child(args.child, n_layer, batch)
        return 0
    print(f"GPT-2 {n_layer} layers, input ids {batch} x 128, peak RSS after the models are built")
    results = {method: run(method, n_layer, batch) for method in METHODS}
    floor = results["forwards"][0]
    print(f"\n{'method':<14}{'peak MiB':>10}{'over forwards':>15}{'seconds':>10}")
    for method, (peak, seconds) in results.items():
        print(f"{method:<14}{peak:>10.0f}{peak - floor:>+15.0f}{seconds:>10.2f}")
    if args.json is not None:
        # written without ``common`` (which imports torch): the parent process only starts children
        data = {"layers": n_layer, "batch": batch, "peak_mib": {m: p for m, (p, _) in results.items()}}
        data |= {"seconds": {m: s for m, (_, s) in results.items()}, "summary": []}
        args.json.write_text(json.dumps(data, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Throughput of ``hs.extract`` against a plain forward and a naive capture loop, and its peak memory (CPU).

The workload: GPT-2 with 6 layers, ``GPT2Model(GPT2Config(n_layer=6))`` with random weights (nothing is
downloaded), eval mode, ``torch.no_grad()``, 2,048 sequences of 128 random token ids, batches of 32. Three sites,
the blocks ``h.1``, ``h.3`` and ``h.5``, each reduced to the mean over tokens (``(batch, 768)`` per batch).
Three methods go through the same rows:

- ``forward``: ``model(ids[i:i + 32])`` for every batch, nothing kept: the floor;
- ``extract``: ``hs.extract(model, ids, layers, out, reduce="mean:1", batch_size=32)`` into a fresh zarr store
  (zstd level 3, the default), the whole call timed: attach, every forward, compression and writing on the writer
  thread, the manifest, completing the store;
- ``naive``: forward hooks on the three blocks that keep ``output.mean(1).numpy()``, and ``np.save`` of each
  site's array per batch into a folder, the loop people write by hand.

Why: extraction runs for hours over large data sets, so what it adds to the forward is what it costs. The target
is ``extract`` at least 0.9x the rows/s of ``forward`` (median of per-round ratios).

Before timing, the script checks that the store's rows equal the naive loop's arrays (to float32 round-off).
After timing, it times the store's integrity work alone: the checksums of every chunk's values and input rows,
the full model fingerprint, and a rerun on the complete store, which checks every chunk and input row.

How it is measured: each round runs every method once over all the rows, in an order rotated from round to
round, after a full garbage collection; the figures are medians of per-round ratios, since the machine drifts.
No warm-up round: each timed call runs 64 batches, so one-off costs are small beside it. Peak memory: ``--rss``
runs ``extract`` alone in fresh processes over N (``--rss-rows``, default ``--rows``) and 4N rows, with glibc's
default allocator and with a fixed mmap threshold, and reports their peak RSS (``ru_maxrss``).

Run: ``.venv/bin/python bench/bench_extract.py``; ``--rounds N``; ``--rows N``; ``--rss [--rss-rows N]`` adds the
memory runs;
``--quick`` for a smoke run (2-layer GPT-2, 128 rows).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Run as a file, not as a package: make ``common`` (next to this file) importable from any working directory.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import torch
from torch import nn
from transformers import GPT2Config, GPT2Model

import common
import hookscope as hs
from hookscope._extract.config import fingerprint
from hookscope._store.checksums import crc32c

TARGET = 0.9
N_LAYER, QUICK_N_LAYER = 6, 2
ROWS, QUICK_ROWS = 2048, 128
SEQ_LEN, BATCH = 128, 32
SITES = ["h.1", "h.3", "h.5"]
QUICK_SITES = ["h.0", "h.1"]
DEFAULT_ROUNDS, MIN_ROUNDS, QUICK_ROUNDS = 3, 3, 1
FORWARD, EXTRACT, NAIVE = "forward", "extract", "naive"


@dataclass
class Table(common.RoundRatios):
    """Seconds per method per round, over the same rows."""

    key: str
    title: str
    rows: int
    times: dict[str, list[float]]
    notes: list[str] = field(default_factory=list)

    def rows_per_second(self, name: str) -> float:
        return self.rows / statistics.median(self.times[name])


# -- the methods ------------------------------------------------------------------------------------


class Methods:
    """The three ways through the rows; each writes into its own folder under ``scratch``."""

    def __init__(self, sites: list[str], scratch: Path) -> None:
        self.sites = sites
        self.scratch = scratch

    def forward(self, model: nn.Module, ids: torch.Tensor) -> common.Timed:
        def loop() -> None:
            for start in range(0, len(ids), BATCH):
                model(ids[start : start + BATCH])

        return common.timed_call(loop)

    def extract(self, model: nn.Module, ids: torch.Tensor) -> common.Timed:
        out = self.fresh("store.zarr")
        return common.timed_call(
            lambda: hs.extract(model, ids, self.sites, out, reduce="mean:1", batch_size=BATCH, progress=False)
        )

    def naive(self, model: nn.Module, ids: torch.Tensor) -> common.Timed:
        folder = self.fresh("naive")
        folder.mkdir()
        kept: dict[str, np.ndarray] = {}
        handles = [
            model.get_submodule(site).register_forward_hook(
                lambda module, args, output, site=site: kept.__setitem__(site, output.mean(1).numpy())
            )
            for site in self.sites
        ]

        def loop() -> None:
            for start in range(0, len(ids), BATCH):
                model(ids[start : start + BATCH])
                for site, values in kept.items():
                    np.save(folder / f"{site}-{start:08d}.npy", values)

        try:
            return common.timed_call(loop)
        finally:
            for handle in handles:
                handle.remove()

    def fresh(self, name: str) -> Path:
        path = self.scratch / name
        if path.exists():
            shutil.rmtree(path)
        return path

    def runs(self) -> dict[str, common.Run]:
        return {FORWARD: self.forward, EXTRACT: self.extract, NAIVE: self.naive}


def check(methods: Methods, model: nn.Module, ids: torch.Tensor) -> list[str]:
    """The store's rows equal the naive loop's arrays; a note for the report."""
    methods.extract(model, ids)
    methods.naive(model, ids)
    store = hs.open_store(methods.scratch / "store.zarr")
    for site in methods.sites:
        naive = np.concatenate([np.load(p) for p in sorted((methods.scratch / "naive").glob(f"{site}-*.npy"))])
        assert np.allclose(store[site][:], naive, atol=1e-5), f"{site}: the store differs from the naive arrays"
    size = sum(f.stat().st_size for f in (methods.scratch / "store.zarr").rglob("*") if f.is_file())
    return [
        f"sites {', '.join(methods.sites)}, reduce mean:1 -> {len(methods.sites)} arrays of (N, 768) float32; "
        f"store {size / 2**20:.2f} MiB on disk ({store.meta['chunks']} chunks of {store.chunk_rows} rows)",
        "the store's rows equal the naive loop's arrays (atol 1e-5)",
    ]


def integrity(methods: Methods, model: nn.Module, ids: torch.Tensor, forward_s: float) -> list[str]:
    """What the store's integrity costs, each part timed alone, as notes for the report.

    The checksums written with every chunk (its values and its input rows) and the writer record
    are inside ``extract``'s time above; here each part is also timed on its own, and so is the
    check a resumed or repeated run makes of every done chunk (reading the store and the input
    rows again, the model not run), against the forward over the same rows.
    """
    out = methods.scratch / "store.zarr"  # complete, from check()
    store = hs.open_store(out)
    values = [store[site][:] for site in methods.sites]
    started = time.perf_counter()
    for array in values:
        crc32c(array)
    crc32c(ids.numpy())
    checksums = time.perf_counter() - started
    started = time.perf_counter()
    fingerprint(model)
    fingerprinted = time.perf_counter() - started
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    started = time.perf_counter()
    hs.extract(model, ids, methods.sites, out, reduce="mean:1", batch_size=BATCH, progress=False)  # checks, writes none
    rerun = time.perf_counter() - started
    return [
        f"integrity, timed alone: checksums of every chunk's values and input rows {checksums * 1e3:.1f} ms "
        f"({checksums / forward_s:.2%} of the forward); full model fingerprint ({size / 2**20:.0f} MiB of weights) "
        f"{fingerprinted * 1e3:.0f} ms, once per run",
        f"a rerun on the complete store (every chunk read and checked, every input row checked, no forward): "
        f"{rerun:.2f} s, {rerun / forward_s:.3f}x the forward over the same rows",
    ]


def bench(quick: bool, rows: int, rounds: int) -> Table:
    n_layer = QUICK_N_LAYER if quick else N_LAYER
    config = GPT2Config(n_layer=n_layer)
    model = GPT2Model(config).eval()
    ids = torch.randint(0, config.vocab_size, (rows, SEQ_LEN))
    sites = QUICK_SITES if quick else SITES
    with tempfile.TemporaryDirectory(prefix="bench-extract-") as scratch:
        methods = Methods(sites, Path(scratch))
        notes = check(methods, model, ids)
        times = common.measure(methods.runs(), model, ids, rounds, warmup=0, first_round=None)
        notes += integrity(methods, model, ids, statistics.median(times[FORWARD]))
    title = f"GPT-2 {n_layer} layers, {rows:,} sequences x {SEQ_LEN} tokens, batch {BATCH}"
    return Table("gpt2", title, rows, times, notes)


# -- peak memory in fresh processes -----------------------------------------------------------------


def rss_child(rows: int, quick: bool) -> None:
    """``--rss-child N``: extract N rows once in this fresh process; print the peak RSS of the extraction in KiB.

    The peak is reset after the model is built (``/proc/self/clear_refs``), so that building GPT-2's
    weights, which peaks higher than a forward, does not hide what the extraction itself holds.
    """
    common.prepare_torch(2)
    config = GPT2Config(n_layer=QUICK_N_LAYER if quick else N_LAYER)
    model = GPT2Model(config).eval()
    ids = torch.randint(0, config.vocab_size, (rows, SEQ_LEN))
    reset_peak()
    with tempfile.TemporaryDirectory(prefix="bench-extract-rss-") as scratch, torch.no_grad():
        hs.extract(
            model, ids, QUICK_SITES if quick else SITES, Path(scratch) / "s.zarr", reduce="mean:1", progress=False
        )
    print(peak_kib())


def reset_peak() -> None:
    """Reset the kernel's peak-RSS mark of this process (Linux); harmless where it cannot."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_kib() -> int:
    """Peak RSS since :func:`reset_peak` (``VmHWM``), else since the process started (``ru_maxrss``)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


# glibc's default allocator raises its mmap threshold as large blocks are freed, then serves them from a heap
# that other threads' small allocations fragment: peak RSS then drifts up by a few hundred MiB with any work
# that runs long (a random walk's maximum), leak or not. A fixed threshold makes RSS follow live memory.
FIXED_MMAP = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def peak_rss(rows: int, quick: bool, env: dict[str, str] | None = None) -> int:
    """Peak RSS in KiB of ``extract`` over ``rows`` rows in a fresh process (``env`` added to its environment)."""
    argv = [sys.executable, __file__, "--rss-child", str(rows)] + (["--quick"] if quick else [])
    done = subprocess.run(argv, capture_output=True, text=True, check=True, env={**os.environ, **(env or {})})
    return int(done.stdout.split()[-1])


# -- reporting --------------------------------------------------------------------------------------


def extract_over_forward(table: Table) -> float:
    """Rows/s of extract over rows/s of the forward: the inverse of the per-round time ratio."""
    return 1 / table.median_ratio(EXTRACT, FORWARD)


def passed(table: Table) -> bool:
    return extract_over_forward(table) >= TARGET


def format_table(table: Table) -> str:
    header = f"{'method':<10}{'median s':>10}{'rows/s':>10}{'x forward (rows/s)':>20}{'range':>16}"
    lines = [table.title, *(f"  {note}" for note in table.notes), "", header]
    for name, seconds in table.times.items():
        speed = [1 / r for r in table.ratios(name, FORWARD)]
        row = f"{name:<10}{statistics.median(seconds):>10.2f}{table.rows_per_second(name):>10.1f}"
        row += f"{statistics.median(speed):>20.3f}{common.ratio_range(speed):>16}"
        lines.append(row)
    verdict = "PASS" if passed(table) else "FAIL"
    lines += [
        "",
        f"{table.key}: extract rows/s over forward rows/s: {extract_over_forward(table):.3f} "
        f"(target >= {TARGET:.2f}): {verdict}",
    ]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    def extra(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--rows", type=int, default=None, help=f"sequences (default {ROWS})")
        parser.add_argument("--rss", action="store_true", help="also measure peak RSS for N and 4N rows")
        parser.add_argument("--rss-rows", type=int, default=None, help="N for --rss (default: --rows)")
        parser.add_argument("--rss-child", type=int, default=None, help=argparse.SUPPRESS)

    return common.parse_run_args(
        argv,
        description=__doc__.splitlines()[0],
        min_rounds=MIN_ROUNDS,
        default_rounds=DEFAULT_ROUNDS,
        quick_rounds=QUICK_ROUNDS,
        quick_help=f"smoke run: {QUICK_ROUNDS} round, {QUICK_N_LAYER}-layer GPT-2, {QUICK_ROWS} rows",
        check_help=f"exit 1 if extract's rows/s is below {TARGET}x the forward's",
        extra=extra,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rss_child is not None:
        rss_child(args.rss_child, args.quick)
        return 0
    common.prepare_torch(args.threads)
    rows = args.rows or (QUICK_ROWS if args.quick else ROWS)
    print(f"torch {torch.__version__}, {common.threads_label(args.threads)}, {args.rounds} rounds, torch.no_grad()")
    with torch.no_grad():
        table = bench(args.quick, rows, args.rounds)
    print(f"\n{format_table(table)}", flush=True)
    data: dict[str, Any] = {"torch_version": torch.__version__, "threads": args.threads, "rounds": args.rounds}
    data |= {"target": TARGET, "table": asdict(table) | table.medians(FORWARD), "passed": passed(table)}
    speed = extract_over_forward(table)
    data["summary"] = [common.summary_row("hs.extract rows/s over forward", speed, TARGET, better="higher")]
    if args.rss:
        n = args.rss_rows or rows
        data["peak_rss_kib"] = {}
        print()
        for label, env in (("default allocator", None), ("MALLOC_MMAP_THRESHOLD_=65536", FIXED_MMAP)):
            small, large = peak_rss(n, args.quick, env), peak_rss(4 * n, args.quick, env)
            print(
                f"peak RSS of extract alone, {label}: {n:,} rows {small / 1024:.0f} MiB, {4 * n:,} rows "
                f"{large / 1024:.0f} MiB ({large / small:.3f}x)",
                flush=True,
            )
            data["peak_rss_kib"][label] = {str(n): small, str(4 * n): large}
    if args.json is not None:
        common.write_json(args.json, data)
    return 1 if args.check and not passed(table) else 0


if __name__ == "__main__":
    sys.exit(main())

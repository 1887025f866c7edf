"""Wall-clock seconds of ``hs.report()`` writing the HTML report of a 12-layer GPT-2 (CPU).

The workload: ``GPT2Model(GPT2Config(n_layer=12))`` with random weights (nothing is downloaded), eval mode, on a
batch of 4 x 128 random token ids, ``torch.manual_seed(0)``. Two methods:

- ``plain``: ``model(ids)`` under ``torch.no_grad()``, for orientation only (no target);
- ``report``: ``hs.report(model, ids, out=<temp dir>/report.html)`` with its defaults, the whole call timed: the
  trace with statistics and histograms of every module call, the feature maps' capture (the forward runs twice),
  the figures drawn with matplotlib, and the page rendered and written.

Why: a report is what one asks for while looking at a model, so it should come back in about the time it takes
to look away: the target is a median of at most 3.0 seconds. Unlike the other scripts' ratios this is absolute
time, so it depends on the machine; the ``x plain`` column (report over a plain forward in the same round) says
how much of a miss is the machine being slow rather than the report.

How it is measured: each method is warmed up with one call (the first report imports and sets up matplotlib and
jinja2), then every round times one call per method, in an order rotated from round to round, after a full
garbage collection (see ``bench/common.py``). The figure held to the target is the median of the report's
seconds over the rounds; the page is rewritten in the same file every time and removed at the end.

Run: ``.venv/bin/python bench/bench_report.py``; ``--rounds N``; ``--quick`` for a smoke run (2-layer GPT-2, one
round).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Run as a file, not as a package: make ``common`` (next to this file) importable from any working directory.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from torch import nn

import common
import hookscope as hs

TARGET_S = 3.0
N_LAYER = 12
QUICK_N_LAYER = 2
DEFAULT_ROUNDS = 5
MIN_ROUNDS = 3
QUICK_ROUNDS = 1
WARMUP = 1
PLAIN, REPORT = "plain", "report"


@dataclass
class Table(common.RoundRatios):
    """Timings of the plain forward and of the report, and the size of the page written."""

    key: str
    title: str
    times: dict[str, list[float]]
    html_bytes: int


# -- the methods ------------------------------------------------------------------------------------


def methods(out: Path) -> dict[str, common.Run]:
    """The plain forward and the report written to ``out``, each timed as one call."""

    def run_plain(model: nn.Module, x: Any) -> common.Timed:
        with torch.no_grad():
            return common.timed_call(lambda: model(x))

    def run_report(model: nn.Module, x: Any) -> common.Timed:
        return common.timed_call(lambda: hs.report(model, x, out=out))

    return {PLAIN: run_plain, REPORT: run_report}


def bench(n_layer: int, rounds: int) -> Table:
    """Time both methods on GPT-2 of ``n_layer`` layers, writing the page into a temporary folder."""
    work = common.gpt2_workload(n_layer)
    with tempfile.TemporaryDirectory(prefix="bench-report-") as folder:
        out = Path(folder) / "report.html"
        times = common.measure(methods(out), work.model, work.inputs, rounds, WARMUP)
        html_bytes = out.stat().st_size
    return Table(work.key, work.title, times, html_bytes)


# -- reporting --------------------------------------------------------------------------------------


def report_seconds(table: Table) -> float:
    """The figure held to the target: the median seconds of one report."""
    return statistics.median(table.times[REPORT])


def passed(table: Table) -> bool:
    """True when the median report takes at most ``TARGET_S`` seconds."""
    return report_seconds(table) <= TARGET_S


def format_table(table: Table) -> str:
    """The table: median seconds, the report over a plain forward and its range, the page size, and the verdict."""
    header = f"{'method':<10}{'median s':>10}{'x plain':>9}{'range x plain':>16}"
    lines = [table.title, f"  page written: {table.html_bytes / 2**20:.2f} MiB", "", header]
    for name, seconds in table.times.items():
        per_round = table.ratios(name, PLAIN)
        row = f"{name:<10}{statistics.median(seconds):>10.3f}{table.median_ratio(name, PLAIN):>9.2f}"
        lines.append(row + f"{common.ratio_range(per_round):>16}")
    verdict = "PASS" if passed(table) else "FAIL"
    what = "hs.report writing the HTML page, median seconds"
    lines += ["", f"{table.key}: {what}: {report_seconds(table):.2f} s (target <= {TARGET_S:.2f} s): {verdict}"]
    return "\n".join(lines)


def table_to_json(table: Table) -> dict[str, Any]:
    """The table as JSON-ready data (:func:`common.table_json`)."""
    return common.table_json(table, passed(table), PLAIN)


# -- entry point ------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options; ``--quick`` overrides ``--rounds`` and shrinks the model."""
    return common.parse_run_args(
        argv,
        description=__doc__.splitlines()[0],
        min_rounds=MIN_ROUNDS,
        default_rounds=DEFAULT_ROUNDS,
        quick_rounds=QUICK_ROUNDS,
        quick_help=f"smoke run: {QUICK_ROUNDS} round, {QUICK_N_LAYER}-layer GPT-2",
        check_help=f"exit 1 if the median report takes over {TARGET_S} s",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print the report, and return the exit code."""
    args = parse_args(argv)
    common.start(args, f"warm-up {WARMUP}, eval mode")
    table = bench(QUICK_N_LAYER if args.quick else N_LAYER, args.rounds)
    print(f"\n{format_table(table)}", flush=True)
    summary = [common.summary_row("hs.report of GPT-2, median seconds", report_seconds(table), TARGET_S, unit="s")]
    return common.finish(args, [table_to_json(table)], passed(table), target_s=TARGET_S, warmup=WARMUP, summary=summary)


if __name__ == "__main__":
    sys.exit(main())

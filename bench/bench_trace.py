"""What ``hs.trace()`` costs over a plain forward, with statistics of every module call and without (CPU).

Two models, random weights from their configs (nothing is downloaded), eval mode, ``torch.no_grad()``:

- ResNet-50 (``ResNetModel(ResNetConfig())``: bottleneck blocks, depths 3, 4, 6, 3), input ``randn(8, 3, 224, 224)``;
- GPT-2, 12 layers (``GPT2Model(GPT2Config(n_layer=12))``, the default depth), input ids batch 4 x 128, passed
  positionally as in ``bench_capture.py``.

Seven methods run the same forward of each model:

- ``plain``: ``model(x)`` alone;
- ``trace``: ``hs.trace(model, x)`` with its defaults: one row per module call, and on every tensor a call
  takes or returns its min, max, mean, std, mean |x|, fraction of zeros and NaN/Inf counts, computed inside
  the hooks and read on the host once, after the forward;
- ``trace stats=False``: ``hs.trace(model, x, stats=False)``, shapes and dtypes only;
- ``trace histograms``: ``hs.trace(model, x, histograms=True)``, the statistics plus a 64-bucket histogram of
  every measured tensor (a sample of at most 32,768 values), as the HTML report takes it;
- ``detect_nonfinite``: ``with hs.detect_nonfinite(model): model(x)``;
- ``naive hooks``: ``register_forward_hook`` on every module, computing each of the eight statistics of every
  floating-point output tensor with its own ``.item()`` call (``min``, ``max``, ``mean``, ``std``,
  ``abs().mean()``, ``(o == 0).float().mean()``, ``isnan().sum()``, ``isinf().sum()``): what one writes by hand;
- ``torchinfo summary``: ``torchinfo.summary(model, input_data=x, verbose=0)``, a shapes-only summary from
  another library, for comparison (skipped, with a note, where torchinfo is not installed).

Why: a trace with statistics is what one runs to look at every activation of a model at once, and it should
cost little more than the forward. Targets (median ratio over plain): ``trace`` at most 1.15x on ResNet-50 and
1.08x on GPT-2, ``detect_nonfinite`` at most 1.03x on each; the other methods are there for comparison.

Beside a busy process: ResNet-50's ``plain``, ``trace`` and ``trace stats=False`` run again while another
process spins on one of the cores (``--no-busy`` skips it). A shared machine is where many small parallel
reductions hurt: each one waits for a thread the other process holds. Target: ``trace`` at most 1.5x plain.

How it is measured: every figure is a ratio between methods timed in the same process and the same round,
because the machine drifts by several percent over minutes. Each round times one call per method, in an
order rotated from round to round. Each timer covers the whole call a user makes: ``hs.trace`` attaches its
hooks, runs the forward, reads the statistics and removes the hooks in one call, so the naive hooks are
attached and removed inside their timer too, and ``detect_nonfinite`` is timed with its ``with`` block.
A full garbage collection runs before every timed call, for every method, so that what the previous method
left behind is not collected inside someone else's timer. The reported ratio is the median of the per-round
ratios, not the ratio of medians.

Before timing, the script runs the naive hooks and ``hs.trace`` once and asserts that they saw the same
module calls and agree on the statistics of every floating-point output: min, max and NaN/Inf counts exactly,
the other fields to 1e-4 relative. On the CPU ``hs.trace`` reads each tensor once with its fused kernel, whose
float32 sums run over blocks of ``kernel.BLOCK_VALUES`` values (read from the library) before they go to
float64; the statistics path that ran is printed with the notes; the check prints the largest deviation it saw:
2.7e-7 on ResNet-50 and 1.0e-7 on GPT-2 when last measured (1.8e-6 and 3.1e-6 with the torch path).

Measured when the kernel landed (three runs of 15 rounds): trace 1.10-1.34x on ResNet-50, 1.06-1.37x on GPT-2
(1.50x and 1.30x with ``HOOKSCOPE_FUSED_STATS=0``), 1.12-1.24x beside a busy process (1.64x), ``detect_nonfinite``
1.11-1.19x and 1.03-1.09x. Those runs read long tensors with torch's OpenMP team, whose parallel region ends at a
barrier that waits for a team thread another process holds off its core. A later build read every tensor under 16 Mi
values alone: on a machine loaded 3-9 by other jobs trace over plain went from 1.25, 1.40, 2.12, 1.40, 1.43x to 1.11,
3.00, 1.14, 1.33, 1.11x, but on a quiet one the team is about twice as fast. Now tensors of ``kernel.TEAM_MIN_VALUES``
values and more go whichever way has been reading faster (timed as they are read). One sitting, the three builds in
alternating processes (ResNet-50, 7 rounds; quiet, then beside a busy process): the team for every long tensor 1.22
and 1.20x, 1.28 and 1.24x, 1.41 and 1.40x; alone under 16 Mi values 1.44 and 1.38x, 1.40 and 1.12x; the faster way
1.28 and 1.23x (from 1 Mi values), 1.38 and 1.20x, 1.39 and 1.47x (from 512 Ki). In one process with the choice
forced, 8 rounds: the faster way 1.29x, always the team 1.45x, always alone 1.44x. The machine's own noise (per-round
ratios from 0.96 to 1.91x) is larger than the differences, and the 1.15x target was not met by any build.

Run: ``.venv/bin/python bench/bench_trace.py``; ``--model resnet50|gpt2|all``, ``--rounds N`` (default 15:
single rounds vary by 10% and more), ``--no-busy``; ``--quick`` for a smoke run.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Run as a file, not as a package: make ``common`` (next to this file) importable from any working directory.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from torch import nn

import common
import hookscope as hs

# trace with statistics over plain, per model; detect_nonfinite over plain; trace under a busy process
TARGETS = {"resnet50": 1.15, "gpt2": 1.08}
TARGET_NONFINITE = 1.03
TARGET_BUSY = 1.5
BUSY_MODEL = "resnet50"
DEFAULT_ROUNDS = 15
MIN_ROUNDS = 5
QUICK_ROUNDS = 2
WARMUP = 2  # the first traced forwards fault in fresh pages and fill caches: one warm-up read 2.0x, two 1.4x
MODELS = ("resnet50", "gpt2")
INSTALL_HINT = "pip install torchinfo"
# The naive hook's statistics, in the order they are computed and compared.
NAIVE_FIELDS = ("min", "max", "mean", "std", "abs_mean", "zero_frac", "nan", "inf")
# mean, std, mean |x| and zero fraction agree to a few 1e-6 (see the module docstring); 1e-4 leaves room.
REL_TOL = 1e-4

NaiveRecord = list[tuple[str, list[tuple[float, ...]]]]


@dataclass
class Table(common.RoundRatios):
    """Timings of one model's methods."""

    key: str
    title: str
    times: dict[str, list[float]]
    notes: list[str] = field(default_factory=list)


# -- the methods ------------------------------------------------------------------------------------


def run_plain(model: nn.Module, x: Any) -> common.Timed:
    """The forward alone."""
    return common.timed_call(lambda: model(x))


def run_trace(model: nn.Module, x: Any) -> common.Timed:
    """``hs.trace(model, x)`` with its defaults: statistics of every tensor of every module call."""
    return common.timed_call(lambda: hs.trace(model, x))


def run_trace_histograms(model: nn.Module, x: Any) -> common.Timed:
    """``hs.trace(model, x, histograms=True)``: statistics and a histogram of every tensor."""
    return common.timed_call(lambda: hs.trace(model, x, histograms=True))


def run_trace_shapes(model: nn.Module, x: Any) -> common.Timed:
    """``hs.trace(model, x, stats=False)``: shapes only."""
    return common.timed_call(lambda: hs.trace(model, x, stats=False))


def run_detect_nonfinite(model: nn.Module, x: Any) -> common.Timed:
    """``with hs.detect_nonfinite(model): model(x)``."""

    def call() -> Any:
        with hs.detect_nonfinite(model):
            return model(x)

    return common.timed_call(call)


def output_tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors of an output: a tensor, or those inside tuples, lists and dicts (a ``ModelOutput``)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from output_tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from output_tensors(item)


def naive_stats(record: NaiveRecord, name: str) -> Callable[[nn.Module, Any, Any], None]:
    """A hand-written hook: the eight statistics of every floating-point output, one ``.item()`` each."""

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        values = []
        for o in output_tensors(output):
            if o.is_floating_point():
                values.append(
                    (
                        o.min().item(),
                        o.max().item(),
                        o.mean().item(),
                        o.std().item(),
                        o.abs().mean().item(),
                        (o == 0).float().mean().item(),
                        o.isnan().sum().item(),
                        o.isinf().sum().item(),
                    )
                )
        record.append((name, values))

    return hook


def naive_forward(model: nn.Module, x: Any, record: NaiveRecord) -> Any:
    """Attach the naive hook to every module (the root included), run the forward, remove the hooks."""
    handles = [module.register_forward_hook(naive_stats(record, name)) for name, module in model.named_modules()]
    try:
        return model(x)
    finally:
        for handle in handles:
            handle.remove()


def run_naive(model: nn.Module, x: Any) -> common.Timed:
    """The naive hooks, attached and removed inside the timer (as ``hs.trace`` does inside its call)."""
    record: NaiveRecord = []
    return common.timed_call(lambda: (naive_forward(model, x, record), record))


def run_torchinfo(model: nn.Module, x: Any) -> common.Timed:
    """``torchinfo.summary(model, input_data=x, verbose=0)``."""
    from torchinfo import summary

    return common.timed_call(lambda: summary(model, input_data=x, verbose=0))


def methods() -> tuple[dict[str, common.Run], list[str]]:
    """The methods to time, and notes on those skipped."""
    table: dict[str, common.Run] = {
        "plain": run_plain,
        "trace": run_trace,
        "trace stats=False": run_trace_shapes,
        "trace histograms": run_trace_histograms,
        "detect_nonfinite": run_detect_nonfinite,
        "naive hooks": run_naive,
    }
    if importlib.util.find_spec("torchinfo") is None:
        return table, [f"torchinfo summary: skipped, torchinfo is not installed; install it with `{INSTALL_HINT}`"]
    table["torchinfo summary"] = run_torchinfo
    return table, []


# -- the check --------------------------------------------------------------------------------------


def deviation(ours: float, theirs: float, scale: float) -> float:
    """``|ours - theirs|`` relative to the value, or to ``scale`` for values near zero; 0 for two NaNs."""
    if math.isnan(ours) or math.isnan(theirs):
        return 0.0 if math.isnan(ours) and math.isnan(theirs) else math.inf
    return abs(ours - theirs) / max(abs(theirs), scale)


def trace_values(stats: hs.Stats) -> tuple[float, ...]:
    """A trace's statistics in the naive hook's order (``inf`` counts both signs)."""
    return (
        stats.min,
        stats.max,
        stats.mean,
        stats.std,
        stats.abs_mean,
        stats.zero_frac,
        stats.nan,
        stats.posinf + stats.neginf,
    )


def check_trace(work: common.Workload) -> list[str]:
    """Run the naive hooks and ``hs.trace`` once; assert the same module calls and the same statistics.

    Returns notes for the report: module, call and tensor counts.
    """
    record: NaiveRecord = []
    naive_forward(work.model, work.inputs, record)
    traced = hs.trace(work.model, work.inputs)
    assert len(traced) == len(record), f"hs.trace has {len(traced)} rows, the naive hooks saw {len(record)} calls"
    naive: dict[str, list[list[tuple[float, ...]]]] = defaultdict(list)
    for name, values in record:
        naive[name].append(values)
    compared, largest = 0, 0.0
    for row in traced:
        outputs = [info for info in row.outputs if getattr(torch, info.dtype).is_floating_point]
        theirs = naive[row.name][row.call]
        assert len(outputs) == len(theirs), f"{row.site}: {len(outputs)} outputs traced, {len(theirs)} naive"
        for info, expected in zip(outputs, theirs, strict=True):
            assert info.stats is not None, f"{row.site} {info.path}: no statistics"
            got = trace_values(info.stats)
            scale = max(abs(expected[4]), abs(expected[3]), 1e-30)
            assert got[:2] == expected[:2], f"{row.site} {info.path}: min/max {got[:2]} != naive {expected[:2]}"
            assert got[6:] == expected[6:], f"{row.site} {info.path}: NaN/Inf {got[6:]} != naive {expected[6:]}"
            worst = max(deviation(a, b, scale) for a, b in zip(got[2:6], expected[2:6], strict=True))
            assert worst <= REL_TOL, f"{row.site} {info.path}: trace {got} != naive {expected}"
            compared, largest = compared + 1, max(largest, worst)
    modules = sum(1 for _ in work.model.named_modules())
    return [
        f"{modules} modules, {len(traced)} module calls traced (the root included), "
        f"{compared} floating-point outputs: min, max and NaN/Inf counts equal the naive hooks', "
        f"mean, std, mean |x| and zero fraction within {largest:.1e} relative (allowed {REL_TOL:.0e})"
    ]


# -- the workloads ----------------------------------------------------------------------------------

# ResNet-50 (one block per stage and batch 2 with ``quick``) and GPT-2 (12 layers; 2 with ``quick``).
WORKLOADS: dict[str, Callable[[bool], common.Workload]] = {
    "resnet50": common.resnet_workload,
    "gpt2": lambda quick: common.gpt2_workload(2 if quick else 12),
}


def bench(work: common.Workload, rounds: int) -> Table:
    """Check, then time every method on one workload."""
    notes = [f"statistics: {hs.info().statistics}", *check_trace(work)]
    runs, skipped = methods()
    times = common.measure(runs, work.model, work.inputs, rounds, WARMUP)
    return Table(work.key, work.title, times, notes + skipped)


@contextlib.contextmanager
def busy_core() -> Iterator[int]:
    """A process spinning on one core (the last this process may use) while the block runs; yields the core."""
    core = max(os.sched_getaffinity(0))
    spin = f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True:\n    pass\n"
    process = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.5)  # let it start spinning
        yield core
    finally:
        process.kill()
        process.wait(timeout=30)


def bench_busy(work: common.Workload, rounds: int) -> Table:
    """plain, trace and trace stats=False while another process keeps one core busy."""
    runs = {"plain": run_plain, "trace": run_trace, "trace stats=False": run_trace_shapes}
    with busy_core() as core:
        times = common.measure(runs, work.model, work.inputs, rounds, WARMUP)
    title = f"{work.title}, with another process spinning on core {core}"
    return Table(f"{work.key} busy", title, times, [])


# -- reporting --------------------------------------------------------------------------------------


def format_table(table: Table) -> str:
    """One model's table: medians, ratios to plain and to the trace, round range, and the verdict."""
    header = f"{'method':<20}{'median s':>10}{'x plain':>9}{'x trace':>9}{'range x plain':>16}"
    lines = [table.title, *(f"  {note}" for note in table.notes), "", header]
    for name, seconds in table.times.items():
        per_round = table.ratios(name, "plain")
        row = f"{name:<20}{statistics.median(seconds):>10.4f}{table.median_ratio(name, 'plain'):>9.3f}"
        row += f"{table.median_ratio(name, 'trace'):>9.3f}{common.ratio_range(per_round):>16}"
        lines.append(row)
    lines.append("")
    for row in summary_rows(table):
        verdict = "PASS" if row["value"] <= row["target"] else "MISS"
        lines.append(f"{row['name']}: {row['value']:.3f} (target <= {row['target']:.2f}): {verdict}")
    return "\n".join(lines)


def summary_rows(table: Table) -> list[common.SummaryRow]:
    """The ratios of one table that have a target, as rows of ``make bench``'s summary."""
    trace = table.median_ratio("trace", "plain")
    if table.key.endswith(" busy"):
        return [common.summary_row(f"{table.key}: trace with statistics over plain", trace, TARGET_BUSY)]
    nonfinite = table.median_ratio("detect_nonfinite", "plain")
    return [
        common.summary_row(f"{table.key}: trace with statistics over plain", trace, TARGETS[table.key]),
        common.summary_row(f"{table.key}: detect_nonfinite over plain", nonfinite, TARGET_NONFINITE),
    ]


def table_to_json(table: Table) -> dict[str, Any]:
    """A table as JSON-ready data, with medians and median ratios spelled out."""
    data = asdict(table) | table.medians("plain", "trace")
    data["passed"] = passed(table)
    return data


def passed(table: Table) -> bool:
    """True when every judged ratio of the table is within its target."""
    return all(row["value"] <= row["target"] for row in summary_rows(table))


# -- entry point ------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options; ``--quick`` overrides ``--rounds`` and shrinks the models."""
    return common.parse_run_args(
        argv,
        description=__doc__.splitlines()[0],
        min_rounds=MIN_ROUNDS,
        default_rounds=DEFAULT_ROUNDS,
        quick_help=f"smoke run: {QUICK_ROUNDS} rounds, small models",
        check_help="exit 1 if a ratio misses its target",
        quick_rounds=QUICK_ROUNDS,
        extra=add_options,
    )


def add_options(parser: argparse.ArgumentParser) -> None:
    """This script's own options."""
    parser.add_argument("--model", choices=[*MODELS, "all"], default="all", help="which model (default all)")
    parser.add_argument(
        "--no-busy", dest="busy", action="store_false", help=f"skip the run of {BUSY_MODEL} beside a busy process"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print the report, and return the exit code."""
    args = parse_args(argv)
    common.start(args, f"warm-up {WARMUP}, torch.no_grad(), eval mode")
    tables = []
    with torch.no_grad():
        for key in MODELS if args.model == "all" else [args.model]:
            work = WORKLOADS[key](args.quick)
            table = bench(work, args.rounds)
            tables.append(table)
            print(f"\n{format_table(table)}", flush=True)
            if args.busy and key == BUSY_MODEL:
                busy = bench_busy(work, args.rounds)
                tables.append(busy)
                print(f"\n{format_table(busy)}", flush=True)
    passed_all = all(map(passed, tables))
    summary = [row for table in tables for row in summary_rows(table)]
    targets = {"trace": TARGETS, "detect_nonfinite": TARGET_NONFINITE, "busy": TARGET_BUSY}
    return common.finish(
        args, [table_to_json(t) for t in tables], passed_all, targets=targets, warmup=WARMUP, summary=summary
    )


if __name__ == "__main__":
    sys.exit(main())

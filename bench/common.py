"""What the benchmark scripts share: the timing loop, the workloads, per-round ratios and the run options.

The scripts compare methods on a machine whose speed drifts by several percent over minutes, so they all
measure the same way: each method is warmed up, then every round times one call per method in an order
rotated from round to round, a full garbage collection runs before every timed call, and every figure is a
median of ratios taken within a round. Keeping that procedure in one place keeps the scripts' figures
comparable with one another.

The scripts are run as files (``python bench/bench_trace.py``), not as a package; each puts its own folder
on ``sys.path`` and imports this module as ``common``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypedDict

# The models are built from their configs with random weights; nothing may be fetched from the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from torch import nn
from transformers import GPT2Config, GPT2Model, ResNetConfig, ResNetModel

GPT2_BATCH = 4
GPT2_SEQ_LEN = 128


# -- timing -----------------------------------------------------------------------------------------


@dataclass
class Timed:
    """One timed call: its seconds, and what the method kept (alive until this object is dropped).

    Holding the kept values until the caller drops them lets a method's memory count inside its own timer
    and lets the caller inspect them afterwards, outside any timer.
    """

    seconds: float
    kept: Any = None


Run = Callable[[nn.Module, Any], Timed]
"""A method under test: runs on a model and its input, returns its timing."""


def timed_call(fn: Callable[[], Any]) -> Timed:
    """Seconds taken by ``fn()``, and its result, which stays alive until after the timer stopped.

    A full collection runs first so that garbage another method left behind is not collected inside this
    timer; freeing the result is left to the caller, outside the timer.
    """
    gc.collect()
    start = time.perf_counter()
    result = fn()
    return Timed(time.perf_counter() - start, result)


def measure(
    runs: Mapping[str, Run],
    model: nn.Module,
    x: Any,
    rounds: int,
    warmup: int,
    first_round: Callable[[str, Any], None] | None = None,
) -> dict[str, list[float]]:
    """Warm every method up, then time one call per method per round, rotating the order; seconds per method.

    The order rotates so that every method takes each place in a round in turn: in a fixed order, one
    method would always inherit the caches and allocator state that the same other method left behind.
    ``first_round(name, kept)``, when given, sees what each method kept in the first timed round, after its
    timer stopped; the kept values are dropped before the next method runs.
    """
    names = list(runs)
    for name in names:
        for _ in range(warmup):
            runs[name](model, x)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            timed = runs[name](model, x)
            times[name].append(timed.seconds)
            if round_index == 0 and first_round is not None:
                first_round(name, timed.kept)
            del timed  # drop the kept values before the next method
    return times


class RoundRatios:
    """Ratios between methods for a result class that holds ``times`` (seconds per method, one per round).

    Only times from the same round are compared, since seconds from different moments are not: each
    figure is the median of the per-round ratios, not the ratio of medians.
    """

    times: dict[str, list[float]]

    def ratios(self, name: str, baseline: str) -> list[float]:
        """Per-round ratios ``name / baseline``."""
        return [t / b for t, b in zip(self.times[name], self.times[baseline], strict=True)]

    def median_ratio(self, name: str, baseline: str) -> float:
        """Median of the per-round ratios ``name / baseline``."""
        return statistics.median(self.ratios(name, baseline))

    def medians(self, *baselines: str) -> dict[str, dict[str, float]]:
        """For the JSON output: ``median_s`` per method, then ``median_ratio_vs_<baseline>`` per baseline.

        The seconds are for orientation only (they drift); the ratios are the figures to compare.
        """
        data = {"median_s": {name: statistics.median(values) for name, values in self.times.items()}}
        for baseline in baselines:
            key = f"median_ratio_vs_{baseline.replace(' ', '_')}"
            data[key] = {name: self.median_ratio(name, baseline) for name in self.times}
        return data


# -- the workloads ----------------------------------------------------------------------------------


def table_json(table: RoundRatios, passed: bool, *baselines: str) -> dict[str, Any]:
    """A result table as JSON-ready data: its fields, the medians and median ratios against
    ``baselines`` spelled out, and whether it met its target."""
    return dataclasses.asdict(table) | table.medians(*baselines) | {"passed": passed}


@dataclass
class Workload:
    """A model, its input, and how its table names it."""

    key: str
    title: str
    model: nn.Module
    inputs: Any


def gpt2_workload(n_layer: int) -> Workload:
    """GPT-2 of ``n_layer`` layers (the rest of ``GPT2Config()``), random weights, eval mode; 4 x 128 token ids.

    Random weights from the config keep the benchmarks offline; the cost of a forward does not depend on
    the weights' values.
    """
    config = GPT2Config(n_layer=n_layer)
    model = GPT2Model(config).eval()
    x = torch.randint(0, config.vocab_size, (GPT2_BATCH, GPT2_SEQ_LEN))
    return Workload("gpt2", f"GPT-2 {config.n_layer} layers, input ids {GPT2_BATCH} x {GPT2_SEQ_LEN}", model, x)


def resnet_workload(quick: bool) -> Workload:
    """ResNet-50 (``ResNetConfig()``), random weights, eval mode, input 8 x 3 x 224 x 224.

    With ``quick``, one block per stage and a batch of 2: enough to see that a script runs.
    """
    config = ResNetConfig(depths=[1, 1, 1, 1]) if quick else ResNetConfig()
    batch = 2 if quick else 8
    model = ResNetModel(config).eval()
    x = torch.randn(batch, 3, 224, 224)
    depths = "-".join(str(d) for d in config.depths or ())
    title = f"ResNet ({config.layer_type}, depths {depths}), input {batch} x 3 x 224 x 224"
    return Workload("resnet50", title, model, x)


def prepare_torch(threads: int) -> None:
    """Set the intra-op threads and seed 0, so that every run builds the same weights and inputs."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)


# -- options and output -----------------------------------------------------------------------------


def add_run_options(
    parser: argparse.ArgumentParser,
    *,
    min_rounds: int,
    quick_help: str,
    check_help: str,
    default_rounds: int | None = None,
) -> None:
    """Add ``--rounds``, ``--threads``, ``--quick``, ``--json`` and ``--check``, in that order, to ``parser``.

    ``--rounds`` defaults to ``default_rounds`` when given, else to ``min_rounds``.
    """
    if default_rounds is None:
        default, rounds_help = min_rounds, f"timed rounds (>= {min_rounds})"
    else:
        default, rounds_help = default_rounds, f"timed rounds (default {default_rounds}, >= {min_rounds})"
    parser.add_argument("--rounds", type=int, default=default, help=rounds_help)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON here")
    parser.add_argument("--check", action="store_true", help=check_help)


def check_run_options(parser: argparse.ArgumentParser, args: argparse.Namespace, min_rounds: int) -> None:
    """Refuse too few rounds (a median of fewer ratios is mostly noise) and fewer than one thread."""
    if not args.quick and args.rounds < min_rounds:
        parser.error(f"--rounds must be at least {min_rounds} (use --quick for a smoke run)")
    if args.threads < 1:
        parser.error("--threads must be at least 1")


def parse_run_args(
    argv: Sequence[str] | None,
    *,
    description: str,
    min_rounds: int,
    default_rounds: int,
    quick_rounds: int,
    quick_help: str,
    check_help: str,
    extra: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.Namespace:
    """The command line of a benchmark script: ``extra`` options first, then the shared run options;
    ``--quick`` overrides ``--rounds``."""
    parser = argparse.ArgumentParser(description=description)
    if extra is not None:
        extra(parser)
    add_run_options(
        parser, min_rounds=min_rounds, default_rounds=default_rounds, quick_help=quick_help, check_help=check_help
    )
    args = parser.parse_args(argv)
    check_run_options(parser, args, min_rounds)
    if args.quick:
        args.rounds = quick_rounds
    return args


def threads_label(threads: int) -> str:
    """``"1 thread"``, ``"2 threads"``: for the report's first line."""
    return f"{threads} thread{'s' if threads != 1 else ''}"


def ratio_range(ratios: list[float]) -> str:
    """The smallest and largest per-round ratio, ``"0.950..1.080"``: a view of the noise."""
    return f"{min(ratios):.3f}..{max(ratios):.3f}"


def print_ratio_table(table: RoundRatios, baseline: str, width: int = 18) -> None:
    """Print each method's median seconds, its median ratio to ``baseline`` and the per-round range."""
    print(f"{'method':<{width}}{'median s':>10}{'x ' + baseline:>10}{'range':>16}")
    for name, seconds in table.times.items():
        ratios = table.ratios(name, baseline)
        print(
            f"{name:<{width}}{statistics.median(seconds):>10.4f}{statistics.median(ratios):>10.3f}"
            f"{ratio_range(ratios):>16}"
        )


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as indented JSON with a final newline."""
    path.write_text(json.dumps(data, indent=2) + "\n")


def start(args: argparse.Namespace, how: str) -> None:
    """Set torch up for the run and print its first line: torch, threads, rounds and ``how`` it runs."""
    prepare_torch(args.threads)
    print(f"torch {torch.__version__}, {threads_label(args.threads)}, {args.rounds} rounds, {how}", flush=True)


class SummaryRow(TypedDict):
    """One figure held to a target, as ``bench/summary.py`` reads it from a script's JSON (key ``summary``).

    ``better`` says which side of ``target`` passes (``"lower"``: ``value <= target``; ``"higher"``:
    ``value >= target``); ``unit`` is ``"x"`` for a ratio, ``"s"`` for seconds.
    """

    name: str
    value: float
    target: float
    better: Literal["lower", "higher"]
    unit: Literal["x", "s"]


def summary_row(
    name: str,
    value: float,
    target: float,
    better: Literal["lower", "higher"] = "lower",
    unit: Literal["x", "s"] = "x",
) -> SummaryRow:
    """One row of the JSON ``summary`` list: the figure a script judges, its target and which side passes.

    Every script that judges a figure passes its rows to :func:`finish` as ``summary=[...]`` (or puts them under
    ``"summary"`` in the JSON it writes itself), so that ``bench/summary.py`` can print every verdict of a
    ``make bench`` in one table without knowing each script's own JSON layout.
    """
    if better not in ("lower", "higher"):
        raise ValueError(f"better={better!r}; expected 'lower' or 'higher'")
    if unit not in ("x", "s"):
        raise ValueError(f"unit={unit!r}; expected 'x' or 's'")
    return {"name": name, "value": float(value), "target": float(target), "better": better, "unit": unit}


def finish(args: argparse.Namespace, tables: list[dict[str, Any]], passed: bool, **settings: Any) -> int:
    """Write the JSON report when ``--json`` asks (the run's settings, ``settings``, the tables) and
    return the exit code: 1 when ``--check`` asks and a target was missed.

    ``summary=[summary_row(...), ...]`` among ``settings`` lands in the JSON as the list ``bench/summary.py``
    reads."""
    if args.json is not None:
        run = {"torch_version": torch.__version__, "threads": args.threads, "rounds": args.rounds}
        write_json(args.json, run | settings | {"tables": tables})
    return 1 if args.check and not passed else 0

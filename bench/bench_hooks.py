"""What hookscope's ``hooks()`` costs over raw PyTorch hooks, on a GPT-2 forward (CPU).

Three methods run the same forward pass of a 12-layer GPT-2 (random weights, batch 4 x 128 tokens):

- ``plain``: no hooks at all;
- ``raw hooks``: one pass-through forward hook registered with ``module.register_forward_hook`` on every
  module of ``model.named_modules()``, the root included;
- ``hookscope``: the same function on the same modules, attached with ``hs.hooks(model, {("", "*"): fn})``.

hookscope registers the user's function directly with PyTorch, so its forward should cost what raw hooks
cost; the target is a median ratio over raw hooks of at most 1.05.

How it is measured: every figure is a ratio between methods timed in the
same process and the same round, because the machine drifts by several percent over minutes. Each round
times one forward per method, in an order rotated from round to round; hooks are attached right before the
timed forward and removed right after, so only the forward itself is inside the timer and the methods stay
independent. A full garbage collection runs before every timed forward, for every method, so that garbage
left by attaching is not collected inside someone else's timer. The reported ratio is the median of the
per-round ratios, not the ratio of medians.

Run: ``.venv/bin/python bench/bench_hooks.py`` (or ``make bench``); ``--quick`` for a smoke run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Run as a file, not as a package: make ``common`` (next to this file) importable from any working directory.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from torch import nn

import common
import hookscope as hs

TARGET = 1.05
MIN_ROUNDS = 10
WARMUP = 2


def passthrough(module: nn.Module, args: Any, output: Any) -> None:
    """The hook under test: does nothing and returns None, so the output is kept."""


def timed_forward(model: nn.Module, x: torch.Tensor) -> common.Timed:
    """One forward pass, timed after a full collection; its output is freed inside the timer."""

    def forward() -> None:
        model(x)

    return common.timed_call(forward)


def run_plain(model: nn.Module, x: torch.Tensor) -> common.Timed:
    """(a) A forward with no hooks."""
    return timed_forward(model, x)


def run_raw_hooks(model: nn.Module, x: torch.Tensor) -> common.Timed:
    """(b) ``register_forward_hook(passthrough)`` on every module, removed after the forward."""
    handles = [module.register_forward_hook(passthrough) for _, module in model.named_modules()]
    try:
        return timed_forward(model, x)
    finally:
        for handle in handles:
            handle.remove()


def run_hookscope(model: nn.Module, x: torch.Tensor) -> common.Timed:
    """(c) ``hs.hooks`` with the same function on the same modules, removed after the forward."""
    with hs.hooks(model, {("", "*"): passthrough}):
        return timed_forward(model, x)


METHODS: dict[str, common.Run] = {"plain": run_plain, "raw hooks": run_raw_hooks, "hookscope": run_hookscope}


@dataclass
class Result(common.RoundRatios):
    """Timings and per-round ratios of one benchmark run."""

    torch_version: str
    threads: int
    rounds: int
    n_layer: int
    batch: int
    seq_len: int
    modules_hooked: int
    times: dict[str, list[float]] = field(default_factory=dict)

    @property
    def hookscope_over_raw(self) -> float:
        """The figure held to the target."""
        return self.median_ratio("hookscope", "raw hooks")

    @property
    def passed(self) -> bool:
        """True when hookscope's median ratio over raw hooks is within the target."""
        return self.hookscope_over_raw <= TARGET


def check_hook_counts(model: nn.Module) -> int:
    """Number of modules hooked; asserts that hookscope attaches as many hooks as the raw method."""
    n_modules = len(list(model.named_modules()))
    with hs.hooks(model, {("", "*"): passthrough}) as group:
        assert len(group) == n_modules, f"hookscope attached {len(group)} hooks, raw hooks attach {n_modules}"
    return n_modules


def format_report(result: Result) -> str:
    """The printed table and summary lines."""
    lines = [
        f"GPT-2 {result.n_layer} layers, batch {result.batch} x {result.seq_len}, torch {result.torch_version}, "
        f"{common.threads_label(result.threads)}, {result.rounds} rounds, {result.modules_hooked} modules hooked "
        "(root included)",
        "",
        f"{'method':<12}{'median s':>12}{'x plain':>10}{'x raw hooks':>14}{'round range x raw':>22}",
    ]
    for name in result.times:
        lines.append(
            f"{name:<12}{statistics.median(result.times[name]):>12.4f}"
            f"{result.median_ratio(name, 'plain'):>10.3f}{result.median_ratio(name, 'raw hooks'):>14.3f}"
            f"{common.ratio_range(result.ratios(name, 'raw hooks')):>22}"
        )
    verdict = "PASS" if result.passed else "FAIL"
    lines += ["", f"hookscope over raw hooks: {result.hookscope_over_raw:.3f} (target <= {TARGET:.2f}): {verdict}"]
    return "\n".join(lines)


def to_json(result: Result) -> dict[str, Any]:
    """The result as JSON-ready data, with the medians and median ratios spelled out."""
    data = asdict(result) | result.medians("plain", "raw hooks")
    data["hookscope_over_raw_hooks"] = result.hookscope_over_raw
    data["target"] = TARGET
    data["passed"] = result.passed
    data["summary"] = [common.summary_row("hs.hooks forward over raw hooks", result.hookscope_over_raw, TARGET)]
    return data


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options; ``--quick`` overrides ``--rounds`` and the depth."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_run_options(
        parser,
        min_rounds=MIN_ROUNDS,
        quick_help="smoke run: 3 rounds, 2-layer model",
        check_help=f"exit 1 if hookscope/raw exceeds {TARGET}",
    )
    args = parser.parse_args(argv)
    common.check_run_options(parser, args, MIN_ROUNDS)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print the report, and return the exit code."""
    args = parse_args(argv)
    rounds, n_layer = (3, 2) if args.quick else (args.rounds, 12)
    common.prepare_torch(args.threads)
    with torch.no_grad():
        work = common.gpt2_workload(n_layer)
        modules_hooked = check_hook_counts(work.model)
        times = common.measure(METHODS, work.model, work.inputs, rounds, WARMUP)
    result = Result(
        torch.__version__, args.threads, rounds, n_layer, common.GPT2_BATCH, common.GPT2_SEQ_LEN, modules_hooked, times
    )
    print(format_report(result))
    if args.json is not None:
        common.write_json(args.json, to_json(result))
    return 1 if args.check and not result.passed else 0


if __name__ == "__main__":
    sys.exit(main())

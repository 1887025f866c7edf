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
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from torch import nn
from transformers import GPT2Config, GPT2Model

import hookscope as hs

TARGET = 1.05
MIN_ROUNDS = 10
WARMUP = 2
BATCH = 4
SEQ_LEN = 128

Method = Callable[[nn.Module, torch.Tensor], float]


def passthrough(module: nn.Module, args: Any, output: Any) -> None:
    """The hook under test: does nothing and returns None, so the output is kept."""


def timed_forward(model: nn.Module, x: torch.Tensor) -> float:
    """Seconds taken by one forward pass, with a full collection beforehand."""
    gc.collect()
    start = time.perf_counter()
    model(x)
    return time.perf_counter() - start


def run_plain(model: nn.Module, x: torch.Tensor) -> float:
    """(a) A forward with no hooks."""
    return timed_forward(model, x)


def run_raw_hooks(model: nn.Module, x: torch.Tensor) -> float:
    """(b) ``register_forward_hook(passthrough)`` on every module, removed after the forward."""
    handles = [module.register_forward_hook(passthrough) for _, module in model.named_modules()]
    try:
        return timed_forward(model, x)
    finally:
        for handle in handles:
            handle.remove()


def run_hookscope(model: nn.Module, x: torch.Tensor) -> float:
    """(c) ``hs.hooks`` with the same function on the same modules, removed after the forward."""
    with hs.hooks(model, {("", "*"): passthrough}):
        return timed_forward(model, x)


METHODS: dict[str, Method] = {"plain": run_plain, "raw hooks": run_raw_hooks, "hookscope": run_hookscope}


@dataclass
class Result:
    """Timings and per-round ratios of one benchmark run."""

    torch_version: str
    threads: int
    rounds: int
    n_layer: int
    batch: int
    seq_len: int
    modules_hooked: int
    times: dict[str, list[float]] = field(default_factory=dict)

    def ratios(self, name: str, baseline: str) -> list[float]:
        """Per-round ratios ``name / baseline``."""
        return [t / b for t, b in zip(self.times[name], self.times[baseline], strict=True)]

    def median_ratio(self, name: str, baseline: str) -> float:
        """Median of the per-round ratios ``name / baseline``."""
        return statistics.median(self.ratios(name, baseline))

    @property
    def hookscope_over_raw(self) -> float:
        """The figure held to the target."""
        return self.median_ratio("hookscope", "raw hooks")

    @property
    def passed(self) -> bool:
        """True when hookscope's median ratio over raw hooks is within the target."""
        return self.hookscope_over_raw <= TARGET


def build_model(n_layer: int) -> tuple[nn.Module, torch.Tensor]:
    """A GPT-2 of ``n_layer`` layers with random weights (no download), in eval mode, and its input."""
    config = GPT2Config(n_layer=n_layer)
    model: nn.Module = GPT2Model(config)
    model.eval()
    x = torch.randint(0, config.vocab_size, (BATCH, SEQ_LEN))
    return model, x


def check_hook_counts(model: nn.Module) -> int:
    """Number of modules hooked; asserts that hookscope attaches as many hooks as the raw method."""
    n_modules = len(list(model.named_modules()))
    with hs.hooks(model, {("", "*"): passthrough}) as group:
        assert len(group) == n_modules, f"hookscope attached {len(group)} hooks, raw hooks attach {n_modules}"
    return n_modules


def measure(model: nn.Module, x: torch.Tensor, rounds: int) -> dict[str, list[float]]:
    """Warm every method up, then time one forward per method per round, rotating the order."""
    names = list(METHODS)
    for name in names:
        for _ in range(WARMUP):
            METHODS[name](model, x)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(METHODS[name](model, x))
    return times


def format_report(result: Result) -> str:
    """The printed table and summary lines."""
    threads = f"{result.threads} thread{'s' if result.threads != 1 else ''}"
    lines = [
        f"GPT-2 {result.n_layer} layers, batch {result.batch} x {result.seq_len}, torch {result.torch_version}, "
        f"{threads}, {result.rounds} rounds, {result.modules_hooked} modules hooked (root included)",
        "",
        f"{'method':<12}{'median s':>12}{'x plain':>10}{'x raw hooks':>14}{'round range x raw':>22}",
    ]
    for name in result.times:
        per_round = result.ratios(name, "raw hooks")
        lines.append(
            f"{name:<12}{statistics.median(result.times[name]):>12.4f}"
            f"{result.median_ratio(name, 'plain'):>10.3f}{result.median_ratio(name, 'raw hooks'):>14.3f}"
            f"{f'{min(per_round):.3f}..{max(per_round):.3f}':>22}"
        )
    verdict = "PASS" if result.passed else "FAIL"
    lines += ["", f"hookscope over raw hooks: {result.hookscope_over_raw:.3f} (target <= {TARGET:.2f}): {verdict}"]
    return "\n".join(lines)


def to_json(result: Result) -> dict[str, Any]:
    """The result as JSON-ready data, with the medians and median ratios spelled out."""
    data = asdict(result)
    data["median_s"] = {name: statistics.median(values) for name, values in result.times.items()}
    data["median_ratio_vs_plain"] = {name: result.median_ratio(name, "plain") for name in result.times}
    data["median_ratio_vs_raw_hooks"] = {name: result.median_ratio(name, "raw hooks") for name in result.times}
    data["hookscope_over_raw_hooks"] = result.hookscope_over_raw
    data["target"] = TARGET
    data["passed"] = result.passed
    return data


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options; ``--quick`` overrides ``--rounds`` and the depth."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS, help=f"timed rounds (>= {MIN_ROUNDS})")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 3 rounds, 2-layer model")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON here")
    parser.add_argument("--check", action="store_true", help=f"exit 1 if hookscope/raw exceeds {TARGET}")
    args = parser.parse_args(argv)
    if not args.quick and args.rounds < MIN_ROUNDS:
        parser.error(f"--rounds must be at least {MIN_ROUNDS} (use --quick for a smoke run)")
    if args.threads < 1:
        parser.error("--threads must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print the report, and return the exit code."""
    args = parse_args(argv)
    rounds, n_layer = (3, 2) if args.quick else (args.rounds, 12)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with torch.no_grad():
        model, x = build_model(n_layer)
        modules_hooked = check_hook_counts(model)
        times = measure(model, x, rounds)
    result = Result(torch.__version__, args.threads, rounds, n_layer, BATCH, SEQ_LEN, modules_hooked, times)
    print(format_report(result))
    if args.json is not None:
        args.json.write_text(json.dumps(to_json(result), indent=2) + "\n")
    return 1 if args.check and not result.passed else 0


if __name__ == "__main__":
    sys.exit(main())

"""What op sites cost on a GPT-2 forward (CPU), and attention patterns under SDPA against eager attention.

A 12-layer GPT-2 (random weights from ``GPT2Config()``, eval mode, ``torch.no_grad()``, 4 x 128 token ids),
built twice from one set of weights: with ``attn_implementation="sdpa"`` (transformers' default) and
``"eager"``. Methods:

- ``plain``: the SDPA model's forward, no hooks: the floor;
- ``idle``: an ``OpWatcher`` attached to the SDPA model watching a module that never runs in the forward (an
  unused ``nn.Identity`` added to it): the op-site machinery with no op selected;
- ``watch attn``: every block's attention module watched, the listener doing nothing: the mode's cost;
- ``patterns``: every block's attention module watched, each ``scaled_dot_product_attention`` call's pattern
  recomputed from its arguments (``hookscope._arch.attention``) and kept: what an ``:attn.pattern`` capture of
  every layer costs;
- ``capture patterns``: ``hs.capture(model, "h.*.attn:attn.pattern")``, the public way to the same values
  (the capture's keeper, call counting and checks included);
- ``eager + weights``: the eager model's forward with ``output_attentions=True``: what people do today to get
  the patterns;
- ``trace``: ``hs.trace`` of the SDPA model (a row per module call, statistics on the device);
- ``trace + attn ops``: the same with ``ops=`` every attention module's kernel call and its pattern
  (``h.*.attn:op[scaled_dot_product_attention]``, ``h.*.attn:attn.pattern``): two more rows per block.

Why: op sites must cost nothing where no op is asked for (target ``idle`` <= 1.02x ``plain``), and the pattern
under SDPA should cost no more than switching the model to eager attention.

How: each round runs every method once, in an order rotated from round to round, after a full collection;
figures are medians of per-round ratios to ``plain``, after two warm-up calls of each method.
Before timing, the kept patterns are checked against the eager model's ``attn_weights`` (atol 1e-5).

Run: ``.venv/bin/python bench/bench_ops.py``; ``--rounds N``; ``--quick`` (2 layers, 3 rounds).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from torch import nn
from transformers import GPT2Config, GPT2Model

import common
import hookscope as hs
from hookscope._arch.attention import sdpa_call
from hookscope._core.ops import OpWatcher

TARGET = 1.02
N_LAYER, QUICK_N_LAYER = 12, 2
DEFAULT_ROUNDS, MIN_ROUNDS, QUICK_ROUNDS = 10, 5, 3
PLAIN, IDLE, WATCH, PATTERNS, CAPTURE, EAGER = (
    "plain",
    "idle",
    "watch attn",
    "patterns",
    "capture patterns",
    "eager + weights",
)
TRACE, TRACE_OPS = "trace", "trace + attn ops"
ATTN_OPS = ["h.*.attn:op[scaled_dot_product_attention]", "h.*.attn:attn.pattern"]


@dataclass
class Table(common.RoundRatios):
    times: dict[str, list[float]]


def twins(n_layer: int) -> tuple[nn.Module, nn.Module]:
    made = []
    for implementation in ("sdpa", "eager"):
        torch.manual_seed(0)
        made.append(GPT2Model(GPT2Config(n_layer=n_layer, attn_implementation=implementation)).eval())
    made[1].load_state_dict(made[0].state_dict())
    return made[0], made[1]


def ignore(*_: Any) -> None:
    return None


class Patterns:
    """A listener keeping the pattern of every ``scaled_dot_product_attention`` call."""

    def __init__(self) -> None:
        self.kept: list[torch.Tensor] = []

    def __call__(self, module: str, call: int, op: str, index: int, args: Any, kwargs: Any, output: Any) -> None:
        if op == "scaled_dot_product_attention":
            self.kept.append(sdpa_call(args, kwargs).pattern)


def runs(sdpa: nn.Module, eager: nn.Module) -> dict[str, common.Run]:
    attention = [(f"h.{i}.attn", block.attn) for i, block in enumerate(sdpa.h)]
    sdpa.unused = nn.Identity()  # never called by the forward

    def plain(model: nn.Module, x: Any) -> common.Timed:
        return common.timed_call(lambda: sdpa(x))

    def watched(listener: Any) -> common.Run:
        def run(model: nn.Module, x: Any) -> common.Timed:
            with OpWatcher(sdpa, attention, listener):
                return common.timed_call(lambda: (sdpa(x), getattr(listener, "kept", None)))

        return run

    def idle_run(model: nn.Module, x: Any) -> common.Timed:
        with OpWatcher(sdpa, [("unused", sdpa.unused)], ignore):
            return common.timed_call(lambda: sdpa(x))

    def capture_run(model: nn.Module, x: Any) -> common.Timed:
        with hs.capture(sdpa, "h.*.attn:attn.pattern") as cap:
            return common.timed_call(lambda: (sdpa(x), cap))

    def eager_run(model: nn.Module, x: Any) -> common.Timed:
        return common.timed_call(lambda: eager(x, output_attentions=True))

    def traced(ops: Any) -> common.Run:  # the statistics are read inside the timing: len() builds the rows
        return lambda model, x: common.timed_call(lambda: len(hs.trace(sdpa, x, ops=ops)))

    return {
        PLAIN: plain,
        IDLE: idle_run,
        WATCH: watched(ignore),
        PATTERNS: lambda model, x: watched(Patterns())(model, x),
        CAPTURE: capture_run,
        EAGER: eager_run,
        TRACE: traced(False),
        TRACE_OPS: traced(ATTN_OPS),
    }


def check(sdpa: nn.Module, eager: nn.Module, x: torch.Tensor) -> None:
    listener = Patterns()
    attention = [(f"h.{i}.attn", block.attn) for i, block in enumerate(sdpa.h)]
    with OpWatcher(sdpa, attention, listener):
        sdpa(x)
    expected = eager(x, output_attentions=True).attentions
    assert len(listener.kept) == len(expected)
    for got, want in zip(listener.kept, expected, strict=True):
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def main(argv: Sequence[str] | None = None) -> int:
    args = common.parse_run_args(
        argv,
        description=__doc__.splitlines()[0],
        min_rounds=MIN_ROUNDS,
        default_rounds=DEFAULT_ROUNDS,
        quick_rounds=QUICK_ROUNDS,
        quick_help=f"smoke run: {QUICK_ROUNDS} rounds, {QUICK_N_LAYER}-layer GPT-2",
        check_help=f"exit 1 if the idle machinery costs more than {TARGET}x a plain forward",
    )
    common.prepare_torch(args.threads)
    n_layer = QUICK_N_LAYER if args.quick else N_LAYER
    sdpa, eager = twins(n_layer)
    x = torch.randint(0, 50257, (common.GPT2_BATCH, common.GPT2_SEQ_LEN))
    print(f"torch {torch.__version__}, {common.threads_label(args.threads)}, {args.rounds} rounds, torch.no_grad()")
    with torch.no_grad():
        check(sdpa, eager, x)
        times = common.measure(runs(sdpa, eager), sdpa, x, args.rounds, warmup=2)
    table = Table(times)
    print(f"\nGPT-2 {n_layer} layers (sdpa and eager twins), input ids {common.GPT2_BATCH} x {common.GPT2_SEQ_LEN}")
    print("  the patterns recomputed under SDPA equal the eager model's attn_weights (atol 1e-5)\n")
    common.print_ratio_table(table, PLAIN, width=18)
    idle = table.median_ratio(IDLE, PLAIN)
    verdict = "PASS" if idle <= TARGET else "FAIL"
    print(f"\nop-site machinery with no op selected: {idle:.3f}x a plain forward (target <= {TARGET}): {verdict}")
    if args.json is not None:
        summary = [common.summary_row("op-site machinery with no op selected, over plain", idle, TARGET)]
        data = {"times": times, "medians": table.medians(PLAIN), "idle_passed": idle <= TARGET, "summary": summary}
        common.write_json(args.json, data)
    return 1 if args.check and idle > TARGET else 0


if __name__ == "__main__":
    sys.exit(main())

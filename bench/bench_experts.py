"""What the experts tap costs on a small mixture-of-experts forward (CPU).

A 4-layer Mixtral (random weights from ``MixtralConfig``, width 256, 8 experts of width 512, top-2, eval mode,
``torch.no_grad()``, 4 x 128 token ids), transformers' default ``grouped_mm`` experts. Methods:

- ``plain``: the forward, nothing of hookscope attached: the floor;
- ``untapped``: an expert sub-site captured on a second Mixtral (never run here): the dispatchers are in
  transformers' experts interface, so every experts module of the measured model goes through them untapped;
- ``tapped``: ``hs.capture(model, "model.layers.*.mlp.experts:expert.out")``, every expert's output rows of
  every layer kept: the tap computing the experts step by step, the op watch and the capture's keeping;
- ``tapped, all values``: the same with every sub-site (``in``, ``pre``, ``up``, ``post``, ``out``,
  ``tokens``, ``weights``) kept.

Why: untapped, the experts must cost nothing (target ``untapped`` <= 1.01x ``plain``); tapped, reading every
expert must cost little next to the forward (target ``tapped`` <= 1.10x ``untapped``).

How: each round runs every method once, in an order rotated from round to round, after a full collection;
figures are medians of per-round ratios, after two warm-up calls of each method. Before timing, the tapped
output is checked bit for bit against the plain one.

Run: ``.venv/bin/python bench/bench_experts.py``; ``--rounds N``; ``--quick`` (2 layers, 3 rounds).
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
from transformers import MixtralConfig, MixtralForCausalLM

import common
import hookscope as hs

UNTAPPED_TARGET, TAPPED_TARGET = 1.01, 1.10
N_LAYER, QUICK_N_LAYER = 4, 2
DEFAULT_ROUNDS, MIN_ROUNDS, QUICK_ROUNDS = 15, 5, 3
PLAIN, UNTAPPED, TAPPED, ALL = "plain", "untapped", "tapped", "tapped, all values"
EXPERTS = "model.layers.*.mlp.experts"
KINDS = ("in", "pre", "up", "post", "out", "tokens", "weights")


@dataclass
class Table(common.RoundRatios):
    times: dict[str, list[float]]


def mixtral(n_layer: int) -> nn.Module:
    torch.manual_seed(0)
    config = MixtralConfig(
        num_hidden_layers=n_layer, hidden_size=256, intermediate_size=512, num_attention_heads=8,
        num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2, vocab_size=1000,
    )  # fmt: skip
    return MixtralForCausalLM(config).eval()


def runs(model: nn.Module, other: nn.Module) -> dict[str, common.Run]:
    def plain(_: nn.Module, x: Any) -> common.Timed:
        return common.timed_call(lambda: model(x))

    def untapped(_: nn.Module, x: Any) -> common.Timed:
        with hs.capture(other, "model.layers.0.mlp.experts:expert.out"):
            return common.timed_call(lambda: model(x))

    def tapped(layers: list[str]) -> common.Run:
        def run(_: nn.Module, x: Any) -> common.Timed:
            with hs.capture(model, layers) as cap:
                return common.timed_call(lambda: (model(x), cap))

        return run

    return {
        PLAIN: plain,
        UNTAPPED: untapped,
        TAPPED: tapped([f"{EXPERTS}:expert.out"]),
        ALL: tapped([f"{EXPERTS}:expert.{kind}" for kind in KINDS]),
    }


def check(model: nn.Module, x: torch.Tensor) -> None:
    plain = model(x).logits
    with hs.capture(model, [f"{EXPERTS}:expert.{kind}" for kind in KINDS]):
        tapped = model(x).logits
    assert torch.equal(plain, tapped), (plain - tapped).abs().max()


def main(argv: Sequence[str] | None = None) -> int:
    args = common.parse_run_args(
        argv,
        description=__doc__.splitlines()[0],
        min_rounds=MIN_ROUNDS,
        default_rounds=DEFAULT_ROUNDS,
        quick_rounds=QUICK_ROUNDS,
        quick_help=f"smoke run: {QUICK_ROUNDS} rounds, {QUICK_N_LAYER}-layer Mixtral",
        check_help=f"exit 1 if untapped > {UNTAPPED_TARGET}x plain or tapped > {TAPPED_TARGET}x untapped",
    )
    common.prepare_torch(args.threads)
    n_layer = QUICK_N_LAYER if args.quick else N_LAYER
    model, other = mixtral(n_layer), mixtral(1)
    x = torch.randint(0, 1000, (common.GPT2_BATCH, common.GPT2_SEQ_LEN))
    print(f"torch {torch.__version__}, {common.threads_label(args.threads)}, {args.rounds} rounds, torch.no_grad()")
    with torch.no_grad():
        check(model, x)
        times = common.measure(runs(model, other), model, x, args.rounds, warmup=2)
    table = Table(times)
    print(f"\nMixtral {n_layer} layers, 8 experts top-2, input ids {common.GPT2_BATCH} x {common.GPT2_SEQ_LEN}")
    print("  the tapped output equals the plain one bit for bit\n")
    common.print_ratio_table(table, PLAIN, width=20)
    idle = table.median_ratio(UNTAPPED, PLAIN)
    tapped = table.median_ratio(TAPPED, UNTAPPED)
    passed = idle <= UNTAPPED_TARGET and tapped <= TAPPED_TARGET
    print(f"\nuntapped over plain: {idle:.3f}x (target <= {UNTAPPED_TARGET})")
    print(f"tapped over untapped: {tapped:.3f}x (target <= {TAPPED_TARGET}): {'PASS' if passed else 'FAIL'}")
    summary = [
        common.summary_row("experts untapped, over plain", idle, UNTAPPED_TARGET),
        common.summary_row("every expert's output kept, over untapped", tapped, TAPPED_TARGET),
    ]
    return common.finish(args, [common.table_json(table, passed, PLAIN, UNTAPPED)], passed, summary=summary)


if __name__ == "__main__":
    sys.exit(main())

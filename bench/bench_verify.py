"""Wall-clock seconds of ``hs.verify`` on 2-layer transformers models with random weights (CPU).

The workloads: GPT-2, Llama, BERT and T5 of 2 layers and width 64, built from their configs with random
weights (nothing is downloaded), ``torch.manual_seed(0)``, on ``hs.sample_input`` (one row of 16 tokens). The
figure is the whole call with its defaults: every check (capture of every module, gradients, zero and patch
edits of 3 modules, trace and the first-NaN blame, attention op sites and SDPA sub-sites, the std: map, and
``torch.compile`` with the ``eager`` backend), the plain forwards it makes included.

Why: verify is what one runs on a model before trusting hookscope there, and in CI after an upgrade, so it
should come back in the time a test does: the target is a median of at most 20 seconds for each model on
2 cores. Like ``bench_report.py`` this is absolute time, so it depends on the machine; the forwards column says
how many forwards the call made (the cost the report states).

How it is measured: each model is verified once to warm up (the first call imports and sets up dynamo), then
once per round; the figure held to the target is the largest of the models' medians.

Run: ``.venv/bin/python bench/bench_verify.py``; ``--rounds N``; ``--quick`` for a smoke run (one round).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# Run as a file, not as a package: make ``common`` (next to this file) importable from any working directory.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from torch import nn

import common
import hookscope as hs

TARGET_S = 20.0
DEFAULT_ROUNDS = 3
MIN_ROUNDS = 1
QUICK_ROUNDS = 1


def models() -> dict[str, Callable[[], nn.Module]]:
    """The four 2-layer models, each built on call with seeded random weights."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers as tf

    ids = {"vocab_size": 128, "bos_token_id": 0, "eos_token_id": 0}
    return {
        "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=64, n_head=4, **ids)),
        "llama": lambda: tf.LlamaForCausalLM(
            tf.LlamaConfig(
                num_hidden_layers=2,
                hidden_size=64,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=128,
                **ids,
            )
        ),
        "bert": lambda: tf.BertForMaskedLM(
            tf.BertConfig(
                num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=128
            )
        ),
        "t5": lambda: tf.T5ForConditionalGeneration(
            tf.T5Config(num_layers=2, d_model=64, d_kv=16, num_heads=4, d_ff=128, vocab_size=128)
        ),
    }


def bench(rounds: int) -> dict[str, dict[str, Any]]:
    """Seconds of each round per model, and the forwards and rows of the last report."""
    results: dict[str, dict[str, Any]] = {}
    for name, build in models().items():
        torch.manual_seed(0)
        model = build()
        hs.verify(model)  # warm-up
        seconds = []
        for _ in range(rounds):
            start = time.perf_counter()
            report = hs.verify(model)
            seconds.append(time.perf_counter() - start)
        results[name] = {"seconds": seconds, "forwards": report.forwards, "counts": report.counts, "ok": report.ok}
    return results


def worst_median(results: dict[str, dict[str, Any]]) -> float:
    """The figure held to the target: the largest median over the models."""
    return max(statistics.median(result["seconds"]) for result in results.values())


def format_table(results: dict[str, dict[str, Any]]) -> str:
    """Median seconds, forwards and the report's verdict per model, then the verdict on the target."""
    lines = [f"{'model':<8}{'median s':>10}{'forwards':>10}  report", ""]
    for name, result in results.items():
        verdict = "ok" if result["ok"] else "NOT OK"
        counts = ", ".join(f"{n} {status}" for status, n in result["counts"].items() if n)
        lines.append(
            f"{name:<8}{statistics.median(result['seconds']):>10.2f}{result['forwards']:>10}  {verdict}: {counts}"
        )
    figure = worst_median(results)
    verdict = "PASS" if figure <= TARGET_S else "FAIL"
    lines += ["", f"hs.verify of a 2-layer model, worst median: {figure:.2f} s (target <= {TARGET_S:.0f} s): {verdict}"]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options; ``--quick`` runs one round."""
    return common.parse_run_args(
        argv,
        description=__doc__.splitlines()[0],
        min_rounds=MIN_ROUNDS,
        default_rounds=DEFAULT_ROUNDS,
        quick_rounds=QUICK_ROUNDS,
        quick_help=f"smoke run: {QUICK_ROUNDS} round",
        check_help=f"exit 1 if a model's median takes over {TARGET_S} s",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print the table, and return the exit code."""
    args = parse_args(argv)
    common.start(args, "warm-up 1, every check, compile backend eager")
    results = bench(args.rounds)
    print(f"\n{format_table(results)}", flush=True)
    figure = worst_median(results)
    summary = [common.summary_row("hs.verify of a 2-layer model, worst median seconds", figure, TARGET_S, unit="s")]
    table = {"key": "verify", "results": results, "passed": figure <= TARGET_S}
    return common.finish(args, [table], figure <= TARGET_S, target_s=TARGET_S, summary=summary)


if __name__ == "__main__":
    sys.exit(main())

"""What ``hs.methods.patch_sweep()`` and ``attribution_patch()`` cost against a hand-written patching loop (CPU).

The workload: ``GPT2LMHeadModel(GPT2Config(n_layer=12))`` (the default width, 768, and vocabulary, 50257) with
random weights (nothing is downloaded), eval mode, one prompt of 16 random token ids (``clean``); ``corrupted`` is
the same prompt with the token at position 10 changed. The metric is ``hs.methods.logit_diff(correct, wrong)`` at
the last position, with the two tokens chosen (outside any timer) as those whose logit the corruption moves most in
each direction, so that ``clean - corrupted`` is as large as random weights allow and the normalised values are well
conditioned. The grid: every block's residual stream input (``std:blocks.*.resid_pre``, the input hidden state of
``transformer.h[i]``) x every position: 12 x 16 = 192 patches, denoising (clean values into the corrupted run).

Six methods, each timed as the one call a user makes:

- ``naive loop``: no hookscope. One forward of ``clean`` with ``register_forward_pre_hook`` on every block keeping
  its input hidden state, one forward of ``corrupted`` for its baseline score, then one forward of ``corrupted``
  per patch with a pre-hook on ``transformer.h[i]`` that replaces position ``p`` of the input hidden state by the
  clean run's value; the metric is read with plain indexing and normalised as the sweep does. 194 forwards of one
  row, under ``torch.no_grad()``;
- ``sweep``: ``hs.methods.patch_sweep(model, clean, corrupted, metric=metric)`` with its defaults
  (``batch_rows=64``: 64 patches per forward, 3 forwards of 64 rows after the clean and corrupted runs);
- ``sweep rows=16``, ``sweep rows=192``: the same with ``batch_rows=16`` (12 forwards of 16 rows) and
  ``batch_rows=192`` (one forward of 192 rows), to judge the default;
- ``attribution_patch``: ``hs.methods.attribution_patch(model, clean, corrupted, metric=metric)``, the same grid
  estimated from one forward of each input and one backward;
- ``plain forward``: ``model(clean)`` under ``torch.no_grad()``, the unit the attribution is counted in.

Before timing, the script runs the naive loop and the sweep once and asserts that their normalised grids agree
to 1e-4 (it prints the largest difference), and prints the correlation of the attribution estimate with the
sweep (for information; the estimate is first-order and need not match).

The targets: the sweep (default ``batch_rows``) at least 4x faster than the naive loop (median of the per-round
ratios naive / sweep), and ``attribution_patch`` at most 3 plain forwards (median of the per-round ratios
attribution / plain forward).

How it is measured: as in the other scripts (``common.measure``): each method is warmed up with one call, then
each round times one call per method, in an order rotated from round to round, after a full garbage collection;
every figure is a median of ratios taken within a round. A round takes about 45 s on 2 cores (the naive loop
alone about 20 s), so the default is 3 rounds: the figures are coarse, rerun with ``--rounds 5`` before drawing
conclusions from one run. Reading the table: ``median s`` is for orientation only; ``x plain fwd`` is the median
per-round ratio to one plain forward; ``naive / method`` the median per-round speed-up over the naive loop;
``range`` the smallest and largest per-round speed-up (a view of the noise).

Run: ``.venv/bin/python bench/bench_methods.py``; ``--rounds N``; ``--quick`` for a smoke run (2-layer GPT-2).
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
from transformers import GPT2Config, GPT2LMHeadModel

import common
import hookscope as hs

TARGET_SWEEP_SPEEDUP = 4.0
TARGET_ATTRIBUTION_FORWARDS = 3.0
MAX_DIFFERENCE = 1e-4
N_LAYER = 12
QUICK_N_LAYER = 2
SEQ_LEN = 16
CHANGED_POSITION = 10
DEFAULT_ROUNDS = 3
MIN_ROUNDS = 3
QUICK_ROUNDS = 2
WARMUP = 1
BATCH_ROWS_VARIANTS = (16, 192)  # besides the default, 64
PLAIN, NAIVE, SWEEP, ATTRIBUTION = "plain forward", "naive loop", "sweep", "attribution_patch"


@dataclass
class Study:
    """The two prompts and the metric's tokens, fixed for the whole run."""

    clean: torch.Tensor
    corrupted: torch.Tensor
    correct: int
    wrong: int

    def metric(self) -> hs.methods.Metric:
        return hs.methods.logit_diff(self.correct, self.wrong)


@dataclass
class Table(common.RoundRatios):
    """Timings of the methods."""

    key: str
    title: str
    times: dict[str, list[float]]
    notes: list[str] = field(default_factory=list)
    max_difference: float = 0.0
    correlation: float = 0.0


# -- the workload -----------------------------------------------------------------------------------


def build(n_layer: int) -> tuple[nn.Module, Study]:
    """The model, the prompts, and the metric's tokens: those the corruption moves most either way."""
    config = GPT2Config(n_layer=n_layer)
    model = GPT2LMHeadModel(config).eval()
    clean = torch.randint(0, config.vocab_size, (1, SEQ_LEN))
    corrupted = clean.clone()
    corrupted[0, CHANGED_POSITION] = (clean[0, CHANGED_POSITION] + 1) % config.vocab_size
    with torch.no_grad():
        moved = model(clean).logits[0, -1] - model(corrupted).logits[0, -1]
    return model, Study(clean, corrupted, int(moved.argmax()), int(moved.argmin()))


# -- the naive loop (no hookscope) ------------------------------------------------------------------


def naive_sweep(model: nn.Module, study: Study) -> torch.Tensor:
    """Every block x position patched by hand, one forward each; the normalised grid ``(blocks, positions)``."""
    blocks = list(model.transformer.h)

    def score(output: Any) -> float:
        logits = output.logits[:, -1].double()
        return float((logits[:, study.correct] - logits[:, study.wrong]).mean())

    stored: dict[int, torch.Tensor] = {}

    def keeper(index: int) -> Any:
        def keep(module: nn.Module, args: tuple[Any, ...]) -> None:
            stored[index] = args[0].detach()

        return keep

    with torch.no_grad():
        handles = [block.register_forward_pre_hook(keeper(index)) for index, block in enumerate(blocks)]
        try:
            clean_score = score(model(study.clean))
        finally:
            for handle in handles:
                handle.remove()
        corrupted_score = score(model(study.corrupted))
        raw = torch.empty(len(blocks), SEQ_LEN, dtype=torch.float64)
        for index, block in enumerate(blocks):
            for position in range(SEQ_LEN):

                def patch(
                    module: nn.Module, args: tuple[Any, ...], index: int = index, position: int = position
                ) -> Any:
                    hidden = args[0].clone()
                    hidden[:, position] = stored[index][:, position]
                    return (hidden, *args[1:])

                handle = block.register_forward_pre_hook(patch)
                try:
                    raw[index, position] = score(model(study.corrupted))
                finally:
                    handle.remove()
    return (raw - corrupted_score) / (clean_score - corrupted_score)


# -- the methods ------------------------------------------------------------------------------------


def run_naive(model: nn.Module, study: Study) -> common.Timed:
    return common.timed_call(lambda: naive_sweep(model, study))


def sweep_run(batch_rows: int | None) -> common.Run:
    def run(model: nn.Module, study: Study) -> common.Timed:
        metric = study.metric()
        return common.timed_call(
            lambda: hs.methods.patch_sweep(model, study.clean, study.corrupted, metric=metric, batch_rows=batch_rows)
        )

    return run


def run_attribution(model: nn.Module, study: Study) -> common.Timed:
    metric = study.metric()
    return common.timed_call(lambda: hs.methods.attribution_patch(model, study.clean, study.corrupted, metric=metric))


def run_plain(model: nn.Module, study: Study) -> common.Timed:
    with torch.no_grad():
        return common.timed_call(lambda: model(study.clean))


def methods() -> dict[str, common.Run]:
    runs: dict[str, common.Run] = {PLAIN: run_plain, NAIVE: run_naive, SWEEP: sweep_run(None)}
    runs |= {f"{SWEEP} rows={rows}": sweep_run(rows) for rows in BATCH_ROWS_VARIANTS}
    runs[ATTRIBUTION] = run_attribution
    return runs


# -- the check --------------------------------------------------------------------------------------


def check(model: nn.Module, study: Study) -> tuple[list[str], float, float]:
    """The sweep against the naive loop (asserted), and the attribution's correlation with the sweep."""
    metric = study.metric()
    naive = naive_sweep(model, study)
    sweep = hs.methods.patch_sweep(model, study.clean, study.corrupted, metric=metric)
    n_blocks = len(model.transformer.h)
    assert sweep.coords["site"] == [f"blocks.{index}.resid_pre" for index in range(n_blocks)], sweep.coords["site"]
    assert tuple(sweep.values.shape) == (n_blocks, SEQ_LEN), sweep.values.shape
    difference = float((sweep.values - naive).abs().max())
    assert difference < MAX_DIFFERENCE, f"sweep and naive loop differ by {difference:.3g} (normalised)"
    attribution = hs.methods.attribution_patch(model, study.clean, study.corrupted, metric=metric)
    correlation = attribution.correlation(sweep)
    top = sweep.top(1)[0]
    notes = [
        f"metric {metric.name} at the last position: clean {sweep.clean:.4f}, corrupted {sweep.corrupted:.4f}",
        f"grid: {n_blocks} blocks x {SEQ_LEN} positions = {n_blocks * SEQ_LEN} patches (resid_pre, denoise); "
        f"largest cell {top[0]}: {top[1]:+.3f}",
        f"sweep vs naive loop, normalised: max |difference| {difference:.3g} (asserted < {MAX_DIFFERENCE:g})",
        f"attribution_patch vs sweep: correlation {correlation:.3f} (information only)",
    ]
    return notes, difference, correlation


def bench(n_layer: int, rounds: int) -> Table:
    """Check, then time every method."""
    model, study = build(n_layer)
    notes, difference, correlation = check(model, study)
    times = common.measure(methods(), model, study, rounds, WARMUP)
    title = f"GPT2LMHeadModel {n_layer} layers, n_embd 768, one prompt of {SEQ_LEN} tokens"
    return Table("gpt2-lm", title, times, notes, difference, correlation)


# -- reporting --------------------------------------------------------------------------------------


def sweep_speedup(table: Table) -> float:
    return table.median_ratio(NAIVE, SWEEP)


def attribution_forwards(table: Table) -> float:
    return table.median_ratio(ATTRIBUTION, PLAIN)


def verdicts(table: Table) -> dict[str, bool]:
    return {
        "sweep_speedup": sweep_speedup(table) >= TARGET_SWEEP_SPEEDUP,
        "attribution_forwards": attribution_forwards(table) <= TARGET_ATTRIBUTION_FORWARDS,
    }


def format_table(table: Table) -> str:
    """Medians, ratio to a plain forward, speed-up over the naive loop and its range, and the verdicts."""
    header = f"{'method':<20}{'median s':>10}{'x plain fwd':>13}{'naive / method':>16}{'range':>20}"
    lines = [table.title, *(f"  {note}" for note in table.notes), "", header]
    for name, seconds in table.times.items():
        speedups = table.ratios(NAIVE, name)
        row = f"{name:<20}{statistics.median(seconds):>10.3f}{table.median_ratio(name, PLAIN):>13.2f}"
        row += f"{statistics.median(speedups):>16.2f}{common.ratio_range(speedups):>20}"
        lines.append(row)
    passed = verdicts(table)
    lines += [
        "",
        f"patch_sweep (batch_rows=64) speed-up over the naive loop: {sweep_speedup(table):.2f}x "
        f"(target >= {TARGET_SWEEP_SPEEDUP:.0f}x): {'PASS' if passed['sweep_speedup'] else 'FAIL'}",
        f"attribution_patch in plain forwards: {attribution_forwards(table):.2f} "
        f"(target <= {TARGET_ATTRIBUTION_FORWARDS:.0f}): {'PASS' if passed['attribution_forwards'] else 'FAIL'}",
    ]
    return "\n".join(lines)


def table_to_json(table: Table) -> dict[str, Any]:
    data = asdict(table) | table.medians(PLAIN, SWEEP)
    data["median_speedup_over_naive"] = {name: statistics.median(table.ratios(NAIVE, name)) for name in table.times}
    data["passed"] = verdicts(table)
    return data


# -- entry point ------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options; ``--quick`` overrides ``--rounds`` and shrinks the model."""
    return common.parse_run_args(
        argv,
        description=__doc__.splitlines()[0],
        min_rounds=MIN_ROUNDS,
        default_rounds=DEFAULT_ROUNDS,
        quick_help=f"smoke run: {QUICK_ROUNDS} rounds, {QUICK_N_LAYER}-layer GPT-2",
        check_help=(
            f"exit 1 if the sweep is under {TARGET_SWEEP_SPEEDUP:.0f}x faster than the naive loop or "
            f"attribution_patch costs over {TARGET_ATTRIBUTION_FORWARDS:.0f} plain forwards"
        ),
        quick_rounds=QUICK_ROUNDS,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print the report, and return the exit code."""
    args = parse_args(argv)
    common.start(args, f"warm-up {WARMUP}, eval mode")
    table = bench(QUICK_N_LAYER if args.quick else N_LAYER, args.rounds)
    print(f"\n{format_table(table)}", flush=True)
    targets = {"sweep_speedup_min": TARGET_SWEEP_SPEEDUP, "attribution_forwards_max": TARGET_ATTRIBUTION_FORWARDS}
    summary = [
        common.summary_row(
            "patch_sweep speed-up over the naive loop", sweep_speedup(table), TARGET_SWEEP_SPEEDUP, better="higher"
        ),
        common.summary_row(
            "attribution_patch in plain forwards", attribution_forwards(table), TARGET_ATTRIBUTION_FORWARDS
        ),
    ]
    return common.finish(
        args,
        [table_to_json(table)],
        all(verdicts(table).values()),
        targets=targets,
        seq_len=SEQ_LEN,
        changed_position=CHANGED_POSITION,
        warmup=WARMUP,
        summary=summary,
    )


if __name__ == "__main__":
    sys.exit(main())

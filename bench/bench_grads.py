"""What ``hs.watch_grads()`` costs over a plain training step of GPT-2, recording every step and on skipped steps (CPU).

The workload: ``GPT2LMHeadModel(GPT2Config(n_layer=6))`` with random weights (nothing is downloaded), dropout
probabilities set to 0 in the config (``resid_pdrop``, ``embd_pdrop``, ``attn_pdrop``) so that every step runs
the same work, train mode, on one fixed batch of 4 x 128 random token ids with ``labels=input_ids`` (the model's
own language-model loss). A training step is the forward, ``loss.backward()``, ``optimizer.step()`` of plain SGD
(lr 1e-4) and ``optimizer.zero_grad()``. Three methods run that step:

- ``plain``: the step alone;
- ``watch_grads``: ``hs.watch_grads(model)``, attached once before the run and removed after it, recording every
  step: per module call, statistics of the gradients with respect to its outputs and inputs (tensor hooks
  registered from forward hooks, summarised inside the hooks during the backward), and per parameter its
  gradient's statistics, all read by ``monitor.step()``, which runs inside the timer between
  ``loss.backward()`` and ``optimizer.step()``;
- ``every=10, skipped``: ``hs.watch_grads(model, every=10)``, attached once, timed only on steps it does not
  record. Such a monitor records steps 0, 10, 20, ...; before a timed step that would be one of those, the
  script closes it with a ``monitor.step()`` on no forward at all (an empty recorded step), outside the timer,
  so every timed step is one on which the hooks return at once. The script asserts that ``monitor.step()``
  returned None on every timed step.

Why: a monitor left on for a whole training run should cost little. The targets are ``watch_grads`` at most
1.10x the plain step and ``every=10, skipped`` at most 1.05x (median ratios); the script prints a verdict for
each.

One model per method: each method trains its own copy of the model, built from the same seed (so with the same
weights), with its own optimiser and monitor. A monitor attached once for the whole run would otherwise hook the
other methods' steps too, and attaching and removing monitors around every timed step would time something a
training loop does not do. The monitors do not change gradients, and every method takes the same number of SGD
steps on the same batch, so the three models stay equal; the script prints the largest difference between
their parameters after the run (0 when the steps are bitwise reproducible) as evidence that no method's work
leaked into another's.

How it is measured: every figure is a ratio between methods timed in the same process and the same round,
because the machine drifts by several percent over minutes. Each round times one step per method, in an order
rotated from round to round, after a full garbage collection, so that what the previous method left behind is
not collected inside someone else's timer. The reported ratio is the median of the per-round ratios, not the
ratio of medians. Each method is warmed up with one step (for ``watch_grads`` its first recorded step).

Run: ``.venv/bin/python bench/bench_grads.py``; ``--rounds N``; ``--quick`` for a smoke run (2-layer GPT-2).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Run as a file, not as a package: make ``common`` (next to this file) importable from any working directory.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

import common
import hookscope as hs

TARGET_EVERY_STEP = 1.10
TARGET_SKIPPED = 1.05
EVERY = 10
N_LAYER = 6
QUICK_N_LAYER = 2
LEARNING_RATE = 1e-4
DEFAULT_ROUNDS = 7
MIN_ROUNDS = 5
QUICK_ROUNDS = 2
WARMUP = 1
PLAIN, EVERY_STEP, SKIPPED = "plain", "watch_grads", f"every={EVERY}, skipped"


@dataclass
class Table(common.RoundRatios):
    """Timings of the three methods."""

    key: str
    title: str
    times: dict[str, list[float]]
    notes: list[str] = field(default_factory=list)


# -- the methods ------------------------------------------------------------------------------------


class Trainer:
    """One method: a model of its own, its SGD optimiser and, for the monitored methods, its monitor.

    ``common.measure`` hands every method the same model and input; here that model is an ``nn.ModuleDict``
    with one model per method, and each trainer steps its own entry, ``models[key]``.
    """

    def __init__(self, key: str, model: nn.Module, every: int | None, *, skip_recorded: bool = False) -> None:
        self.key = key
        self.optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
        self.monitor = None if every is None else hs.watch_grads(model, every=every)
        self.every = every or 1
        self.skip_recorded = skip_recorded
        self.steps = 0  # monitor.step() calls so far: the index of the monitor's next step
        self.timed_results: list[hs.GradStep | None] = []  # what monitor.step() returned on each timed step
        self.empty_steps: list[int] = []  # recorded steps closed on no forward, outside the timer

    def train_step(self, model: nn.Module, x: torch.Tensor) -> hs.GradStep | None:
        """Forward, backward, ``monitor.step()`` when monitored, SGD step, ``zero_grad()``."""
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        result = self.monitor.step() if self.monitor is not None else None
        self.optimizer.step()
        self.optimizer.zero_grad()
        return result

    def run(self, models: nn.Module, x: Any) -> common.Timed:
        """One timed training step of ``models[key]``; with ``skip_recorded``, on a step the monitor skips."""
        if self.skip_recorded and self.monitor is not None:
            while self.steps % self.every == 0:  # a step the monitor would record: close it empty, untimed
                self.monitor.step()  # nothing ran and no gradient is left: nothing is recorded
                self.empty_steps.append(self.steps)
                self.steps += 1
        assert isinstance(models, nn.ModuleDict)
        model = models[self.key]
        timed = common.timed_call(lambda: self.train_step(model, x))
        self.steps += 1
        self.timed_results.append(timed.kept)
        return timed

    def remove(self) -> None:
        """Remove the monitor's hooks, if any."""
        if self.monitor is not None:
            self.monitor.remove()


# -- the workload -----------------------------------------------------------------------------------


def gpt2_lm(config: GPT2Config) -> GPT2LMHeadModel:
    """GPT-2 LM from ``config``, random weights from seed 0, train mode."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    model.train()
    # The loss the model falls back to anyway (its class name names no loss); saying so silences a warning.
    model.loss_type = "ForCausalLM"
    return model


def build(n_layer: int) -> tuple[nn.ModuleDict, torch.Tensor, dict[str, Trainer], str]:
    """One model per method (same seed, same weights), the input ids, the trainers, and the table's title."""
    # Dropout probabilities 0: every step runs the same work, and the models stay equal.
    config = GPT2Config(n_layer=n_layer, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    models = nn.ModuleDict({name: gpt2_lm(config) for name in ("plain", "every_step", "skipped")})
    torch.manual_seed(0)
    x = torch.randint(0, config.vocab_size, (common.GPT2_BATCH, common.GPT2_SEQ_LEN))
    trainers = {
        PLAIN: Trainer("plain", models["plain"], None),
        EVERY_STEP: Trainer("every_step", models["every_step"], 1),
        SKIPPED: Trainer("skipped", models["skipped"], EVERY, skip_recorded=True),
    }
    title = (
        f"GPT-2 LM {config.n_layer} layers, input ids {common.GPT2_BATCH} x {common.GPT2_SEQ_LEN}, train mode, "
        f"dropout 0, SGD lr {LEARNING_RATE:g}"
    )
    return models, x, trainers, title


def parameter_difference(models: nn.ModuleDict) -> float:
    """The largest |difference| between any parameter of any model and the same parameter of ``plain``."""
    reference = dict(models["plain"].named_parameters())
    largest = 0.0
    with torch.no_grad():
        for key, model in models.items():
            if key != "plain":
                for name, parameter in model.named_parameters():
                    largest = max(largest, (parameter - reference[name]).abs().max().item())
    return largest


def notes_for(models: nn.ModuleDict, trainers: dict[str, Trainer]) -> list[str]:
    """What the monitors watched and recorded, and whether the models stayed equal; asserts the skipped steps."""
    every_step, skipped = trainers[EVERY_STEP], trainers[SKIPPED]
    recorded = [result for result in every_step.timed_results if result is not None]
    assert len(recorded) == len(every_step.timed_results), "watch_grads(model) skipped a timed step"
    assert all(result is None for result in skipped.timed_results), f"{SKIPPED}: a timed step was recorded"
    last = recorded[-1]
    watched = sum(1 for name, _ in models["every_step"].named_modules() if name)
    empty = ", ".join(str(step) for step in skipped.empty_steps)
    difference = parameter_difference(models)
    return [
        f"watch_grads: {watched} modules watched (every module but the root); each recorded step: "
        f"{len(last.of('grad_output'))} grad_output, {len(last.of('grad_input'))} grad_input and "
        f"{len(last.of('param'))} parameter records",
        f"{SKIPPED}: {len(skipped.timed_results)} steps run (warm-up included), none recorded; "
        f"recorded steps {empty} closed empty outside the timer",
        f"parameters after the run: largest difference between the three models {difference:.1e}",
    ]


def bench(n_layer: int, rounds: int) -> Table:
    """Build the models, time every method, remove the monitors, and check what they did."""
    models, x, trainers, title = build(n_layer)
    runs: dict[str, common.Run] = {name: trainer.run for name, trainer in trainers.items()}
    try:
        times = common.measure(runs, models, x, rounds, WARMUP)
    finally:
        for trainer in trainers.values():
            trainer.remove()
    return Table("gpt2", title, times, notes_for(models, trainers))


# -- reporting --------------------------------------------------------------------------------------


def verdicts(table: Table) -> list[tuple[str, float, float, bool]]:
    """``(what, median ratio over plain, target, passed)`` for each target."""
    every_step = table.median_ratio(EVERY_STEP, PLAIN)
    skipped = table.median_ratio(SKIPPED, PLAIN)
    recording = "hookscope watch_grads recording every step over plain"
    skipping = f"hookscope watch_grads every={EVERY} on a step not recorded over plain"
    return [
        (recording, every_step, TARGET_EVERY_STEP, every_step <= TARGET_EVERY_STEP),
        (skipping, skipped, TARGET_SKIPPED, skipped <= TARGET_SKIPPED),
    ]


def passed(table: Table) -> bool:
    """True when both targets are met."""
    return all(ok for *_, ok in verdicts(table))


def format_table(table: Table) -> str:
    """The table: medians, ratios to plain, round range, and one verdict line per target."""
    header = f"{'method':<20}{'median s':>10}{'x plain':>9}{'range x plain':>16}"
    lines = [table.title, *(f"  {note}" for note in table.notes), "", header]
    for name, seconds in table.times.items():
        per_round = table.ratios(name, PLAIN)
        row = f"{name:<20}{statistics.median(seconds):>10.4f}{table.median_ratio(name, PLAIN):>9.3f}"
        lines.append(row + f"{common.ratio_range(per_round):>16}")
    lines.append("")
    for what, ratio, target, ok in verdicts(table):
        lines.append(f"{table.key}: {what}: {ratio:.3f} (target <= {target:.2f}): {'PASS' if ok else 'FAIL'}")
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
        quick_help=f"smoke run: {QUICK_ROUNDS} rounds, {QUICK_N_LAYER}-layer GPT-2",
        check_help=f"exit 1 if watch_grads exceeds {TARGET_EVERY_STEP} or every={EVERY} exceeds {TARGET_SKIPPED}",
        quick_rounds=QUICK_ROUNDS,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print the report, and return the exit code."""
    args = parse_args(argv)
    common.start(args, f"warm-up {WARMUP}, training steps")
    table = bench(QUICK_N_LAYER if args.quick else N_LAYER, args.rounds)
    print(f"\n{format_table(table)}", flush=True)
    targets = {EVERY_STEP: TARGET_EVERY_STEP, SKIPPED: TARGET_SKIPPED}
    summary = [common.summary_row(what, ratio, target) for what, ratio, target, _ in verdicts(table)]
    return common.finish(
        args, [table_to_json(table)], passed(table), targets=targets, every=EVERY, warmup=WARMUP, summary=summary
    )


if __name__ == "__main__":
    sys.exit(main())

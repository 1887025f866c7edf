"""What ``hs.monitor()`` costs in a training loop of GPT-2, against a plain step and ``wandb.watch`` (CPU).

The workload: ``GPT2LMHeadModel(GPT2Config(n_layer=12))`` with random weights (nothing is downloaded), dropout
probabilities set to 0 in the config (``resid_pdrop``, ``embd_pdrop``, ``attn_pdrop``) so that every step runs
the same work, train mode, on one fixed batch of 4 x 128 random token ids with ``labels=input_ids`` (the model's
own language-model loss). A training step is the forward, ``loss.backward()``, the method's call after the
backward (``monitor.step()`` or ``run.log(...)``), ``optimizer.step()`` of plain SGD (lr 1e-4) and
``optimizer.zero_grad()``. Five methods run that step:

- ``plain``: the step alone;
- ``wandb.watch``: ``wandb.watch(model, log="all", log_freq=1)`` in an offline run (``WANDB_MODE=offline``,
  ``WANDB_DIR`` and ``wandb.init(dir=...)`` a temporary folder, ``WANDB_SILENT=true``), and
  ``run.log({"loss": loss.item()}, step=i)`` after the backward of every step: wandb.watch computes a
  histogram of every parameter (in a forward hook) and of every parameter's gradient (in tensor hooks) and
  sends them with the next ``run.log``. The run is finished after the timings. Skipped, with a printed note,
  where wandb cannot be imported;
- ``monitor every step``: ``hs.monitor(model)`` with its defaults, attached once before the run and removed
  after it: gradient statistics per block (``std:blocks.*``), every parameter's gradient norm and its ratio to
  the weight's norm, activation statistics per block, and the NaN/Inf tripwire (``hs.detect_nonfinite`` on every
  module); ``monitor.step()`` runs inside the timer and logs every step;
- ``monitor every=10, skipped``: ``hs.monitor(model, every=10)``, timed only on steps it does not log. Such a
  monitor logs steps 0, 10, 20, ...; before a timed step that would be one of those, the script trains that step
  outside the timer (a ``monitor.step()`` with nothing run since the last is refused), so every timed step is one
  on which its hooks return at once. The script asserts that ``monitor.step()`` returned None on every timed step;
- ``monitor + precision``: ``hs.monitor(model, precision="bf16")``, logging every step: the defaults plus, per
  block, what bfloat16 would lose of its output and of its gradient.

Why: a monitor left on for a whole training run should cost little, and less than the tool people reach for
first. The target is ``monitor every step`` at most 1.10x the plain step (median ratio); the script prints a
verdict for it, and the median ratio ``wandb.watch / monitor every step`` for comparison (no target).

One model per method: each method trains its own copy of the model, built from the same seed (so with the same
weights), with its own optimiser and its own monitor or wandb watch. A monitor attached once for the whole run
would otherwise hook the other methods' steps too, and attaching and removing monitors around every timed step
would time something a training loop does not do. Neither the monitors nor wandb change gradients, and every
method takes the same number of SGD steps on the same batch, so the models stay equal; the script prints the
largest difference between their parameters after the run (0 when the steps are bitwise reproducible) as
evidence that no method's work leaked into another's.

How it is measured: every figure is a ratio between methods timed in the same process and the same round,
because the machine drifts by several percent over minutes. Each round times one step per method, in an order
rotated from round to round, after a full garbage collection, so that what the previous method left behind is
not collected inside someone else's timer. The reported ratio is the median of the per-round ratios, not the
ratio of medians. Each method is warmed up with one step (for the monitors their first logged step, for
wandb.watch its first histograms). wandb's offline run writes its records from a process of its own
(``wandb-core``); what that process does between timers is not in wandb's figure, and it competes for the same
cores with whichever method runs next.

Run: ``.venv/bin/python bench/bench_monitor.py``; ``--rounds N``; ``--quick`` for a smoke run (2-layer GPT-2).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
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
EVERY = 10
PRECISION_FORMAT = "bf16"
N_LAYER = 12
QUICK_N_LAYER = 2
LEARNING_RATE = 1e-4
DEFAULT_ROUNDS = 5
MIN_ROUNDS = 3
QUICK_ROUNDS = 2
WARMUP = 1
WANDB_PROJECT = "hookscope-bench-monitor"
PLAIN, WANDB, EVERY_STEP = "plain", "wandb.watch", "monitor every step"
SKIPPED, PRECISION = f"monitor every={EVERY}, skipped", "monitor + precision"
KEYS = {PLAIN: "plain", WANDB: "wandb", EVERY_STEP: "every_step", SKIPPED: "skipped", PRECISION: "precision"}


@dataclass
class Table(common.RoundRatios):
    """Timings of the methods."""

    key: str
    title: str
    times: dict[str, list[float]]
    notes: list[str] = field(default_factory=list)


# -- the methods ------------------------------------------------------------------------------------


class Trainer:
    """One method: a model of its own, its SGD optimiser, and its monitor or wandb run, if any.

    ``common.measure`` hands every method the same model and input; here that model is an ``nn.ModuleDict``
    with one model per method, and each trainer steps its own entry, ``models[key]``.
    """

    def __init__(
        self,
        key: str,
        model: nn.Module,
        monitor: hs.Monitor | None = None,
        *,
        every: int = 1,
        skip_logged: bool = False,
        wandb_run: Any = None,
    ) -> None:
        self.key = key
        self.optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
        self.monitor = monitor
        self.every = every
        self.skip_logged = skip_logged
        self.wandb_run = wandb_run
        self.steps = 0  # training steps (and monitor.step() calls) so far: the index of the next one
        self.timed_results: list[hs.MonitorStep | None] = []  # what monitor.step() returned on each timed step
        self.untimed_steps: list[int] = []  # logged steps, trained outside the timer

    def train_step(self, model: nn.Module, x: torch.Tensor) -> hs.MonitorStep | None:
        """Forward, backward, ``monitor.step()`` or ``run.log``, SGD step, ``zero_grad()``."""
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        result = self.monitor.step() if self.monitor is not None else None
        if self.wandb_run is not None:
            self.wandb_run.log({"loss": loss.item()}, step=self.steps)  # sends wandb.watch's histograms
        self.optimizer.step()
        self.optimizer.zero_grad()
        return result

    def run(self, models: nn.Module, x: Any) -> common.Timed:
        """One timed training step of ``models[key]``; with ``skip_logged``, on a step the monitor skips."""
        assert isinstance(models, nn.ModuleDict)
        model = models[self.key]
        if self.skip_logged and self.monitor is not None:
            while self.steps % self.every == 0:  # a step the monitor logs: trained outside the timer
                self.train_step(model, x)  # a step with nothing run is refused, so it trains
                self.untimed_steps.append(self.steps)
                self.steps += 1
        timed = common.timed_call(lambda: self.train_step(model, x))
        self.steps += 1
        self.timed_results.append(timed.kept)
        return timed

    def remove(self) -> None:
        """Remove the monitor's hooks, if any (the wandb run is finished by ``bench``)."""
        if self.monitor is not None:
            self.monitor.remove()


def start_wandb(model: nn.Module, folder: str) -> Any:
    """An offline wandb run in ``folder`` watching ``model`` (every histogram, every step); None without wandb."""
    os.environ.update({"WANDB_MODE": "offline", "WANDB_DIR": folder, "WANDB_SILENT": "true"})
    try:
        import wandb
    except ImportError as error:
        print(f"{WANDB}: skipped, wandb cannot be imported ({error}); pip install wandb to compare with it")
        return None
    run = wandb.init(project=WANDB_PROJECT, dir=folder)
    wandb.watch(model, log="all", log_freq=1)
    return run


# -- the workload -----------------------------------------------------------------------------------


def gpt2_lm(config: GPT2Config) -> GPT2LMHeadModel:
    """GPT-2 LM from ``config``, random weights from seed 0, train mode."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    model.train()
    # The loss the model falls back to anyway (its class name names no loss); saying so silences a warning.
    model.loss_type = "ForCausalLM"
    return model


def build(n_layer: int, wandb_folder: str) -> tuple[nn.ModuleDict, torch.Tensor, dict[str, Trainer], str]:
    """One model per method (same seed, same weights), the input ids, the trainers, and the table's title.

    The wandb method is left out where wandb cannot be imported.
    """
    # Dropout probabilities 0: every step runs the same work, and the models stay equal.
    config = GPT2Config(n_layer=n_layer, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    models = nn.ModuleDict({key: gpt2_lm(config) for key in KEYS.values()})
    torch.manual_seed(0)
    x = torch.randint(0, config.vocab_size, (common.GPT2_BATCH, common.GPT2_SEQ_LEN))
    trainers = {PLAIN: Trainer(KEYS[PLAIN], models[KEYS[PLAIN]])}
    wandb_run = start_wandb(models[KEYS[WANDB]], wandb_folder)
    if wandb_run is None:
        del models[KEYS[WANDB]]
    else:
        trainers[WANDB] = Trainer(KEYS[WANDB], models[KEYS[WANDB]], wandb_run=wandb_run)
    monitored = {
        EVERY_STEP: (hs.monitor(models[KEYS[EVERY_STEP]]), {}),
        SKIPPED: (hs.monitor(models[KEYS[SKIPPED]], every=EVERY), {"every": EVERY, "skip_logged": True}),
        PRECISION: (hs.monitor(models[KEYS[PRECISION]], precision=PRECISION_FORMAT), {}),
    }
    for name, (monitor, options) in monitored.items():
        trainers[name] = Trainer(KEYS[name], models[KEYS[name]], monitor, **options)
    title = (
        f"GPT-2 LM {config.n_layer} layers, input ids {common.GPT2_BATCH} x {common.GPT2_SEQ_LEN}, train mode, "
        f"dropout 0, SGD lr {LEARNING_RATE:g}"
    )
    return models, x, trainers, title


def parameter_difference(models: nn.ModuleDict) -> float:
    """The largest |difference| between any parameter of any model and the same parameter of ``plain``."""
    reference = dict(models[KEYS[PLAIN]].named_parameters())
    largest = 0.0
    with torch.no_grad():
        for key, model in models.items():
            if key != KEYS[PLAIN]:
                for name, parameter in model.named_parameters():
                    largest = max(largest, (parameter - reference[name]).abs().max().item())
    return largest


def logged(trainer: Trainer) -> list[hs.MonitorStep]:
    """The steps a monitor logged inside the timer; asserts it logged every timed step."""
    found = [result for result in trainer.timed_results if result is not None]
    assert len(found) == len(trainer.timed_results), f"{trainer.key}: the monitor skipped a timed step"
    return found


def notes_for(models: nn.ModuleDict, trainers: dict[str, Trainer]) -> list[str]:
    """What the monitors watched and logged, and whether the models stayed equal; asserts the skipped steps."""
    every_step, skipped, precision = trainers[EVERY_STEP], trainers[SKIPPED], trainers[PRECISION]
    last = logged(every_step)[-1]
    last_precision = logged(precision)[-1]
    assert all(result is None for result in skipped.timed_results), f"{SKIPPED}: a timed step was logged"
    assert every_step.monitor is not None
    layers = len(every_step.monitor._chosen)  # the layers it watches (blocks, by default)
    grads = last.grads
    records = "" if grads is None else f" from {len(grads.records)} gradient records"
    kinds = ("act/", "grad/", "param_grad/", "precision/")
    counts = ", ".join(f"{sum(1 for k in last_precision.scalars if k.startswith(kind))} {kind}" for kind in kinds)
    untimed = ", ".join(str(step) for step in skipped.untimed_steps)
    notes = [
        f"monitor: {layers} layers watched; each logged step: {len(last.scalars)} scalars{records}, "
        f"{len(last.flags)} flags",
        f"{PRECISION} ({PRECISION_FORMAT}): each logged step {len(last_precision.scalars)} scalars ({counts}), "
        f"{len(last_precision.flags)} flags on the last",
        f"{SKIPPED}: {len(skipped.timed_results)} steps run (warm-up included), none logged; "
        f"logged steps {untimed} trained outside the timer",
    ]
    if WANDB in trainers:
        notes.append(f"{WANDB}: log='all', log_freq=1, offline; {trainers[WANDB].steps} steps logged with run.log")
    notes.append(
        f"parameters after the run: largest difference between the {len(models)} models "
        f"{parameter_difference(models):.1e}"
    )
    return notes


def bench(n_layer: int, rounds: int) -> Table:
    """Build the models, time every method, remove the monitors, finish the wandb run, check what was done."""
    with tempfile.TemporaryDirectory(prefix="bench-monitor-wandb-") as folder:
        models, x, trainers, title = build(n_layer, folder)
        runs: dict[str, common.Run] = {name: trainer.run for name, trainer in trainers.items()}
        try:
            times = common.measure(runs, models, x, rounds, WARMUP)
        finally:
            for trainer in trainers.values():
                trainer.remove()
            if WANDB in trainers:
                trainers[WANDB].wandb_run.finish()
        return Table("gpt2", title, times, notes_for(models, trainers))


# -- reporting --------------------------------------------------------------------------------------


def verdict(table: Table) -> tuple[str, float, bool]:
    """``(what, median ratio of monitor every step over plain, passed)``."""
    ratio = table.median_ratio(EVERY_STEP, PLAIN)
    return "hookscope monitor logging every step over plain", ratio, ratio <= TARGET_EVERY_STEP


def passed(table: Table) -> bool:
    """True when the target is met."""
    return verdict(table)[2]


def format_table(table: Table) -> str:
    """The table: medians, ratios to plain and to the monitor, round range, the verdict and the wandb ratio."""
    header = f"{'method':<28}{'median s':>10}{'x plain':>9}{'x monitor':>11}{'range x plain':>16}"
    lines = [table.title, *(f"  {note}" for note in table.notes), "", header]
    for name, seconds in table.times.items():
        row = f"{name:<28}{statistics.median(seconds):>10.4f}{table.median_ratio(name, PLAIN):>9.3f}"
        row += f"{table.median_ratio(name, EVERY_STEP):>11.3f}"
        lines.append(row + f"{common.ratio_range(table.ratios(name, PLAIN)):>16}")
    lines.append("")
    what, ratio, ok = verdict(table)
    lines.append(f"{table.key}: {what}: {ratio:.3f} (target <= {TARGET_EVERY_STEP:.2f}): {'PASS' if ok else 'FAIL'}")
    if WANDB in table.times:
        per_round = table.ratios(WANDB, EVERY_STEP)
        lines.append(
            f"{table.key}: {WANDB} / {EVERY_STEP}: {statistics.median(per_round):.3f} "
            f"(median of per-round ratios, range {common.ratio_range(per_round)}; no target)"
        )
    return "\n".join(lines)


def table_to_json(table: Table) -> dict[str, Any]:
    """The table as JSON-ready data (:func:`common.table_json`)."""
    return common.table_json(table, passed(table), PLAIN, EVERY_STEP)


# -- entry point ------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options; ``--quick`` overrides ``--rounds`` and shrinks the model."""
    return common.parse_run_args(
        argv,
        description=__doc__.splitlines()[0],
        min_rounds=MIN_ROUNDS,
        default_rounds=DEFAULT_ROUNDS,
        quick_help=f"smoke run: {QUICK_ROUNDS} rounds, {QUICK_N_LAYER}-layer GPT-2",
        check_help=f"exit 1 if the monitor logging every step exceeds {TARGET_EVERY_STEP}x plain",
        quick_rounds=QUICK_ROUNDS,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print the report, and return the exit code."""
    args = parse_args(argv)
    common.start(args, f"warm-up {WARMUP}, training steps")
    table = bench(QUICK_N_LAYER if args.quick else N_LAYER, args.rounds)
    print(f"\n{format_table(table)}", flush=True)
    what, ratio, _ = verdict(table)
    return common.finish(
        args,
        [table_to_json(table)],
        passed(table),
        targets={EVERY_STEP: TARGET_EVERY_STEP},
        every=EVERY,
        precision=PRECISION_FORMAT,
        warmup=WARMUP,
        summary=[common.summary_row(what, ratio, TARGET_EVERY_STEP)],
    )


if __name__ == "__main__":
    sys.exit(main())

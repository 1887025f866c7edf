"""What ``hs.edit()`` costs over a plain forward, zero-ablating one hidden unit in every block of GPT-2 (CPU).

The workload: GPT-2 with 12 layers, ``GPT2Model(GPT2Config())`` with random weights (nothing is downloaded), eval
mode, ``torch.no_grad()``, input ids batch 4 x 128, passed positionally as in ``bench_trace.py``. Each block
``h.0`` ... ``h.11`` returns a tensor of shape ``(batch, seq, 768)``; the edit zeroes hidden unit 7 (the last dim)
of every block's output. Four methods run the same forward:

- ``plain``: ``model(x)`` alone;
- ``edit``: ``with hs.edit(model, {"re:h\\.[0-9]+": hs.edits.zero(neurons=[7])}): model(x)``, the edit attached
  right before the timer starts and removed right after it stops: the timer holds the forward only, as in a loop
  that runs many forwards inside one ``with`` block;
- ``run_with_edits``: ``hs.run_with_edits(model, x, edits=...)``, the same edit, timed as one call: attach,
  forward, remove;
- ``hand hooks``: ``register_forward_hook`` on every block with ``out = out.clone(); out[..., 7] = 0; return out``,
  the usual hand-written way, attached and removed outside the timer like ``edit``.

The selector is a regular expression on purpose: the glob ``"h.*"`` also matches every module inside the blocks
(``*`` crosses dots), so it would edit 156 modules instead of 12. The script asserts that the edit sites are the
12 blocks. The edit objects are made once for the whole run, so the part's mask, built on the first call, is reused
as it would be in a loop.

Why: ablating a unit is what one does many times over (every unit, every layer), so the edit should cost about
what the forward costs. The target is ``edit`` at most 1.1x the plain forward (median ratio); the other two
methods have no target and are there to compare with.

Before timing, the script runs each method once and asserts that ``edit``, ``run_with_edits`` and ``hand hooks``
return bit-identical ``last_hidden_state`` tensors, and that these differ from the plain forward's.

How it is measured: every figure is a ratio between methods timed in the same process and the same round,
because the machine drifts by several percent over minutes. Each round times one forward per method, in an order
rotated from round to round, after a full garbage collection, so that what the previous method left behind is
not collected inside someone else's timer. The reported ratio is the median of the per-round ratios, not the
ratio of medians. Each method is warmed up with two forwards. How to read the table: ``x plain`` and
``x hand hooks`` are medians of the per-round ratios to that method, ``range x plain`` the smallest and largest
per-round ratio to ``plain`` (a view of the noise); the last line is the verdict.

Run: ``.venv/bin/python bench/bench_edit.py``; ``--rounds N``; ``--quick`` for a smoke run (2-layer GPT-2).
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

import common
import hookscope as hs

TARGET = 1.1
N_LAYER = 12
QUICK_N_LAYER = 2
UNIT = 7
DEFAULT_ROUNDS = 15
MIN_ROUNDS = 5
QUICK_ROUNDS = 2
WARMUP = 2
# Every block and nothing inside one: a glob such as "h.*" would also match "h.0.attn.c_attn" and the rest.
BLOCKS = r"re:h\.[0-9]+"
# Made once: the part's mask is built on the first call and reused by every later forward.
EDITS = {BLOCKS: hs.edits.zero(neurons=[UNIT])}
PLAIN, EDIT, RUN_WITH_EDITS, HAND_HOOKS = "plain", "edit", "run_with_edits", "hand hooks"


@dataclass
class Table(common.RoundRatios):
    """Timings of the four methods."""

    key: str
    title: str
    times: dict[str, list[float]]
    notes: list[str] = field(default_factory=list)


# -- the methods ------------------------------------------------------------------------------------


def blocks(model: nn.Module) -> list[nn.Module]:
    """GPT-2's blocks, ``h.0`` ... ``h.<n-1>``."""
    return list(model.get_submodule("h").children())


def zero_unit(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    """The hand-written hook: a copy of the block's output with hidden unit ``UNIT`` zeroed."""
    output = output.clone()
    output[..., UNIT] = 0
    return output


def run_plain(model: nn.Module, x: Any) -> common.Timed:
    """The forward alone."""
    return common.timed_call(lambda: model(x))


def run_edit(model: nn.Module, x: Any) -> common.Timed:
    """The forward inside ``hs.edit``, attached before the timer starts and removed after it stops."""
    with hs.edit(model, EDITS):
        return common.timed_call(lambda: model(x))


def run_with_edits(model: nn.Module, x: Any) -> common.Timed:
    """``hs.run_with_edits``: attach, forward and remove, all inside the timer."""
    return common.timed_call(lambda: hs.run_with_edits(model, x, edits=EDITS)[0])


def run_hand_hooks(model: nn.Module, x: Any) -> common.Timed:
    """``zero_unit`` registered on every block before the timer starts, removed after it stops."""
    handles = [block.register_forward_hook(zero_unit) for block in blocks(model)]
    try:
        return common.timed_call(lambda: model(x))
    finally:
        for handle in handles:
            handle.remove()


METHODS: dict[str, common.Run] = {
    PLAIN: run_plain,
    EDIT: run_edit,
    RUN_WITH_EDITS: run_with_edits,
    HAND_HOOKS: run_hand_hooks,
}


# -- the check --------------------------------------------------------------------------------------


def check_edits(work: common.Workload) -> list[str]:
    """Run every method once; assert that the three edited outputs are bit-identical and differ from plain.

    Returns notes for the report: the sites edited and how far the edited output is from the plain one.
    """
    n_blocks = len(blocks(work.model))
    with hs.edit(work.model, EDITS) as editor:
        sites = [site.split(" ")[0] for site in editor.sites]
    expected = [f"h.{index}" for index in range(n_blocks)]
    assert sites == expected, f"the edit attaches to {sites}, expected the {n_blocks} blocks {expected}"
    outputs = {name: run(work.model, work.inputs).kept.last_hidden_state for name, run in METHODS.items()}
    plain, hand = outputs[PLAIN], outputs[HAND_HOOKS]
    for name in (EDIT, RUN_WITH_EDITS):
        assert torch.equal(outputs[name], hand), f"{name}: last_hidden_state differs from the hand hooks'"
    assert not torch.equal(hand, plain), "the edited output equals the plain one: the edit did nothing"
    changed = (hand != plain).sum().item()
    largest = (hand - plain).abs().max().item()
    return [
        f"edit sites: the {n_blocks} blocks {sites[0]} ... {sites[-1]}, hidden unit {UNIT} of each block's output",
        f"{EDIT}, {RUN_WITH_EDITS} and {HAND_HOOKS}: last_hidden_state bit-identical; it differs from plain in "
        f"{changed} of {plain.numel()} values (largest |difference| {largest:.3g})",
    ]


def bench(work: common.Workload, rounds: int) -> Table:
    """Check, then time every method."""
    notes = check_edits(work)
    times = common.measure(METHODS, work.model, work.inputs, rounds, WARMUP)
    return Table(work.key, work.title, times, notes)


# -- reporting --------------------------------------------------------------------------------------


def edit_over_plain(table: Table) -> float:
    """The figure held to the target."""
    return table.median_ratio(EDIT, PLAIN)


def passed(table: Table) -> bool:
    """True when the edited forward's median ratio over plain is within the target."""
    return edit_over_plain(table) <= TARGET


def format_table(table: Table) -> str:
    """The table: medians, ratios to plain and to the hand hooks, round range, and the verdict."""
    header = f"{'method':<20}{'median s':>10}{'x plain':>9}{'x hand hooks':>14}{'range x plain':>16}"
    lines = [table.title, *(f"  {note}" for note in table.notes), "", header]
    for name, seconds in table.times.items():
        per_round = table.ratios(name, PLAIN)
        row = f"{name:<20}{statistics.median(seconds):>10.4f}{table.median_ratio(name, PLAIN):>9.3f}"
        row += f"{table.median_ratio(name, HAND_HOOKS):>14.3f}{common.ratio_range(per_round):>16}"
        lines.append(row)
    verdict = "PASS" if passed(table) else "FAIL"
    what = "hookscope edit zeroing one unit in every block, forward only, over plain"
    lines += ["", f"{table.key}: {what}: {edit_over_plain(table):.3f} (target <= {TARGET:.2f}): {verdict}"]
    return "\n".join(lines)


def table_to_json(table: Table) -> dict[str, Any]:
    """The table as JSON-ready data (:func:`common.table_json`)."""
    return common.table_json(table, passed(table), PLAIN, HAND_HOOKS)


# -- entry point ------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options; ``--quick`` overrides ``--rounds`` and shrinks the model."""
    return common.parse_run_args(
        argv,
        description=__doc__.splitlines()[0],
        min_rounds=MIN_ROUNDS,
        default_rounds=DEFAULT_ROUNDS,
        quick_help=f"smoke run: {QUICK_ROUNDS} rounds, {QUICK_N_LAYER}-layer GPT-2",
        check_help=f"exit 1 if edit/plain exceeds {TARGET}",
        quick_rounds=QUICK_ROUNDS,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print the report, and return the exit code."""
    args = parse_args(argv)
    common.start(args, f"warm-up {WARMUP}, torch.no_grad(), eval mode")
    with torch.no_grad():
        table = bench(common.gpt2_workload(QUICK_N_LAYER if args.quick else N_LAYER), args.rounds)
    print(f"\n{format_table(table)}", flush=True)
    settings = {"target": TARGET, "unit": UNIT, "selector": BLOCKS, "warmup": WARMUP}
    summary = [common.summary_row("hs.edit forward over plain", edit_over_plain(table), TARGET)]
    return common.finish(args, [table_to_json(table)], passed(table), **settings, summary=summary)


if __name__ == "__main__":
    sys.exit(main())

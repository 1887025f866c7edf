"""What ``hs.capture()`` costs over a plain forward and over hand-written hooks, when every leaf module is kept (CPU).

Two models, random weights from their configs (nothing is downloaded), eval mode, ``torch.no_grad()``:

- GPT-2, 12 layers (``GPT2Model(GPT2Config())``), input ids batch 4 x 128;
- ResNet-50 (``ResNetModel(ResNetConfig())``: bottleneck blocks, depths 3, 4, 6, 3), input ``randn(8, 3, 224, 224)``.

Three methods run the same forward of each model:

- ``plain``: the forward alone;
- ``hand hooks``: ``register_forward_hook`` on every leaf module (no children) storing ``output.detach()`` in a
  dict keyed by module name, the cheapest way to keep every activation (and silently wrong where a later
  in-place op, such as ResNet's residual ``out += identity``, rewrites a kept tensor);
- ``hookscope``: ``hs.capture(model, is_leaf)`` with its defaults (``copy="auto"``: references are kept and
  a value is copied only just before an in-place op would overwrite it; values stay on their device).

Why: capturing every activation is the heaviest everyday use of hookscope, and it should cost little more
than the unsafe hand-written hooks. The target is hookscope at most 1.10x the plain forward (median ratio),
for each model. Keeping every activation alive is part of the cost: each method's values stay referenced
until its timer stops, and are dropped before the next method runs.

Memory: with glibc's default settings, the 1.2 GiB that a ResNet-50 capture keeps is handed back to the
operating system when the values are dropped and faulted in again by the next forward: measured, 229-244k
minor page faults per captured forward (hand hooks 224k) against 41-61k for a plain one, and 1.25x in a
quiet run. A capture pass that ends holding 64 MiB or more now has glibc keep that freed memory resident
(``hookscope._shared.malloc``: ``mallopt`` of the mmap and trim thresholds, once per process, at most
2 GiB; ``HOOKSCOPE_MALLOC=default`` opts out), and once warm no method takes a page fault (0 for plain,
hand hooks and hookscope alike). The setting is made by the check run before the warm-up, so every timed
round, plain included, runs with it, as a user's process would after its first capture. 10 rounds on a
machine shared with other jobs (per-round ratios 0.51-2.64): hookscope 1.069x plain, 1.066x hand hooks;
the same run with ``HOOKSCOPE_MALLOC=default`` read 1.055x there, so on a busy machine the page faults are
the figure to compare, not the seconds.

How it is measured: every figure is a ratio between methods timed in the same process and the same round,
because the machine drifts by several percent over minutes. Each round times one forward per method, in an
order rotated from round to round; hooks are attached right before the timed forward and removed right
after, so only the forward is inside the timer. A full garbage collection runs before every timed forward,
for every method, so that what the previous method left behind is not collected inside someone else's
timer. The reported ratio is the median of the per-round ratios, not the ratio of medians.

Optional comparisons, each against its own plain forward with the same rounds method, each in a separate
process (torchlens wraps torch functions process-wide; neither touches the main measurement):
torchlens (``torchlens.trace`` on both models) and transformer-lens (``run_with_cache`` of a GPT-2-like
``TransformerBridge.boot_native`` model). They are skipped, with a note, where the package is missing.

The JSON (``--json``) carries ``summary``: one row per judged ratio (``name``, ``value``, ``target``,
``better``, ``unit``), hookscope over plain for each model.

Run: ``.venv/bin/python bench/bench_capture.py`` (or ``make bench``); ``--quick`` for a smoke run;
``--model resnet50`` (repeatable) for one model.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Run as a file, not as a package: make ``common`` (next to this file) importable from any working directory.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from torch import nn

import common
import hookscope as hs

TARGET = 1.10
MIN_ROUNDS = 10
QUICK_ROUNDS = 3
WARMUP = 2
OPTIONAL_WARMUP = 1
INSTALL_HINT = "pip install -e '.[bench]'"
OPTIONAL = {"torchlens": "torchlens", "transformer-lens": "transformer_lens"}
MIB = float(1 << 20)
# Sites whose value a later in-place op may rewrite, where the hand hooks then disagree with hookscope. In
# ResNet's bottleneck the last conv layer ends in BatchNorm then Identity (both return the same tensor), and
# the block then does ``hidden_state += residual`` in place.
REWRITTEN = {"resnet50": re.compile(r"\.layer\.2\.(normalization|activation)$")}


@dataclass
class Method:
    """A way of running the forward, and how to list the tensors it kept."""

    run: common.Run
    tensors: Callable[[Any], list[torch.Tensor]] = lambda kept: []


@dataclass
class Footprint:
    """What a method kept after one forward: values, their bytes, and the bytes of their distinct storages."""

    values: int
    bytes: int
    distinct_bytes: int


@dataclass
class Table(common.RoundRatios):
    """Timings and footprints of one model's methods."""

    key: str
    title: str
    baseline: str
    times: dict[str, list[float]]
    footprints: dict[str, Footprint]
    notes: list[str] = field(default_factory=list)


# -- the methods ------------------------------------------------------------------------------------


def is_leaf(name: str, module: nn.Module) -> bool:
    """The selection under test: modules without children."""
    return next(module.children(), None) is None


def run_plain(model: nn.Module, x: Any) -> common.Timed:
    """The forward alone."""
    return common.Timed(common.timed_call(lambda: model(x)).seconds)


def keep_output(store: dict[str, Any], name: str) -> Callable[[nn.Module, Any, Any], None]:
    """A hand-written hook storing the detached output (the tensors of a tuple output) under ``name``."""

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor):
            store[name] = output.detach()
        elif isinstance(output, (tuple, list)):
            store[name] = tuple(o.detach() for o in output if isinstance(o, torch.Tensor))

    return hook


def run_hand_hooks(model: nn.Module, x: Any) -> common.Timed:
    """``register_forward_hook(keep_output)`` on every leaf module, removed after the forward."""
    store: dict[str, Any] = {}
    handles = [m.register_forward_hook(keep_output(store, n)) for n, m in model.named_modules() if is_leaf(n, m)]
    try:
        timed = common.timed_call(lambda: model(x))
    finally:
        for handle in handles:
            handle.remove()
    return common.Timed(timed.seconds, store)


def hand_tensors(store: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors a hand-hooks dict holds."""
    return [t for value in store.values() for t in (value if isinstance(value, tuple) else (value,))]


def run_hookscope(model: nn.Module, x: Any) -> common.Timed:
    """``hs.capture(model, is_leaf)`` with defaults, removed after the forward (its values stay readable)."""
    recorder = hs.capture(model, is_leaf)
    try:
        timed = common.timed_call(lambda: model(x))
    finally:
        recorder.remove()
    return common.Timed(timed.seconds, recorder)


def hookscope_tensors(recorder: hs.Capture) -> list[torch.Tensor]:
    """The tensors a capture holds."""
    return [recorder[site] for site in recorder.sites()]


MAIN_METHODS: dict[str, Method] = {
    "plain": Method(run_plain),
    "hand hooks": Method(run_hand_hooks, hand_tensors),
    "hookscope": Method(run_hookscope, hookscope_tensors),
}


# -- measuring --------------------------------------------------------------------------------------


def footprint(tensors: Iterable[torch.Tensor]) -> Footprint:
    """Count values and bytes; views of one storage count once in ``distinct_bytes``."""
    values = nbytes = 0
    storages: dict[int, int] = {}
    for tensor in tensors:
        values += 1
        nbytes += tensor.numel() * tensor.element_size()
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return Footprint(values, nbytes, sum(storages.values()))


def measure_kept(
    methods: dict[str, Method], model: nn.Module, x: Any, rounds: int, warmup: int
) -> tuple[dict[str, list[float]], dict[str, Footprint]]:
    """Time the methods with :func:`common.measure`; also the footprint of what each kept in the first round."""
    footprints: dict[str, Footprint] = {}

    def take_footprint(name: str, kept: Any) -> None:
        footprints[name] = footprint(methods[name].tensors(kept))

    runs = {name: method.run for name, method in methods.items()}
    times = common.measure(runs, model, x, rounds, warmup, take_footprint)
    return times, footprints


# -- the workloads ----------------------------------------------------------------------------------


MODELS = ("gpt2", "resnet50")


def build_workloads(quick: bool, models: Sequence[str] = MODELS) -> list[common.Workload]:
    """GPT-2 (12 layers; 2 with ``quick``) then ResNet-50 (smaller with ``quick``), in that order; only
    those named in ``models``."""
    builders = {
        "gpt2": lambda: common.gpt2_workload(2 if quick else 12),
        "resnet50": lambda: common.resnet_workload(quick),
    }
    return [builders[key]() for key in MODELS if key in models]


def check_capture(work: common.Workload) -> list[str]:
    """Run hand hooks and hookscope once; assert they saw the same modules and agree where nothing rewrites.

    Returns notes for the report: leaf counts, and how many hand-hook values an in-place op changed.
    """
    leaves = sum(1 for n, m in work.model.named_modules() if is_leaf(n, m))
    hand: dict[str, Any] = run_hand_hooks(work.model, work.inputs).kept
    recorder: hs.Capture = run_hookscope(work.model, work.inputs).kept
    pattern = REWRITTEN.get(work.key)
    modules = {site.module for site in recorder.sites()}
    assert modules == set(hand), f"hookscope captured {len(modules)} modules, hand hooks {len(hand)}"
    rewritten = []
    for name, value in hand.items():
        ours = [recorder[site] for site in recorder.sites() if site.module == name]
        theirs = list(value) if isinstance(value, tuple) else [value]
        same = len(ours) == len(theirs) and all(map(torch.equal, ours, theirs))
        if pattern is not None and pattern.search(name):
            if not same:
                rewritten.append(name)
        else:
            assert same, f"{name}: hookscope's value differs from the hand hook's, and no in-place op is expected"
    notes = [f"{leaves} leaf modules, {len(hand)} ran and were captured by both methods; values equal elsewhere"]
    if pattern is not None:
        notes.append(
            f"{len(rewritten)} hand-hook values differ from hookscope's: an in-place op later rewrote them "
            "(hand hooks keep the rewritten tensor, hookscope copied it just before the write)"
        )
    return notes


def bench_main(work: common.Workload, rounds: int) -> Table:
    """Check, then time plain / hand hooks / hookscope on one workload."""
    notes = check_capture(work)
    times, footprints = measure_kept(MAIN_METHODS, work.model, work.inputs, rounds, WARMUP)
    return Table(work.key, work.title, "plain", times, footprints, notes)


# -- optional comparisons (each in its own process) -------------------------------------------------


def bench_torchlens(workloads: list[common.Workload], rounds: int) -> list[Table]:
    """``torchlens.trace(model, x)`` (every op, default save) against the plain forward.

    torchlens wraps torch functions process-wide on first use; the wrappers are installed before each
    trace's timer starts and removed after it stops, so ``plain`` runs on unwrapped torch and the trace
    is timed in its steady state (the one-time wrapping is left out).
    """
    import torchlens
    from torchlens.backends.torch.wrappers import unwrap_torch, wrap_torch

    def run_trace(model: nn.Module, x: Any) -> common.Timed:
        wrap_torch()
        try:
            return common.timed_call(lambda: torchlens.trace(model, x))
        finally:
            unwrap_torch()

    def trace_tensors(trace: Any) -> list[torch.Tensor]:
        return [op.out for op in trace.layer_list if isinstance(op.out, torch.Tensor)]

    methods = {"plain": Method(run_plain), "torchlens trace": Method(run_trace, trace_tensors)}
    tables = []
    for work in workloads:
        times, footprints = measure_kept(methods, work.model, work.inputs, rounds, OPTIONAL_WARMUP)
        title = f"torchlens {torchlens.__version__}: {work.title}"
        note = f"trace with default options (every op kept), warm-up {OPTIONAL_WARMUP}"
        tables.append(Table(f"torchlens/{work.key}", title, "plain", times, footprints, [note]))
    return tables


def bench_transformer_lens(quick: bool, rounds: int) -> list[Table]:
    """``run_with_cache`` of a GPT-2-like ``TransformerBridge`` (random weights) against its own forward."""
    from transformer_lens.model_bridge import TransformerBridge

    n_layers = 2 if quick else 12
    config: dict[str, Any] = {
        "d_model": 768,
        "d_head": 64,
        "n_heads": 12,
        "n_layers": n_layers,
        "n_ctx": 1024,
        "d_vocab": 50257,
    }
    config |= {"d_mlp": 3072, "act_fn": "gelu_new", "normalization_type": "LN", "seed": 0}
    bridge = TransformerBridge.boot_native(config).eval()
    x = torch.randint(0, 50257, (4, 128))

    def run_with_cache(model: nn.Module, tokens: Any) -> common.Timed:
        timed = common.timed_call(lambda: bridge.run_with_cache(tokens))
        _, cache = timed.kept
        return common.Timed(timed.seconds, cache)

    def cache_tensors(cache: Any) -> list[torch.Tensor]:
        return [t for t in cache.values() if isinstance(t, torch.Tensor)]

    methods = {"plain": Method(run_plain), "run_with_cache": Method(run_with_cache, cache_tensors)}
    times, footprints = measure_kept(methods, bridge, x, rounds, OPTIONAL_WARMUP)
    version = importlib.metadata.version("transformer-lens")
    title = f"transformer-lens {version}: GPT-2-like bridge (boot_native), {n_layers} layers, input ids 4 x 128"
    note = f"its own model (logits included), not HF's GPT2Model; every hook point cached; warm-up {OPTIONAL_WARMUP}"
    return [Table("transformer-lens/gpt2", title, "plain", times, footprints, [note])]


def run_optional(name: str, args: argparse.Namespace) -> list[Table] | str:
    """Run one optional comparison in a child process; its tables, or why it was skipped."""
    if importlib.util.find_spec(OPTIONAL[name]) is None:
        return f"{name} is not installed; install it with `{INSTALL_HINT}`"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, str(Path(__file__).resolve()), "--only", name, "--json", str(out)]
        command += ["--rounds", str(args.rounds), "--threads", str(args.threads)] + (["--quick"] if args.quick else [])
        command += [arg for key in args.model or () for arg in ("--model", key)]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0 or not out.exists():
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            return f"{name} failed in its own process (exit {done.returncode}): {tail}"
        return [table_from_json(data) for data in json.loads(out.read_text())["tables"]]


# -- reporting --------------------------------------------------------------------------------------


def format_table(table: Table) -> str:
    """One model's table: medians, ratios, round range and footprints."""
    second = "hand hooks" if "hand hooks" in table.times else None
    header = f"{'method':<17}{'median s':>10}{'x plain':>9}"
    header += f"{'x hand hooks':>14}" if second else ""
    header += f"{'range x plain':>16}{'values':>8}{'MiB kept':>10}{'MiB distinct':>14}"
    lines = [table.title, *(f"  {note}" for note in table.notes), "", header]
    for name, seconds in table.times.items():
        per_round = table.ratios(name, table.baseline)
        kept = table.footprints.get(name, Footprint(0, 0, 0))
        row = f"{name:<17}{statistics.median(seconds):>10.4f}{table.median_ratio(name, table.baseline):>9.3f}"
        row += f"{table.median_ratio(name, second):>14.3f}" if second else ""
        row += f"{common.ratio_range(per_round):>16}"
        row += f"{kept.values:>8}{kept.bytes / MIB:>10.1f}{kept.distinct_bytes / MIB:>14.1f}"
        lines.append(row)
    if second:
        ratio = table.median_ratio("hookscope", "plain")
        verdict = "PASS" if passed(table) else "FAIL"
        lines += ["", f"{table.key}: hookscope capture over plain: {ratio:.3f} (target <= {TARGET:.2f}): {verdict}"]
    return "\n".join(lines)


def table_to_json(table: Table) -> dict[str, Any]:
    """A table as JSON-ready data, with medians and median ratios spelled out."""
    main_table = "hand hooks" in table.times
    data = asdict(table) | table.medians("plain", *(["hand hooks"] if main_table else []))
    if main_table:
        data["passed"] = passed(table)
    return data


def table_from_json(data: dict[str, Any]) -> Table:
    """A table written by :func:`table_to_json` (in a child process)."""
    footprints = {name: Footprint(**value) for name, value in data["footprints"].items()}
    return Table(data["key"], data["title"], data["baseline"], data["times"], footprints, data["notes"])


def summary(tables: Sequence[Table]) -> list[dict[str, Any]]:
    """One row per judged ratio (hookscope over plain, per model), for a summary table across benchmarks."""
    return [
        {
            "name": f"capture every leaf, {table.key}: hookscope / plain",
            "value": table.median_ratio("hookscope", "plain"),
            "target": TARGET,
            "better": "lower",
            "unit": "x",
        }
        for table in tables
        if "hand hooks" in table.times
    ]


def passed(table: Table) -> bool:
    """True when hookscope's median ratio over plain is within the target."""
    return table.median_ratio("hookscope", "plain") <= TARGET


# -- entry point ------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options; ``--quick`` overrides ``--rounds`` and shrinks the models."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_run_options(
        parser,
        min_rounds=MIN_ROUNDS,
        quick_help=f"smoke run: {QUICK_ROUNDS} rounds, small models",
        check_help=f"exit 1 if hookscope/plain exceeds {TARGET}",
    )
    parser.add_argument(
        "--only", choices=["hookscope", *OPTIONAL], help="run one part: the hookscope tables or one comparison"
    )
    parser.add_argument(
        "--model", action="append", choices=MODELS, help="measure only this model (repeatable; default: both)"
    )
    args = parser.parse_args(argv)
    common.check_run_options(parser, args, MIN_ROUNDS)
    if args.quick:
        args.rounds = QUICK_ROUNDS
    return args


def run_part(part: str, args: argparse.Namespace) -> list[Table]:
    """The tables of one part, measured in this process."""
    common.prepare_torch(args.threads)
    with torch.no_grad():
        if part == "transformer-lens":
            return bench_transformer_lens(args.quick, args.rounds)
        if part == "torchlens":
            return bench_torchlens(build_workloads(args.quick, args.model or MODELS), args.rounds)
        return [bench_main(work, args.rounds) for work in build_workloads(args.quick, args.model or MODELS)]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print the report, and return the exit code."""
    args = parse_args(argv)
    parts = [args.only] if args.only else ["hookscope", *OPTIONAL]
    threads = common.threads_label(args.threads)
    print(f"torch {torch.__version__}, {threads}, {args.rounds} rounds, torch.no_grad(), eval mode, random weights")
    tables: list[Table] = []
    skipped: dict[str, str] = {}
    for part in parts:
        result = run_part(part, args) if part == "hookscope" or args.only else run_optional(part, args)
        if isinstance(result, str):
            skipped[part] = result
            print(f"\n{part}: skipped: {result}", flush=True)
            continue
        tables += result
        for table in result:
            print(f"\n{format_table(table)}", flush=True)
    if args.json is not None:
        data = {"torch_version": torch.__version__, "threads": args.threads, "rounds": args.rounds, "target": TARGET}
        data |= {"tables": [table_to_json(t) for t in tables], "skipped": skipped, "summary": summary(tables)}
        common.write_json(args.json, data)
    main_tables = [t for t in tables if "hand hooks" in t.times]
    return 1 if args.check and not all(map(passed, main_tables)) else 0


if __name__ == "__main__":
    sys.exit(main())

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
than the unsafe hand-written hooks. The target is hookscope at most 1.15x the plain forward (median ratio).
Keeping every activation alive is part of the cost: each method's values stay referenced until its timer
stops, and are dropped before the next method runs.

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

Run: ``.venv/bin/python bench/bench_capture.py`` (or ``make bench``); ``--quick`` for a smoke run.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from torch import nn
from transformers import GPT2Config, GPT2Model, ResNetConfig, ResNetModel

import hookscope as hs

TARGET = 1.15
MIN_ROUNDS = 10
QUICK_ROUNDS = 3
WARMUP = 2
OPTIONAL_WARMUP = 1
INSTALL_HINT = "pip install -e '.[bench]'"
OPTIONAL = {"torchlens": "torchlens", "transformer-lens": "transformer_lens"}
MIB = float(1 << 20)


@dataclass
class Timed:
    """One timed forward: its seconds, and what the method kept (alive until this object is dropped)."""

    seconds: float
    kept: Any = None


Run = Callable[[nn.Module, Any], Timed]


@dataclass
class Method:
    """A way of running the forward, and how to list the tensors it kept."""

    run: Run
    tensors: Callable[[Any], list[torch.Tensor]] = lambda kept: []


@dataclass
class Footprint:
    """What a method kept after one forward: values, their bytes, and the bytes of their distinct storages."""

    values: int
    bytes: int
    distinct_bytes: int


@dataclass
class Workload:
    """A model and its input, plus the sites a later in-place op may rewrite (hand hooks then disagree)."""

    key: str
    title: str
    model: nn.Module
    inputs: Any
    rewritten: re.Pattern[str] | None = None


@dataclass
class Table:
    """Timings and footprints of one model's methods."""

    key: str
    title: str
    baseline: str
    times: dict[str, list[float]]
    footprints: dict[str, Footprint]
    notes: list[str] = field(default_factory=list)

    def ratios(self, name: str, baseline: str) -> list[float]:
        """Per-round ratios ``name / baseline``."""
        return [t / b for t, b in zip(self.times[name], self.times[baseline], strict=True)]

    def median_ratio(self, name: str, baseline: str) -> float:
        """Median of the per-round ratios ``name / baseline``."""
        return statistics.median(self.ratios(name, baseline))


# -- the methods ------------------------------------------------------------------------------------


def is_leaf(name: str, module: nn.Module) -> bool:
    """The selection under test: modules without children."""
    return next(module.children(), None) is None


def timed_call(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds taken by ``fn()`` after a full collection, and its result (alive until the timer stopped)."""
    gc.collect()
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def run_plain(model: nn.Module, x: Any) -> Timed:
    """The forward alone."""
    seconds, _ = timed_call(lambda: model(x))
    return Timed(seconds)


def keep_output(store: dict[str, Any], name: str) -> Callable[[nn.Module, Any, Any], None]:
    """A hand-written hook storing the detached output (the tensors of a tuple output) under ``name``."""

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor):
            store[name] = output.detach()
        elif isinstance(output, (tuple, list)):
            store[name] = tuple(o.detach() for o in output if isinstance(o, torch.Tensor))

    return hook


def run_hand_hooks(model: nn.Module, x: Any) -> Timed:
    """``register_forward_hook(keep_output)`` on every leaf module, removed after the forward."""
    store: dict[str, Any] = {}
    handles = [m.register_forward_hook(keep_output(store, n)) for n, m in model.named_modules() if is_leaf(n, m)]
    try:
        seconds, _ = timed_call(lambda: model(x))
    finally:
        for handle in handles:
            handle.remove()
    return Timed(seconds, store)


def hand_tensors(store: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors a hand-hooks dict holds."""
    return [t for value in store.values() for t in (value if isinstance(value, tuple) else (value,))]


def run_hookscope(model: nn.Module, x: Any) -> Timed:
    """``hs.capture(model, is_leaf)`` with defaults, removed after the forward (its values stay readable)."""
    recorder = hs.capture(model, is_leaf)
    try:
        seconds, _ = timed_call(lambda: model(x))
    finally:
        recorder.remove()
    return Timed(seconds, recorder)


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


def measure(
    methods: dict[str, Method], model: nn.Module, x: Any, rounds: int, warmup: int
) -> tuple[dict[str, list[float]], dict[str, Footprint]]:
    """Warm every method up, then time one forward per method per round, rotating the order.

    Footprints are taken from the first timed round, after the timer stopped.
    """
    names = list(methods)
    for name in names:
        for _ in range(warmup):
            methods[name].run(model, x)
    times: dict[str, list[float]] = {name: [] for name in names}
    footprints: dict[str, Footprint] = {}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            timed = methods[name].run(model, x)
            times[name].append(timed.seconds)
            if round_index == 0:
                footprints[name] = footprint(methods[name].tensors(timed.kept))
            del timed  # drop the kept values before the next method
    return times, footprints


# -- the workloads ----------------------------------------------------------------------------------


def gpt2_workload(quick: bool) -> Workload:
    """GPT-2 (12 layers; 2 with ``quick``), batch 4 x 128 random token ids."""
    config = GPT2Config(n_layer=2) if quick else GPT2Config()
    model = GPT2Model(config).eval()
    x = torch.randint(0, config.vocab_size, (4, 128))
    return Workload("gpt2", f"GPT-2 {config.n_layer} layers, input ids 4 x 128", model, x)


def resnet_workload(quick: bool) -> Workload:
    """ResNet-50 (one block per stage and batch 2 with ``quick``), batch 8 x 3 x 224 x 224."""
    config = ResNetConfig(depths=[1, 1, 1, 1]) if quick else ResNetConfig()
    batch = 2 if quick else 8
    model = ResNetModel(config).eval()
    x = torch.randn(batch, 3, 224, 224)
    depths = "-".join(str(d) for d in config.depths or ())
    # The bottleneck's last conv layer ends in BatchNorm then Identity (both return the same tensor),
    # and the block then does ``hidden_state += residual`` in place.
    rewritten = re.compile(r"\.layer\.2\.(normalization|activation)$")
    title = f"ResNet ({config.layer_type}, depths {depths}), input {batch} x 3 x 224 x 224"
    return Workload("resnet50", title, model, x, rewritten)


def check_capture(work: Workload) -> list[str]:
    """Run hand hooks and hookscope once; assert they saw the same modules and agree where nothing rewrites.

    Returns notes for the report: leaf counts, and how many hand-hook values an in-place op changed.
    """
    leaves = sum(1 for n, m in work.model.named_modules() if is_leaf(n, m))
    hand: dict[str, Any] = run_hand_hooks(work.model, work.inputs).kept
    recorder: hs.Capture = run_hookscope(work.model, work.inputs).kept
    modules = {site.module for site in recorder.sites()}
    assert modules == set(hand), f"hookscope captured {len(modules)} modules, hand hooks {len(hand)}"
    rewritten = []
    for name, value in hand.items():
        ours = [recorder[site] for site in recorder.sites() if site.module == name]
        theirs = list(value) if isinstance(value, tuple) else [value]
        same = len(ours) == len(theirs) and all(map(torch.equal, ours, theirs))
        if work.rewritten is not None and work.rewritten.search(name):
            if not same:
                rewritten.append(name)
        else:
            assert same, f"{name}: hookscope's value differs from the hand hook's, and no in-place op is expected"
    notes = [f"{leaves} leaf modules, {len(hand)} ran and were captured by both methods; values equal elsewhere"]
    if work.rewritten is not None:
        notes.append(
            f"{len(rewritten)} hand-hook values differ from hookscope's: an in-place op later rewrote them "
            "(hand hooks keep the rewritten tensor, hookscope copied it just before the write)"
        )
    return notes


def bench_main(work: Workload, rounds: int) -> Table:
    """Check, then time plain / hand hooks / hookscope on one workload."""
    notes = check_capture(work)
    times, footprints = measure(MAIN_METHODS, work.model, work.inputs, rounds, WARMUP)
    return Table(work.key, work.title, "plain", times, footprints, notes)


# -- optional comparisons (each in its own process) -------------------------------------------------


def bench_torchlens(workloads: list[Workload], rounds: int) -> list[Table]:
    """``torchlens.trace(model, x)`` (every op, default save) against the plain forward.

    torchlens wraps torch functions process-wide on first use; the wrappers are installed before each
    trace's timer starts and removed after it stops, so ``plain`` runs on unwrapped torch and the trace
    is timed in its steady state (the one-time wrapping is left out).
    """
    import torchlens
    from torchlens.backends.torch.wrappers import unwrap_torch, wrap_torch

    def run_trace(model: nn.Module, x: Any) -> Timed:
        wrap_torch()
        try:
            seconds, trace = timed_call(lambda: torchlens.trace(model, x))
        finally:
            unwrap_torch()
        return Timed(seconds, trace)

    def trace_tensors(trace: Any) -> list[torch.Tensor]:
        return [op.out for op in trace.layer_list if isinstance(op.out, torch.Tensor)]

    methods = {"plain": Method(run_plain), "torchlens trace": Method(run_trace, trace_tensors)}
    tables = []
    for work in workloads:
        times, footprints = measure(methods, work.model, work.inputs, rounds, OPTIONAL_WARMUP)
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

    def run_with_cache(model: nn.Module, tokens: Any) -> Timed:
        seconds, (_, cache) = timed_call(lambda: bridge.run_with_cache(tokens))
        return Timed(seconds, cache)

    def cache_tensors(cache: Any) -> list[torch.Tensor]:
        return [t for t in cache.values() if isinstance(t, torch.Tensor)]

    methods = {"plain": Method(run_plain), "run_with_cache": Method(run_with_cache, cache_tensors)}
    times, footprints = measure(methods, bridge, x, rounds, OPTIONAL_WARMUP)
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
        row += f"{f'{min(per_round):.3f}..{max(per_round):.3f}':>16}"
        row += f"{kept.values:>8}{kept.bytes / MIB:>10.1f}{kept.distinct_bytes / MIB:>14.1f}"
        lines.append(row)
    if second:
        ratio = table.median_ratio("hookscope", "plain")
        verdict = "PASS" if passed(table) else "FAIL"
        lines += ["", f"{table.key}: hookscope capture over plain: {ratio:.3f} (target <= {TARGET:.2f}): {verdict}"]
    return "\n".join(lines)


def table_to_json(table: Table) -> dict[str, Any]:
    """A table as JSON-ready data, with medians and median ratios spelled out."""
    data = asdict(table)
    data["median_s"] = {name: statistics.median(values) for name, values in table.times.items()}
    data["median_ratio_vs_plain"] = {name: table.median_ratio(name, "plain") for name in table.times}
    if "hand hooks" in table.times:
        data["median_ratio_vs_hand_hooks"] = {name: table.median_ratio(name, "hand hooks") for name in table.times}
        data["passed"] = passed(table)
    return data


def table_from_json(data: dict[str, Any]) -> Table:
    """A table written by :func:`table_to_json` (in a child process)."""
    footprints = {name: Footprint(**value) for name, value in data["footprints"].items()}
    return Table(data["key"], data["title"], data["baseline"], data["times"], footprints, data["notes"])


def passed(table: Table) -> bool:
    """True when hookscope's median ratio over plain is within the target."""
    return table.median_ratio("hookscope", "plain") <= TARGET


# -- entry point ------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options; ``--quick`` overrides ``--rounds`` and shrinks the models."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS, help=f"timed rounds (>= {MIN_ROUNDS})")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK_ROUNDS} rounds, small models")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON here")
    parser.add_argument("--check", action="store_true", help=f"exit 1 if hookscope/plain exceeds {TARGET}")
    parser.add_argument(
        "--only", choices=["hookscope", *OPTIONAL], help="run one part: the hookscope tables or one comparison"
    )
    args = parser.parse_args(argv)
    if not args.quick and args.rounds < MIN_ROUNDS:
        parser.error(f"--rounds must be at least {MIN_ROUNDS} (use --quick for a smoke run)")
    if args.threads < 1:
        parser.error("--threads must be at least 1")
    if args.quick:
        args.rounds = QUICK_ROUNDS
    return args


def run_part(part: str, args: argparse.Namespace) -> list[Table]:
    """The tables of one part, measured in this process."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with torch.no_grad():
        if part == "transformer-lens":
            return bench_transformer_lens(args.quick, args.rounds)
        workloads = [gpt2_workload(args.quick), resnet_workload(args.quick)]
        if part == "torchlens":
            return bench_torchlens(workloads, args.rounds)
        return [bench_main(work, args.rounds) for work in workloads]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print the report, and return the exit code."""
    args = parse_args(argv)
    parts = [args.only] if args.only else ["hookscope", *OPTIONAL]
    threads = f"{args.threads} thread{'s' if args.threads != 1 else ''}"
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
        data |= {"tables": [table_to_json(t) for t in tables], "skipped": skipped}
        args.json.write_text(json.dumps(data, indent=2) + "\n")
    main_tables = [t for t in tables if "hand hooks" in t.times]
    return 1 if args.check and not all(map(passed, main_tables)) else 0


if __name__ == "__main__":
    sys.exit(main())

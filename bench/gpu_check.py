"""What hookscope costs on a GPU, and whether its forwards are free of host syncs: one short, unattended run.

What it measures, for two workloads in bfloat16 on one GPU, random weights from their configs (nothing is
downloaded):

- GPT-2, 12 layers (``GPT2Model(GPT2Config(n_layer=12))``), input ids batch 8 x 512;
- ResNet-50 (``ResNetModel(ResNetConfig())``), input ``randn(64, 3, 224, 224)``.

Each method's cost as a ratio to a plain forward (or a plain training step) timed in the same rounds:

- ``trace``: ``hs.trace(model, x)`` with statistics (the whole call: attach, forward, reading the statistics,
  detach), and ``trace stats=False``;
- ``detect_nonfinite``: ``with hs.detect_nonfinite(model): model(x)``, the whole block;
- ``capture``: ``hs.capture(model, is_leaf)`` keeping every leaf module's output on the device (attached before
  the timer and removed after it, as in ``bench_capture.py``; the values stay alive until the timer stopped);
- ``watch_grads``: a training step (forward, loss, backward, ``monitor.step()``, SGD step, ``zero_grad()``)
  with ``hs.watch_grads(model)`` recording every step, against the same step without it; each method trains
  its own copy of the model, in train mode;
- ``extract``: ``hs.extract`` of a few sites (reduced on the device) into a temporary local store, as rows/s
  against a plain loop of forwards over the same rows (host rows copied to the device per batch in both).

The others run in eval mode under ``torch.no_grad()``. Targets (median ratios): trace at most 1.15x on
ResNet-50 and 1.08x on GPT-2, ``detect_nonfinite`` 1.03x, ``watch_grads`` 1.10x, ``capture`` 1.10x, and
extract at least 0.9x the forward's rows/s. A miss is printed as MISS; it does not change the exit code.

Then a sync check: ``torch.cuda.set_sync_debug_mode("error")`` is set around (only around) a traced forward
(``hs.tracing``), a captured forward (values kept on the device), and a forward + backward under
``hs.watch_grads``, each run once after an unchecked warm-up; torch raises on any host sync inside, and the
check prints PASS or the exception with the innermost frames. The results are read (``tracer.trace``,
``capture.sites()``, ``monitor.step()``) after the mode is set back to 0. The same checks of the plain forward
and the plain forward + backward come first, as controls: a sync the model itself makes fails those too.

Why: the CPU benchmarks cannot say what hookscope's hooks cost beside a fast GPU forward, where Python
overhead and any host sync inside a hook show at once, and a GPU machine is lent for minutes at a time.
So everything runs in one script with a time budget, printing (and writing the JSON) as it goes, so that a
run cut off still reports what it measured.

How it is measured, as in ``bench/common.py``: every figure is a median of per-round ratios between methods
timed in the same rounds, in an order rotated from round to round, after warm-up; a full garbage collection
runs before every timed unit, and ``torch.cuda.synchronize()`` runs before starting and before stopping each
timer. A timed unit repeats the call enough times to last about 0.1 s (a single GPU forward is a few
milliseconds); its time is divided by the repeats. Peak GPU memory per method (``max_memory_allocated``) is
reset before each unit. Before each group of methods the script estimates its time from the plain forward's,
and skips it with a note when the run would pass ``--budget-s``. Each model is built once; the training copies
are deep copies.

The JSON (``--json PATH``, rewritten after every step, ``"complete": true`` at the end): versions, device and
``fused_cpu_kernel``; ``tables`` (seconds per round, ``median_ratio_vs_<baseline>``, ``peak_mib`` per method);
``ratios`` (per workload, each method's figure: its ratio to the plain forward or step, extract's rows/s over the
forward's); ``summary`` (one ``{"name", "value", "target", "better", "unit"}`` row per target, as the other
scripts write it); ``sync_check``; ``skipped``; ``errors``.

Run on the GPU machine: ``python bench/gpu_check.py [--json out.json]`` (about 1-2 minutes; ``--budget-s``,
default 270). Smoke run anywhere: ``python bench/gpu_check.py --device cpu --quick`` (tiny models in float32,
where bfloat16 is slow, 2 rounds, no sync check; its figures mean nothing; ``--threads 1`` on a busy machine).
Exit code 0 when it ran, MISSes included; 1 when a method raised (the others still run and are reported).
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.metadata
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

STARTED = time.perf_counter()  # the budget counts from here: torch's import and the model builds are in it

# The models are built from their configs with random weights; nothing may be fetched from the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Run as a file, not as a package: make ``common`` (next to this file) importable from any working directory.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from transformers import GPT2Config, GPT2Model, ResNetConfig, ResNetModel  # noqa: E402

import common  # noqa: E402
import hookscope as hs  # noqa: E402
from hookscope.tensors import parse_dtype  # noqa: E402

ROUNDS, WARMUP = 5, 2
QUICK_ROUNDS, QUICK_WARMUP = 2, 1
EXTRACT_ROUNDS, EXTRACT_WARMUP = 3, 1
UNIT_S = 0.1  # a timed unit repeats a call to last about this long (GPU); one call per unit with --quick
EXTRACT_FORWARD_S = 2.0  # the plain loop over the extracted rows lasts about this long (GPU)
EXTRACT_MAX_BYTES = 1 << 30  # host memory for the extracted rows at most
EXTRACT_BATCHES = (4, 512)  # the fewest and most batches extracted
BUDGET_S = 270.0
MIB = float(1 << 20)

PLAIN, TRACE, SHAPES, NONFINITE, CAPTURE = "plain", "trace", "trace stats=False", "detect_nonfinite", "capture"
STEP, WATCH = "plain step", "watch_grads"
FORWARD, EXTRACT = "forward", "extract"
# Rough cost of each method in plain forwards, for the budget's estimates only (each group adds a few seconds
# for one-off work: first calls, copies of the model, the extracted rows).
COST = {PLAIN: 1.0, TRACE: 2.5, SHAPES: 1.5, NONFINITE: 1.3, CAPTURE: 1.5, STEP: 3.5, WATCH: 4.5}
# (method, workload) -> target median ratio; extract's is a floor on rows/s, the others are ceilings.
TARGETS: dict[tuple[str, str], float] = {
    (TRACE, "resnet50"): 1.15,
    (TRACE, "gpt2"): 1.08,
    (NONFINITE, "resnet50"): 1.03,
    (NONFINITE, "gpt2"): 1.03,
    (WATCH, "resnet50"): 1.10,
    (WATCH, "gpt2"): 1.10,
    (CAPTURE, "resnet50"): 1.10,
    (CAPTURE, "gpt2"): 1.10,
    (EXTRACT, "resnet50"): 0.9,
    (EXTRACT, "gpt2"): 0.9,
}
HIGHER_IS_BETTER = {EXTRACT}


def say(text: str = "") -> None:
    """Print at once: a run cut off by its time limit still shows everything up to that moment."""
    print(text, flush=True)


def elapsed() -> float:
    """Seconds since the script started (imports included)."""
    return time.perf_counter() - STARTED


# -- the workloads ----------------------------------------------------------------------------------


@dataclass
class Workload:
    """A model on its device, its input batch, and what ``extract`` and the training step need."""

    key: str
    title: str
    model: nn.Module
    x: torch.Tensor
    batch: int
    sites: list[str]
    reduce: str
    make_rows: Callable[[int], torch.Tensor]  # n input rows on the host, as a data set holds them
    row_bytes: int
    forward_s: float = 0.0  # median seconds of one plain forward, measured after warm-up
    train: dict[str, nn.Module] = field(default_factory=dict)  # training copies, made on first use

    def train_copy(self, name: str) -> nn.Module:
        """A training copy of the model (train mode, autograd on), one per method, made once."""
        if name not in self.train:
            self.train[name] = copy.deepcopy(self.model).train().requires_grad_(True)
        return self.train[name]


def loss_of(output: Any) -> torch.Tensor:
    """A synthetic loss: the mean square of the main output, in float32 (both models return ``last_hidden_state``)."""
    hidden: torch.Tensor = output.last_hidden_state
    return hidden.float().square().mean()


def gpt2(device: torch.device, dtype: torch.dtype, quick: bool) -> Workload:
    """GPT-2, 12 layers, ids 8 x 512 (quick: 2 narrow layers, ids 2 x 16)."""
    if quick:
        config = GPT2Config(
            n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=512, bos_token_id=0, eos_token_id=0
        )
        batch, seq, sites = 2, 16, ["h.0", "h.1"]
    else:
        config = GPT2Config(n_layer=12)
        batch, seq, sites = 8, 512, ["h.3", "h.7", "h.11"]
    model: nn.Module = GPT2Model(config)
    model = model.to(device=device, dtype=dtype).eval()
    x = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    title = f"GPT-2 {config.n_layer} layers (n_embd {config.n_embd}), input ids {batch} x {seq}, {dtype_name(dtype)}"

    def rows(n: int) -> torch.Tensor:
        return torch.randint(0, config.vocab_size, (n, seq))

    return Workload("gpt2", title, model, x, batch, sites, "mean:1", rows, seq * 8)


def resnet50(device: torch.device, dtype: torch.dtype, quick: bool) -> Workload:
    """ResNet-50 (``ResNetConfig()``), batch 64 x 3 x 224 x 224 (quick: one narrow block per stage, 2 x 3 x 32 x 32)."""
    if quick:
        config = ResNetConfig(depths=[1, 1, 1, 1], hidden_sizes=[32, 64, 128, 256], embedding_size=16)
        batch, side = 2, 32
    else:
        config, batch, side = ResNetConfig(), 64, 224
    model: nn.Module = ResNetModel(config)
    model = model.to(device=device, dtype=dtype).eval()
    x = torch.randn(batch, 3, side, side, device=device, dtype=dtype)
    depths = "-".join(str(d) for d in config.depths or ())
    title = f"ResNet (depths {depths}), input {batch} x 3 x {side} x {side}, {dtype_name(dtype)}"

    def rows(n: int) -> torch.Tensor:
        return torch.randn(n, 3, side, side, dtype=dtype)

    sites = ["encoder.stages.1", "encoder.stages.3"]
    return Workload("resnet50", title, model, x, batch, sites, "mean:2,3", rows, 3 * side * side * dtype.itemsize)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


# -- timing -----------------------------------------------------------------------------------------


@dataclass
class Method:
    """A method under test: ``call(context)`` is timed; ``attach()`` makes the context before the timer
    and ``detach(context)`` runs after it stopped, both untimed (hooks a user attaches once)."""

    call: Callable[[Any], Any]
    attach: Callable[[], Any] = lambda: None
    detach: Callable[[Any], None] = lambda context: None


class Clock:
    """Times units of calls on one device: synchronizes before starting and before stopping each timer."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def unit(self, method: Method, repeat: int) -> tuple[float, float | None]:
        """Seconds per call over ``repeat`` calls, and the peak GPU memory in MiB (None on the CPU)."""
        context = method.attach()
        try:
            gc.collect()
            self.sync()
            if self.cuda:
                torch.cuda.reset_peak_memory_stats()
            kept: Any = None
            start = time.perf_counter()
            for _ in range(repeat):
                kept = None  # the previous call's values go before the next call, as in a loop
                kept = method.call(context)
            self.sync()
            seconds = time.perf_counter() - start
            peak = torch.cuda.max_memory_allocated() / MIB if self.cuda else None
        finally:
            method.detach(context)
        del kept  # outside the timer
        return seconds / repeat, peak

    def measure(
        self, methods: dict[str, Method], rounds: int, warmup: int, repeat: int
    ) -> tuple[dict[str, list[float]], dict[str, float | None]]:
        """Warm every method up, then time one unit per method per round, rotating the order.

        Returns seconds per call per round, and each method's largest peak memory over the rounds.
        """
        names = list(methods)
        for name in names:
            for _ in range(warmup):
                self.unit(methods[name], 1)
        times: dict[str, list[float]] = {name: [] for name in names}
        peaks: dict[str, float | None] = dict.fromkeys(names)
        for round_index in range(rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                seconds, peak = self.unit(methods[name], repeat)
                times[name].append(seconds)
                if peak is not None:
                    peaks[name] = max(peaks[name] or 0.0, peak)
        return times, peaks


def forward_seconds(clock: Clock, work: Workload, quick: bool) -> float:
    """The median of three plain forwards after two warm-ups: the yardstick for repeats and budget estimates."""
    plain = Method(lambda _: work.model(work.x))
    for _ in range(1 if quick else 2):
        clock.unit(plain, 1)
    return statistics.median(clock.unit(plain, 1)[0] for _ in range(3))


# -- the tables -------------------------------------------------------------------------------------


@dataclass
class Table(common.RoundRatios):
    """One group of methods on one workload, timed in the same rounds against ``baseline``."""

    key: str
    workload: str
    title: str
    baseline: str
    repeat: int
    times: dict[str, list[float]]
    peak_mib: dict[str, float | None]
    rows: int | None = None  # extract: the rows each method went through
    notes: list[str] = field(default_factory=list)

    def figure(self, name: str) -> float:
        """The reported figure of a method: its median ratio to the baseline; for extract, rows/s over the
        forward's (the inverse of the per-round time ratios)."""
        ratio = self.median_ratio(name, self.baseline)
        return 1 / ratio if name in HIGHER_IS_BETTER else ratio


def verdict(method: str, workload: str, value: float) -> tuple[float, str] | None:
    """``(target, "PASS" | "MISS")`` for a method with a target, else None."""
    target = TARGETS.get((method, workload))
    if target is None:
        return None
    ok = value >= target if method in HIGHER_IS_BETTER else value <= target
    return target, "PASS" if ok else "MISS"


def format_table(table: Table) -> str:
    """Medians, ratios to the baseline, per-round range, peak memory, and a verdict per target."""
    unit = "rows/s x" if table.rows is not None else "x"
    header = f"{'method':<20}{'median ms':>11}{f'{unit} {table.baseline}':>22}{'range':>16}{'peak MiB':>11}"
    lines = [f"{table.key} / {table.title}", *(f"  {note}" for note in table.notes), header]
    for name, seconds in table.times.items():
        ratios = table.ratios(name, table.baseline)
        if name in HIGHER_IS_BETTER:
            ratios = [1 / r for r in ratios]
        peak = table.peak_mib.get(name)
        row = f"{name:<20}{statistics.median(seconds) * 1e3:>11.2f}{table.figure(name):>22.3f}"
        row += f"{common.ratio_range(ratios):>16}{'-' if peak is None else f'{peak:.0f}':>11}"
        lines.append(row)
    for name in table.times:
        judged = verdict(name, table.workload, table.figure(name))
        if judged is not None:
            target, word = judged
            sign = ">=" if name in HIGHER_IS_BETTER else "<="
            lines.append(f"{table.workload}: {name}: {table.figure(name):.3f} (target {sign} {target:.2f}): {word}")
    return "\n".join(lines)


# -- the groups of methods --------------------------------------------------------------------------


def is_leaf(name: str, module: nn.Module) -> bool:
    """The capture's selection, as in ``bench_capture.py``: modules without children."""
    return next(module.children(), None) is None


def forward_methods(work: Workload) -> dict[str, Method]:
    """plain, trace, trace stats=False, detect_nonfinite, capture: the same forward of the model."""
    model, x = work.model, work.x

    def nonfinite(_: Any) -> Any:
        with hs.detect_nonfinite(model):
            return model(x)

    def capture_attach() -> hs.Capture:
        return hs.capture(model, is_leaf)

    def capture_call(recorder: hs.Capture) -> Any:
        return model(x), recorder  # the recorder's latest pass keeps its values alive

    return {
        PLAIN: Method(lambda _: model(x)),
        TRACE: Method(lambda _: hs.trace(model, x)),
        SHAPES: Method(lambda _: hs.trace(model, x, stats=False)),
        NONFINITE: Method(nonfinite),
        CAPTURE: Method(capture_call, capture_attach, lambda recorder: recorder.remove()),
    }


class Trainer:
    """One training method: its own copy of the model, an SGD optimiser and, when watched, its monitor."""

    def __init__(self, model: nn.Module, x: torch.Tensor, watched: bool) -> None:
        self.model, self.x = model, x
        self.optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        self.monitor = hs.watch_grads(model) if watched else None
        self.recorded = 0

    def step(self, _: Any = None) -> None:
        """Forward, loss, backward, ``monitor.step()`` when watched, SGD step, ``zero_grad()``."""
        with torch.enable_grad():
            loss_of(self.model(self.x)).backward()
        if self.monitor is not None and self.monitor.step() is not None:
            self.recorded += 1
        self.optimizer.step()
        self.optimizer.zero_grad()

    def remove(self) -> None:
        if self.monitor is not None:
            self.monitor.remove()


def extract_methods(work: Workload, rows: torch.Tensor, scratch: Path) -> dict[str, Method]:
    """forward (a plain loop over the rows) and extract (``hs.extract`` into a fresh local store)."""
    device = work.x.device

    def forward(_: Any) -> None:
        for start in range(0, len(rows), work.batch):
            work.model(rows[start : start + work.batch].to(device))

    def fresh() -> Path:  # untimed: the previous call's store goes first
        out = scratch / "store.zarr"
        if out.exists():
            shutil.rmtree(out)
        return out

    def extract(out: Path) -> hs.Store:
        return hs.extract(
            work.model, rows, out, layers=work.sites, reduce=work.reduce, batch_size=work.batch, progress=False
        )

    return {FORWARD: Method(forward), EXTRACT: Method(extract, fresh)}


# -- the run ----------------------------------------------------------------------------------------


class Run:
    """The run's state: options, budget, results so far; the JSON is rewritten after every step."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.args = args
        self.device = device
        self.clock = Clock(device)
        self.tables: list[Table] = []
        self.skipped: list[str] = []
        self.errors: list[str] = []
        self.sync: dict[str, dict[str, str]] = {}
        self.info: dict[str, Any] = {}
        self.rounds = QUICK_ROUNDS if args.quick else args.rounds
        self.warmup = QUICK_WARMUP if args.quick else args.warmup

    # -- budget and errors

    def within_budget(self, what: str, estimate_s: float) -> bool:
        """True when ``what`` (about ``estimate_s`` seconds) fits in the budget; else a note, and False."""
        if elapsed() + estimate_s <= self.args.budget_s:
            say(f"\n{what}: starting, about {estimate_s:.0f} s estimated ({elapsed():.0f} s elapsed)")
            return True
        note = (
            f"{what}: skipped, {elapsed():.0f} s elapsed + about {estimate_s:.0f} s estimated "
            f"> budget {self.args.budget_s:.0f} s"
        )
        self.skipped.append(note)
        say(f"\n{note}")
        self.save()
        return False

    def failed(self, what: str, error: BaseException) -> None:
        """A method raised: report it in full and go on with the others (the exit code says 1 at the end)."""
        text = "".join(traceback.format_exception(error))
        self.errors.append(f"{what}: {type(error).__name__}: {error}")
        say(f"\n{what}: ERROR\n{text}")
        self.save()

    def repeat(self, work: Workload, cost: float) -> int:
        """Calls per timed unit: enough for about ``UNIT_S`` (one with ``--quick``)."""
        if self.args.quick:
            return 1
        return max(1, round(UNIT_S / max(work.forward_s * cost, 1e-6)))

    # -- the groups

    def forward_group(self, work: Workload) -> None:
        methods = forward_methods(work)
        repeat = self.repeat(work, 1.0)
        estimate = sum(COST[name] for name in methods) * work.forward_s * (self.warmup + self.rounds * repeat) * 1.5 + 3
        if not self.within_budget(f"{work.key}: trace, detect_nonfinite, capture", estimate):
            return
        try:
            leaves = sum(1 for name, module in work.model.named_modules() if is_leaf(name, module))
            times, peaks = self.clock.measure(methods, self.rounds, self.warmup, repeat)
            notes = [
                f"eval mode, torch.no_grad(); {self.rounds} rounds of {repeat} call(s), warm-up {self.warmup}; "
                f"capture keeps the outputs of {leaves} leaf modules on the device"
            ]
            self.add(Table("forward", work.key, work.title, PLAIN, repeat, times, peaks, notes=notes))
        except Exception as error:  # reported; the other groups still run
            self.failed(f"{work.key}: forward methods", error)

    def grads_group(self, work: Workload) -> None:
        repeat = self.repeat(work, COST[STEP])
        estimate = (COST[STEP] + COST[WATCH]) * work.forward_s * (self.warmup + self.rounds * repeat) * 1.5 + 3
        if not self.within_budget(f"{work.key}: watch_grads", estimate):
            return
        trainers: list[Trainer] = []
        try:
            plain = Trainer(work.train_copy(STEP), work.x, watched=False)
            trainers.append(plain)
            watched = Trainer(work.train_copy(WATCH), work.x, watched=True)
            trainers.append(watched)
            methods = {STEP: Method(plain.step), WATCH: Method(watched.step)}
            times, peaks = self.clock.measure(methods, self.rounds, self.warmup, repeat)
            notes = [
                f"train mode, SGD lr 1e-4, loss mean(last_hidden_state^2) in float32; each method its own copy; "
                f"{self.rounds} rounds of {repeat} step(s), warm-up {self.warmup}; "
                f"watch_grads recorded {watched.recorded} steps"
            ]
            self.add(Table("grads", work.key, work.title, STEP, repeat, times, peaks, notes=notes))
        except Exception as error:
            self.failed(f"{work.key}: watch_grads", error)
        finally:
            for trainer in trainers:
                trainer.remove()

    def extract_group(self, work: Workload) -> None:
        low, high = EXTRACT_BATCHES
        wanted = 0 if self.args.quick else math.ceil(self.args.extract_s / max(work.forward_s, 1e-6))
        fit = max(1, EXTRACT_MAX_BYTES // (work.row_bytes * work.batch))
        batches = max(low, min(wanted, high, fit))
        estimate = 2.5 * batches * work.forward_s * (EXTRACT_WARMUP + EXTRACT_ROUNDS) * 1.5 + 5
        if not self.within_budget(f"{work.key}: extract", estimate):
            return
        rounds, warmup = (1, 0) if self.args.quick else (EXTRACT_ROUNDS, EXTRACT_WARMUP)
        try:
            rows = work.make_rows(batches * work.batch)
            with tempfile.TemporaryDirectory(prefix="gpu-check-extract-") as scratch:
                methods = extract_methods(work, rows, Path(scratch))
                times, peaks = self.clock.measure(methods, rounds, warmup, 1)
                store = hs.open_store(Path(scratch) / "store.zarr")
                shapes = ", ".join(f"{site} {tuple(store[site].shape)}" for site in store.sites)
            notes = [
                f"{len(rows):,} rows ({batches} batches of {work.batch}) from host memory, sites reduced "
                f"{work.reduce}: {shapes}; {rounds} rounds, warm-up {warmup}"
            ]
            table = Table("extract", work.key, work.title, FORWARD, 1, times, peaks, rows=len(rows), notes=notes)
            self.add(table)
        except Exception as error:
            self.failed(f"{work.key}: extract", error)

    # -- the sync check

    def sync_check(self, work: Workload) -> None:
        """Each check once unchecked (warm-up), then once under ``set_sync_debug_mode("error")``."""
        if not self.within_budget(f"{work.key}: sync check", 12 * work.forward_s * 4 + 2):
            return
        model, x = work.model, work.x
        results: dict[str, str] = {}
        self.sync[work.key] = results

        def plain_forward() -> Callable[[], str]:
            model(x)
            return lambda: "model(x)"

        def traced() -> Callable[[], str]:
            with hs.tracing(model) as tracer:
                model(x)
            return lambda: f"{len(tracer.trace)} calls traced, statistics read after"

        def captured() -> Callable[[], str]:
            with hs.capture(model, is_leaf) as recorder:
                model(x)
            return lambda: f"{len(recorder.sites())} sites kept on {recorder[recorder.sites()[0]].device}"

        train_plain, train_watched = work.train_copy(STEP), work.train_copy(WATCH)

        def backward_plain() -> Callable[[], str]:
            with torch.enable_grad():
                loss_of(train_plain(x)).backward()

            def read() -> str:
                train_plain.zero_grad()
                return "forward + backward"

            return read

        def backward_watched() -> Callable[[], str]:
            with torch.enable_grad():
                loss_of(train_watched(x)).backward()

            def read() -> str:
                record = monitor.step()
                train_watched.zero_grad()
                count = 0 if record is None else len(record.of("grad_output"))
                return f"{count} grad_output records read after"

            return read

        checks: list[tuple[str, Callable[[], Callable[[], str]]]] = [
            ("plain forward (control)", plain_forward),
            ("trace (hs.tracing)", traced),
            ("capture every leaf", captured),
            ("plain forward+backward (control)", backward_plain),
            ("watch_grads forward+backward", backward_watched),
        ]
        monitor = hs.watch_grads(train_watched)
        say(f"\nsync check, {work.key}: set_sync_debug_mode('error') around each call")
        try:
            for name, check in checks:
                results[name] = self.one_sync_check(check)
                say(f"  {name:<34} {results[name]}")
        finally:
            monitor.remove()
        self.save()

    def one_sync_check(self, check: Callable[[], Callable[[], str]]) -> str:
        """Run ``check`` once unchecked, then once checked; its reading after the mode is back to 0."""
        try:
            check()()  # warm-up: one-off work (allocations, kernels' first launches) is not what is checked
            torch.cuda.synchronize()
        except Exception as error:
            return f"ERROR in the unchecked warm-up: {type(error).__name__}: {first_line(error)}"
        torch.cuda.set_sync_debug_mode("error")
        try:
            read = check()
        except Exception as error:
            torch.cuda.set_sync_debug_mode(0)
            return f"FAIL: {type(error).__name__}: {first_line(error)}{where(error)}"
        torch.cuda.set_sync_debug_mode(0)
        try:
            return f"PASS ({read()})"
        except Exception as error:
            return f"PASS, but reading after failed: {type(error).__name__}: {first_line(error)}"

    # -- output

    def add(self, table: Table) -> None:
        self.tables.append(table)
        say(f"\n{format_table(table)}\n  ({elapsed():.0f} s elapsed)")
        self.save()

    def ratios(self) -> dict[str, dict[str, float]]:
        """Each workload's figure per method (ratio to its baseline; extract: rows/s over the forward's)."""
        flat: dict[str, dict[str, float]] = {}
        for table in self.tables:
            for name in table.times:
                if name != table.baseline:
                    flat.setdefault(table.workload, {})[name] = table.figure(name)
        return flat

    def summary(self) -> list[dict[str, Any]]:
        """One row per target met or missed: name, value, target, which way is better, unit."""
        rows = []
        for table in self.tables:
            for name in table.times:
                judged = verdict(name, table.workload, table.figure(name))
                if judged is not None:
                    label = f"{name} rows/s" if name in HIGHER_IS_BETTER else name
                    rows.append(
                        {
                            "name": f"{table.workload} {label}",
                            "value": table.figure(name),
                            "target": judged[0],
                            "better": "higher" if name in HIGHER_IS_BETTER else "lower",
                            "unit": "x",
                        }
                    )
        return rows

    def save(self, complete: bool = False) -> None:
        """Write the JSON so far (``complete`` is False until the end: a run cut off leaves a readable file)."""
        if self.args.json is None:
            return
        tables = [asdict(t) | t.medians(t.baseline) for t in self.tables]
        data = self.info | {"rounds": self.rounds, "warmup": self.warmup, "budget_s": self.args.budget_s}
        data |= {"elapsed_s": elapsed(), "complete": complete, "tables": tables, "ratios": self.ratios()}
        data |= {"summary": self.summary(), "sync_check": self.sync, "skipped": self.skipped, "errors": self.errors}
        common.write_json(self.args.json, data)


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0]


def where(error: BaseException) -> str:
    """The innermost frame of the traceback, and the innermost one inside hookscope when that is another."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return ""
    text = f"; at {describe(frames[-1])}"
    ours = [frame for frame in frames if f"{os.sep}hookscope{os.sep}" in frame.filename]
    if ours and ours[-1] is not frames[-1]:
        text += f"; innermost hookscope frame {describe(ours[-1])}"
    return text


def describe(frame: traceback.FrameSummary) -> str:
    return f"{Path(*Path(frame.filename).parts[-3:])}:{frame.lineno} in {frame.name}"


def environment(device: torch.device) -> dict[str, Any]:
    """Versions, the device, and whether hookscope's fused CPU statistics kernel is available."""
    info: dict[str, Any] = {"torch_version": torch.__version__, "hookscope_version": hs.__version__}
    info["transformers_version"] = importlib.metadata.version("transformers")
    info["device"] = str(device)
    info["threads"] = torch.get_num_threads()
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
        info["cuda_version"] = torch.version.cuda
        try:
            info["triton_version"] = importlib.metadata.version("triton")
        except importlib.metadata.PackageNotFoundError:
            info["triton_version"] = None
    else:
        info["device_name"] = "cpu"
    try:
        from hookscope._shared.stats import kernel as fused

        info["fused_cpu_kernel"] = bool(fused.available())
    except ImportError:
        info["fused_cpu_kernel"] = "n/a"
    return info


# -- entry point ------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument(
        "--dtype", default=None, help="model dtype (default bfloat16 on a GPU, float32 on the CPU, where bf16 is slow)"
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny models, 2 rounds, 1 call per unit")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"timed rounds (default {ROUNDS})")
    parser.add_argument("--warmup", type=int, default=WARMUP, help=f"warm-up calls per method (default {WARMUP})")
    parser.add_argument(
        "--budget-s", type=float, default=BUDGET_S, help=f"skip what would end later (default {BUDGET_S:.0f})"
    )
    parser.add_argument(
        "--extract-s",
        type=float,
        default=EXTRACT_FORWARD_S,
        help=f"seconds of plain forwards the extracted rows take (default {EXTRACT_FORWARD_S})",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the results as JSON here (after every step)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0:
        parser.error("--rounds must be at least 1 and --warmup at least 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Build both workloads, run the sync check and the groups of methods within the budget; report."""
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        say("no CUDA device here; run with --device cpu --quick for a smoke run")
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = parse_dtype(args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    run = Run(args, device)
    run.info = environment(device)
    info = run.info
    say(
        f"torch {info['torch_version']} (CUDA {info.get('cuda_version')}, triton {info.get('triton_version')}), "
        f"transformers {info['transformers_version']}, hookscope {info['hookscope_version']}"
    )
    say(
        f"device: {info['device_name']}; {common.threads_label(info['threads'])}; "
        f"fused CPU kernel: {info['fused_cpu_kernel']}; "
        f"{run.rounds} rounds, warm-up {run.warmup}; budget {args.budget_s:.0f} s; {elapsed():.1f} s elapsed"
    )
    workloads: list[Workload] = []
    with torch.no_grad():
        for build in (gpt2, resnet50):
            work = build(device, dtype, args.quick)
            work.forward_s = forward_seconds(run.clock, work, args.quick)
            workloads.append(work)
            say(f"built {work.key}: {work.title}; plain forward {work.forward_s * 1e3:.2f} ms ({elapsed():.1f} s)")
        run.save()
        if device.type == "cuda":
            for work in workloads:
                try:
                    run.sync_check(work)
                except Exception as error:  # reported; the timing still runs
                    torch.cuda.set_sync_debug_mode(0)
                    run.failed(f"{work.key}: sync check", error)
        else:
            run.skipped.append("sync check: skipped on the CPU (it checks host syncs of CUDA work)")
            say("\nsync check: skipped on the CPU (it checks host syncs of CUDA work)")
        for group in (Run.forward_group, Run.grads_group, Run.extract_group):
            for work in workloads:
                group(run, work)
    summary = run.summary()
    say(f"\nsummary ({elapsed():.0f} s elapsed):")
    for row in summary:
        sign = ">=" if row["better"] == "higher" else "<="
        ok = row["value"] >= row["target"] if row["better"] == "higher" else row["value"] <= row["target"]
        say(
            f"  {row['name']:<34}{row['value']:>8.3f}x  (target {sign} {row['target']:.2f})  {'PASS' if ok else 'MISS'}"
        )
    for key, results in run.sync.items():
        failing = [name for name, result in results.items() if not result.startswith("PASS")]
        say(f"  sync check {key}: {'PASS' if not failing else 'not PASS: ' + ', '.join(failing)}")
    for note in run.skipped:
        say(f"  {note}")
    for message in run.errors:
        say(f"  ERROR {message}")
    run.save(complete=True)
    return 1 if run.errors else 0


if __name__ == "__main__":
    sys.exit(main())

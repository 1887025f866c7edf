"""What hookscope's hooks cost inside a ``torch.compile``'d model (CPU).

GPT-2 (``GPT2Model(GPT2Config(n_layer=4))``, random weights, eval mode, ``torch.no_grad()``), input ids
batch 4 x 128, compiled with inductor (``--backend`` to change it). Four methods, each on its own
deep copy of the model compiled once before timing, hooks attached before that first call (so that
Dynamo traces them into the graph) and left attached while it is timed:

- ``eager``: the model without compilation, for orientation;
- ``compiled``: the compiled model with no hooks (the baseline of the ratios);
- ``capture``: the compiled model under ``hs.capture(model, is_leaf)``: every leaf output kept;
- ``trace``: the compiled model under ``hs.tracing(model)``: statistics of every module's inputs
  and outputs, kernels only under compilation.

Why: a watched compiled model should stay one graph and cost little more than the unwatched one;
a graph break per module would make it cost as much as eager or more. Each copy's graph count is
printed (``torch._dynamo.explain`` before timing): Dynamo compiles GPT-2 as ``GPT2Model.forward``,
so the root's own hooks run around that graph, eagerly; a trace's statistics of the root's
input and output are two more graphs there, not breaks inside the model. The ratios are medians of per-round ratios
against ``compiled`` in the same round (see bench/common.py).
The target: ``capture`` and ``trace`` each at most 1.5x ``compiled``; the script prints a verdict for each.

Run: ``.venv/bin/python bench/bench_compile.py`` (``--quick``: 1 layer, 3 rounds, eager backend).
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch._dynamo
from torch import nn
from transformers import GPT2Config, GPT2Model

import common
import hookscope as hs

WARMUP = 2
TARGET = 1.5
WATCHED = ("capture", "trace")


def is_leaf(_name: str, module: nn.Module) -> bool:
    return not any(module.children())


def parse_args(argv: Sequence[str] | None) -> Any:
    def extra(parser: Any) -> None:
        parser.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
        parser.add_argument("--layers", type=int, default=4, help="GPT-2 layers (default 4)")

    return common.parse_run_args(
        argv,
        description=__doc__.splitlines()[0],
        min_rounds=10,
        default_rounds=10,
        quick_rounds=3,
        quick_help="1 layer, 3 rounds, eager backend: checks that the script runs",
        check_help=f"exit 1 when capture or trace costs over {TARGET}x the unwatched compiled forward",
        extra=extra,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    common.prepare_torch(args.threads)
    if args.quick:
        args.layers, args.backend = 1, "eager"
    config = GPT2Config(n_layer=args.layers)
    model = GPT2Model(config).eval()
    ids = torch.randint(0, config.vocab_size, (4, 128))
    print(
        f"torch {torch.__version__}, {common.threads_label(args.threads)}, backend {args.backend}, "
        f"GPT-2 {args.layers} layers, ids 4 x 128, {args.rounds} rounds, torch.no_grad()"
    )
    scopes: dict[str, Callable[[nn.Module], Any] | None] = {
        "compiled": None,
        "capture": lambda m: hs.capture(m, is_leaf),
        "trace": lambda m: hs.tracing(m),
    }
    calls: dict[str, Callable[[], Any]] = {"eager": lambda: model(ids)}
    torch._dynamo.reset()
    twins: dict[str, nn.Module] = {}
    opened = []
    for name, scope in scopes.items():  # every copy's hooks attached before anything is compiled
        twins[name] = copy.deepcopy(model)
        if scope is not None:
            opened.append(scope(twins[name]))
    with torch.no_grad():
        for name, twin in twins.items():
            explained = torch._dynamo.explain(twin)(ids)
            compiled = torch.compile(twin, backend=args.backend)
            began = time.perf_counter()
            compiled(ids)
            print(
                f"{name:>9}: {explained.graph_count} graph(s), {explained.graph_break_count} break(s), "
                f"first call {time.perf_counter() - began:.1f} s"
            )
            calls[name] = lambda compiled=compiled: compiled(ids)
        runs = {name: (lambda _m, _x, call=call: common.timed_call(call)) for name, call in calls.items()}
        times = common.measure(runs, model, ids, args.rounds, WARMUP)
    for scope in opened:
        scope.remove()
    ratios = {name: [t / b for t, b in zip(times[name], times["compiled"], strict=True)] for name in times}
    print(f"\n{'method':>9}  {'median s':>9}  {'x compiled':>10}  range")
    for name in times:
        median = statistics.median(times[name])
        print(f"{name:>9}  {median:9.4f}  {statistics.median(ratios[name]):10.3f}  {common.ratio_range(ratios[name])}")
    medians = {name: statistics.median(ratios[name]) for name in WATCHED}
    for name, median in medians.items():
        verdict = "PASS" if median <= TARGET else "FAIL"
        print(f"{name} over the unwatched compiled forward: {median:.3f} (target <= {TARGET:.2f}): {verdict}")
    if args.json:
        summary = [
            common.summary_row(f"compiled {name} over compiled", median, TARGET) for name, median in medians.items()
        ]
        data = {"times": times, "ratios": ratios, "backend": args.backend, "layers": args.layers, "summary": summary}
        common.write_json(args.json, data)
    return 1 if args.check and max(medians.values()) > TARGET else 0


if __name__ == "__main__":
    raise SystemExit(main())

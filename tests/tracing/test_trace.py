"""hs.trace / hs.tracing: one row per module call, right statistics, every path cleans up."""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope._trace.timing import PeakMemory
from hookscope.errors import SiteNotFoundError, SpecError
from hookscope.tensors import flatten_tensors
from tests.conftest import Golden
from tests.models import (
    KeywordOnly,
    LinearInplaceReLU,
    Looped,
    MixedOutputs,
    Nested,
    RaisesMidForward,
    Residual,
    SharedTwice,
    SmallCNN,
    gpt2_input,
    tiny_gpt2,
    tiny_resnet,
    track,
)


def observe(
    model: nn.Module, run: Callable[[], Any]
) -> tuple[list[tuple[str, int]], dict[tuple[str, int], torch.Tensor]]:
    """What plain PyTorch hooks see in one forward: the calls in start order, and a copy of each
    call's first tensor output as it was returned."""
    modules = {id(m): (name, m) for name, m in reversed(list(model.named_modules()))}
    started: list[tuple[str, int]] = []
    counts: dict[str, int] = {}
    open_calls: dict[str, list[int]] = {}
    kept: dict[tuple[str, int], torch.Tensor] = {}

    def enter(module: nn.Module, _args: Any) -> None:
        name = modules[id(module)][0]
        started.append((name, counts.get(name, 0)))
        open_calls.setdefault(name, []).append(counts.get(name, 0))
        counts[name] = counts.get(name, 0) + 1

    def leave(module: nn.Module, _args: Any, output: Any) -> None:
        name = modules[id(module)][0]
        leaves = flatten_tensors(output)
        call = open_calls[name].pop()
        if leaves:
            kept[(name, call)] = leaves[0][1].detach().clone()

    with_plain_hooks([m for _, m in modules.values()], enter, leave, run)
    return started, kept


def with_plain_hooks(
    modules: list[nn.Module], enter: Callable[..., None], leave: Callable[..., None], run: Callable[[], Any]
) -> None:
    """``run()`` under ``no_grad`` with a plain PyTorch pre-hook and hook on each module."""
    handles = [m.register_forward_pre_hook(enter) for m in modules]
    handles += [m.register_forward_hook(leave) for m in modules]
    try:
        with torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()


def calls_made(model: nn.Module, run: Callable[[], Any]) -> list[tuple[str, int]]:
    return observe(model, run)[0]


def outputs_seen(model: nn.Module, run: Callable[[], Any]) -> dict[tuple[str, int], torch.Tensor]:
    return observe(model, run)[1]


@pytest.mark.parametrize("build", [SmallCNN, SharedTwice, Looped, Nested, MixedOutputs, KeywordOnly, Residual])
def test_rows_are_the_module_calls_in_start_order(build: Callable[[], nn.Module]) -> None:
    model = build()
    x = Residual.example() if build is Residual else (SmallCNN.example() if build is SmallCNN else torch.randn(2, 4))
    with torch.no_grad():
        expected = calls_made(model, lambda: model(x))
    trace = hs.trace(model, x)
    assert [(row.name, row.call) for row in trace] == expected
    assert len(trace) == len(expected)
    assert [row.order for row in trace] == list(range(len(trace)))
    for row in trace:
        if row.parent is None:
            assert row.depth == 0
        else:
            assert trace[row.parent].depth == row.depth - 1
    assert sorted(row.finished for row in trace if row.finished is not None) == list(range(len(trace)))


def test_shared_module_has_one_row_per_call() -> None:
    trace = hs.trace(SharedTwice(), torch.randn(3, 4))
    shared = trace.calls("shared")
    assert [row.call for row in shared] == [0, 1]
    assert trace["shared"] is shared[0]
    assert "shared#1" in str(trace)


@pytest.mark.parametrize("build", [LinearInplaceReLU, Residual, SmallCNN, Nested])
def test_statistics_are_those_of_each_output_when_it_was_returned(build: Callable[[], nn.Module]) -> None:
    model = build()
    x = Residual.example() if build is Residual else (SmallCNN.example() if build is SmallCNN else torch.randn(5, 4))
    with torch.no_grad():
        reference = outputs_seen(model, lambda: model(x))
    trace = hs.trace(model, x)
    assert reference
    for (name, call), value in reference.items():
        row = trace.calls(name)[call]
        stats = row.outputs[0].stats
        assert stats is not None
        exact = value.double()
        assert stats.min == pytest.approx(exact.min().item(), abs=1e-6), name
        assert stats.max == pytest.approx(exact.max().item(), abs=1e-6), name
        assert stats.mean == pytest.approx(exact.mean().item(), rel=1e-5, abs=1e-6), name
        assert stats.std == pytest.approx(exact.std().item(), rel=1e-5, abs=1e-6), name
        assert stats.zero_frac == pytest.approx((exact == 0).double().mean().item()), name


def test_in_place_relu_does_not_change_the_linear_rows_statistics() -> None:
    model = LinearInplaceReLU()
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    trace = hs.trace(model, x)
    fc, act = trace["fc"].stats, trace["act"].stats
    assert fc is not None
    assert act is not None
    assert fc.min < 0 <= act.min  # the ReLU rewrote fc's output tensor after the fact
    assert act.zero_frac > 0 == fc.zero_frac


def test_input_rows_show_shapes_dtypes_devices_and_keywords() -> None:
    trace = hs.trace(KeywordOnly(), torch.randn(2, 4))
    block = trace["block"]
    assert [(info.what, info.path) for info in block.inputs] == [("input", "[0]"), ("input", "['scale']")]
    assert [info.label for info in block.inputs] == ["input[0]", "input['scale']"]
    assert block.inputs[1].shape == (1,)
    assert {info.dtype for info in block.inputs} == {"float32"}
    assert {info.device for info in block.inputs} == {"cpu"}
    assert "scale=[1]" in str(trace)


def test_structured_outputs_list_every_tensor_leaf() -> None:
    trace = hs.trace(MixedOutputs(), torch.randn(2, 3))
    assert [info.path for info in trace["dict_out"].outputs] == ["['a']", "['b'][0]"]
    assert [info.label for info in trace["dict_out"].outputs] == ["output['a']", "output['b'][0]"]
    assert {info.what for info in trace["dict_out"].outputs} == {"output"}
    assert [info.path for info in trace["dataclass_out"].outputs] == [".value"]
    assert trace["none_out"].outputs == ()
    assert trace["none_out"].stats is None
    root = trace[0]
    assert [info.path for info in root.outputs] == ["['out']", "['pair'].value"]


def test_inputs_name_the_call_that_returned_them() -> None:
    trace = hs.trace(SmallCNN(), SmallCNN.example())
    assert trace["relu"].inputs[0].source == "conv1#0"
    assert trace["conv1"].inputs[0].source is None  # the model's own input
    assert trace["fc"].inputs[0].source is None  # flatten() between pool and fc made a new tensor


def test_own_parameter_counts() -> None:
    model = Nested()
    trace = hs.trace(model, torch.randn(2, 4))
    for row in trace:
        module = model.get_submodule(row.name)
        assert row.params == sum(p.numel() for p in module.parameters(recurse=False))


@pytest.mark.transformers
def test_gpt2_rows_match_calls_and_show_structured_outputs() -> None:
    model = tiny_gpt2()
    ids = gpt2_input()
    with torch.no_grad():
        expected = calls_made(model, lambda: model(input_ids=ids))
    trace = hs.trace(model, input_ids=ids)
    assert [(row.name, row.call) for row in trace] == expected
    root = trace[0]
    assert root.inputs[0].path == "['input_ids']"
    assert root.inputs[0].dtype == "int64"
    assert root.output is not None
    assert (root.output.what, root.output.path) == ("output", ".last_hidden_state")
    assert root.output.label == "output.last_hidden_state"
    assert root.output.shape == (2, 8, 32)
    assert all(row.output_finite is not False for row in trace)
    assert trace.first_nonfinite() is None
    assert "input_ids=[2, 8]" in trace.table(max_depth=0)


@pytest.mark.transformers
def test_bfloat16_model_table() -> None:
    model = tiny_gpt2().to(torch.bfloat16)
    trace = hs.trace(model, gpt2_input())
    ln = trace["h.0.ln_1"]
    assert ln.output is not None
    assert ln.output.dtype == "bfloat16"
    assert ln.stats is not None
    assert ln.stats.std == pytest.approx(1.0, rel=0.05)
    text = str(trace)
    assert "bfloat16" in text
    assert "h.1.mlp.c_fc" in text


@pytest.mark.transformers
def test_resnet_trace_of_in_place_residual_blocks() -> None:
    model = tiny_resnet()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = outputs_seen(model, lambda: model(x))
        expected = calls_made(model, lambda: model(x))
    trace = hs.trace(model, x)
    assert [(row.name, row.call) for row in trace] == expected
    for (name, call), value in reference.items():
        stats = trace.calls(name)[call].outputs[0].stats
        assert stats is not None
        assert stats.max == pytest.approx(value.max().item(), abs=1e-6), name


def test_layers_restricts_the_rows() -> None:
    trace = hs.trace(SmallCNN(), SmallCNN.example(), layers=[nn.Conv2d, "fc"])
    assert [row.name for row in trace] == ["conv1", "fc"]
    assert all(row.depth == 0 for row in trace)


def test_stats_off_keeps_shapes_only() -> None:
    trace = hs.trace(SmallCNN(), SmallCNN.example(), stats=False)
    assert all(info.stats is None for row in trace for info in (*row.inputs, *row.outputs))
    assert trace["fc"].outputs[0].shape == (1, 10)
    assert "mean" not in str(trace).splitlines()[0]


def test_trace_runs_without_grad_unless_asked() -> None:
    model = track(nn.Sequential(nn.Linear(2, 2)))
    x = torch.randn(1, 2)
    grads: list[bool] = []
    hook = model[0].register_forward_hook(lambda m, a, o: grads.append(o.requires_grad))
    try:
        hs.trace(model, x)
        hs.trace(model, x, grad=True)
    finally:
        hook.remove()
    assert grads == [False, True]


def test_a_failed_forward_names_where_it_raised_and_cleans_up() -> None:
    model = RaisesMidForward()
    with pytest.raises(RuntimeError, match="boom") as raised:
        hs.trace(model, torch.randn(2, 4))
    notes = getattr(raised.value, "__notes__", [])
    assert any("'boom' (Boom, call 0) with input[0] [2, 4] float32" in note for note in notes)
    with hs.tracing(model) as tracer, pytest.raises(RuntimeError):
        model(torch.randn(2, 4))
    trace = tracer.trace
    assert [(row.name, row.status) for row in trace] == [("", "raised"), ("first", "ok"), ("boom", "raised")]
    assert trace.failure is not None
    assert trace.failure.name == "boom"
    assert json.loads(trace.to_json())["meta"]["failure"] == trace.failure.order
    assert trace.failure.inputs[0].shape == (2, 4)
    assert "boom#0" in str(trace)
    assert "!" in str(trace)


def test_a_forward_inside_an_except_block_is_not_mistaken_for_a_failure() -> None:
    model = SmallCNN()
    try:
        raise KeyError("handled elsewhere")
    except KeyError:
        trace = hs.trace(model, SmallCNN.example())
    assert {row.status for row in trace} == {"ok"}


def test_tracing_keeps_the_latest_pass() -> None:
    model = Looped()
    with hs.tracing(model) as tracer:
        with pytest.raises(SpecError, match="no forward pass"):
            _ = tracer.trace
        model(torch.randn(1, 4))
        first = tracer.trace
        model(torch.randn(3, 4))
    assert tracer.trace is not first
    assert tracer.trace["block"].outputs[0].shape == (3, 4)
    assert len(tracer.trace.calls("block")) == 3
    assert not tracer.live


def generation_passes(model: nn.Module, run: Callable[[], Any]) -> list[list[tuple[str, int, tuple[int, ...]]]]:
    """From plain hooks: per call of the model (one pass), each module call in start order, with
    its output's shape."""
    names = {id(m): name for name, m in model.named_modules()}
    passes: list[list[list[Any]]] = []  # per pass, [name, call, output shape] per call
    counts: dict[str, int] = {}
    started: list[list[Any]] = []  # the open calls

    def enter(module: nn.Module, _args: Any) -> None:
        if not started:  # nothing open: the model itself is called, a new pass
            passes.append([])
            counts.clear()
        name = names[id(module)]
        entry = [name, counts.get(name, 0), ()]
        counts[name] = counts.get(name, 0) + 1
        passes[-1].append(entry)
        started.append(entry)

    def leave(module: nn.Module, _args: Any, output: Any) -> None:
        entry = started.pop()  # calls nest: the innermost open one returns first
        leaves = flatten_tensors(output)
        entry[2] = tuple(leaves[0][1].shape) if leaves else (-1,)

    with_plain_hooks(list(model.modules()), enter, leave, run)
    return [[(name, call, shape) for name, call, shape in calls] for calls in passes]


@pytest.mark.transformers
def test_tracing_keeps_every_pass_of_a_generation_loop_when_asked() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0, pad_token_id=0
    )
    model = track(GPT2LMHeadModel(config).eval())
    ids = torch.randint(1, 64, (1, 6), generator=torch.Generator().manual_seed(0))

    def generate() -> Any:
        return model.generate(ids, max_new_tokens=3, do_sample=False)  # type: ignore[operator]

    expected = generation_passes(model, generate)
    assert len(expected) == 3  # the prefill, then one forward per new token
    with torch.no_grad(), hs.tracing(model, passes="all") as tracer:
        generate()
    traced = [
        [(row.name, row.call, row.outputs[0].shape if row.outputs else (-1,)) for row in trace]
        for trace in tracer.passes
    ]
    assert traced == expected
    assert tracer.trace is tracer.passes[-1]
    blocks = [t["transformer.h.1"].outputs[0].shape for t in tracer.passes]
    assert blocks == [(1, 6, 32), (1, 1, 32), (1, 1, 32)]  # the prompt, then one token at a time
    with torch.no_grad(), hs.tracing(model) as latest:
        generate()
    assert len(latest.passes) == 1  # by default each call of the model replaces the trace
    assert [(row.name, row.call) for row in latest.trace] == [(n, c) for n, c, _ in expected[-1]]
    with pytest.raises(SpecError, match="passes='every'"):
        hs.tracing(model, passes="every")  # type: ignore[arg-type]


def test_timing_gives_each_call_its_time_and_own_share() -> None:
    trace = hs.trace(Nested(), torch.randn(8, 4), timing=True)
    for row in trace:
        assert row.time_ms is not None
        assert row.self_ms is not None
        assert 0 <= row.self_ms <= row.time_ms + 1e-9
    root = trace[0]
    children = sum(row.time_ms or 0 for row in trace if row.parent == 0)
    assert root.time_ms is not None
    assert root.time_ms >= children
    assert "self ms" in str(trace)


def test_memory_is_measured_on_cuda_only() -> None:
    trace = hs.trace(SmallCNN(), SmallCNN.example(), memory=True)
    assert all(row.peak_bytes is None for row in trace)


class Counter:
    """A stand-in allocator counter: current bytes and a resettable peak."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    def alloc(self, n: int) -> None:
        self.now += n
        self.peak = max(self.peak, self.now)

    def reset(self) -> None:
        self.peak = self.now


def test_peak_memory_of_nested_calls_includes_the_childrens_peaks() -> None:
    counter = Counter()
    peaks = PeakMemory(read_allocated=lambda: counter.now, read_peak=lambda: counter.peak, reset_peak=counter.reset)
    counter.alloc(100)
    peaks.enter()  # parent
    counter.alloc(50)
    peaks.enter()  # child 1: +200 then frees 200
    counter.alloc(200)
    counter.alloc(-200)
    child1 = peaks.exit()
    peaks.enter()  # child 2: +30
    counter.alloc(30)
    child2 = peaks.exit()
    counter.alloc(-80)
    parent = peaks.exit()
    assert (child1, child2, parent) == (200, 30, 250)


def test_table_options() -> None:
    model = Nested()
    trace = hs.trace(model, torch.randn(2, 4))
    assert [line.split()[1] for line in trace.table(max_depth=0).splitlines()[2:3]] == ["(root)"]
    shallow = trace.table(max_depth=1)
    assert "stem.0.0" not in shallow
    assert "stem" in shallow
    only = trace.table(filter="blocks.*.0")
    assert "blocks.0.0" in only
    assert "stem" not in only
    assert "2 of" in only
    narrow = trace.table(columns=["module", "outputs"])
    assert narrow.splitlines()[0].split() == ["module", "outputs"]
    with pytest.raises(SpecError, match="expected keys among"):
        trace.table(columns=["module", "colour"])
    with pytest.raises(SpecError, match="negative"):
        trace.table(max_depth=-1)
    with pytest.raises(hs.SelectionError, match="did you mean"):
        trace.table(filter="blockz.*")


def test_lookup_by_unknown_name_suggests() -> None:
    model = SmallCNN()
    trace = hs.trace(model, SmallCNN.example())
    with pytest.raises(SiteNotFoundError, match="did you mean 'conv1'"):
        trace["conv2"]
    assert trace["(root)"] is trace[0]
    assert [row.name for row in trace.select(nn.ReLU)] == ["relu"]


def test_exports_agree() -> None:
    trace = hs.trace(Nested(), torch.randn(2, 4))
    frame = trace.to_pandas()
    assert len(frame) == len(trace)
    assert list(frame["name"]) == [row.name for row in trace]
    assert frame["max"].tolist() == pytest.approx([row.stats.max for row in trace if row.stats is not None])
    leaves = trace.to_pandas(per="leaf")
    assert len(leaves) == sum(len(row.outputs) for row in trace)
    with pytest.raises(SpecError, match="per="):
        trace.to_pandas(per="module")
    rows = list(csv.DictReader(io.StringIO(trace.to_csv())))
    assert [r["name"] for r in rows] == [row.name for row in trace]
    assert float(rows[1]["mean"]) == pytest.approx(trace[1].stats.mean if trace[1].stats else math.nan)


def test_json_is_strict_and_complete(tmp_path: Any) -> None:
    model = track(nn.Sequential(nn.Linear(2, 2), nn.LogSigmoid()))
    with torch.no_grad():
        model[0].bias.fill_(-math.inf)
    trace = hs.trace(model, torch.randn(3, 2))

    def refuse(token: str) -> None:
        raise AssertionError(f"non-standard JSON token {token}")

    document = json.loads(trace.to_json(tmp_path / "t.json"), parse_constant=refuse)
    assert json.loads((tmp_path / "t.json").read_text()) == document
    assert len(document["rows"]) == len(trace)
    assert document["rows"][1]["outputs"][0]["stats"]["min"] == "-inf"
    assert document["meta"]["model"] == "Sequential"


def test_csv_written_atomically(tmp_path: Any) -> None:
    trace = hs.trace(SmallCNN(), SmallCNN.example())
    text = trace.to_csv(tmp_path / "out" / "t.csv")
    assert (tmp_path / "out" / "t.csv").read_text() == text
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["t.csv"]


def test_html_escapes_module_names() -> None:
    model = track(nn.Sequential())
    model.add_module("<script>alert(1)</script>", nn.Linear(2, 2))
    html = hs.trace(model, torch.randn(1, 2))._repr_html_()
    assert "<script>" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert html.count("<tr") == 3  # header and two calls


def test_rich_rendering_marks_non_finite_rows() -> None:
    from rich.console import Console

    model = track(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    with torch.no_grad():
        model[1].weight.fill_(math.nan)
    console = Console(file=io.StringIO(), record=True, width=250, color_system="truecolor", force_terminal=True)
    console.print(hs.trace(model, torch.randn(1, 2)))
    assert "first NaN/Inf: made by 1#0 (Linear) from finite inputs" in console.export_text(clear=False)
    assert "\x1b[31m" in console.export_text(styles=True)


@pytest.mark.transformers
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_host_sync_inside_the_forward_on_cuda() -> None:
    model = tiny_gpt2().cuda()
    ids = gpt2_input().cuda()
    with hs.tracing(model, timing=True, memory=True, histograms=True) as tracer, torch.no_grad():
        torch.cuda.set_sync_debug_mode("error")
        try:
            model(input_ids=ids)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert tracer.trace["h.0.ln_1"].stats is not None
    histogram = tracer.trace["h.0.ln_1"].outputs[0].histogram
    assert histogram is not None
    assert histogram.counted == 2 * 8 * 32
    assert all(row.time_ms is not None for row in tracer.trace)


def normalised(text: str) -> str:
    """Numbers to '#', runs of spaces and rules to one: what stays is the table's structure."""
    import re

    text = re.sub(r"-?\d[\d,]*(\.\d+)?(e[+-]\d+)?%?", "#", text)
    text = re.sub(r"─+", "─", text)
    return "\n".join(re.sub(r" +", " ", line).strip() for line in text.splitlines())


def small_cnn_trace() -> hs.Trace:
    torch.manual_seed(0)
    model = SmallCNN()
    return hs.trace(model, torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)))


def test_small_cnn_layout_golden(golden: Golden) -> None:
    trace = small_cnn_trace()
    golden.check(
        "trace_small_cnn.txt", trace.table(columns=["order", "module", "class", "inputs", "outputs", "dtype", "params"])
    )


def test_small_cnn_full_table_golden_normalised(golden: Golden) -> None:
    trace = small_cnn_trace()
    text = str(trace)
    golden.check("trace_small_cnn_stats.txt", normalised(text))
    lines = text.splitlines()
    body = lines[2 : 2 + len(trace)]
    assert len(body) == len(trace) == 5  # invariant: one line per module call
    assert lines[2 + len(trace)] == "5 calls · 5 modules · 618 parameters"
    for line, row in zip(body, trace, strict=True):  # each line shows its own row's numbers
        assert row.stats is not None
        cells = line.split()
        assert cells[-7:-1] == [f"{getattr(row.stats, f):.4g}" for f in ("min", "max", "mean", "std", "abs_mean")] + [
            f"{100 * row.stats.zero_frac:.1f}%"
        ]


class Raiser(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("caught by the parent")


class CatchesChild(nn.Module):
    """``a`` raises, the forward catches it and goes on with ``b``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = Raiser()
        self.b = nn.Linear(4, 4)
        track(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            return self.a(x)
        except ValueError:
            out: torch.Tensor = self.b(x)
            return out


class RaisesItsOwn(nn.Module):
    """``block`` catches its child's error and raises a different one."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Module()
        self.block.a = Raiser()
        self.block.forward = self._block_forward  # type: ignore[method-assign]
        track(self)

    def _block_forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            return self.block.a(x)  # type: ignore[no-any-return]
        except ValueError:
            raise KeyError("the block's own error") from None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)  # type: ignore[no-any-return]


def test_an_exception_caught_inside_the_forward_is_not_a_failure() -> None:
    trace = hs.trace(CatchesChild(), torch.randn(2, 4))
    assert trace.failure is None
    assert [(row.name, row.status) for row in trace] == [("", "ok"), ("a", "raised"), ("b", "ok")]
    assert "the forward raised" not in str(trace)


def test_failure_is_where_the_final_error_was_raised() -> None:
    model = RaisesItsOwn()
    with hs.tracing(model) as tracer, pytest.raises(KeyError):
        model(torch.randn(2, 4))
    failure = tracer.trace.failure
    assert failure is not None
    assert failure.name == "block"


def test_a_second_thread_passes_through_and_leaves_the_first_threads_trace_intact() -> None:
    import threading

    raised: list[BaseException] = []
    got: list[torch.Tensor] = []

    class CallsFromAnotherThread(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(4, 4)
            self.outer = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            def other() -> None:
                try:
                    got.append(self.inner(x * 3))
                except Exception as error:
                    raised.append(error)

            worker = threading.Thread(target=other)
            worker.start()
            worker.join()
            out: torch.Tensor = self.outer(self.inner(x))
            return out

    model = track(CallsFromAnotherThread())
    x = torch.randn(2, 4)
    trace = hs.trace(model, x)
    assert raised == []
    torch.testing.assert_close(got[0], model.inner(x * 3), rtol=0, atol=0)  # ran, untraced
    assert [(row.name, row.status) for row in trace] == [("", "ok"), ("inner", "ok"), ("outer", "ok")]
    assert all(len(row.outputs) == 1 for row in trace)
    assert trace["inner"].outputs[0].stats.max == pytest.approx(model.inner(x).max().item())


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_nested_tensors_are_measured_over_their_components() -> None:
    layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, batch_first=True)
    model = track(nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=True).eval())
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(0))
    padding = torch.zeros(3, 5, dtype=torch.bool)
    padding[0, 3:] = True
    seen: list[torch.Tensor] = []
    hook = model.layers[0].register_forward_hook(lambda _m, _a, out: seen.append(out))
    try:
        trace = hs.trace(model, x, src_key_padding_mask=padding)
    finally:
        hook.remove()
    assert seen[0].is_nested, "the fast path passes nested tensors between layers"
    row = trace["layers.0"]
    assert row.outputs[0].shape == (3, -1, 8)
    assert "[3, ?, 8]" in str(trace)
    values = torch.cat([part.reshape(-1) for part in seen[0].unbind()]).double()
    stats = row.outputs[0].stats
    assert stats is not None
    assert stats.count == values.numel() == (3 + 5 + 5) * 8
    assert stats.mean == pytest.approx(values.mean().item(), rel=1e-5, abs=1e-6)
    assert stats.max == pytest.approx(values.max().item())
    with torch.no_grad():
        model.layers[0].linear2.bias[0] = math.nan
    culprit = hs.trace(model, x, src_key_padding_mask=padding).first_nonfinite()
    assert culprit is not None
    assert culprit.name == "layers.0.linear2"  # not the root: the nested input was measured, finite
    assert -1 in culprit.inputs[0].shape
    with hs.detect_nonfinite(model), pytest.raises(hs.NonFiniteError) as raised:
        model(x, src_key_padding_mask=padding)
    assert raised.value.module == "layers.0.linear2"


def test_input_stats_off_measures_outputs_only() -> None:
    trace = hs.trace(SmallCNN(), SmallCNN.example(), input_stats=False)
    assert trace["conv1"].inputs[0].stats is None  # the model's own input
    assert trace["relu"].inputs[0].stats is not None  # conv1's output, measured anyway
    assert trace.first_nonfinite() is None


def test_first_nonfinite_needs_statistics() -> None:
    trace = hs.trace(SmallCNN(), SmallCNN.example(), stats=False)
    with pytest.raises(SpecError, match="stats=False"):
        trace.first_nonfinite()


def test_options_that_look_like_model_keywords_are_refused_with_the_fix() -> None:
    layer = nn.TransformerDecoderLayer(d_model=8, nhead=2, dim_feedforward=16, batch_first=True)
    decoder = track(nn.TransformerDecoder(layer, num_layers=1).eval())
    target, memory = torch.randn(2, 3, 8), torch.randn(2, 4, 8)
    with pytest.raises(SpecError, match=r"model_kwargs=\{'memory': \.\.\.\}"):
        hs.trace(decoder, target, memory=memory)  # type: ignore[arg-type]
    trace = hs.trace(decoder, target, model_kwargs={"memory": memory})
    assert trace[0].inputs[1].path == "['memory']"


def test_tied_weights_are_counted_once() -> None:
    model = track(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    model[1].weight = model[0].weight
    trace = hs.trace(model, torch.randn(1, 4))
    assert trace.meta["params"] == 16 + 4 + 4
    assert "3 calls · 3 modules · 24 parameters" in str(trace)


def test_repr_is_one_line() -> None:
    trace = hs.trace(SmallCNN(), SmallCNN.example())
    assert repr(trace) == "<Trace of SmallCNN: 5 calls of 5 modules; print() it>"


def test_selectors_on_a_trace_whose_model_is_gone() -> None:
    import gc

    trace = hs.trace(Nested(), torch.randn(2, 4))
    gc.collect()
    assert "blocks.0.0" in trace.table(filter="blocks.*.0")
    assert [row.name for row in trace.select(["stem", "re:heads\\..*"])] == ["stem", "heads.main", "heads.aux"]
    with pytest.raises(hs.SelectionError, match="did you mean 'blocks.*.0'"):
        trace.table(filter="blockz.*.0")
    with pytest.raises(SpecError, match="the traced model is gone"):
        trace.select(nn.Linear)


def test_numpy_booleans_are_flags_too() -> None:
    import numpy as np

    trace = hs.trace(SmallCNN(), SmallCNN.example(), stats=np.bool_(False))  # type: ignore[arg-type]
    assert trace["fc"].stats is None


def test_lazy_modules_count_zero_parameters_until_they_run() -> None:
    model = track(nn.Sequential(nn.LazyLinear(3), nn.ReLU()))
    assert hs.layers(model).total_params == 0
    trace = hs.trace(model, torch.randn(2, 5))
    assert trace["0"].outputs[0].shape == (2, 3)
    assert trace["0"].params == 0  # counted when the hooks were attached, before the forward
    assert hs.trace(model, torch.randn(2, 5))["0"].params == 18


def test_rows_are_found_by_every_spelling_a_cache_key_takes() -> None:
    model = SharedTwice()
    trace = hs.trace(model, torch.randn(3, 4))
    shared = trace.calls("shared")
    assert trace["shared#1"] is shared[1]
    assert trace["shared#0:output"] is shared[0]
    assert trace["shared:input[0]"] is shared[0]  # no call named: the first, as trace["shared"]
    assert trace["(root)#0"] is trace[0]
    assert trace.calls("shared#1") == shared
    with pytest.raises(SiteNotFoundError, match=r"'shared#2': call 2 was not traced; calls kept: \[0, 1\]"):
        trace["shared#2"]
    with pytest.raises(SiteNotFoundError, match="did you mean 'shared'") as info:
        trace["shraed#0"]
    assert info.value.candidates[0] == "shared"

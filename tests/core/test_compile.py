"""torch.compile: hooks fire in compiled code, stale compiled code is stepped around, no graph breaks.

Dynamo traces hooks present at its first call into the graph and guards on them, but not on
hook dicts it saw empty: hooks attached after a compiled run would never fire. hookscope runs
that model eagerly while they are attached (``StaleCompiledCodeWarning``), dropping no compiled
code, and its statistics and capture hooks trace without graph breaks, so a compiled model stays
one graph while it is watched.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch._dynamo
from torch import nn

import hookscope as hs
from hookscope._core.compat import compiled
from hookscope.errors import UnsupportedModelError
from tests.models import Handshake

# Dynamo reads .grad of the tensors alive where it breaks a graph; a pass opening or ending inside
# compiled code is such a break (hookscope runs it eagerly). The warning is Dynamo's own.
pytestmark = [
    pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning"),
    pytest.mark.compile,
    pytest.mark.slow,
]


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def x() -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


def eager_capture(model: nn.Module, x: torch.Tensor, selector: str = "*") -> dict[str, torch.Tensor]:
    with hs.capture(model, selector) as cap:
        model(x)
    return {key: cap[key] for key in cap}


def test_names_drop_the_wrapper_and_both_spellings_select(x: torch.Tensor) -> None:
    model = mlp()
    compiled_model = torch.compile(model, backend="eager")
    assert [row.name for row in hs.layers(compiled_model).rows] == ["", "_orig_mod", "0", "1", "2"]
    with hs.capture(compiled_model, ["0", "_orig_mod.2"]) as cap:
        compiled_model(x)
    assert sorted(cap) == ["0#0:output", "2#0:output"]
    torch.testing.assert_close(cap["_orig_mod.2"], model(x))  # the old spelling reads back too
    torch.testing.assert_close(cap["2"], model(x))


def test_hooks_attached_before_the_first_call_fire_with_eager_values(x: torch.Tensor) -> None:
    model = mlp()
    expected = eager_capture(model, x)
    compiled_model = torch.compile(model, backend="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error", hs.StaleCompiledCodeWarning)  # nothing stale: no recompilation warning
        with hs.capture(compiled_model, "*") as cap:
            compiled_model(x)
            compiled_model(x)  # the second call runs the cached code, hooks included
    assert {key for key in cap if key != "_orig_mod#0:output"} == set(expected) - {"#0:output"} - {"_orig_mod#0:output"}
    for key, value in expected.items():
        if key in cap:
            torch.testing.assert_close(cap[key], value)


def test_attaching_after_a_compiled_run_runs_eagerly_with_the_hooks(x: torch.Tensor) -> None:
    model = mlp()
    compiled_model = torch.compile(model, backend="eager")
    compiled_model(x)  # compiled without hooks: that code would never call them
    with pytest.warns(hs.StaleCompiledCodeWarning, match=r"torch\._dynamo\.reset\(\)"):
        cap = hs.capture(compiled_model, "0")
    with cap:
        compiled_model(x)
    torch.testing.assert_close(cap["0"], model[0](x))


def test_the_eager_module_hooked_while_its_wrapper_is_called(x: torch.Tensor) -> None:
    model = mlp()
    compiled_model = torch.compile(model, backend="eager")
    compiled_model(x)
    with pytest.warns(hs.StaleCompiledCodeWarning, match="a torch.compile wrapper of this Sequential"):
        cap = hs.capture(model, "1")
    with cap:
        compiled_model(x)
    torch.testing.assert_close(cap["1"], torch.relu(model[0](x)))


def test_edits_apply_in_compiled_code_and_leave_with_their_hooks(x: torch.Tensor) -> None:
    model = mlp()
    plain = model(x)
    compiled_model = torch.compile(model, backend="eager")
    with hs.edit(compiled_model, {"0": hs.edits.zero()}):
        edited = compiled_model(x)
    torch.testing.assert_close(edited, model[2](torch.relu(model[0].bias.new_zeros(4, 16))))
    torch.testing.assert_close(compiled_model(x), plain)  # removing hooks fails Dynamo's guard: recompiled
    compiled_model(x)
    with pytest.warns(hs.StaleCompiledCodeWarning), hs.edit(compiled_model, {"0": hs.edits.zero()}):
        assert not torch.allclose(compiled_model(x), plain)


def test_model_compile_in_place_needs_no_reset(x: torch.Tensor) -> None:
    model = mlp()
    model.compile(backend="eager")
    model(x)
    with warnings.catch_warnings():
        warnings.simplefilter(
            "error", hs.StaleCompiledCodeWarning
        )  # its compiled code reads the hooks at run time: nothing stale
        with hs.capture(model, "0") as cap:
            model(x)
    torch.testing.assert_close(cap["0"], model[0](x))


def test_a_compiled_call_that_skips_the_hooks_raises_and_leaves_none(
    x: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last line of defence: had the stale code not been found (a torch whose Dynamo keeps
    its code elsewhere), the wrapper's own hooks see that the hooks inside never ran."""
    model = mlp()
    compiled_model = torch.compile(model, backend="eager")
    compiled_model(x)
    monkeypatch.setattr(compiled, "_stale_frames", lambda model: "")
    skipped = pytest.raises(UnsupportedModelError, match=r"ran without calling the hooks.*torch\._dynamo\.reset")
    with skipped, hs.capture(compiled_model, "0"):
        compiled_model(x)
    assert hs.attached(compiled_model) == []


@pytest.mark.parametrize("feature", ["capture", "trace", "edit", "hooks"])
def test_no_graph_breaks_from_hookscope_hooks(feature: str, x: torch.Tensor) -> None:
    """Hooks inside a compiled model stay in its one graph. The pass opens and ends at the
    wrapper torch.compile returned, outside the graph (a pass opening inside compiled code is
    one deliberate break: see the next test)."""
    from torch._dynamo.utils import counters

    compiled_model = torch.compile(mlp(), backend="eager")
    scopes = {
        "capture": lambda: hs.capture(compiled_model, "*", keep="both"),
        "trace": lambda: hs.tracing(compiled_model, histograms=True),
        "edit": lambda: hs.edit(compiled_model, {"0": hs.edits.scale(2.0)}),
        "hooks": lambda: hs.hooks(compiled_model, {"*": lambda module, args, output: None}),
    }
    counters.clear()
    with scopes[feature]():
        compiled_model(x)
        compiled_model(x)
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1


def test_an_editor_counts_the_calls_it_edited_in_compiled_code(x: torch.Tensor) -> None:
    from torch._dynamo.utils import counters

    compiled_model = torch.compile(mlp(), backend="eager")
    counters.clear()
    with hs.edit(compiled_model, {"0": hs.edits.scale(2.0), "2": hs.edits.zero()}) as editor:
        for _ in range(3):
            compiled_model(x)
    assert editor.applied == {"0": 3, "2": 3}
    assert counters["stats"]["unique_graphs"] == 1  # the counts do not make it recompile


def test_a_pass_opening_inside_compiled_code_runs_eagerly(x: torch.Tensor) -> None:
    """Hooking the eager module whose wrapper is called: the pass opens in compiled code, where
    the thread and autograd's state cannot be read, so its opening and end run eagerly."""
    from torch._dynamo.utils import counters

    model = mlp()
    compiled_model = torch.compile(model, backend="eager")
    counters.clear()
    with hs.capture(model, "*", passes="all") as cap:
        for _ in range(10):  # no recompilation per call (the deferred values are filed each pass)
            compiled_model(x)
    assert len(cap.passes) == 10
    assert all(sorted(cache) == ["0#0:output", "1#0:output", "2#0:output"] for cache in cap.passes)
    torch.testing.assert_close(cap.passes[-1]["2"], model(x))
    assert counters["stats"]["unique_graphs"] <= 3  # the graph, cut where the pass opens and ends


def test_a_compiled_trace_has_the_eager_statistics(x: torch.Tensor) -> None:
    model = mlp()
    eager = hs.trace(model, x)
    compiled_model = torch.compile(model, backend="eager")
    traced = hs.trace(compiled_model, x)
    rows = {(row.name, row.call): row for row in traced.rows}
    for row in eager.rows:
        if not row.name:
            continue
        twin = rows[(row.name, row.call)]
        assert twin.outputs[0].shape == row.outputs[0].shape
        got, want = twin.outputs[0].stats, row.outputs[0].stats
        assert got is not None
        assert want is not None
        assert got.min == pytest.approx(want.min)
        assert got.max == pytest.approx(want.max)
        assert got.mean == pytest.approx(want.mean, abs=1e-6)
        assert got.std == pytest.approx(want.std, rel=1e-5)
        assert got.zero_frac == want.zero_frac


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's own
def test_inductor_capture_and_trace_equal_eager(x: torch.Tensor) -> None:
    model = mlp()
    expected = eager_capture(model, x, "0")
    eager_trace = hs.trace(model, x)
    compiled_model = torch.compile(model, backend="inductor")
    with hs.capture(compiled_model, "0") as cap, hs.tracing(compiled_model) as tracer:
        compiled_model(x)
    torch.testing.assert_close(cap["0"], expected["0#0:output"])
    relu = {row.name: row for row in tracer.trace.rows}["1"].outputs[0].stats
    want = {row.name: row for row in eager_trace.rows}["1"].outputs[0].stats
    assert relu is not None
    assert want is not None
    assert relu.mean == pytest.approx(want.mean, rel=1e-5)
    assert relu.zero_frac == want.zero_frac


@pytest.mark.transformers
def test_gpt2_compiled_with_graph_breaks_runs_eagerly_with_the_hooks() -> None:
    """GPT-2 compiles as its own frame (``GPT2Model.forward``): stale code found there too."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64)
    model = transformers.GPT2Model(config).eval()
    ids = torch.randint(0, 100, (2, 8))
    with hs.capture(model, ["h.0.mlp", "h.1"]) as expected:
        model(ids)
    compiled_model = torch.compile(model, backend="eager")
    compiled_model(ids)
    with pytest.warns(hs.StaleCompiledCodeWarning):
        cap = hs.capture(compiled_model, ["h.0.mlp", "h.1"])
    with cap:
        compiled_model(ids)
    assert sorted(cap) == sorted(expected)
    for key in expected:
        torch.testing.assert_close(cap[key], expected[key], rtol=1e-4, atol=1e-5)


def test_capture_options_apply_inside_compiled_code(x: torch.Tensor) -> None:
    """detach=False keeps the autograd graph, reduce and dtype shrink the value in the graph."""
    model = mlp()
    with hs.capture(model, ["0", "2"], detach=False, dtype=torch.float16, reduce="mean:0") as expected:
        model(x)
    torch._dynamo.reset()
    compiled_model = torch.compile(model, backend="eager")
    with hs.capture(compiled_model, ["0", "2"], detach=False, dtype=torch.float16, reduce="mean:0") as cap:
        compiled_model(x)
    for key in expected:
        assert cap[key].shape == expected[key].shape
        assert cap[key].dtype == torch.float16
        assert cap[key].requires_grad
        torch.testing.assert_close(cap[key], expected[key])


def test_a_checkpointed_compiled_block_recomputes_without_a_new_pass() -> None:
    """The reentrant kind: its recomputation runs the block's forward again, inside backward."""
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = torch.compile(nn.Sequential(nn.Linear(4, 4), nn.Tanh()), backend="eager")
            self.head = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(checkpoint(self.block, x, use_reentrant=True))

    torch.manual_seed(0)
    net = Net()
    x = torch.randn(3, 4, requires_grad=True)
    with hs.capture(net, ["block.0", "head"], passes="all") as cap:
        net(x).sum().backward()
    assert [sorted(cache) for cache in cap.passes] == [["block.0#0:output", "head#0:output"]]


def test_a_compiled_model_diffs_within_its_eager_self(x: torch.Tensor) -> None:
    model = mlp()
    diff = hs.diff(model, torch.compile(model, backend="eager"), x)
    assert diff.within()
    assert "_orig_mod" not in {row.name for row in diff.rows}


def test_a_second_thread_inside_a_compiled_pass_passes_through_and_the_pass_stays_whole() -> None:
    """The pass opens inside compiled code (the eager module is hooked); another thread calling
    the compiled model meanwhile passes through untouched: compiled code cannot read the thread,
    so from then on the hooks check it eagerly, and the first pass stays whole."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), Handshake(), nn.Linear(3, 3)).eval()
    compiled_model = torch.compile(model, backend="eager")
    first, second = torch.ones(2, 3), torch.zeros(2, 3)
    with torch.no_grad():
        plain = model[2](model[0](second) * 2)  # what the model returns, without holding the handshake
    got: list[torch.Tensor] = []
    with hs.edit(model, {"2": hs.edits.scale(2.0)}), hs.capture(model, "*", passes="all") as cap:
        other, raised = model[1].intruder(lambda: got.append(compiled_model(second)))
        out = compiled_model(first)
        other.join(timeout=30)
        again = compiled_model(first)  # the owner's compiled code, now checking the thread eagerly
    assert raised == []
    assert len(got) == 1
    assert torch.equal(got[0].detach(), plain)
    assert len(cap.passes) == 2
    for cache in cap.passes:
        assert sorted(cache) == ["0#0:output", "1#0:output", "2#0:output"]
    torch.testing.assert_close(cap["2"], out)
    torch.testing.assert_close(again, out)
    torch.testing.assert_close(cap["0"], model[0](first))
    torch.testing.assert_close(out, model[2](model[1](model[0](first))) * 2)


def test_another_thread_calling_the_hooked_wrapper_passes_through_while_the_owner_compiles() -> None:
    """Hooks on the wrapper torch.compile returned: the other thread enters while the owner is
    held inside the compiled call (Dynamo compiling around it, which turns torch's process-wide
    is_compiling() flag on for every thread), and its forward runs unedited and untraced."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), Handshake(), nn.Linear(3, 3)).eval()
    compiled_model = torch.compile(model, backend="eager")
    first, second = torch.ones(2, 3), torch.zeros(2, 3)
    with torch.no_grad():
        plain = model[2](model[0](second) * 2)
        edited = model[2](model[0](first) * 2) * 2
    got: list[torch.Tensor] = []
    with (
        hs.edit(compiled_model, {"2": hs.edits.scale(2.0)}) as editor,
        hs.tracing(compiled_model, passes="all") as tracer,
    ):
        other, raised = model[1].intruder(lambda: got.append(compiled_model(second)))
        out = compiled_model(first)
        other.join(timeout=30)
        again = compiled_model(first)
    assert raised == []
    assert len(got) == 1
    assert torch.equal(got[0].detach(), plain)
    torch.testing.assert_close(out, edited)
    torch.testing.assert_close(again, edited)
    assert editor.applied == {"2": 2}
    assert len(tracer.passes) == 2
    assert [(row.name, row.call) for row in tracer.passes[0].rows] == [
        ("", 0),
        ("_orig_mod", 0),
        ("0", 0),
        ("1", 0),
        ("2", 0),
    ]


# -- hooks on one compiled model never drop another's compiled code (issue 36, item 13) ------------


class TwoLayer(nn.Module):
    """A class of the user's own: torch.compile compiles its forward as a frame of its own."""

    def __init__(self, graph_break: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)
        self.graph_break = graph_break

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        if self.graph_break:
            torch._dynamo.graph_break()
        out: torch.Tensor = self.b(torch.relu(y))
        return out


def counting(counts: dict[str, int], tag: str) -> object:
    """A Dynamo backend that runs the graph as traced and counts each compilation under ``tag``."""

    def backend(graph: torch.fx.GraphModule, _inputs: object) -> object:
        counts[tag] = counts.get(tag, 0) + 1
        return graph.forward

    return backend


def raw_outputs(model: TwoLayer, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """``a`` and ``b``'s outputs from plain forward hooks on the eager model."""
    seen: dict[str, torch.Tensor] = {}
    handles = [
        getattr(model, name).register_forward_hook(lambda m, i, o, name=name: seen.__setitem__(name, o.detach()))
        for name in ("a", "b")
    ]
    try:
        model(x)
    finally:
        for handle in handles:
            handle.remove()
    return seen


@pytest.mark.parametrize("how", ["wrapper", "eager module hooked", "in place", "function around it"])
def test_hooks_after_a_compiled_call_fire_and_keep_other_models_compiled_code(how: str, x: torch.Tensor) -> None:
    torch.manual_seed(0)
    first, second = TwoLayer(graph_break=how == "function around it"), TwoLayer()
    expected = raw_outputs(first, x)
    counts: dict[str, int] = {}
    call: nn.Module | object
    if how == "in place":
        first.compile(backend=counting(counts, "first"))
        call = target = first
    elif how == "function around it":
        call, target = torch.compile(lambda inputs: first(inputs), backend=counting(counts, "first")), first
    else:
        call = torch.compile(first, backend=counting(counts, "first"))
        target = first if how == "eager module hooked" else call
    other = torch.compile(second, backend=counting(counts, "second"))
    assert callable(call)
    call(x)
    other(x)
    warm = dict(counts)
    # a wrapper or model.compile() of the model runs it eagerly and says so; around a function
    # Dynamo compiles again around the hooked modules, and nothing needs saying
    around_a_function = how == "function around it"

    def said() -> Any:
        return warnings.catch_warnings() if around_a_function else pytest.warns(hs.StaleCompiledCodeWarning)

    with said():
        if around_a_function:
            warnings.simplefilter("error", hs.StaleCompiledCodeWarning)
        cap = hs.capture(target, ["a", "b"])
    with cap:
        call(x)
    torch.testing.assert_close(cap["a"], expected["a"])
    torch.testing.assert_close(cap["b"], expected["b"])
    with said(), hs.edit(target, {"a": hs.edits.zero()}) as editor:
        if around_a_function:
            warnings.simplefilter("error", hs.StaleCompiledCodeWarning)
        edited = call(x)
    assert editor.applied == {"a": 1}
    torch.testing.assert_close(edited, first.b(torch.relu(torch.zeros_like(expected["a"]))))
    used = dict(counts)
    torch.testing.assert_close(other(x), second(x))
    torch.testing.assert_close(call(x), expected["b"])
    assert counts == used  # no code was dropped: both models run the code compiled before
    assert counts["second"] == warm["second"]
    if how != "function around it":  # there Dynamo compiles around the hooked modules, once per attach
        assert counts == warm
    assert hs.attached(first) == []


@pytest.mark.parametrize("graph_break", [False, True])
def test_a_never_compiled_model_of_a_compiled_class_attaches_as_if_nothing_were_compiled(
    graph_break: bool, x: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    eager, other = TwoLayer(graph_break), TwoLayer(graph_break)
    expected = raw_outputs(eager, x)
    torch.compile(other, backend="eager")(x)  # the class's code is compiled, for another model
    del other
    with hs.capture(eager, ["a"]):  # a first attach may look once for wrappers made before hookscope
        pass
    walks: list[int] = []
    heap_walk = compiled.gc.get_objects
    monkeypatch.setattr(compiled.gc, "get_objects", lambda *a: walks.append(1) or heap_walk(*a))
    with warnings.catch_warnings():
        warnings.simplefilter("error", hs.StaleCompiledCodeWarning)
        for _ in range(3):
            with hs.capture(eager, ["a", "b"]) as cap:
                eager(x)
            torch.testing.assert_close(cap["a"], expected["a"])
            torch.testing.assert_close(cap["b"], expected["b"])
    assert walks == []  # no walk of the heap per attach
    assert hs.attached(eager) == []


@pytest.mark.transformers
def test_a_sweep_on_a_compiled_model_compiles_nothing_and_equals_the_eager_sweep() -> None:
    """The issue's case: a 10-token sweep reset Dynamo per cell (21 s) and the next call of another
    compiled model recompiled."""
    transformers = pytest.importorskip("transformers")

    def lm() -> nn.Module:
        torch.manual_seed(0)
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(config).eval()

    first, second = lm(), lm()
    clean = torch.randint(0, 100, (1, 10), generator=torch.Generator().manual_seed(0))
    corrupted = clean.clone()
    corrupted[0, 3] = (clean[0, 3] + 1) % 100
    metric = hs.methods.logit_diff(5, 6)
    eager = hs.methods.patch_sweep(first, clean, corrupted, metric=metric, layers="std:blocks.*.resid_pre")
    counts: dict[str, int] = {}
    compiled_first = torch.compile(first, backend=counting(counts, "first"))
    compiled_second = torch.compile(second, backend=counting(counts, "second"))
    compiled_first(clean)
    compiled_second(clean)
    warm = dict(counts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hs.StaleCompiledCodeWarning)
        swept = hs.methods.patch_sweep(compiled_first, clean, corrupted, metric=metric, layers="std:blocks.*.resid_pre")
    compiled_second(clean)
    compiled_first(clean)
    assert counts == warm
    torch.testing.assert_close(swept.raw, eager.raw)
    torch.testing.assert_close(swept.values, eager.values)


# -- an op site's graph break keeps every later module's hooks (issue 36, item 19) -----------------


@pytest.mark.transformers
def test_op_sites_under_compile_keep_the_hooks_of_later_blocks() -> None:
    """An op watcher runs its module eagerly: a graph break inside block 0, after which Dynamo
    compiles the rest of the block as a frame shared by both blocks. Compiled for block 0 (no
    hooks on its MLP), it ran for block 1 and skipped block 1's hooks: the capture lacked the
    site, the edit applied 0 times."""
    from tests.models import attention_gpt2, attention_tokens

    model, ids = attention_gpt2("eager"), attention_tokens()
    sites = ["h.0.attn:op[softmax#0]", "h.1.mlp", "ln_f", "std:blocks.1.resid_mid"]
    with hs.capture(model, sites) as eager:
        model(ids)
    edits = {"h.0.attn:op[softmax#0]": hs.edits.scale(0.5), "h.1.mlp": hs.edits.zero()}
    with hs.edit(model, edits):
        eager_edited = model(ids).last_hidden_state
    plain = model(ids).last_hidden_state
    compiled_model = torch.compile(model, backend="eager")
    hs.std_map(compiled_model)  # names std: sites by one compiled run: before the reset, so the hooks compile in
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", hs.StaleCompiledCodeWarning)  # compiled with the hooks, not run eagerly
        with hs.capture(compiled_model, sites) as cap:
            compiled_model(ids)
    assert sorted(cap) == sorted(eager)
    for key in eager:
        torch.testing.assert_close(cap[key], eager[key])
    torch._dynamo.reset()  # the edit's own first compiled call, as a user would make it
    with hs.edit(compiled_model, edits) as editor:
        edited = compiled_model(ids).last_hidden_state
    assert editor.applied == {"h.0.attn:op[softmax#0]": 1, "h.1.mlp": 1}
    torch.testing.assert_close(edited, eager_edited)
    assert not torch.allclose(edited, plain)


@pytest.mark.transformers
def test_the_hook_guard_switched_back_on_while_hooks_are_attached_is_switched_off_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A user's ``config.patch(skip_nnmodule_hook_guards=True)`` around a capture's creation put
    the setting back on when it exited, the capture still attached: block 1's hooks were skipped."""
    from tests.models import attention_gpt2, attention_tokens

    monkeypatch.setattr(compiled, "_SWITCHED_ON_SAID", [], raising=False)  # the warning is said once
    config = torch._dynamo.config
    model, ids = attention_gpt2("eager"), attention_tokens()
    sites = ["h.0.attn:op[softmax#0]", "h.1.mlp", "ln_f", "std:blocks.1.resid_mid"]
    with hs.capture(model, sites) as eager:
        model(ids)
    compiled_model = torch.compile(model, backend="eager")
    hs.std_map(compiled_model)
    torch._dynamo.reset()
    with config.patch(skip_nnmodule_hook_guards=True):
        cap = hs.capture(compiled_model, sites)
    assert config.skip_nnmodule_hook_guards is True  # the patch put it back, the capture attached
    with cap:
        with pytest.warns(hs.StaleCompiledCodeWarning, match="skip_nnmodule_hook_guards"):
            compiled_model(ids)
        assert config.skip_nnmodule_hook_guards is False
    assert sorted(cap) == sorted(eager)
    for key in eager:
        torch.testing.assert_close(cap[key], eager[key])
    # set by hand while a group is attached: the next attach switches it off again
    small = mlp()
    with hs.capture(small, "0"):
        config.skip_nnmodule_hook_guards = True
        with hs.capture(small, "2"):
            assert config.skip_nnmodule_hook_guards is False

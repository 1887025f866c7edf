"""The shared per-call recorder and the one blame rule, against references taken with plain PyTorch hooks."""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import hookscope as hs
from hookscope._core.tracker import REPLICAS_HINT
from hookscope._shared.blame import blame, findings, fine_input
from hookscope._shared.call_recorder import Args, CallRecorder, Handled, Kwargs, OpenCall, Watched
from hookscope.errors import NonFiniteError
from tests.models import Handshake, gpt2_input, tiny_gpt2, track

# -- a recorder that writes down what it is told ---------------------------------------------------------


class Log(CallRecorder[Watched, OpenCall[Watched]]):
    """Every event the base hands a subclass, in order."""

    feature = "log"

    def __init__(
        self, model: nn.Module, *, modules: list[tuple[str, nn.Module]] | None = None, recompute: bool = False
    ) -> None:
        self.events: list[tuple[Any, ...]] = []
        self._recompute = recompute
        super().__init__(model, modules if modules is not None else list(model.named_modules()))

    def open_call(self, site: Watched, call: int, handled: Handled, args: Args, kwargs: Kwargs) -> OpenCall[Watched]:
        self.events.append(("open", site.name, call))
        return OpenCall(site, call, handled)

    def close_call(self, draft: OpenCall[Watched], output: Any) -> None:
        self.events.append(("return", draft.site.name, draft.call))

    def call_raised(self, draft: OpenCall[Watched], error: BaseException) -> None:
        self.events.append(("raise", draft.site.name, draft.call, type(error).__name__))

    def skips_pass(self) -> bool:
        return False if self._recompute else super().skips_pass()

    def start_pass(self, module: nn.Module) -> None:
        self.events.append(("start", type(module).__name__))

    def end_pass(self, module: nn.Module, error: BaseException | None) -> None:
        self.events.append(("end", None if error is None else type(error).__name__))

    def abandon_pass(self) -> None:
        self.events.append(("abandon",))

    def calls(self, kind: str) -> list[tuple[Any, ...]]:
        return [event[1:] for event in self.events if event[0] == kind]


def plain_hooks(model: nn.Module) -> tuple[list[tuple[str, str]], Callable[[], None]]:
    """The reference: PyTorch's own hooks on every module, logging ("open"/"close", name) in order."""
    seen: list[tuple[str, str]] = []
    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(lambda m, a, name=name: seen.append(("open", name))))
        handles.append(
            module.register_forward_hook(lambda m, a, o, name=name: seen.append(("close", name)), always_call=True)
        )

    def remove() -> None:
        for handle in handles:
            handle.remove()

    return seen, remove


def numbered(events: list[tuple[str, str]]) -> list[tuple[str, str, int]]:
    """Number each module's calls by hand, in the order they open; a close takes its module's innermost."""
    counts: dict[str, int] = {}
    open_calls: dict[str, list[int]] = {}
    out = []
    for kind, name in events:
        if kind == "open":
            index = counts.get(name, 0)
            counts[name] = index + 1
            open_calls.setdefault(name, []).append(index)
            out.append((kind, name, index))
        else:
            out.append((kind, name, open_calls[name].pop()))
    return out


class Shared(nn.Module):
    """One Linear applied twice, inside a block, around a Tanh: nesting and repeated calls."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.block = nn.Sequential(nn.Tanh(), self.fc)
        track(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.block(self.fc(x))
        return out


# -- the recorder ---------------------------------------------------------------------------------------


def test_calls_open_and_close_as_pytorchs_own_hooks_see_them() -> None:
    model = Shared()
    x = torch.randn(2, 4)
    seen, remove = plain_hooks(model)
    model(x)
    remove()
    expected = numbered(seen)
    with Log(model) as log:
        model(x)
    got = [("open", *e[1:]) if e[0] == "open" else ("close", *e[1:]) for e in log.events if e[0] in ("open", "return")]
    assert got == expected
    assert ("open", "fc", 1) in got  # the shared Linear's second call, inside the block
    assert log.events[0] == ("start", "Shared")
    assert log.events[-1] == ("end", None)
    assert log.opened == []


class CatchesInside(nn.Module):
    """Calls a module that raises, catches the error, and goes on: a call that raised in a pass that did not."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.bad = nn.Linear(3, 3)  # the wrong width: calling it on x raises
        self.after = nn.Linear(4, 4)
        track(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h: torch.Tensor = self.first(x)
        with contextlib.suppress(RuntimeError):
            self.bad(h)
        out: torch.Tensor = self.after(h)
        return out


def test_a_raised_call_is_told_apart_even_inside_a_users_except_block() -> None:
    """The model runs while the user handles another exception: sys.exc_info() holds it throughout,
    so only the exception at a call's close being a new one means the call raised."""
    model = CatchesInside()
    with Log(model) as log:
        model(torch.randn(2, 4))
        try:
            raise KeyError("the user's own")
        except KeyError:
            model(torch.randn(2, 4))
    first, second = log.events[: len(log.events) // 2], log.events[len(log.events) // 2 :]
    assert first == second  # the user's except block changes nothing
    assert log.calls("raise")[0] == ("bad", 0, "RuntimeError")
    assert sorted(log.calls("return")[:3]) == [("", 0), ("after", 0), ("first", 0)]
    assert ("end", None) in second


def test_a_forward_that_raises_ends_its_pass_with_the_error() -> None:
    model = track(nn.Sequential(nn.Linear(4, 4), nn.Linear(3, 3)))
    with Log(model) as log, pytest.raises(RuntimeError):
        model(torch.randn(2, 4))
    assert log.calls("raise") == [("1", 0, "RuntimeError"), ("", 0, "RuntimeError")]
    assert log.calls("return") == [("0", 0)]
    assert log.events[-1] == ("end", "RuntimeError")
    assert log.opened == []


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_checkpoint_recomputing_in_backward_is_skipped_unless_asked(reentrant: bool) -> None:
    block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    model = track(nn.Sequential(block, nn.Linear(4, 1)))
    x = torch.randn(3, 4, requires_grad=True)

    def step() -> None:
        checkpoint(block, x, use_reentrant=reentrant)  # the block's forward ...
        model[1](checkpoint(block, x, use_reentrant=reentrant)).sum().backward()  # ... and its recomputation

    seen, remove = plain_hooks(block)
    step()
    remove()
    recomputed = seen.count(("open", "0"))
    assert recomputed == 3  # the reference: two forwards, one recomputation in backward
    with Log(model, modules=[("0.0", block[0])]) as log:
        step()
    assert log.calls("open") == [("0.0", 0), ("0.0", 0)]  # each forward its own pass; no recomputation
    with Log(model, modules=[("0.0", block[0])], recompute=True) as log:
        step()
    assert log.calls("open") == [("0.0", 0)] * recomputed


class Interrupts(nn.Module):
    """Raises KeyboardInterrupt once, which skips PyTorch's always_call hooks: the pass stays open."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.armed = True
        track(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h: torch.Tensor = self.fc(x)
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt
        return h


def test_a_pass_cut_short_is_abandoned_and_the_next_one_is_whole() -> None:
    model = Interrupts()
    with Log(model) as log:
        with pytest.raises(KeyboardInterrupt):
            model(torch.randn(2, 4))
        assert len(log.opened) == 1  # the root's call never closed
        del log.events[:]
        model(torch.randn(2, 4))
    assert log.events == [
        ("abandon",),
        ("start", "Interrupts"),
        ("open", "", 0),
        ("open", "fc", 0),
        ("return", "fc", 0),
        ("return", "", 0),
        ("end", None),
    ]
    assert log.opened == []


def intrude(model: nn.Module, handshake: Handshake, scope: Any, run: Callable[[], Any]) -> tuple[list[Any], list[Any]]:
    """Run ``run`` with ``scope`` attached while another thread calls the handshake module
    mid-pass; returns what the other thread got and what it raised."""
    got: list[Any] = []
    x = torch.zeros(2, 3)
    with scope:
        other, raised = handshake.intruder(lambda: got.append(handshake(x)))
        run()
        other.join(timeout=30)
    return got, raised


def test_a_second_thread_passes_through_unrecorded_and_leaves_the_pass_whole() -> None:
    handshake = Handshake()
    model = track(nn.Sequential(nn.Linear(3, 3), handshake, nn.Linear(3, 3)))
    log = Log(model)
    got, raised = intrude(model, handshake, log, lambda: model(torch.ones(2, 3)))
    assert raised == []
    assert len(got) == 1
    assert torch.equal(got[0], torch.zeros(2, 3))  # Handshake doubles: the plain result
    # the other thread's call of the handshake opened and closed nothing; the first thread's pass is whole
    assert log.events == [
        ("start", "Sequential"),
        ("open", "", 0),
        ("open", "0", 0),
        ("return", "0", 0),
        ("open", "1", 0),
        ("return", "1", 0),
        ("open", "2", 0),
        ("return", "2", 0),
        ("return", "", 0),
        ("end", None),
    ]


class Doubling(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


@pytest.mark.parametrize("feature", ["trace", "detect_nonfinite", "watch_grads", "capture", "hooks"])
def test_every_feature_lets_a_second_thread_pass_through(feature: str) -> None:
    handshake = Handshake()
    model = track(nn.Sequential(nn.Linear(3, 3), handshake, nn.Linear(3, 3)))
    scopes: dict[str, Callable[[], Any]] = {
        "trace": lambda: hs.tracing(model),
        "detect_nonfinite": lambda: hs.detect_nonfinite(model),
        "watch_grads": lambda: hs.watch_grads(model, params=False),
        "capture": lambda: hs.capture(model, "*"),
        "hooks": lambda: hs.hooks(model, {"*": lambda module, args, output: None}, track_calls=True),
    }
    scope = scopes[feature]()
    x = torch.ones(2, 3, requires_grad=True)
    got, raised = intrude(model, handshake, scope, lambda: model(x).sum().backward())
    assert raised == []
    assert len(got) == 1
    assert torch.equal(got[0], torch.zeros(2, 3))
    if feature == "trace":
        rows = scope.trace.rows
        assert [(row.name, row.status, len(row.outputs)) for row in rows] == [
            ("", "ok", 1),
            ("0", "ok", 1),
            ("1", "ok", 1),
            ("2", "ok", 1),
        ]
        assert rows[2].outputs[0].shape == (2, 3)
    if feature == "capture":
        assert torch.equal(scope["1"], model[1](model[0](torch.ones(2, 3))))
    if feature == "watch_grads":  # the other thread's close of "1" took nothing from the first thread's pass
        step = scope.step()
        assert step is not None
        assert "1#0" in {record.layer for record in step.of("grad_output")}


@pytest.mark.parametrize("feature", ["trace", "monitor", "watch_grads"])
def test_a_replica_a_feature_cannot_keep_apart_is_refused_with_the_way_out(feature: str) -> None:
    """A DataParallel replica (a shallow copy sharing the hook dicts) entering a trace (or the
    training monitor's pass, in either of its forms) from another thread belongs to the pass yet
    cannot be told apart in it: refused, naming what works."""
    handshake = Handshake()
    model = track(nn.Sequential(nn.Linear(3, 3), handshake, nn.Linear(3, 3)))
    replica = model[2]._replicate_for_data_parallel()
    scopes: dict[str, Callable[[], Any]] = {
        "trace": lambda: hs.tracing(model),
        # the monitor's own recorder: its tripwire (hs.detect_nonfinite) would refuse first
        "monitor": lambda: hs.monitor(model, layers=["0", "1", "2"], names="modules", params=False, tripwire=False),
        "watch_grads": lambda: hs.watch_grads(model, params=False),
    }
    with scopes[feature]() as scope:
        other, raised = handshake.intruder(lambda: replica(torch.zeros(2, 3)))
        model(torch.ones(2, 3))
        other.join(timeout=30)
    assert len(raised) == 1
    error = raised[0]
    assert isinstance(error, hs.ConcurrentPassError)
    assert isinstance(error, RuntimeError)
    assert (error.feature, error.module) == (feature, "2")
    assert f"hs.{feature} records the forward pass of the thread that attached it" in str(error)
    assert error.args[0].endswith(REPLICAS_HINT)
    if feature == "trace":
        assert [row.name for row in scope.trace.rows] == ["", "0", "1", "2"]  # the refused close took nothing


class ReadsBack(CallRecorder[Watched, OpenCall[Watched]]):
    """Reads each output back to the host, and notes whether its hook body was being compiled."""

    feature = "reads_back"

    def __init__(self, model: nn.Module, *, escape: bool) -> None:
        self.seen: list[tuple[str, float, bool]] = []
        super().__init__(model, list(model.named_modules()), escape_compiled=escape)

    def open_call(self, site: Watched, call: int, handled: Handled, args: Args, kwargs: Kwargs) -> OpenCall[Watched]:
        return OpenCall(site, call, handled)

    def close_call(self, draft: OpenCall[Watched], output: Any) -> None:
        compiling = torch.compiler.is_compiling()
        self.seen.append((draft.site.name, 0.0 if compiling else float(output.sum()), compiling))


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """Compiled code made here must not outlive the test: later hooks on a Sequential would find it stale."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.compile
@pytest.mark.usefixtures("fresh_dynamo")
def test_an_escaping_recorder_runs_its_hooks_eagerly_inside_compiled_code() -> None:
    """The eager model is hooked and its torch.compile wrapper called: every hook body of an
    escaping recorder runs outside the graph, where values can be read back."""
    torch.manual_seed(0)
    model = track(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).eval())
    x = torch.randn(2, 3)
    with torch.no_grad(), ReadsBack(model, escape=True) as eager:
        model(x)
    compiled_model = torch.compile(model, backend="eager")
    with torch.no_grad(), ReadsBack(model, escape=True) as escaped:
        compiled_model(x)
    assert [name for name, _, _ in escaped.seen] == ["0", "1", "2", ""]
    assert not any(compiling for *_, compiling in escaped.seen)
    assert [value for _, value, _ in escaped.seen] == pytest.approx([value for _, value, _ in eager.seen])
    torch._dynamo.reset()
    compiled_model = torch.compile(model, backend="eager")
    with torch.no_grad(), ReadsBack(model, escape=False) as traced:
        compiled_model(x)
    assert any(compiling for *_, compiling in traced.seen)  # without the escape, Dynamo traces the body


# -- the blame rule -------------------------------------------------------------------------------------

# (name, inputs fine, output fine), in the order the calls returned
CALLS = [("embed", True, True), ("inherits", False, False), ("makes", True, False), ("later", True, False)]


def test_blame_is_the_first_call_with_fine_inputs_and_a_bad_output() -> None:
    def output_fine(call: tuple[str, bool, bool]) -> bool:
        return call[2]

    def inputs_fine(call: tuple[str, bool, bool]) -> bool:
        return call[1]

    assert blame(CALLS, output_fine=output_fine, inputs_fine=inputs_fine) == CALLS[2]
    verdicts = [(f.call[0], f.introduced) for f in findings(CALLS, output_fine=output_fine, inputs_fine=inputs_fine)]
    assert verdicts == [("inherits", False), ("makes", True), ("later", True)]
    assert blame(CALLS[:2], output_fine=output_fine, inputs_fine=inputs_fine) is None  # it came from outside
    assert blame(list(reversed(CALLS)), output_fine=output_fine, inputs_fine=inputs_fine) == CALLS[3]  # order rules


def test_only_minus_inf_in_a_mask_or_an_allowed_source_is_a_fine_input() -> None:
    assert fine_input("['attention_mask']", None, finite=False, negative_inf_only=True, allowed=())
    assert fine_input("[1]['causal_bias']", None, finite=False, negative_inf_only=True, allowed=())
    assert not fine_input("[0]", None, finite=False, negative_inf_only=True, allowed=())
    assert not fine_input("['attention_mask']", None, finite=False, negative_inf_only=False, allowed=())
    assert fine_input("[0]", "masker#0", finite=False, negative_inf_only=False, allowed={"masker"})
    assert not fine_input("[0]", "masker#0", finite=False, negative_inf_only=False, allowed={"mask"})


def leaves(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside a value (tuples, lists, dicts and transformers' ModelOutput), written anew here."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from leaves(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from leaves(item)


def finite(value: Any) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in leaves(value) if t.is_floating_point())


def reference_culprit(model: nn.Module, *args: Any, **kwargs: Any) -> str | None:
    """The first call to return with finite inputs and a non-finite output, from plain forward hooks."""
    returned: list[tuple[str, bool, bool]] = []
    handles = [
        module.register_forward_hook(
            lambda m, a, k, o, name=name: returned.append((name, finite((a, k)), finite(o))), with_kwargs=True
        )
        for name, module in model.named_modules()
    ]
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    culprits = [name for name, inputs_ok, output_ok in returned if inputs_ok and not output_ok]
    return culprits[0] if culprits else None


@pytest.fixture
def gpt2() -> nn.Module:
    pytest.importorskip("transformers")
    return tiny_gpt2()


@pytest.mark.slow
@pytest.mark.transformers
@pytest.mark.parametrize("culprit", ["h.0.attn.c_attn", "h.1.mlp.c_fc", "ln_f"])
def test_gpt2_nan_is_blamed_on_the_same_layer_as_plain_hooks_find(gpt2: nn.Module, culprit: str) -> None:
    ids = gpt2_input()
    with torch.no_grad():
        gpt2.get_submodule(culprit).weight.view(-1)[0] = math.nan
    expected = reference_culprit(gpt2, ids)
    assert expected == culprit  # the reference finds the layer whose weight was broken
    row = hs.trace(gpt2, ids).first_nonfinite()
    assert row is not None
    assert row.name == culprit
    with hs.detect_nonfinite(gpt2), pytest.raises(NonFiniteError) as raised, torch.no_grad():
        gpt2(ids)
    assert (raised.value.module, raised.value.call) == (culprit, 0)


@pytest.mark.transformers
def test_gpt2_nan_that_came_in_with_the_input_is_blamed_on_no_layer(gpt2: nn.Module) -> None:
    embeds = gpt2.wte(gpt2_input()).detach()
    embeds[0, 0, 0] = math.nan
    assert reference_culprit(gpt2, inputs_embeds=embeds) is None
    found = hs.trace(gpt2, inputs_embeds=embeds).first_nonfinite()
    assert found is not None
    assert found.from_input
    with hs.detect_nonfinite(gpt2), pytest.raises(NonFiniteError, match="came in with the input"), torch.no_grad():
        gpt2(inputs_embeds=embeds)


def within(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> bool:
    """hs.diff's rule, written anew: max|a - b| <= atol + rtol * max|a|."""
    return bool((a - b).abs().max() <= atol + rtol * a.abs().max())


def reference_divergence(a: nn.Module, b: nn.Module, ids: torch.Tensor, rtol: float, atol: float) -> tuple[str, bool]:
    """The first module, in the order b's calls return, whose output leaves tolerance, and whether its
    inputs were still within: from plain forward hooks on both models."""
    runs: list[list[tuple[str, list[torch.Tensor], list[torch.Tensor]]]] = []
    for model in (a, b):
        returned: list[tuple[str, list[torch.Tensor], list[torch.Tensor]]] = []
        handles = [
            module.register_forward_hook(
                lambda m, args, kw, out, name=name, returned=returned: returned.append(
                    (name, [t.clone() for t in leaves((args, kw))], [t.clone() for t in leaves(out)])
                ),
                with_kwargs=True,
            )
            for name, module in model.named_modules()
        ]
        with torch.no_grad():
            model(ids)
        for handle in handles:
            handle.remove()
        runs.append(returned)
    for (name, inputs_a, outputs_a), (_, inputs_b, outputs_b) in zip(*runs, strict=True):
        floats = [(x, y) for x, y in zip(outputs_a, outputs_b, strict=True) if x.is_floating_point()]
        if not all(within(x, y, rtol, atol) for x, y in floats):
            pairs = zip(inputs_a, inputs_b, strict=True)
            return name, all(within(x, y, rtol, atol) for x, y in pairs if x.is_floating_point())
    raise AssertionError("the two models agree everywhere")


@pytest.mark.transformers
@pytest.mark.parametrize(("changed", "introduced"), [("h.0.attn.c_proj", True), ("h.1.ln_2", True)])
def test_gpt2_first_divergence_is_where_plain_hooks_see_the_models_part(
    gpt2: nn.Module, changed: str, introduced: bool
) -> None:
    other = track(copy.deepcopy(gpt2))
    with torch.no_grad():
        other.get_submodule(changed).weight.mul_(1.01)
    ids = gpt2_input()
    expected = reference_divergence(gpt2, other, ids, rtol=1e-5, atol=1e-8)
    assert expected == (changed, introduced)
    divergence = hs.diff(gpt2, other, ids, rtol=1e-5, atol=1e-8).first_divergence()
    assert divergence is not None
    assert (divergence.row.name, divergence.introduced) == expected


@pytest.mark.transformers
def test_gpt2_a_difference_in_the_input_comes_in_at_the_first_layer(gpt2: nn.Module) -> None:
    """The embeddings differ: the first divergence is the first call, handed the difference."""
    embeds = gpt2.wte(gpt2_input()).detach()
    a_run = hs.run_with_capture(gpt2, layers=["drop", "h.0"], keep="both", inputs_embeds=embeds)[1]
    b_run = hs.run_with_capture(gpt2, layers=["drop", "h.0"], keep="both", inputs_embeds=embeds + 0.01)[1]
    divergence = hs.diff(a_run, b_run).first_divergence()
    assert divergence is not None
    assert divergence.row.name == "drop"
    assert divergence.introduced is False

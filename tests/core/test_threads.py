"""Threads: hookscope records, edits and checks the forwards of the thread that attached it, only.

The report (issue 18): a trace, edit or extract in one thread made every plain forward of the
same model in another thread (a serving thread) raise. Now another thread's forward passes
through untouched: not recorded, not edited, no error, and the owner's pass is not disturbed.
Each test holds the owner's pass open (a :class:`Gate` in the model) while another thread runs
40 forwards, so the overlap is real; the owner's results are checked against raw PyTorch hooks
in a single-threaded run, the other thread's against the model with no hooks at all.
"""

from __future__ import annotations

import _thread
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import hookscope as hs
from tests.models import track

FORWARDS = 40
WAIT = 30.0  # seconds: every wait is bounded


class Gate(nn.Module):
    """Passes its input on; on the thread it was told to hold, its first call waits there until
    the other thread is done, so that the other thread runs while that thread's pass is open."""

    def __init__(self) -> None:
        super().__init__()
        self.held: int | None = None  # the thread whose next call is held
        self.inside = threading.Event()
        self.go_on = threading.Event()

    def hold(self) -> None:
        """Hold this thread's next call."""
        self.inside.clear()
        self.go_on.clear()
        self.held = threading.get_ident()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.held == threading.get_ident():
            self.held = None
            self.inside.set()
            assert self.go_on.wait(timeout=WAIT), "the other thread never finished"
        return x


class Reciprocal(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 1 / x  # inf where x is 0: what detect_nonfinite blames


def build() -> tuple[nn.Sequential, Gate]:
    """``0`` Reciprocal, ``1`` Linear, ``2`` Gate, ``3`` ReLU, ``4`` Linear."""
    torch.manual_seed(0)
    gate = Gate()
    model = nn.Sequential(Reciprocal(), nn.Linear(4, 8), gate, nn.ReLU(), nn.Linear(8, 3))
    return track(model), gate  # type: ignore[return-value]


def owner_input(rows: int = 3) -> torch.Tensor:
    return torch.rand(rows, 4, generator=torch.Generator().manual_seed(1)) + 1


def other_inputs() -> list[torch.Tensor]:
    """The other thread's batches: 5 rows, where the owner's have 3, so a mix-up shows in shapes too."""
    generator = torch.Generator().manual_seed(2)
    return [torch.rand(5, 4, generator=generator) + 1 for _ in range(FORWARDS)]


def plain(model: nn.Module, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """What the model returns with no hooks (computed before anything is attached)."""
    with torch.no_grad():
        return [model(x) for x in inputs]


class Serving:
    """Another thread that, once the gate holds the owner's pass open, runs a plain forward of
    each input (with grad on, as a model is usually called), then lets the owner go on."""

    def __init__(self, model: nn.Module, gate: Gate, inputs: list[torch.Tensor]) -> None:
        self.outputs: list[torch.Tensor] = []
        self.errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._serve, args=(model, gate, inputs), name="serving")

    def _serve(self, model: nn.Module, gate: Gate, inputs: list[torch.Tensor]) -> None:
        try:
            if not gate.inside.wait(timeout=WAIT):
                raise AssertionError("the owner's pass never reached the gate")
            for x in inputs:
                try:
                    self.outputs.append(model(x).detach())
                except Exception as error:
                    self.errors.append(error)
        finally:
            gate.go_on.set()

    def __enter__(self) -> Serving:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._thread.join(timeout=2 * WAIT)
        assert not self._thread.is_alive()

    def check(self, expected: list[torch.Tensor]) -> None:
        """Every forward succeeded and returned exactly what the model returns with no hooks."""
        assert [repr(error) for error in self.errors] == []
        assert len(self.outputs) == len(expected) == FORWARDS
        assert all(torch.equal(got, want) for got, want in zip(self.outputs, expected, strict=True))


def raw_run(
    model: nn.Sequential, x: torch.Tensor, edits: dict[str, Callable[[torch.Tensor], torch.Tensor]] | None = None
) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor, torch.Tensor]]]:
    """The reference: one single-threaded forward with raw ``register_forward_hook``s; returns the
    output and ``(name, input, output)`` of every call of every module in the order calls ended,
    ``edits`` applied as forward hooks returning the new output."""
    seen: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    handles = []
    for name, module in model.named_modules():
        edit = (edits or {}).get(name)

        def hook(module: nn.Module, args: Any, output: Any, name: str = name, edit: Any = edit) -> Any:
            new = edit(output) if edit is not None else None
            seen.append((name, args[0], output if new is None else new))
            return new

        handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            out = model(x)
    finally:
        for handle in handles:
            handle.remove()
    return out, seen


class Other:
    """The other thread's 40 batches and what the model returns for them with no hooks, worked
    out when made: make it before attaching anything."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.inputs = other_inputs()
        self.expected = plain(model, self.inputs)

    def beside(self, gate: Gate, run: Callable[[], Any]) -> Any:
        """``run()`` on this thread, its first pass held open while the other thread runs its
        forwards; checks what the other thread got, and returns what ``run`` returned."""
        gate.hold()
        with Serving(self.model, gate, self.inputs) as serving:
            result = run()
        serving.check(self.expected)
        return result


def test_a_capture_keeps_only_the_owners_pass() -> None:
    model, gate = build()
    x = owner_input()
    out, reference = raw_run(model, x)
    other = Other(model)
    with hs.capture(model, ["1", "4"], keep="both", passes="all") as cap:
        got = other.beside(gate, lambda: model(x))
    assert torch.equal(got, out)
    assert len(cap.passes) == 1  # the other thread's 40 forwards are no passes here
    expected = {name: (inp, output) for name, inp, output in reference if name in ("1", "4")}
    assert sorted(cap) == ["1#0:input[0]", "1#0:output", "4#0:input[0]", "4#0:output"]
    for name, (inp, output) in expected.items():
        assert torch.equal(cap[f"{name}:input[0]"], inp)
        assert torch.equal(cap[f"{name}:output"], output)


def test_a_trace_counts_the_owners_calls_only() -> None:
    model, gate = build()
    x = owner_input()
    _, reference = raw_run(model, x)
    trace = Other(model).beside(gate, lambda: hs.trace(model, x))
    ended = [(name, tuple(output.shape)) for name, _, output in reference]
    assert sorted((row.name, row.outputs[0].shape) for row in trace.rows) == sorted(ended)
    assert [row.call for row in trace.rows] == [0] * len(reference)  # one call each: the owner's
    for name, _, output in reference:
        stats = trace[name].outputs[0].stats
        assert stats is not None
        assert (stats.min, stats.max) == pytest.approx((output.min().item(), output.max().item()))


def test_an_edit_applies_to_the_owner_and_never_leaks_into_the_other_thread() -> None:
    model, gate = build()
    x = owner_input()
    edited, _ = raw_run(model, x, edits={"3": lambda value: value * 0.5})
    other = Other(model)  # the other thread's outputs must equal the unedited model's
    out, editor = other.beside(gate, lambda: hs.run_with_edits(model, x, edits={"3": hs.edits.scale(0.5)}))
    assert torch.equal(out.detach(), edited)
    assert editor.applied == {"3": 1}


def test_detect_nonfinite_checks_the_owner_only() -> None:
    model, gate = build()
    x = owner_input()
    x[1, 2] = 0.0  # 1 / 0: the Reciprocal makes an inf from a finite input
    _, reference = raw_run(model, x)
    culprit = next(
        name for name, inp, output in reference if torch.isfinite(inp).all() and not torch.isfinite(output).all()
    )
    other = Other(model)
    with pytest.raises(hs.NonFiniteError) as raised, hs.detect_nonfinite(model):
        other.beside(gate, lambda: model(x))
    assert (raised.value.module, raised.value.call, raised.value.posinf) == (culprit, 0, 1)
    with hs.detect_nonfinite(model):  # a finite pass beside the other thread: nothing to report
        other.beside(gate, lambda: model(owner_input()))


def test_a_diff_runs_beside_another_thread() -> None:
    model, gate = build()
    twin, _ = build()
    x = owner_input()
    _, reference = raw_run(model, x)
    diff = Other(model).beside(gate, lambda: hs.diff(model, twin, x, layers="*"))
    assert diff.within()
    shapes = {name: tuple(output.shape) for name, _, output in reference if name}
    assert {row.name: row.shape for row in diff.rows} == shapes


def test_watch_grads_records_the_owners_calls_only() -> None:
    model, gate = build()
    x = owner_input().requires_grad_()
    grads: dict[str, torch.Tensor] = {}

    def keep(module: nn.Module, grad_input: Any, grad_output: Any, name: str) -> None:
        grads[name] = grad_output[0]

    handles = [
        module.register_full_backward_hook(lambda m, gi, go, name=name: keep(m, gi, go, name))
        for name, module in model.named_children()
    ]
    try:
        model(x).square().sum().backward()
    finally:
        for handle in handles:
            handle.remove()
    model.zero_grad()
    other = Other(model)
    with hs.watch_grads(model, params=False) as monitor:
        other.beside(gate, lambda: model(x).square().sum().backward())
        step = monitor.step()
    assert step is not None
    records = {record.layer: record for record in step.of("grad_output") if record.module}
    assert sorted(records) == sorted(f"{name}#0" for name in grads)
    for name, grad in grads.items():
        assert records[f"{name}#0"].count == grad.numel()
        assert records[f"{name}#0"].max_abs == pytest.approx(grad.abs().max().item())


def test_extract_stores_the_owners_rows_only(tmp_path: Path) -> None:
    model, gate = build()
    data = torch.rand(8, 4, generator=torch.Generator().manual_seed(3)) + 1
    expected = {"1": [], "4": []}  # type: dict[str, list[torch.Tensor]]
    for batch in data.split(4):
        _, reference = raw_run(model, batch)
        for name, _, output in reference:
            if name in expected:
                expected[name].append(output)
    store = Other(model).beside(
        gate,
        lambda: hs.extract(
            model, data, tmp_path / "f.zarr", layers=["1", "4"], progress=False, batch_size=4, chunk_rows=4
        ),
    )
    for name, parts in expected.items():
        stored = store[name][:]
        assert stored.shape[0] == len(data)
        assert np.array_equal(stored, torch.cat(parts).numpy())


def test_a_group_counting_calls_names_the_rule_to_another_threads_hook() -> None:
    model, gate = build()
    x = owner_input()
    seen: list[tuple[str, object]] = []
    group: hs.HookGroup

    def note(module: nn.Module, args: Any, output: Any) -> None:
        try:
            seen.append((threading.current_thread().name, group.call_index(module)))
        except hs.errors.SpecError as error:
            seen.append((threading.current_thread().name, str(error)))

    other = Other(model)
    with hs.hooks(model, {"4": note}, track_calls=True) as group:
        other.beside(gate, lambda: model(x))
        assert group.calls["4"] == 1  # the owner's pass only
    assert [text for name, text in seen if name == "MainThread"] == [0]
    others = [text for name, text in seen if name == "serving"]
    assert len(others) == FORWARDS  # plain hooks run on every thread, as PyTorch runs them
    assert all("the thread that attached the hooks" in str(text) for text in others)


def test_a_capture_attached_on_one_thread_and_run_on_another_says_so() -> None:
    model, _ = build()
    with hs.capture(model, "1") as cap, hs.tracing(model) as tracer:
        worker = threading.Thread(target=lambda: model(owner_input()))
        worker.start()
        worker.join(timeout=WAIT)
    assert len(cap) == 0
    with pytest.raises(hs.errors.SiteNotFoundError, match="on the thread that made it"):
        cap["1"]
    with pytest.raises(hs.errors.SpecError, match="forwards on other threads pass through"):
        tracer.trace  # noqa: B018


# -- a checkpointed block recomputing in backward -----------------------------------------------------


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        self.gate = Gate()
        self.head = nn.Linear(4, 1)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = checkpoint(self.block, x, use_reentrant=self.reentrant)
        return self.head(self.gate(hidden))  # type: ignore[no-any-return]


def gradients(model: Checkpointed, x: torch.Tensor, *, backward: Callable[[torch.Tensor], None]) -> list[torch.Tensor]:
    model.zero_grad()
    loss = model(x).square().sum()
    backward(loss)
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def half_tanh(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    return output * 0.5


@pytest.fixture
def edited_reference() -> Callable[[Checkpointed, torch.Tensor], list[torch.Tensor]]:
    def reference(model: Checkpointed, x: torch.Tensor) -> list[torch.Tensor]:
        handle = model.block[1].register_forward_hook(half_tanh)  # applied in the forward and its recomputation
        try:
            return gradients(model, x, backward=lambda loss: loss.backward())
        finally:
            handle.remove()

    return reference


def on_an_autograd_thread(loss: torch.Tensor) -> None:
    """``loss.backward()`` on a thread that Python's ``threading`` did not start, as autograd's
    device threads are (on CUDA the backward, and a checkpoint's recomputation, run there)."""
    done = threading.Event()
    raised: list[BaseException] = []

    def run() -> None:
        try:
            loss.backward()
        except BaseException as error:
            raised.append(error)
        finally:
            done.set()

    _thread.start_new_thread(run, ())
    assert done.wait(timeout=WAIT)
    if raised:
        raise raised[0]


@pytest.mark.parametrize("reentrant", [True, False])
def test_an_edit_applies_when_a_checkpoint_recomputes_on_autograds_thread(
    reentrant: bool, edited_reference: Callable[[Checkpointed, torch.Tensor], list[torch.Tensor]]
) -> None:
    """The owner's backward runs on another thread (autograd's, on CUDA) while yet another
    thread holds a forward of the model open: the recomputation is still the owner's, edited."""
    model = track(Checkpointed(reentrant))
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(4), requires_grad=True)
    expected = edited_reference(model, x)
    plain_grads = gradients(model, x, backward=lambda loss: loss.backward())
    assert not all(torch.equal(a, b) for a, b in zip(expected, plain_grads, strict=True))
    with hs.edit(model, {"block.1": hs.edits.scale(0.5)}) as editor:
        model.zero_grad()
        loss = model(x).square().sum()
        gate = model.gate

        def other_forward() -> None:
            gate.hold()  # the other thread's own forward waits at the gate ...
            model(x)

        other = threading.Thread(target=other_forward)
        other.start()
        assert gate.inside.wait(timeout=WAIT)
        try:
            on_an_autograd_thread(loss)  # ... while the owner's backward recomputes the block
        finally:
            model.gate.go_on.set()
            other.join(timeout=WAIT)
        got = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert editor.applied == {"block.1": 1}  # the forward; the recomputation is edited, not counted


@pytest.mark.parametrize("reentrant", [True, False])
def test_another_threads_checkpointed_backward_is_not_edited(
    reentrant: bool, edited_reference: Callable[[Checkpointed, torch.Tensor], list[torch.Tensor]]
) -> None:
    model = track(Checkpointed(reentrant))
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(4), requires_grad=True)
    expected = gradients(model, x, backward=lambda loss: loss.backward())
    got: list[list[torch.Tensor]] = []
    with hs.edit(model, {"block.1": hs.edits.scale(0.5)}) as editor:
        other = threading.Thread(target=lambda: got.append(gradients(model, x, backward=lambda loss: loss.backward())))
        other.start()
        other.join(timeout=WAIT)
        mine = gradients(model, x, backward=lambda loss: loss.backward())
    assert len(got) == 1
    assert all(torch.equal(a, b) for a, b in zip(got[0], expected, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(mine, edited_reference(model, x), strict=True))
    assert editor.applied == {"block.1": 1}


# -- a real model ------------------------------------------------------------------------------------


@pytest.mark.transformers
@pytest.mark.slow
def test_gpt2_served_on_one_thread_while_another_captures_edits_and_traces() -> None:
    from transformers import GPT2Config, GPT2Model

    class Served(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.gate = Gate()
            self.gpt = GPT2Model(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100)).eval()

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.gpt(self.gate(ids)).last_hidden_state  # type: ignore[no-any-return]

    model = track(Served())
    gate: Gate = model.gate  # type: ignore[assignment]
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 100, (2, 7), generator=generator)
    inputs = [torch.randint(0, 100, (3, 5), generator=generator) for _ in range(FORWARDS)]
    expected = plain(model, inputs)

    kept: dict[str, torch.Tensor] = {}

    def keep_h0(module: nn.Module, args: Any, output: Any) -> None:
        kept["h0"] = output[0] if isinstance(output, tuple) else output

    def half(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return output * 0.5

    handles = [model.gpt.h[1].mlp.register_forward_hook(half), model.gpt.h[0].register_forward_hook(keep_h0)]
    try:
        with torch.no_grad():
            reference = model(ids)
    finally:
        for handle in handles:
            handle.remove()

    gate.hold()
    with (
        torch.no_grad(),
        hs.edit(model, {"gpt.h.1.mlp": hs.edits.scale(0.5)}) as editor,
        hs.capture(model, "gpt.h.0", passes="all") as cap,
        hs.tracing(model, layers="gpt.h.*") as tracer,
        Serving(model, gate, inputs) as serving,
    ):
        out = model(ids)
    serving.check(expected)
    assert torch.equal(out, reference)
    assert editor.applied == {"gpt.h.1.mlp": 1}
    assert len(cap.passes) == 1
    h0 = cap["gpt.h.0"] if "gpt.h.0" in cap else cap["gpt.h.0:output[0]"]
    assert torch.equal(h0, kept["h0"])
    rows = tracer.trace.rows
    assert [(row.name, row.call) for row in rows if row.name.count(".") == 2] == [("gpt.h.0", 0), ("gpt.h.1", 0)]

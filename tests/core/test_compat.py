"""Where real models run: activation checkpointing, generation loops, torch.fx and torch.export.

Each setting either works correctly or is refused with the fix in the message (docs/compatibility.md).
"""

from __future__ import annotations

import ast
import contextlib
import copy
import os
import re
import threading
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

import hookscope as hs
from hookscope._core.compat import private
from hookscope._core.live_hooks import attached
from hookscope._core.select import select_names
from tests.models import Handshake, track


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.linear(x))


class Checkpointed(nn.Module):
    """Three blocks, each run through torch.utils.checkpoint (or not, for the reference)."""

    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x) if self.reentrant is None else checkpoint(block, x, use_reentrant=self.reentrant)
        return x.pow(2).sum()


MODES = [pytest.param(True, id="reentrant"), pytest.param(False, id="non-reentrant")]


@pytest.mark.parametrize("reentrant", MODES)
def test_recomputation_adds_no_capture_and_replaces_none(reentrant: bool) -> None:
    model, plain = track(Checkpointed(reentrant)), track(Checkpointed(None))
    x = torch.randn(4, 6, requires_grad=True)
    with hs.capture(model, "blocks.*.linear") as cap:
        model(x).backward()  # backward recomputes every block's forward
    with hs.capture(plain, "blocks.*.linear") as reference:
        plain(x)
    assert list(cap.cache) == list(reference.cache) == [f"blocks.{i}.linear#0:output" for i in range(3)]
    for key in reference.cache:
        torch.testing.assert_close(cap.cache[key], reference.cache[key], rtol=0, atol=0)


@pytest.mark.parametrize("reentrant", MODES)
def test_a_trace_is_of_the_forward_not_the_recomputation(reentrant: bool) -> None:
    model, plain = track(Checkpointed(reentrant)), track(Checkpointed(None))
    x = torch.randn(4, 6, requires_grad=True)
    with hs.tracing(model) as tracer:
        model(x).backward()
    with hs.tracing(plain) as reference:
        plain(x)
    assert [row.site for row in tracer.trace] == [row.site for row in reference.trace]
    assert len(tracer.trace) == 10  # the root, three blocks of two layers each, and the blocks
    for ours, theirs in zip(tracer.trace, reference.trace, strict=True):
        assert ours.stats == theirs.stats


@pytest.mark.parametrize("reentrant", MODES)
def test_gradients_of_checkpointed_blocks_are_recorded_once_per_call(reentrant: bool) -> None:
    model, plain = track(Checkpointed(reentrant)), track(Checkpointed(None))
    x = torch.randn(4, 6, requires_grad=True)  # reentrant checkpointing needs an input that requires grad
    for net in (model, plain):
        with hs.watch_grads(net, layers=nn.Linear) as monitor:
            net(x).backward()
            monitor.step()
        net.monitor = monitor  # type: ignore[assignment]
    ours = model.monitor.records[-1].of("grad_output")  # type: ignore[union-attr,operator]
    theirs = plain.monitor.records[-1].of("grad_output")  # type: ignore[union-attr,operator]
    assert [r.layer for r in ours] == [r.layer for r in theirs]
    assert sorted(r.layer for r in ours) == ["blocks.0.linear#0", "blocks.1.linear#0", "blocks.2.linear#0"]
    for a, b in zip(ours, theirs, strict=True):
        assert a.norm == pytest.approx(b.norm, rel=1e-6)


@pytest.mark.parametrize("reentrant", MODES)
def test_edits_apply_in_the_recomputation_too(reentrant: bool) -> None:
    model, plain = track(Checkpointed(reentrant)), track(Checkpointed(None))
    x = torch.randn(4, 6, requires_grad=True)
    grads = []
    for net in (model, plain):
        with hs.edit(net, {"blocks.1.linear": hs.edits.scale(0.5)}):
            net(x).backward()
        grads.append(net.blocks[0].linear.weight.grad.clone())  # type: ignore[union-attr,index]
    torch.testing.assert_close(grads[0], grads[1])  # a recomputation without the edit would differ


@pytest.mark.transformers
def test_transformers_gradient_checkpointing() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)
    model = track(GPT2Model(config))
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    model.train()
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with hs.capture(model, r"re:h\.\d+$") as cap, hs.watch_grads(model, layers=r"re:h\.\d+$") as monitor:
        model(input_ids=ids).last_hidden_state.sum().backward()
        monitor.step()
    assert list(cap.cache) == ["h.0#0:output", "h.1#0:output"]
    assert sorted(r.layer for r in monitor.records[-1].of("grad_output")) == ["h.0#0", "h.1#0"]  # once each


@pytest.mark.transformers
def test_a_generation_loop_keeps_one_cache_per_forward() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0, pad_token_id=0
    )
    model = track(GPT2LMHeadModel(config).eval())
    ids = torch.randint(1, 64, (1, 6), generator=torch.Generator().manual_seed(0))
    with hs.capture(model, r"re:transformer\.h\.\d+$", calls="all", passes="all") as cap:
        out = model.generate(ids, max_new_tokens=5, do_sample=False)  # type: ignore[operator]
    assert out.shape == (1, 11)
    shapes = [tuple(cache["transformer.h.1"].shape) for cache in cap.passes]
    assert shapes == [(1, 6, 32)] + [(1, 1, 32)] * 4  # the prefill, then one token per step
    assert all(list(cache) == ["transformer.h.0#0:output", "transformer.h.1#0:output"] for cache in cap.passes)
    assert cap.cache is cap.passes[-1]
    with hs.capture(model, "transformer.h.0") as latest:
        model.generate(ids, max_new_tokens=3, do_sample=False)  # type: ignore[operator]
    assert len(latest.passes) == 1  # by default each call of the model replaces the cache
    assert latest["transformer.h.0"].shape == (1, 1, 32)
    with pytest.raises(hs.SpecError, match="passes='every'"):
        hs.capture(model, "transformer.h.0", passes="every")


def test_a_budget_spans_every_kept_pass() -> None:
    model = track(nn.Sequential(nn.Linear(4, 256)))
    with hs.capture(model, "0", passes="all", max_bytes=2500) as cap:
        model(torch.randn(1, 4))
        model(torch.randn(1, 4))
        with pytest.raises(hs.CaptureError):
            model(torch.randn(1, 4))  # three passes of 1 KiB each outgrow 3 KiB with the cache overhead
    assert len(cap.passes) == 2


def test_an_exported_program_is_refused_with_what_works() -> None:
    eager = track(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).eval())
    unlifted = torch.export.export(eager, (torch.randn(2, 4),)).module()
    for attach in (lambda: hs.capture(unlifted, "*"), lambda: hs.trace(unlifted, torch.randn(2, 4))):
        with pytest.raises(hs.UnsupportedModelError, match=r"never calls '0', '2'.*ExportedProgram.module\(\)"):
            attach()
    assert attached(unlifted) == []
    with hs.capture(unlifted, "") as root:  # the whole program's output still works
        unlifted(torch.randn(2, 4))
    assert root.cache["#0:output"].shape == (2, 2)


def test_an_fx_traced_model_hooks_its_leaves_and_refuses_its_containers() -> None:
    eager = track(nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 2)))
    traced = torch.fx.symbolic_trace(copy.deepcopy(eager))
    x = torch.randn(3, 4)
    _, cache = hs.run_with_capture(traced, x, layers=nn.Linear)
    _, reference = hs.run_with_capture(eager, x, layers=nn.Linear)
    assert list(cache) == list(reference)
    with pytest.raises(hs.UnsupportedModelError, match="never calls '0'"):
        hs.capture(traced, "0")


def test_a_second_thread_inside_a_pass_passes_through_and_the_first_pass_is_whole() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Handshake(), nn.Linear(3, 3))
    first, second = torch.ones(2, 3), torch.zeros(2, 3)
    with torch.no_grad():
        plain = model[1](second * 2)
    got: list[torch.Tensor] = []
    with hs.capture(model, "1", passes="all") as cap:
        other, raised = model[0].intruder(lambda: got.append(model(second)))
        out = model(first)
        other.join(timeout=30)
    assert raised == []
    assert len(got) == 1
    assert torch.equal(got[0].detach(), plain)
    assert len(cap.passes) == 1  # and not captured
    torch.testing.assert_close(cap["1"], out)
    assert attached(model) == []


def test_threads_racing_on_one_model_never_mix_into_the_capturing_threads_passes() -> None:
    """Many threads calling the model at once, one of them capturing: its passes are its own,
    whole, and every other thread's forward passes through."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    inputs = [torch.full((4, 16), float(i)) for i in range(8)]
    with torch.no_grad():
        expected = [model(x) for x in inputs]
    start = threading.Barrier(len(inputs))
    wrong: list[int] = []
    kept: list[hs.Capture] = []

    def run(i: int) -> None:
        with torch.no_grad(), contextlib.ExitStack() as stack:
            if i == 0:  # attached on this thread: it records this thread's passes
                kept.append(stack.enter_context(hs.capture(model, ["0", "2"], keep="both", passes="all")))
            start.wait(timeout=30)
            for _ in range(20):
                if not torch.equal(model(inputs[i]), expected[i]):
                    wrong.append(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert wrong == []
    (cap,) = kept
    assert len(cap.passes) == 20
    for cache in cap.passes:
        assert torch.equal(cache["0:input[0]"], inputs[0])
        assert torch.equal(cache["2:output"], expected[0])


def test_data_parallel_on_the_cpu_names_and_captures_as_the_model() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
    parallel = nn.DataParallel(model)  # no GPU: it calls the model directly
    x = torch.randn(2, 3)
    assert [row.name for row in hs.layers(parallel).rows] == ["", "module", "0", "1"]
    with hs.capture(parallel, ["module.0", "1"]) as cap:
        out = parallel(x)
    torch.testing.assert_close(cap["0"], model[0](x))
    torch.testing.assert_close(cap["module.1"], out)


class Meet(nn.Module):
    """Every replica waits here for the others: their passes overlap for sure."""

    def __init__(self, parties: int) -> None:
        super().__init__()
        self.barrier = threading.Barrier(parties)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.barrier.wait(timeout=30)
        return x


def replica_on(module: nn.Module, device: str) -> nn.Module:
    """What ``torch.nn.parallel.replicate`` makes for one device (shallow copies sharing the
    original's hook dicts, the weights as plain tensors on that device), without CUDA."""
    replica = module._replicate_for_data_parallel()
    for name, parameter in module._parameters.items():
        if parameter is not None:
            setattr(replica, name, parameter.detach().to(device))
    for name, child in module._modules.items():
        if child is not None:
            replica._modules[name] = replica_on(child, device)
    return replica


class ThreadedDataParallel(nn.DataParallel):
    """nn.DataParallel's forward -- replicate, one thread per replica, all at once -- on the CPU
    and the meta device, which need no GPU; the outputs are returned per replica."""

    def __init__(self, module: nn.Module, devices: list[str], *, one_by_one: bool = False) -> None:
        super().__init__(module)
        self.replica_devices = devices
        self.one_by_one = one_by_one  # each thread started after the last ended: Python reuses its ident

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        chunks = x.chunk(len(self.replica_devices))
        results: dict[int, torch.Tensor | BaseException] = {}

        def run(index: int, device: str) -> None:
            try:
                results[index] = replica_on(self.module, device)(chunks[index].to(device))
            except BaseException as error:  # re-raised on the calling thread, as parallel_apply does
                results[index] = error

        threads = [threading.Thread(target=run, args=(i, d)) for i, d in enumerate(self.replica_devices)]
        for thread in threads:
            thread.start()
            if self.one_by_one:
                thread.join(timeout=60)
        for thread in threads:
            thread.join(timeout=60)
        for value in results.values():
            if isinstance(value, BaseException):
                raise value
        return tuple(results[i] for i in range(len(threads)))  # type: ignore[misc]


def replicated_model() -> tuple[nn.Sequential, ThreadedDataParallel]:
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, Meet(parties=2), nn.ReLU(), shared)  # `shared` runs twice per replica
    return model, ThreadedDataParallel(model, ["cpu", "meta"])


def test_threaded_data_parallel_replicas_are_captured_per_device() -> None:
    model, parallel = replicated_model()
    x = torch.randn(6, 4)
    with hs.capture(parallel, ["0", "2"], calls="all") as cap:
        on_cpu, on_meta = parallel(x)
    assert sorted(cap.replicas) == ["cpu", "meta"]
    cpu = cap.replicas["cpu"]
    assert sorted(cpu) == ["0#0:output", "0#1:output", "2#0:output"]  # each replica numbers its own calls
    first = model[0](x[:3])
    torch.testing.assert_close(cpu["0#0"], first)
    torch.testing.assert_close(cpu["2"], torch.relu(first))
    torch.testing.assert_close(cpu["0#1"], on_cpu)
    meta = cap.replicas["meta"]
    assert sorted(meta) == sorted(cpu)
    assert meta["0#1"].device.type == "meta"
    assert meta["0#1"].shape == on_meta.shape == (3, 4)
    assert len(cap.cache) == 0  # the wrapper's own thread ran none of the selected modules
    assert attached(parallel) == []


def test_edits_apply_inside_every_replica() -> None:
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, Meet(parties=2), nn.ReLU(), shared)
    parallel = ThreadedDataParallel(model, ["cpu", "cpu"])  # edits keep nothing per device: both may share one
    x = torch.randn(6, 4)
    with hs.edit(parallel, {"2": hs.edits.zero()}):
        first, second = parallel(x)
    torch.testing.assert_close(first, model[0](torch.zeros(3, 4)))
    torch.testing.assert_close(second, model[0](torch.zeros(3, 4)))


def test_hooks_on_the_model_inside_data_parallel_are_refused_with_the_way_out() -> None:
    """Without the wrapper hooked, a replica would open the pass and the others would join it
    part-way: the values would mix. The first replica to start is refused instead."""
    model, parallel = replicated_model()
    for scope in (lambda: hs.capture(model, "0"), lambda: hs.edit(model, {"0": hs.edits.zero()})):
        refused = pytest.raises(hs.errors.UnsupportedModelError, match="attach to the DataParallel wrapper itself")
        with refused, scope():
            parallel(torch.randn(6, 4))
        assert attached(model) == []


def test_replicas_with_every_pass_kept_are_refused() -> None:
    _, parallel = replicated_model()
    with pytest.raises(hs.errors.CaptureError, match="passes='all'"), hs.capture(parallel, "0", passes="all"):
        parallel(torch.randn(6, 4))


def test_a_trace_of_threaded_replicas_is_refused_with_the_way_out() -> None:
    _, parallel = replicated_model()
    with pytest.raises(hs.HookscopeError, match="DataParallel's replicas run in threads: hs.capture"):
        hs.trace(parallel, torch.randn(6, 4))
    assert attached(parallel) == []


def test_two_replicas_on_one_device_are_refused() -> None:
    torch.manual_seed(0)
    parallel = ThreadedDataParallel(nn.Sequential(nn.Linear(4, 4)), ["cpu", "cpu"])  # one pass, even one by one
    refused = pytest.raises(hs.errors.CaptureError, match="two DataParallel replicas ran on cpu")
    with refused, hs.capture(parallel, "0"):
        parallel(torch.randn(4, 4))


def test_replicas_run_one_after_another_are_still_told_apart() -> None:
    """A thread's ident is reused by the next thread once it has ended; replicas are kept apart
    by the thread itself, so the second replica neither joins the first's cache nor its count."""
    torch.manual_seed(0)
    parallel = ThreadedDataParallel(nn.Sequential(nn.Linear(4, 4)), ["cpu", "meta"], one_by_one=True)
    x = torch.randn(4, 4)
    with hs.capture(parallel, "0") as cap:
        parallel(x)
    assert sorted(cap.replicas) == ["cpu", "meta"]
    torch.testing.assert_close(cap.replicas["cpu"]["0"], parallel.module(x[:2]))
    assert cap.replicas["meta"]["0"].device.type == "meta"
    same = ThreadedDataParallel(nn.Sequential(nn.Linear(4, 4)), ["cpu", "cpu"], one_by_one=True)
    with pytest.raises(hs.errors.CaptureError, match="two DataParallel replicas ran on cpu"), hs.capture(same, "0"):
        same(x)


def test_a_wrapped_models_own_module_attribute_keeps_its_own_name() -> None:
    class Averaged(nn.Module):  # an EMA-style holder whose model attribute is also called `module`
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
            self.scale = nn.Identity()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.scale(self.module(x))

    parallel = nn.DataParallel(Averaged())
    names = [row.name for row in hs.layers(parallel).rows]
    assert names == ["", "module", "module.module", "module.module.0", "module.module.1", "scale"]
    assert len(set(names)) == len(names)
    x = torch.randn(3, 2)
    with hs.capture(parallel, ["module", "module.module"]) as cap:
        out = parallel(x)
    torch.testing.assert_close(cap["module"], out)
    torch.testing.assert_close(cap["module.module"], parallel.module.module(x))


def test_a_trace_reads_back_under_the_wrappers_spelling_too() -> None:
    parallel = nn.DataParallel(nn.Sequential(nn.Linear(2, 2)))
    trace = hs.trace(parallel, torch.randn(1, 2))
    assert trace["module.0"] is trace["0"]
    with pytest.raises(hs.SelectionError, match="did you mean '0'"):
        select_names([row.name for row in trace.rows], "module.0")


def test_a_wrapped_and_a_bare_model_diff_alike_either_way_round() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    x = torch.randn(2, 3)
    assert hs.diff(nn.DataParallel(model), model, x, layers="*").within()
    assert hs.diff(model, nn.DataParallel(model), x, layers="*").within()


def test_a_bare_models_trace_never_reads_a_wrappers_spelling() -> None:
    class Holder(nn.Module):  # its own attribute is called `module`; it is no wrapper
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(2, 2)
            self.head = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.module(x))

    trace = hs.trace(Holder(), torch.randn(1, 2))
    assert trace["module"].name == "module"
    with pytest.raises(hs.errors.SiteNotFoundError):
        trace["module.head"]


# -- the private torch API, one accessor at a time (hookscope._core.compat.private) ----------------


class _Seen(TorchFunctionMode):
    """Counts the torch calls it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_the_mode_stack_reads_as_a_with_block_pushes() -> None:
    before = private.mode_stack_depth()
    with _Seen() as mode:
        assert private.mode_stack_depth() == before + 1
        assert private.mode_at(before) is mode
    assert private.mode_stack_depth() == before


def test_a_pushed_mode_sees_torch_calls_until_popped() -> None:
    mode = _Seen()
    private.push_mode(mode)
    try:
        torch.ones(2).add(1)
    finally:
        popped = private.pop_mode()
    assert popped is mode
    assert mode.calls >= 2
    seen = mode.calls
    torch.ones(2).add(1)
    assert mode.calls == seen


def test_torch_functions_off_hides_calls_from_every_mode() -> None:
    with _Seen() as mode:
        with private.torch_functions_off():
            torch.ones(2).add(1)
        assert mode.calls == 0
        torch.ones(2).add(1)
        assert mode.calls >= 1


def test_the_graph_task_id_is_minus_one_outside_a_backward_and_one_per_backward() -> None:
    assert private.graph_task_id() == -1
    seen: list[int] = []
    weight = torch.ones(3, requires_grad=True)
    weight.register_hook(lambda grad: seen.append(private.graph_task_id()))
    (weight * 2).sum().backward()
    (weight * 3).sum().backward()
    assert len(seen) == 2
    assert -1 not in seen
    assert seen[0] != seen[1]


def test_foreach_norm_equals_one_vector_norm_per_tensor() -> None:
    torch.manual_seed(0)
    tensors = [torch.randn(5), torch.randn(2, 3)]
    assert torch.equal(
        torch.stack(private.foreach_norm(tensors)), torch.stack([torch.linalg.vector_norm(t) for t in tensors])
    )
    half = [t.to(torch.bfloat16) for t in tensors]
    wide = private.foreach_norm(half, torch.float32)
    assert all(norm.dtype == torch.float32 for norm in wide)
    expected = torch.stack([torch.linalg.vector_norm(t.float()) for t in half])
    torch.testing.assert_close(torch.stack(wide), expected)


def test_a_zero_tensor_is_told_from_plain_memory() -> None:
    zero = torch._efficientzerotensor(3)  # the reference: autograd's own constructor
    assert private.is_zero_tensor(zero)
    assert not private.is_zero_tensor(torch.zeros(3))


def test_op_overload_types_tell_overloads_and_packets_from_python_functions() -> None:
    overload, packet = private.op_overload_types()
    assert isinstance(torch.ops.aten.add.Tensor, overload)
    assert isinstance(torch.ops.aten.add, packet)
    assert not isinstance(torch.add, (overload, packet))


def test_the_optimized_module_class_is_the_class_of_a_compile_wrapper() -> None:
    wrapper = torch.compile(nn.Linear(2, 2), backend="eager")  # made, never run: nothing is compiled
    cls = private.optimized_module_class()
    assert cls is not None
    assert type(wrapper) is cls


def test_dynamo_config_holds_the_hook_guard_setting() -> None:
    import torch._dynamo.config as reference

    config = private.dynamo_config()
    assert config is reference
    assert isinstance(config.skip_nnmodule_hook_guards, bool)


def test_dynamo_errors_are_dynamos_exception_types() -> None:
    from torch._dynamo import exc

    limit, failure = private.dynamo_errors()
    assert issubclass(failure, Exception)
    assert failure is exc.TorchDynamoException
    assert limit is getattr(exc, "FailOnRecompileLimitHit", limit)


@pytest.mark.compile
@pytest.mark.slow
def test_compiled_code_is_found_by_its_code_object() -> None:
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    def never(x: torch.Tensor) -> torch.Tensor:
        return x * 3

    torch.compile(double, backend="eager")(torch.ones(2))
    codes = private.compiled_code_objects()
    if codes is not None:
        assert double.__code__ in codes
        assert never.__code__ not in codes
    assert private.has_compiled_code(double.__code__) is True
    assert private.has_compiled_code(never.__code__) is False


@pytest.mark.compile
@pytest.mark.slow
def test_every_compile_wrapper_runs_through_one_code_object() -> None:
    code = private.wrapper_code()
    assert code is not None
    torch.compile(nn.Linear(2, 2), backend="eager")(torch.ones(1, 2))
    assert private.has_compiled_code(code) is True


def test_no_module_but_compat_reads_torchs_private_api() -> None:
    """``torch._C``, ``torch._ops``, ``torch._dynamo`` and ``torch._foreach_*`` are read in
    ``_core/compat/`` only (text in docstrings, comments and messages aside)."""
    package = Path(hs.__file__).parent
    private_use = re.compile(r"torch\._(C|ops|dynamo|foreach_\w+|efficientzerotensor)\b|\._is_zerotensor\b")
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.parent.name == "compat":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Attribute, ast.ImportFrom, ast.Import)):
                text = ast.unparse(node)
                if private_use.search(text) or (isinstance(node, ast.ImportFrom) and "torch._" in (node.module or "")):
                    found.append(f"{path.relative_to(package)}:{node.lineno}: {text}")
    assert found == [], "\n".join(dict.fromkeys(found))

"""hs.monitor in a plain training loop: statistics against torch.autograd and a float64 recount,
the NaN/Inf tripwire at the step and layer it happens, sinks read back, no hook left behind."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope._shared.precision import raw_precision, read_precision

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 64


def gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=3, n_embd=32, n_head=2, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).train()


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(step))


# -- precision health against a float64 recount ------------------------------------------------------


def recount(values: np.ndarray, dtype: torch.dtype) -> dict[str, float]:
    """The same fractions by thresholds in float64 (no cast): round to nearest below half the
    smallest subnormal is zero; below the smallest normal (less half a subnormal step) subnormal."""
    info = torch.finfo(dtype)
    smallest = info.smallest_normal * info.eps  # the smallest subnormal
    magnitude = np.abs(values)
    finite = np.isfinite(values)
    count = finite.sum()
    return {
        "zeros": float(((values == 0) & finite).sum() / count),
        "underflow": float(((magnitude > 0) & (magnitude < smallest / 2) & finite).sum() / count),
        "subnormal": float(
            ((magnitude > smallest / 2) & (magnitude < info.smallest_normal - smallest / 2) & finite).sum() / count
        ),
        "overflow": float(
            ((magnitude >= info.max + 2.0 ** math.floor(math.log2(info.max)) * info.eps / 2) & finite).sum() / count
        ),
    }


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_precision_counts_equal_a_float64_recount(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(1)
    exponents = torch.empty(20000, dtype=torch.float64).uniform_(-140, 20, generator=generator)
    signs = torch.where(torch.rand(20000, generator=generator) < 0.5, -1.0, 1.0).double()
    values = signs * torch.pow(2.0, exponents)
    values[::97] = 0.0
    values[5] = math.inf  # not counted: the tripwire's business
    measured = read_precision([raw_precision(values.float(), dtype)], [dtype])[0]
    expected = recount(values.float().double().numpy(), dtype)
    for name, value in expected.items():
        assert getattr(measured, name) == pytest.approx(value, abs=1e-4), name
    assert measured.count == 19999
    cast = values.float().to(dtype).double().abs()
    kept = cast[torch.isfinite(cast) & (cast > 0)]
    assert measured.dynamic_range == pytest.approx(math.log2(float(kept.max() / kept.min())))


def test_precision_of_an_already_low_precision_tensor_and_bad_formats() -> None:
    values = torch.tensor([0.0, 1.0, 1e-40, 2.0], dtype=torch.float32).to(torch.bfloat16)
    measured = read_precision([raw_precision(values)], [torch.bfloat16])[0]
    assert measured.zeros == 0.25 and measured.underflow == 0.0  # noqa: PT018
    assert measured.subnormal == 0.25  # 1e-40 is a bfloat16 subnormal
    with pytest.raises(hs.SpecError, match="not a low-precision format"):
        hs.monitor(nn.Linear(2, 2), precision="float32")


# -- a training loop -------------------------------------------------------------------------------------


def keep_grad(grads: list[torch.Tensor], index: int) -> Any:
    def keep(grad: torch.Tensor) -> None:
        grads[index] = grad.clone()

    return keep


def keep_first(kept: list[torch.Tensor]) -> Any:
    def keep(module: nn.Module, args: Any, output: Any) -> None:
        kept.append(output[0] if isinstance(output, tuple) else output)

    return keep


def test_logged_gradient_norms_equal_autograd(tmp_path: Path) -> None:
    model = gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    kept: dict[int, dict[str, float]] = {}
    block_grads: dict[int, list[float]] = {}
    sink = tmp_path / "metrics.jsonl"
    with hs.monitor(model, sinks=[sink, tmp_path / "metrics.csv"], every=2) as mon:
        for step in range(5):
            outputs: list[torch.Tensor] = []
            handles = [block.register_forward_hook(keep_first(outputs)) for block in model.transformer.h]
            loss = model(batch(step), labels=batch(step)).loss
            for handle in handles:
                handle.remove()
            grads: list[torch.Tensor] = [torch.empty(0)] * len(outputs)
            for index, output in enumerate(outputs):  # the reference: raw tensor hooks, filled by this backward
                output.register_hook(keep_grad(grads, index))
            loss.backward()
            kept[step] = {n: float(p.grad.double().norm()) for n, p in model.named_parameters() if p.grad is not None}
            block_grads[step] = [float(g.double().norm()) for g in grads]
            logged = mon.step()
            assert (logged is None) == (step % 2 == 1)
            optimizer.step()
            optimizer.zero_grad()
    assert [s.step for s in mon.steps] == [0, 2, 4]
    for logged in mon.steps:
        scalars = logged.scalars
        for name, norm in kept[logged.step].items():
            assert scalars[f"param_grad/norm/{name}"] == pytest.approx(norm, rel=1e-5)
        for index, norm in enumerate(block_grads[logged.step]):
            assert scalars[f"grad/norm/blocks.{index}"] == pytest.approx(norm, rel=1e-5)
    rows = [json.loads(line) for line in sink.read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 2, 4]
    assert rows[1]["grad/norm/blocks.1"] == pytest.approx(mon.steps[1].scalars["grad/norm/blocks.1"])
    csv_rows = (tmp_path / "metrics.csv").read_text().splitlines()
    assert csv_rows[0] == "step,name,value" and len(csv_rows) == 1 + sum(len(s.scalars) for s in mon.steps)  # noqa: PT018


def test_precision_health_flags_gradient_underflow_in_fp16() -> None:
    model = gpt2()
    with hs.monitor(model, precision="fp16", grads=False, params=False) as mon:
        loss = model(batch(0), labels=batch(0)).loss * 1e-6  # a loss scale far too small for float16
        loss.backward()
        logged = mon.step()
    assert logged is not None
    underflow = logged.scalars["precision/grad/underflow/blocks.0"]
    assert underflow > 0.5
    flags = [flag for flag in logged.flags if flag.kind == "grad_underflow"]
    assert {flag.layer for flag in flags} == {"blocks.0", "blocks.1", "blocks.2"}
    assert f"loses {100 * underflow:.1f}% of its gradient to underflow in float16 (step 0)" in str(flags[0])
    assert logged.scalars["precision/act/underflow/blocks.0"] == 0.0


def train(
    model: nn.Module, optimizer: torch.optim.Optimizer, poison: dict[str, bool], at: int, reached: list[int]
) -> None:
    """Ten monitored steps; ``poison["on"]`` at step ``at``."""
    with hs.monitor(model) as mon:
        for step in range(10):
            poison["on"] = step == at
            reached.append(step)
            model(batch(step), labels=batch(step)).loss.backward()
            mon.step()
            optimizer.step()
            optimizer.zero_grad()


def test_the_tripwire_stops_at_the_step_and_layer_of_a_forward_nan() -> None:
    model = gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    poison = {"on": False}
    handle = model.transformer.h[1].mlp.register_forward_hook(
        lambda m, a, out: out * math.nan if poison["on"] else None
    )
    reached = []
    try:
        with pytest.raises(hs.NonFiniteError) as caught:
            train(model, optimizer, poison, 7, reached)
    finally:
        handle.remove()
    assert reached[-1] == 7
    assert caught.value.module == "transformer.h.1.mlp" and caught.value.step == 7  # noqa: PT018


def test_the_tripwire_names_the_first_gradient_that_turns_nan() -> None:
    model = gpt2()
    poison = {"on": False}

    def inject(module: nn.Module, args: Any, output: Any) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        if poison["on"] and hidden.requires_grad:
            hidden.register_hook(lambda grad: grad * math.nan)

    handle = model.transformer.h[2].register_forward_hook(inject)
    reached: list[int] = []
    try:
        with pytest.raises(hs.NonFiniteError, match="step 3: the gradient of 'blocks.2'") as caught:
            train(model, torch.optim.SGD(model.parameters(), lr=0.0), poison, 3, reached)
    finally:
        handle.remove()
    assert reached[-1] == 3
    assert caught.value.step == 3
    assert caught.value.module == "transformer.h.2"


def test_a_plain_model_without_a_map_monitors_its_parametrised_modules() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    with hs.monitor(model, names="modules") as mon:
        model(torch.randn(5, 4)).sum().backward()
        logged = mon.step()
    assert logged is not None
    assert {"grad/norm/0", "grad/norm/2", "act/mean_abs/0", "param_grad/norm/0.weight"} <= set(logged.scalars)
    torch.testing.assert_close(logged.scalars["param_grad/norm/2.weight"], float(model[2].weight.grad.double().norm()))
    with pytest.raises(hs.SpecError, match="every="):
        hs.monitor(model, every=0)

    with pytest.raises(hs.SpecError, match="sink"):
        hs.monitor(model, sinks=["metrics.txt"])


@pytest.mark.slow
@pytest.mark.compile
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's own
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")  # Dynamo's
def test_a_compiled_model_logs_what_the_eager_one_does() -> None:
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    x = torch.randn(6, 4)
    with hs.monitor(eager, names="modules") as mon:
        eager(x).pow(2).mean().backward()
        expected = mon.step()
    eager.zero_grad()
    torch._dynamo.reset()
    compiled = torch.compile(eager)
    try:
        with hs.monitor(compiled, names="modules") as mon:
            compiled(x).pow(2).mean().backward()
            got = mon.step()
    finally:
        torch._dynamo.reset()  # compiled code for Linear.forward would outlive the test (other tests' Linears)
    assert expected is not None and got is not None  # noqa: PT018
    for name in ("param_grad/norm/0.weight", "param_grad/norm/2.bias", "grad/norm/2", "act/mean_abs/0"):
        assert got.scalars[name] == pytest.approx(expected.scalars[name], rel=1e-5), name


def test_under_bf16_autocast_the_logged_norms_are_the_runs_own() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 1))
    x = torch.randn(8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x).float().pow(2).mean()
    loss.backward()
    expected = {name: float(p.grad.double().norm()) for name, p in model.named_parameters()}
    model.zero_grad()
    with hs.monitor(model, precision="bf16", names="modules") as mon:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        logged = mon.step()
    assert logged is not None
    for name, norm in expected.items():
        assert logged.scalars[f"param_grad/norm/{name}"] == pytest.approx(norm, rel=1e-6)
    assert logged.scalars["precision/act/underflow/0"] == 0.0  # already bfloat16: the cast loses nothing
    assert 0 < logged.scalars["precision/grad/dynamic_range/0"] < 254


def test_histograms_on_request_reach_tensorboard(tmp_path: Path) -> None:
    tensorboard = pytest.importorskip("torch.utils.tensorboard")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 1))
    x = torch.randn(32, 4)
    writer = tensorboard.SummaryWriter(str(tmp_path))
    with hs.monitor(model, names="modules", histograms=True, sinks=[writer]) as mon:
        model(x).sum().backward()
        logged = mon.step()
    assert logged is not None
    histogram = logged.histograms["0"]
    values = model[0](x).detach().double()
    assert histogram.counted == values.numel()
    assert histogram.low == pytest.approx(float(values.min())) and histogram.high == pytest.approx(float(values.max()))  # noqa: PT018
    counts, _ = np.histogram(values.numpy(), bins=histogram.bins, range=(histogram.low, histogram.high))
    assert np.abs(np.asarray(histogram.counts) - counts).sum() <= 2  # float32 bucket edges against float64 ones
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path), size_guidance={"histograms": 0})
    events.Reload()
    assert "act/0" in events.Tags()["histograms"]


def test_one_transfer_per_logged_step_and_none_on_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every number of a logged step crosses in one fetch (one copy per device); skipped steps fetch nothing."""
    import importlib

    monitor_module = importlib.import_module(
        "hookscope._monitor.monitor"
    )  # the package exports a function of that name
    grads_module = importlib.import_module("hookscope._monitor.recorder")

    calls: list[int] = []
    fetch = monitor_module.fetch
    monkeypatch.setattr(monitor_module, "fetch", lambda vectors: calls.append(len(vectors)) or fetch(vectors))
    monkeypatch.setattr(grads_module, "read_stats", lambda raws: pytest.fail("watch_grads read on its own"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    per_step = []
    with hs.monitor(model, names="modules", precision="bf16", histograms=True, every=2) as mon:
        for _ in range(4):
            model(torch.randn(3, 4)).sum().backward()
            before = len(calls)
            mon.step()
            per_step.append(len(calls) - before)
            model.zero_grad()
    assert per_step == [1, 0, 1, 0]
    assert len(mon.steps) == 2 and "grad/norm/2" in mon.steps[1].scalars  # noqa: PT018


# -- edges a review found -------------------------------------------------------------------------------


def test_steps_numbered_by_the_caller_log_that_steps_own_numbers() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with hs.monitor(model, names="modules", every=2, start=1) as mon:  # the loop counts from 1
        for step in range(1, 6):
            x = torch.full((3, 4), float(step))
            kept: list[torch.Tensor] = []
            handle = model[0].register_forward_hook(keep_first(kept))
            model(x).sum().backward()
            handle.remove()
            logged = mon.step(step=step)
            if logged is not None:
                assert logged.scalars["act/mean_abs/0"] == pytest.approx(float(kept[0].detach().double().abs().mean()))
                assert logged.grads is not None
                assert logged.grads.step == step
            model.zero_grad()
    assert [s.step for s in mon.steps] == [2, 4]


def test_an_evaluation_forward_between_steps_is_not_counted() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    x = torch.randn(5, 4)
    with hs.monitor(model, names="modules") as mon:
        model(x).sum().backward()
        with torch.no_grad():
            model(torch.randn(7, 4) * 100)  # evaluation
        logged = mon.step()
    assert logged is not None
    assert logged.scalars["act/mean_abs/0"] == pytest.approx(float(model[0](x).detach().double().abs().mean()))


def test_a_failing_sink_does_not_hide_a_nan_gradient() -> None:
    class Broken:
        def write(self, step: int, scalars: dict[str, float]) -> None:
            raise OSError("disk full")

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    handle = model[0].register_forward_hook(lambda m, a, out: out.register_hook(lambda g: g * math.nan) and None)
    try:
        with pytest.raises(hs.NonFiniteError):
            one_step(model, sinks=[Broken()])
    finally:
        handle.remove()


def one_step(model: nn.Module, **options: Any) -> None:
    with hs.monitor(model, names="modules", **options) as mon:
        model(torch.randn(2, 4)).sum().backward()
        mon.step()


def test_precision_edges_empty_tensors_and_the_rounding_at_the_top() -> None:
    values = torch.tensor([65519.0, 65521.0, 70000.0, 1.0])  # float16 max 65504, next step 32: 65520 rounds up
    measured = read_precision([raw_precision(values, torch.float16)], [torch.float16])[0]
    assert measured.overflow == 0.5
    saturating = read_precision([raw_precision(torch.tensor([450.0, 470.0]), torch.float8_e4m3fn)])[0]
    assert saturating.overflow == 0.5  # 450 rounds to 448; 470 is past 448 + 16 and is clamped
    empty = read_precision([raw_precision(torch.empty(0), torch.bfloat16)])[0]
    assert empty.count == 0 and math.isnan(empty.underflow)  # noqa: PT018
    model = nn.Sequential(nn.Linear(4, 4))
    with hs.monitor(model, names="modules", precision="bf16") as mon:
        model(torch.randn(0, 4)).sum().backward()
        assert mon.step() is not None


# -- the tripwire switched off, steps called wrong (issue 36) ------------------------------------------


def test_tripwire_false_flags_a_nan_gradient_and_the_run_goes_on() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    poison = {"on": True}

    def inject(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        if poison["on"]:
            output.register_hook(lambda grad: grad * math.nan)

    handle = model[2].register_forward_hook(inject)
    try:
        with hs.monitor(model, names="modules", tripwire=False) as mon:
            model(torch.randn(3, 4)).sum().backward()
            first = mon.step()  # raised NonFiniteError before: the option was ignored by the gradient check
            model.zero_grad()
            poison["on"] = False
            x = torch.randn(3, 4)
            hidden = model[0](x)
            hidden.retain_grad()
            model[2](model[1](hidden)).sum().backward()  # the reference: autograd's own gradient, read by hand
            second = mon.step()
    finally:
        handle.remove()
    assert first is not None and second is not None  # noqa: PT018
    (flag,) = [flag for flag in first.flags if flag.kind == "grad_nonfinite"]
    assert flag.layer == "2" and flag.value == 3  # noqa: PT018  # the (3, 1) output gradient, all NaN
    assert math.isnan(first.scalars["grad/norm/2"])
    assert not second.flags
    assert second.scalars["grad/norm/0"] == pytest.approx(float(hidden.grad.double().norm()))


def test_step_after_the_with_block_or_twice_after_one_backward_is_refused() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    with hs.monitor(model, names="modules") as mon:
        with pytest.raises(hs.SpecError, match="no training forward or backward .* since the monitor was attached"):
            mon.step()
        model(torch.randn(3, 4)).sum().backward()
        assert mon.step() is not None
        with pytest.raises(hs.SpecError, match="since the last step\\(\\): call it once per optimiser step"):
            mon.step()  # the same backward again: logged as a second step before
        with torch.no_grad():
            model(torch.randn(3, 4))  # an evaluation forward is no training step either
        with pytest.raises(hs.SpecError, match="no training forward"):
            mon.step()
        model(torch.randn(3, 4)).sum().backward()
        assert mon.step() is not None
    with pytest.raises(hs.SpecError, match="monitor that was removed"):
        mon.step()
    assert [s.step for s in mon.steps] == [0, 1]


def test_a_module_named_like_another_modules_second_call_keeps_its_own_metric() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.add_module("fc#1", nn.Linear(4, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return getattr(self, "fc#1")(self.fc(torch.tanh(self.fc(x))))

    torch.manual_seed(0)
    model = Twice()
    outputs: dict[str, list[torch.Tensor]] = {"fc": [], "fc#1": []}
    handles = [
        module.register_forward_hook(lambda m, a, out, name=name: outputs[name].append(out) or out.retain_grad())
        for name, module in (("fc", model.fc), ("fc#1", getattr(model, "fc#1")))
    ]
    try:
        with hs.monitor(model, names="modules") as mon:
            model(torch.randn(5, 4)).square().sum().backward()
            logged = mon.step()
    finally:
        for handle in handles:
            handle.remove()
    assert logged is not None
    expected = {
        "grad/norm/fc": outputs["fc"][0],
        "grad/norm/fc#1": outputs["fc#1"][0],  # the module named fc#1, under its own name
        "grad/norm/fc#1~2": outputs["fc"][1],  # fc's second call: before, one of the two overwrote the other
    }
    for name, output in expected.items():
        assert logged.scalars[name] == pytest.approx(float(output.grad.double().norm()), rel=1e-6), name


# -- ALBERT: one block object at every layer (issue 36) -----------------------------------------------------


def albert() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.AlbertConfig(
        vocab_size=VOCAB, embedding_size=16, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.AlbertForMaskedLM(config).train()


@pytest.mark.transformers
def test_albert_is_monitored_even_where_its_canonical_names_cannot_be_made() -> None:
    """``std:`` names for ALBERT crashed hs.monitor with a raw shape error. Where the map cannot be
    made (a StdMapError), the monitor watches the modules with parameters, with a warning; where
    it can, the blocks. Either way the logged norms are autograd's."""
    import warnings

    model = albert()
    try:
        hs.std_map(model)
        mapped = True
    except hs.StdMapError:
        mapped = False  # a RuntimeError here is the defect itself: the test fails on it
    ffn = model.albert.encoder.albert_layer_groups[0].albert_layers[0].ffn
    calls: list[torch.Tensor] = []
    ids = batch(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with hs.monitor(model) as mon:  # attaching runs the map's probe: the reference hook comes after
            handle = ffn.register_forward_hook(lambda m, a, out: calls.append(out) or out.retain_grad())
            try:
                model(input_ids=ids, labels=ids).loss.backward()
            finally:
                handle.remove()
            logged = mon.step()
    assert logged is not None
    notes = [str(w.message) for w in caught if "no canonical names" in str(w.message)]
    assert len(notes) == (0 if mapped else 1) and (mon.note is None) == mapped  # noqa: PT018
    for name, parameter in model.named_parameters():
        if parameter.grad is not None:
            expected = float(parameter.grad.double().norm())
            assert logged.scalars[f"param_grad/norm/{name}"] == pytest.approx(expected, rel=1e-5), name
    if not mapped:  # the shared block's feed-forward, once per layer, each call its own metric
        shown = "albert.encoder.albert_layer_groups.0.albert_layers.0.ffn"
        assert len(calls) == 3
        for call, output in enumerate(calls):
            name = f"grad/norm/{shown}" + (f"#{call}" if call else "")
            assert logged.scalars[name] == pytest.approx(float(output.grad.double().norm()), rel=1e-5)

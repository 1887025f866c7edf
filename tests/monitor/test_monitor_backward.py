"""hs.monitor reads the parameters' gradients when each backward ends: under a real GradScaler
every gradient of a record is the loss's own (unscaled, against unscale_ and raw hooks), a
backward that raised leaves the next one read, sparse and float16 gradients are measured
right (against float64), and every removal path takes the per-parameter hooks off."""

from __future__ import annotations

import gc
import math
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import hookscope as hs
from tests.models import track


def tiny() -> nn.Module:
    torch.manual_seed(0)
    return track(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))


def parameter_norms(logged: hs.MonitorStep) -> dict[str, float]:
    prefix = "param_grad/norm/"
    return {name.removeprefix(prefix): value for name, value in logged.scalars.items() if name.startswith(prefix)}


def post_accumulate_hooks(model: nn.Module) -> int:
    """The post-accumulate-grad hooks on ``model``'s parameters, read from PyTorch's own dicts (tests only)."""
    return sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())


# -- item: under a GradScaler, one convention: the loss's own gradients --------------------------------


def test_under_a_grad_scaler_every_gradient_of_a_record_is_divided_by_the_scale() -> None:
    """The loop's grad_norm is clip_grad_norm_ after unscale_; the record's parameter norms and
    activation gradients were the scaled ones (306041 against 4.67). Now both are the loss's
    own, at a scale that doubles every step, read before clipping."""
    model = tiny()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=1)
    generator = torch.Generator().manual_seed(1)
    seen: list[torch.Tensor] = []  # the reference for the activations: a raw hook's scaled gradient

    def keep_grad(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        output.register_hook(lambda grad: seen.append(grad.detach().double()))

    handle = model[0].register_forward_hook(keep_grad)
    try:
        with hs.monitor(model, layers=["0", "2"], names="modules", grad_scaler=scaler) as mon:
            for step in range(3):
                seen.clear()
                loss = model(torch.randn(6, 4, generator=generator)).pow(2).sum()
                scale = scaler.get_scale()
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)
                unscaled = {name: float(p.grad.double().norm()) for name, p in model.named_parameters()}
                total = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3))  # clipped hard
                logged = mon.step()
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
                assert logged is not None
                assert logged.scalars["grad/loss_scale"] == scale == 2.0 ** (12 + step)
                norms = parameter_norms(logged)
                assert norms == pytest.approx(unscaled, rel=1e-6)
                assert math.sqrt(sum(v * v for v in norms.values())) == pytest.approx(total, rel=1e-6)
                weight = float(model[0].weight.detach().double().norm())
                assert logged.scalars["param_grad/ratio/0.weight"] == pytest.approx(unscaled["0.weight"] / weight)
                (grad,) = seen
                assert logged.scalars["grad/norm/0"] == pytest.approx(float(grad.norm()) / scale, rel=1e-6)
                assert logged.scalars["grad/max_abs/0"] == pytest.approx(float(grad.abs().max()) / scale, rel=1e-6)
                record = next(r for r in logged.grads.records if r.module == "0" and r.what == "grad_output")
                assert record.mean_abs == pytest.approx(float(grad.abs().mean()) / scale, rel=1e-6)
    finally:
        handle.remove()


def test_float16_autocast_without_a_scaler_is_said_once_and_a_bad_scaler_refused() -> None:
    model = tiny()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with hs.monitor(model, layers=["0"]) as mon:
            for _ in range(2):
                with torch.autocast("cpu", dtype=torch.float16):
                    out = model(torch.randn(3, 4))
                out.float().sum().backward()
                mon.step()
    said = [str(w.message) for w in caught if "float16 autocast" in str(w.message)]
    assert len(said) == 1
    assert "grad_scaler=" in said[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # with the scaler known, nothing to say
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        with hs.monitor(model, layers=["0"], grad_scaler=scaler) as mon:
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(torch.randn(3, 4))
            scaler.scale(out.float().sum()).backward()
            mon.step()
    with pytest.raises(hs.SpecError, match=r"grad_scaler=float: expected the torch.amp.GradScaler"):
        hs.monitor(model, grad_scaler=2.0**16)


def test_under_a_grad_scaler_an_overflow_is_a_flag_and_the_scaler_skips_the_step() -> None:
    """fp16's first steps overflow at the default scale (65536) as a matter of course: the
    GradScaler skips them and halves its scale. A known scaler's overflow does not trip the run."""
    model = tiny()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**70)  # every gradient overflows float16 at first
    before = [p.detach().clone() for p in model.parameters()]
    with hs.monitor(model, layers=["0"], names="modules", grad_scaler=scaler) as mon:
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(torch.randn(3, 4))
        scaler.scale(out.float().sum()).backward()
        logged = mon.step()
        scaler.step(optimizer)
        scaler.update()
    assert [flag.kind for flag in logged.flags] == ["grad_nonfinite"]
    assert "the GradScaler skips this step and lowers its scale" in logged.flags[0].message
    assert scaler.get_scale() == 2.0**69  # the scaler saw the overflow too, and skipped the step
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


# -- item: a backward that raised leaves nothing behind ------------------------------------------------


def test_after_a_backward_that_raised_the_next_one_is_read_before_clipping() -> None:
    """A backward that raises (out of memory) never runs its final callbacks; its read was queued
    and the next backward queued none, so step() read the gradients after clipping."""
    model = tiny()
    x = torch.randn(3, 4)
    with hs.monitor(model, layers=["0", "2"], names="modules") as mon:
        hidden = model[0](x)
        hidden.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("out of memory (simulated)")))
        with pytest.raises(RuntimeError, match="out of memory"):
            model[2](model[1](hidden)).sum().backward()  # model[2]'s gradients accumulated, then it raised
        model.zero_grad()
        model(x).sum().backward()  # the retry
        before = {name: float(p.grad.double().norm()) for name, p in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        logged = mon.step()
    assert parameter_norms(logged) == pytest.approx(before, rel=1e-6)


# -- item: sparse and float16 gradients ----------------------------------------------------------------


def test_a_sparse_gradient_is_measured_and_the_backward_goes_on() -> None:
    """vector_norm of a sparse gradient raised inside autograd's callback: loss.backward() failed."""
    torch.manual_seed(0)
    model = track(nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2)))
    with hs.monitor(model, layers=["1"], names="modules") as mon:
        model(torch.tensor([[1, 2, 1, 7]])).sum().backward()  # index 1 twice: an uncoalesced gradient
        dense = {name: float(p.grad.to_dense().double().norm()) for name, p in model.named_parameters()}
        logged = mon.step()
    assert model[0].weight.grad.is_sparse
    assert parameter_norms(logged) == pytest.approx(dense, rel=1e-6)


def test_float16_and_float32_parameters_together_and_a_norm_past_float16s_range() -> None:
    torch.manual_seed(0)
    model = track(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).half()))
    with hs.monitor(model, layers=["0", "1"], names="modules") as mon:
        out = model[1](model[0](torch.ones(8, 4)).half() * 0 + 1)  # every input of the half layer is 1
        (out.float().sum() * 3000).backward()  # its weight's gradient: 16 values of 24000, norm 96000
        expected = {name: float(p.grad.double().norm()) for name, p in model.named_parameters()}
        logged = mon.step()
    assert expected["1.weight"] > torch.finfo(torch.float16).max
    assert parameter_norms(logged) == pytest.approx(expected, rel=1e-3)


# -- item: every removal path takes the parameters' hooks off ------------------------------------------


def test_remove_all_takes_the_parameter_hooks_of_a_forgotten_monitor_off() -> None:
    model = tiny()
    mon = hs.monitor(model, layers=["0", "2"])
    assert post_accumulate_hooks(model) == 4
    assert sum(hook.kind == "grad accumulated" for hook in hs.attached(model)) == 4
    del mon
    gc.collect()
    assert hs.remove_all(model) > 0
    assert post_accumulate_hooks(model) == 0
    with hs.monitor(model, layers=["0"]) as mon:
        model(torch.randn(3, 4)).sum().backward()
        mon.step()
    assert post_accumulate_hooks(model) == 0  # the with block's end too

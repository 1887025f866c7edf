"""One training monitor: ``hs.monitor`` and its preset ``hs.watch_grads`` share one recorder (one
tensor hook per watched tensor, the recorder's thread rule), one options object, one flag and
step type, and one tag scheme. References are computed with raw PyTorch hooks."""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import hookscope as hs
from tests.models import Handshake, track


def test_one_tensor_hook_per_output_with_every_measure_on() -> None:
    """Gradient statistics and gradient precision of a layer's output come from one hook."""
    torch.manual_seed(0)
    model = track(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)))
    hooks: dict[str, int] = {}
    grads: dict[str, torch.Tensor] = {}
    with hs.monitor(
        model, layers=["0", "2"], names="modules", precision="bf16", histograms=True, params=False, tripwire=False
    ) as mon:
        handles = []
        for name in ("0", "2"):

            def count(module: nn.Module, args: Any, output: torch.Tensor, name: str = name) -> None:
                hooks[name] = len(output._backward_hooks or {})  # the monitor's closing hook ran first
                output.register_hook(lambda grad: grads.__setitem__(name, grad.detach().double()))

            handles.append(model.get_submodule(name).register_forward_hook(count))
        model(torch.randn(3, 4)).sum().backward()
        for handle in handles:
            handle.remove()
        logged = mon.step()
    assert hooks == {"0": 1, "2": 1}
    assert logged is not None
    for name, grad in grads.items():
        assert logged.scalars[f"grad/norm/{name}"] == pytest.approx(float(grad.norm()))
        assert 0.0 <= logged.scalars[f"precision/grad/underflow/{name}"] <= 1.0


def test_activation_measures_without_gradient_statistics_still_hook_once() -> None:
    torch.manual_seed(0)
    model = track(nn.Sequential(nn.Linear(4, 4), nn.Tanh()))
    hooked: list[int] = []
    with hs.monitor(model, layers=["0"], names="modules", grads=False, params=False, precision="fp16") as mon:
        handle = model[0].register_forward_hook(lambda m, a, out: hooked.append(len(out._backward_hooks or {})))
        model(torch.randn(2, 4)).sum().backward()
        handle.remove()
        logged = mon.step()
    assert hooked == [1]
    assert logged is not None and logged.grads is None  # noqa: PT018
    assert "precision/grad/underflow/0" in logged.scalars
    assert "grad/norm/0" not in logged.scalars


def test_another_threads_forward_passes_by_the_monitor_unrecorded() -> None:
    """The monitor's per-call recording follows the recorder's thread rule, as capture's does."""
    handshake = Handshake()
    model = track(nn.Sequential(nn.Linear(3, 3), handshake, nn.Linear(3, 3)))
    x = torch.ones(2, 3)
    got: list[torch.Tensor] = []
    with hs.monitor(model, layers=["0", "1", "2"], names="modules", params=False) as mon:
        other, raised = handshake.intruder(lambda: got.append(handshake(torch.zeros(2, 3)).detach()))
        out = model(x)
        other.join(timeout=30)
        out.sum().backward()
        logged = mon.step()
    assert raised == []
    assert len(got) == 1 and torch.equal(got[0], torch.zeros(2, 3))  # noqa: PT018
    assert logged is not None
    hidden = model[1](model[0](x)).detach().double()
    assert logged.scalars["act/mean_abs/1"] == pytest.approx(float(hidden.abs().mean()))  # the owner's (2, 3) only
    assert [(r.layer, r.count) for r in logged.of("grad_output")] == [("0#0", 6), ("1#0", 6), ("2#0", 6)]
    # a DataParallel replica entering the pass is refused as by every recorder: tests/shared/test_call_recorder.py


def test_monitor_options_are_validated_once_and_round_trip() -> None:
    options = hs.MonitorOptions(every=5, precision=torch.bfloat16, sinks=["m.jsonl"], names="modules")
    data = options.to_dict()
    assert data["precision"] == "bfloat16" and data["sinks"] == ["m.jsonl"]  # noqa: PT018
    again = hs.MonitorOptions.from_dict(data)
    assert dataclasses.replace(again, precision=torch.bfloat16) == options
    assert again.target is torch.bfloat16
    paths = hs.MonitorOptions(sinks=[Path("out") / "m.csv"], trip_dir=Path("trips"))
    assert hs.MonitorOptions.from_dict(paths.to_dict()) == paths
    assert (paths.sinks, paths.trip_dir) == ((os.fspath(Path("out") / "m.csv"),), "trips")
    for bad, message in (
        ({"every": 0}, "every=0 is not a positive whole number"),
        ({"names": "canonical"}, "names='canonical'"),
        ({"precision": "float32"}, "not a low-precision format"),
        ({"sinks": "m.jsonl"}, "is one sink"),
        ({"evry": 2}, "did you mean 'every'"),
    ):
        with pytest.raises(hs.SpecError, match=message):
            hs.MonitorOptions.build(None, bad)
    with pytest.raises(hs.SpecError, match="did you mean 'every'"):
        hs.monitor(nn.Linear(2, 2), evry=2)


def test_monitor_takes_its_options_whole_or_as_keywords() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    x = torch.randn(3, 4)
    results = []
    for make in (
        lambda: hs.monitor(model, layers=["0"], names="modules", every=1, params=False),
        lambda: hs.monitor(model, layers=["0"], options=hs.MonitorOptions(names="modules", params=False)),
    ):
        with make() as mon:
            model(x).sum().backward()
            logged = mon.step()
            model.zero_grad()
        assert logged is not None and mon.options == hs.MonitorOptions(names="modules", params=False)  # noqa: PT018
        results.append(logged.scalars)
    assert results[0] == results[1]


def test_the_callbacks_hold_one_options_object() -> None:
    pytest.importorskip("transformers")
    from hookscope.integrations.hf import HookscopeCallback

    callback = HookscopeCallback(every=3, precision="fp16", names="modules")
    assert callback.options == hs.MonitorOptions(every=3, precision="fp16", names="modules")
    assert repr(callback) == "HookscopeCallback(every=3, precision='fp16', sinks=0)"
    with pytest.raises(hs.SpecError, match="every=0"):
        HookscopeCallback(every=0)  # refused when made, not when training begins


def test_one_flag_and_one_step_type() -> None:
    assert hs.GradFlag is hs.MonitorFlag and hs.GradStep is hs.MonitorStep  # noqa: PT018
    flag = hs.MonitorFlag("vanishing", "0#0", (0, 1, 2), "norm below 0.0001 of the largest layer's")
    assert str(flag) == "vanishing 0#0: norm below 0.0001 of the largest layer's (steps 0-2)"
    assert flag.step == 0 and math.isnan(flag.value)  # noqa: PT018


class Scalars:
    """A writer with ``add_scalar``: what ``to_tensorboard`` and a TensorBoard sink call."""

    def __init__(self) -> None:
        self.values: dict[str, dict[int, float]] = {}

    def add_scalar(self, tag: str, value: float, global_step: int) -> None:
        self.values.setdefault(tag, {})[global_step] = value

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_watch_grads_and_monitor_log_under_one_tag_scheme() -> None:
    torch.manual_seed(0)
    model = track(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))
    x = torch.randn(3, 4)
    writer, sink = Scalars(), Scalars()
    with hs.watch_grads(model) as grads:
        model(x).sum().backward()
        grads.step()
        grads.to_tensorboard(writer)
    model.zero_grad()
    with hs.monitor(model, layers=["0", "2"], names="modules", sinks=[sink]) as mon:
        model(x).sum().backward()
        mon.step()
    model.zero_grad()
    for tag in ("grad/norm/0", "grad/max_abs/2", "param_grad/norm/0.weight", "param_grad/ratio/2.bias"):
        mine = tag if tag.startswith("param") else f"{tag}#0"  # watch_grads names every call
        assert writer.values[mine][0] == pytest.approx(sink.values[tag][0], rel=1e-6), tag

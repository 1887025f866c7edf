"""A model whose weights are on ``meta`` (built there, not loaded yet), given a real input:
one UnsupportedModelError saying so, not a device mismatch deep in the first layer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import hookscope as hs

CALLS: dict[str, Callable[[nn.Module, torch.Tensor], Any]] = {
    "trace": lambda model, x: hs.trace(model, x),
    "run_with_capture": lambda model, x: hs.run_with_capture(model, x, layers="0"),
    "layers": lambda model, x: hs.layers(model, x),
}


def meta_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4, device="meta"), nn.ReLU())


@pytest.mark.parametrize("call", CALLS.values(), ids=CALLS.keys())
def test_a_meta_model_with_a_real_input_is_one_clear_error(call: Callable[[nn.Module, torch.Tensor], Any]) -> None:
    with pytest.raises(RuntimeError):  # what torch itself says: a device mismatch
        meta_model()(torch.ones(2, 4))
    model = meta_model()
    with pytest.raises(hs.UnsupportedModelError) as info:
        call(model, torch.ones(2, 4))
    message = str(info.value)
    assert "meta device" in message
    assert "'0.weight'" in message
    assert "to_empty" in message
    assert "\n" not in message
    assert hs.attached(model) == []  # nothing was left attached


@pytest.mark.parametrize("call", CALLS.values(), ids=CALLS.keys())
def test_a_meta_model_on_a_meta_input_still_runs(call: Callable[[nn.Module, torch.Tensor], Any]) -> None:
    call(meta_model(), torch.ones(2, 4, device="meta"))  # shapes only: a legitimate use


def test_a_materialised_model_runs_as_a_plain_one() -> None:
    model = meta_model().to_empty(device="cpu")
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(4))
        model[0].bias.zero_()
    x = torch.arange(8.0).reshape(2, 4) - 3
    out, cache = hs.run_with_capture(model, x, layers="0")
    torch.testing.assert_close(cache["0"], x, rtol=0, atol=0)
    torch.testing.assert_close(out, x.clamp(min=0), rtol=0, atol=0)

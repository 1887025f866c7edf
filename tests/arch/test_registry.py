"""The registry of live hook groups: weak, anchored by the hooked modules, and what reads it."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope._core.attach import live_groups


class Wide(nn.Module):
    """Returns 8 MiB per call of ``fc`` at batch 1024: a forgotten capture's values are easy to see."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2048)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.act(self.fc(x))
        return out


def _run_forgotten(attach: Callable[[nn.Module], Any]) -> weakref.ref[nn.Module]:
    """Attach with ``attach``, keep no reference to what it returns, run once; a weak reference to the model."""
    model = Wide()
    attach(model)
    with torch.no_grad():
        model(torch.ones(1024, 4))
    assert [group for group in live_groups() if group.model is model], "listed while its model lives"
    return weakref.ref(model)


@pytest.mark.parametrize(
    "attach",
    [
        pytest.param(lambda model: hs.capture(model, "fc"), id="capture"),
        pytest.param(lambda model: hs.tracing(model, layers="fc"), id="tracing"),
        pytest.param(lambda model: hs.hooks(model, {"fc": lambda *hook_args: None}), id="hooks"),
    ],
)
def test_a_forgotten_group_is_freed_with_its_model(attach: Callable[[nn.Module], Any]) -> None:
    model_ref = _run_forgotten(attach)
    gc.collect()
    assert model_ref() is None, "the registry kept the model of a group nobody removed"
    assert all(group.model is not None for group in live_groups())


def test_a_forgotten_capture_frees_its_values() -> None:
    model = Wide()
    with torch.no_grad():
        hs.capture(model, "fc")
        model(torch.ones(1024, 4))
    (group,) = [group for group in live_groups() if group.model is model]
    value = group._tracker._listener["fc"]  # the capture, reached only through its group
    assert value.numel() * value.element_size() == 8 * 2**20
    value_ref, model_ref = weakref.ref(value), weakref.ref(model)
    del value, group, model
    gc.collect()
    assert model_ref() is None
    assert value_ref() is None, "8 MiB kept by a capture whose model is gone"


def test_a_group_nobody_holds_stays_listed_and_removable_while_its_model_lives() -> None:
    model = Wide()
    seen: list[str] = []
    hs.hooks(model, {"fc": lambda module, args, output: seen.append("fc")})  # the group is not kept
    gc.collect()
    assert [hook.module for hook in hs.attached(model)] == ["fc"]
    model(torch.ones(1, 4))
    assert seen == ["fc"]
    (group,) = [group for group in live_groups() if group.model is model]
    group.remove()
    assert hs.attached(model) == []
    assert model._load_state_dict_post_hooks == {}, "the anchors leave with the group"

"""The one site plan and the one transactional attach that capture, edit and trace share."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope._arch.op_selectors import OpSelectors
from hookscope._arch.plan import expand_sites, plan_sites
from hookscope._core.attach import HookGroup, HookSpec
from hookscope._core.live_hooks import attached
from hookscope._core.op_sites import OpPattern
from hookscope._core.ops import OpWatcher
from hookscope._core.plan import attach_plan, split_op_selectors
from tests.models import Residual, track


def test_op_selectors_are_split_from_module_selectors_in_order_lists_opened() -> None:
    patterns, others = split_op_selectors(["conv", ["conv:op[add_#0]", nn.ReLU], "re:^conv$", ":op[relu_]"])
    assert [str(pattern) for pattern in patterns] == ["conv:op[add_#0]", ":op[relu_]"]
    assert others == ["conv", nn.ReLU, "re:^conv$"]


def test_an_empty_list_selector_is_refused_as_the_selector_rules_refuse_it() -> None:
    with pytest.raises(hs.SpecError):
        split_op_selectors([[]])


def test_a_plan_finds_the_modules_of_its_op_selectors_and_keeps_the_rest_as_given() -> None:
    block = Residual()
    plan = plan_sites(block, ["conv", "conv:op[conv2d]"], "read", owner="capture", error=hs.CaptureError)
    assert plan.selectors == ["conv"]
    assert [str(pattern) for pattern in plan.patterns] == ["conv:op[conv2d]"]
    assert plan.ops is not None
    assert plan.op_modules == [("conv", block.conv)]
    assert plan.std == {}


def test_patterns_given_parsed_come_first_and_a_check_sees_them_before_any_module_is_looked_for() -> None:
    block = Residual()
    told: list[list[str]] = []
    plan = plan_sites(
        block,
        None,
        "module",
        owner="trace",
        error=hs.SpecError,
        patterns=[OpPattern("conv")],
        check=lambda patterns: told.append([str(p) for p in patterns]),
    )
    assert told == [["conv:op[*]"]]
    assert plan.selectors == []
    with pytest.raises(hs.SpecError, match="refused"):
        plan_sites(
            block,
            ["convv:op[conv2d]"],
            "read",
            owner="capture",
            error=hs.CaptureError,
            check=lambda patterns: (_ for _ in ()).throw(hs.SpecError("refused")),
        )


def test_expanding_one_selector_watches_nothing_yet() -> None:
    plan = expand_sites(Residual(), "conv:op[conv2d]", "write")
    assert plan.ops is None
    assert [str(p) for p in plan.patterns] == ["conv:op[conv2d]"]


class _Feature:
    """What a feature is to the attach: a group, a watcher, and a ``remove()`` taking both off."""

    def __init__(self) -> None:
        self.group: HookGroup | None = None
        self.watcher: OpWatcher | None = None
        self.removed = 0

    def remove(self) -> None:
        self.removed += 1
        if self.watcher is not None:
            self.watcher.remove()
        if self.group is not None:
            self.group.remove()


def _hooked(block: nn.Module) -> Callable[[list[tuple[str, nn.Module]]], HookGroup]:
    def group(counted: list[tuple[str, nn.Module]]) -> HookGroup:
        assert counted == [("conv", block.conv)]  # the op selectors' modules, counted by the group
        return HookGroup(block, [HookSpec("conv", block.conv, "forward", lambda m, a, o: None)], count=counted)

    return group


def test_a_watcher_that_fails_takes_the_group_off_before_the_error_leaves() -> None:
    block = track(Residual())
    plan = plan_sites(block, ["conv:op[conv2d]"], "read", owner="capture", error=hs.CaptureError)
    feature = _Feature()

    def watch(ops: OpSelectors) -> OpWatcher:
        assert attached(block) != []  # the group went on first
        raise RuntimeError("the watcher failed")

    with pytest.raises(RuntimeError, match="the watcher failed"):
        attach_plan(plan, _hooked(block), watch, feature.remove)
    assert attached(block) == []
    assert feature.removed == 0


def test_remove_all_takes_a_plans_group_and_watcher_off_through_the_features_remove() -> None:
    block = track(Residual())
    plan = plan_sites(block, ["conv:op[conv2d]"], "read", owner="capture", error=hs.CaptureError)
    feature = _Feature()
    seen: list[str] = []

    def watch(ops: OpSelectors) -> OpWatcher:
        return ops.attach(block, lambda *told: seen.append(told[2]), lambda call: True, lambda *told: None)

    feature.group, feature.watcher = attach_plan(plan, _hooked(block), watch, feature.remove)
    block(torch.ones(1, 4, 5, 5))
    assert seen == ["conv2d#0"]
    assert hs.remove_all(block) > 0
    assert attached(block) == []
    assert feature.removed >= 1
    assert not feature.group.live


def test_a_plan_without_op_selectors_attaches_its_group_alone() -> None:
    block = track(Residual())
    plan = plan_sites(block, ["conv"], "read", owner="capture", error=hs.CaptureError)
    feature = _Feature()
    watched: list[object] = []

    def group(counted: list[tuple[str, nn.Module]]) -> HookGroup:
        assert counted == []
        return HookGroup(block, [HookSpec("conv", block.conv, "forward", lambda m, a, o: None)])

    def watch(ops: OpSelectors) -> OpWatcher:
        watched.append(ops)
        raise AssertionError("no op selectors: nothing to watch")

    feature.group, feature.watcher = attach_plan(plan, group, watch, feature.remove)
    assert feature.watcher is None
    assert watched == []
    hs.remove_all(block)
    assert feature.removed == 1

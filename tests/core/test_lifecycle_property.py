"""Property: any interleaving of attach / remove / forward / raising forward leaves zero hooks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from torch import nn

import hookscope as hs
from tests.conftest import raw_hook_count
from tests.models import Tracked

pytestmark = pytest.mark.slow


class Flaky(Tracked):
    """Two blocks; raises between them while ``fail`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.second = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        if self.fail:
            raise RuntimeError("flaky forward")
        out: torch.Tensor = self.second(x)
        return out


HOOK_FOR_KIND: dict[str, Any] = {
    "forward": lambda m, a, o: None,
    "forward_pre": lambda m, a: None,
    "backward": lambda m, gi, go: None,
    "backward_pre": lambda m, go: None,
}
SELECTORS = ["first", "second.*", "*", nn.Linear, ("first.0", "second.1"), "re:.*\\.0"]


class HookLifecycle(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.model = Flaky()
        self.user_handle = self.model.first.register_forward_hook(lambda m, a, o: None)
        self.baseline = raw_hook_count(self.model)
        self.groups: list[hs.HookGroup] = []

    @rule(selector=st.sampled_from(SELECTORS), kind=st.sampled_from(sorted(HOOK_FOR_KIND)), track=st.booleans())
    def attach(self, selector: Any, kind: str, track: bool) -> None:
        self.groups.append(hs.hooks(self.model, {selector: HOOK_FOR_KIND[kind]}, kind=kind, track_calls=track))

    @rule(bad=st.sampled_from([{"nope": HOOK_FOR_KIND["forward"]}, {"first": 3}, {"first": lambda: None}]))
    def attach_bad(self, bad: dict[Any, Any]) -> None:
        with pytest.raises(hs.HookscopeError):
            hs.hooks(self.model, bad)

    @precondition(lambda self: self.groups)
    @rule(index=st.integers(0, 100), twice=st.booleans())
    def remove(self, index: int, twice: bool) -> None:
        group = self.groups.pop(index % len(self.groups))
        group.remove()
        if twice:
            group.remove()

    @rule(fail=st.booleans(), backward=st.booleans())
    def forward(self, fail: bool, backward: bool) -> None:
        self.model.fail = fail
        x = torch.randn(2, 4, requires_grad=True)
        if fail:
            with pytest.raises(RuntimeError, match="flaky forward"):
                self.model(x)
        else:
            out = self.model(x)
            if backward:
                out.sum().backward()

    @rule(selector=st.sampled_from(SELECTORS), fail=st.booleans())
    def scoped_forward(self, selector: Any, fail: bool) -> None:
        self.model.fail = fail
        before = raw_hook_count(self.model)
        try:
            with hs.hooks(self.model, {selector: HOOK_FOR_KIND["forward"]}, track_calls=True):
                self.model(torch.randn(2, 4))
        except RuntimeError:
            assert fail
        assert raw_hook_count(self.model) == before

    @invariant()
    def hooks_match_live_groups(self) -> None:
        expected = sum(len(list(group.hooks())) for group in self.groups)
        assert raw_hook_count(self.model) == self.baseline + expected
        assert len(hs.attached(self.model)) == expected

    def teardown(self) -> None:
        for group in self.groups:
            group.remove()
        assert raw_hook_count(self.model) == self.baseline, "only the user's own hook is left"
        assert hs.attached(self.model) == []
        self.user_handle.remove()


HookLifecycle.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
TestHookLifecycle = HookLifecycle.TestCase

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from hookscope import Site, SpecError
from hookscope._core.attach import HookGroup
from hookscope._core.tracker import CallTracker


class TestSite:
    def test_format_and_parse(self) -> None:
        site = Site("transformer.h.0.attn", 2, "output", "[0]")
        assert str(site) == "transformer.h.0.attn#2:output[0]"
        assert Site.parse("transformer.h.0.attn#2:output[0]") == site

    def test_call_defaults_to_zero(self) -> None:
        assert Site.parse("fc:input") == Site("fc", 0, "input", "")

    def test_root_and_attribute_paths(self) -> None:
        assert Site.parse(":output.last_hidden_state") == Site("", 0, "output", ".last_hidden_state")

    @pytest.mark.parametrize(
        ("text", "message"), [("fc", "not of the form"), ("fc:outptu", "names 'outptu'; expected one of input")]
    )
    def test_bad_text(self, text: str, message: str) -> None:
        with pytest.raises(SpecError, match=message):
            Site.parse(text)

    def test_bad_fields(self) -> None:
        with pytest.raises(SpecError, match="call index -1 is negative"):
            Site("fc", -1)
        with pytest.raises(SpecError, match="site kind 'out' is unknown"):
            Site("fc", 0, "out")  # type: ignore[arg-type]

    @pytest.mark.slow
    @given(
        st.from_regex(r"[a-z_0-9]+(\.[a-z_0-9]+)*", fullmatch=True) | st.just(""),
        st.integers(0, 10_000),
        st.sampled_from(["input", "output", "grad_input", "grad_output"]),
        st.from_regex(r"(\[[0-9]+\]|\.[a-z_]+|\['[a-z]+'\]){0,3}", fullmatch=True),
    )
    def test_round_trip(self, module: str, call: int, what: str, path: str) -> None:
        site = Site(module, call, what, path)  # type: ignore[arg-type]
        assert Site.parse(str(site)) == site


class TestCallTracker:
    def test_numbering_nesting_and_reset(self) -> None:
        root, child = nn.Identity(), nn.Identity()
        tracker = CallTracker()
        tracker.watch("", root)
        tracker.watch("child", child)
        assert tracker.enter(root) == 0
        assert [tracker.enter(child), tracker.current(child)] == [0, 0]
        tracker.exit(child)
        assert tracker.enter(child) == 1
        tracker.exit(child)
        tracker.exit(root)
        assert tracker.counts() == {"": 1, "child": 2}
        assert tracker.enter(root) == 0, "a new pass starts when nothing is open"
        assert tracker.counts() == {"": 1, "child": 0}

    def test_recursion_keeps_a_stack(self) -> None:
        # Driven through real module calls: only the stack tells recursion from an interrupted pass.
        tracker = CallTracker()
        seen: list[int] = []

        class Recursive(nn.Module):
            def forward(self, depth: int) -> int:
                seen.append(tracker.current(self))
                if depth:
                    self(depth - 1)
                seen.append(tracker.current(self))
                return depth

        module = Recursive()
        with HookGroup(module, [], tracker=tracker):
            module(1)
        assert seen == [0, 1, 1, 0], "entered as call 0, then 1; after the inner call closes, 0 again"

    def test_interrupted_pass_is_dropped_when_its_module_is_entered_again(self) -> None:
        module = nn.Identity()
        tracker = CallTracker()
        tracker.watch("m", module)
        assert tracker.enter(module) == 0  # never closed, as after a KeyboardInterrupt
        assert tracker.enter(module) == 0, "not under an outer call of the module: a new pass"

    def test_unbalanced_exit_is_ignored(self) -> None:
        module = nn.Identity()
        tracker = CallTracker()
        tracker.exit(module)
        assert tracker.enter(module) == 0
        with pytest.raises(SpecError, match="valid only inside its hooks"):
            CallTracker().current(module)

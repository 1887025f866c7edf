"""hs.hooks(): plain PyTorch hook functions, attached by selector, always removed."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope._core.live_hooks import attached as attached_hooks
from hookscope.tensors import flatten_tensors
from tests.conftest import raw_hook_count
from tests.models import (
    HalfRefuses,
    KeywordOnly,
    LinearInplaceReLU,
    Looped,
    MixedOutputs,
    Nested,
    RaisesMidForward,
    SharedTwice,
    SmallCNN,
    gpt2_input,
    tiny_gpt2,
)


def names_of(model: nn.Module) -> dict[nn.Module, str]:
    return {module: name for name, module in model.named_modules()}


class TestPyTorchSignatures:
    def test_forward_hook_sees_args_and_output(self) -> None:
        model = SmallCNN()
        x = SmallCNN.example()
        seen: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
        names = names_of(model)

        def record(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
            seen.append((names[module], tuple(args[0].shape), tuple(output.shape)))

        with hs.hooks(model, {"conv1": record, "fc": record}):
            model(x)
        assert seen == [("conv1", (1, 3, 32, 32), (1, 16, 30, 30)), ("fc", (1, 16), (1, 10))]

    def test_forward_hook_return_replaces_output(self) -> None:
        model = SmallCNN()
        x = SmallCNN.example()
        with hs.hooks(model, {"fc": lambda module, args, output: torch.zeros_like(output)}):
            assert torch.count_nonzero(model(x)) == 0
        assert torch.count_nonzero(model(x)) > 0

    def test_forward_pre_hook_return_replaces_args(self) -> None:
        model = SmallCNN()
        x = SmallCNN.example()
        expected = model.fc(torch.zeros(1, 16))
        with hs.hooks(model, {"fc": lambda module, args: (torch.zeros_like(args[0]),)}, kind="forward_pre"):
            torch.testing.assert_close(model(x), expected)

    def test_with_kwargs_sees_keyword_only_tensor(self) -> None:
        model = KeywordOnly()
        seen: dict[str, Any] = {}

        def pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
            seen["pre"] = kwargs["scale"].item()
            return args, {"scale": torch.full((1,), 0.0)}

        def post(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: torch.Tensor) -> None:
            seen["post"] = kwargs["scale"].item()

        with (
            hs.hooks(model, {"block": pre}, kind="forward_pre", with_kwargs=True),
            hs.hooks(model, {"block": post}, with_kwargs=True),
        ):
            out = model(torch.ones(2, 4))
        assert seen == {"pre": 2.0, "post": 0.0}
        assert torch.count_nonzero(out) == 0

    def test_full_backward_hook(self) -> None:
        model = SmallCNN()
        grads: list[tuple[int, ...]] = []

        def on_grad(module: nn.Module, grad_input: tuple[Any, ...], grad_output: tuple[Any, ...]) -> None:
            grads.append(tuple(grad_output[0].shape))

        with hs.hooks(model, {"fc": on_grad}, kind="backward"):
            model(SmallCNN.example()).sum().backward()
        assert grads == [(1, 10)]

    def test_backward_pre_hook_replaces_grad_output(self) -> None:
        model = SmallCNN()
        with hs.hooks(model, {"fc": lambda module, grad_output: (grad_output[0] * 0,)}, kind="backward_pre"):
            model(SmallCNN.example()).sum().backward()
        assert model.conv1.weight.grad is not None
        assert torch.count_nonzero(model.conv1.weight.grad) == 0

    def test_always_call_runs_when_forward_raises(self) -> None:
        model = RaisesMidForward()
        called: list[object] = []
        with (
            hs.hooks(model, {"boom": lambda m, a, o: called.append(o)}, always_call=True),
            pytest.raises(RuntimeError, match="boom"),
        ):
            model(torch.ones(1, 4))
        assert called == [None]

    def test_several_functions_per_selector_run_in_order(self) -> None:
        model = SmallCNN()
        order: list[int] = []
        with hs.hooks(model, {"fc": [lambda m, a, o: order.append(1), lambda m, a, o: order.append(2)]}):
            model(SmallCNN.example())
        assert order == [1, 2]

    def test_pairs_allow_unhashable_selectors(self) -> None:
        model = Nested()
        hit: list[str] = []
        names = names_of(model)
        with hs.hooks(model, [(["heads.main", "heads.aux"], lambda m, a, o: hit.append(names[m]))]):
            model(torch.ones(1, 4))
        assert hit == ["heads.main", "heads.aux"]

    def test_prepend_runs_before_existing_hooks(self) -> None:
        model = SmallCNN()
        order: list[str] = []
        handle = model.fc.register_forward_hook(lambda m, a, o: order.append("user"))
        try:
            with hs.hooks(model, {"fc": lambda m, a, o: order.append("hookscope")}, prepend=True):
                model(SmallCNN.example())
        finally:
            handle.remove()
        assert order == ["hookscope", "user"]


class TestLifecycle:
    def test_removed_on_exit_and_remove_is_idempotent(self) -> None:
        model = SmallCNN()
        group = hs.hooks(model, {"*": lambda m, a, o: None})
        assert raw_hook_count(model) == 4
        assert group.live
        assert len(group) == 4
        group.remove()
        group.remove()
        assert not group.live
        assert raw_hook_count(model) == 0

    def test_forward_raises_exception_propagates_unchanged_and_hooks_go(self) -> None:
        model = RaisesMidForward()
        fired: list[str] = []
        names = names_of(model)
        user_handle = model.first.register_forward_hook(lambda m, a, o: fired.append("user"))
        try:
            with pytest.raises(RuntimeError) as caught, hs.hooks(model, {"*": lambda m, a, o: fired.append(names[m])}):
                model(torch.ones(1, 4))
            assert str(caught.value) == "boom: this module always fails"
            assert caught.value.__cause__ is None
            assert caught.value.__context__ is None
            assert fired == ["user", "first"]
            assert hs.attached(model) == []
            assert raw_hook_count(model) == 1  # only the user's own hook
            fired.clear()
            with pytest.raises(RuntimeError):
                model(torch.ones(1, 4))
            assert fired == ["user"], "the user's pre-existing hook still fires"
        finally:
            user_handle.remove()

    def test_exception_inside_hook_also_cleans_up(self) -> None:
        model = SmallCNN()

        def bad(module: nn.Module, args: Any, output: Any) -> None:
            raise ValueError("hook failed")

        with pytest.raises(ValueError, match="hook failed"), hs.hooks(model, {"relu": bad}):
            model(SmallCNN.example())
        assert raw_hook_count(model) == 0

    def test_nested_groups_remove_only_their_own(self) -> None:
        model = SmallCNN()
        outer = hs.hooks(model, {"conv1": lambda m, a, o: None}, owner="outer")
        with hs.hooks(model, {"conv1": lambda m, a, o: None, "fc": lambda m, a, o: None}, owner="inner") as inner:
            assert [(h.module, h.owner) for h in hs.attached(model)] == [
                ("conv1", "outer"),
                ("conv1", "inner"),
                ("fc", "inner"),
            ]
        assert not inner.live
        assert [(h.module, h.owner, h.group) for h in hs.attached(model)] == [("conv1", "outer", outer)]
        outer.remove()
        assert hs.attached(model) == []

    def test_transactional_attach(self) -> None:
        model = HalfRefuses()
        with pytest.raises(RuntimeError, match="refuses forward hooks"):
            hs.hooks(model, {"*": lambda m, a, o: None})
        assert raw_hook_count(model) == 0
        assert hs.attached(model) == []

    def test_bad_input_attaches_nothing(self) -> None:
        model = SmallCNN()
        with pytest.raises(hs.SelectionError):
            hs.hooks(model, {"conv1": lambda m, a, o: None, "nope": lambda m, a, o: None})
        with pytest.raises(hs.SpecError):
            hs.hooks(model, {"conv1": lambda m, a, o: None, "fc": 42})
        assert raw_hook_count(model) == 0

    def test_train_eval_mode_restored(self) -> None:
        model = SmallCNN().train()
        model.fc.eval()
        with hs.hooks(model, {"fc": lambda m, a, o: None}):
            model.eval()
        assert model.training
        assert not model.fc.training
        assert model.conv1.training

    def test_restore_mode_can_be_turned_off(self) -> None:
        model = SmallCNN().train()
        with hs.hooks(model, {"fc": lambda m, a, o: None}, restore_mode=False):
            model.eval()
        assert not model.training

    def test_group_does_not_keep_model_alive(self) -> None:
        import gc
        import weakref

        model = SmallCNN()
        group = hs.hooks(model, {"fc": lambda m, a, o: None})
        ref = weakref.ref(model)
        del model
        gc.collect()
        assert ref() is None
        assert group.model is None
        group.remove()

    def test_attached_lists_kind_owner_group(self) -> None:
        model = SmallCNN()
        with hs.hooks(model, {"fc": lambda m, a: None}, kind="forward_pre", owner="probe") as group:
            [hook] = hs.attached(model)
            assert (hook.module, hook.kind, hook.owner, hook.group, hook.purpose) == (
                "fc",
                "forward_pre",
                "probe",
                group,
                "hook",
            )
            assert "probe" in repr(group)
            assert "1 hooks, live" in repr(group)

    def test_attached_names_are_relative_to_the_model_asked(self) -> None:
        model = Nested()
        with hs.hooks(model, {"stem.0.0": lambda m, a, o: None}):
            assert [h.module for h in hs.attached(model.stem)] == ["0.0"]
            assert hs.attached(model.heads) == []


class TestCallIndices:
    def test_shared_module_called_twice(self) -> None:
        model = SharedTwice()
        seen: list[int] = []
        group = hs.hooks(model, {"shared": lambda m, a, o: seen.append(group.call_index(m))}, track_calls=True)
        with group:
            model(torch.ones(1, 4))
            assert group.calls == {"": 1, "shared": 2}
            model(torch.ones(1, 4))
        assert seen == [0, 1, 0, 1], "counters reset at each top-level forward"

    def test_loop(self) -> None:
        model = Looped(steps=4)
        seen: list[int] = []
        with hs.hooks(
            model, {"block": lambda m, a: seen.append(group.call_index(m))}, kind="forward_pre", track_calls=True
        ) as group:
            model(torch.ones(1, 4))
        assert seen == [0, 1, 2, 3]

    def test_submodule_called_on_its_own_is_its_own_pass(self) -> None:
        model = Looped(steps=2)
        with hs.hooks(model, {"block": lambda m, a, o: None}, track_calls=True) as group:
            model.block(torch.ones(1, 4))
            model.block(torch.ones(1, 4))
            assert group.calls["block"] == 1

    def test_counting_survives_a_raising_forward(self) -> None:
        model = RaisesMidForward()
        with hs.hooks(model, {"first": lambda m, a, o: None}, track_calls=True) as group:
            for _ in range(2):
                with pytest.raises(RuntimeError):
                    model(torch.ones(1, 4))
            assert group.calls == {"": 1, "first": 1}

    def test_call_index_needs_tracking(self) -> None:
        model = SmallCNN()
        with hs.hooks(model, {"fc": lambda m, a, o: None}) as group, pytest.raises(hs.SpecError, match="track_calls"):
            _ = group.calls


class TestBadInput:
    def test_unknown_kind_suggests(self) -> None:
        with pytest.raises(
            hs.SpecError, match=r"hook kind 'foward' is unknown; expected one of .*did you mean 'forward'"
        ):
            hs.hooks(SmallCNN(), {"fc": lambda m, a, o: None}, kind="foward")

    def test_not_callable(self) -> None:
        with pytest.raises(
            hs.SpecError, match="the hook for 'fc' is a str, not callable; expected a function called as"
        ):
            hs.hooks(SmallCNN(), {"fc": "print"})

    def test_wrong_arity_names_the_kind_that_fits(self) -> None:
        def two(module: nn.Module, args: Any) -> None:
            return None

        with pytest.raises(
            hs.SpecError, match=r"called as fn\(module, args, output\); did you mean kind='forward_pre'"
        ):
            hs.hooks(SmallCNN(), {"fc": two})

    def test_flags_that_do_not_apply(self) -> None:
        with pytest.raises(hs.SpecError, match="always_call=True applies to forward hooks only"):
            hs.hooks(SmallCNN(), {"fc": lambda m, g: None}, kind="backward_pre", always_call=True)
        with pytest.raises(hs.SpecError, match="with_kwargs=True applies to forward"):
            hs.hooks(SmallCNN(), {"fc": lambda m, gi, go: None}, kind="backward", with_kwargs=True)

    def test_not_a_module(self) -> None:
        with pytest.raises(hs.UnsupportedModelError, match=r"expected a torch.nn.Module, got function"):
            hs.hooks(lambda x: x, {"fc": lambda m, a, o: None})  # type: ignore[arg-type]

    def test_script_module(self) -> None:
        scripted = torch.jit.script(nn.Sequential(nn.Linear(2, 2)))
        with pytest.raises(hs.UnsupportedModelError, match="not supported: scripted code does not run Python hooks"):
            hs.hooks(scripted, {"0": lambda m, a, o: None})

    def test_scripted_submodule_inside_eager_model(self) -> None:
        model = track_plain(nn.Sequential(nn.Linear(2, 2), torch.jit.script(nn.Sequential(nn.Linear(2, 2)))))
        with pytest.raises(hs.UnsupportedModelError, match="module '1' is a TorchScript"):
            hs.hooks(model, {"*": lambda m, a, o: None})
        assert raw_hook_count(model) == 0

    def test_hook_map_of_wrong_type(self) -> None:
        with pytest.raises(hs.SpecError, match="hooks expects a mapping"):
            hs.hooks(SmallCNN(), "fc")  # type: ignore[arg-type]
        with pytest.raises(hs.SpecError, match="no \\(selector, fn\\) entries"):
            hs.hooks(SmallCNN(), {})


def track_plain(model: nn.Module) -> nn.Module:
    from tests.models import track

    return track(model)


class TestRealModels:
    @pytest.mark.transformers
    def test_gpt2_blocks_tuple_outputs_and_replacement(self) -> None:
        model = tiny_gpt2()
        ids = gpt2_input()
        plain = model(ids).last_hidden_state
        shapes: dict[str, list[tuple[int, ...]]] = {}
        names = names_of(model)

        def record(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            shapes[names[module]] = [tuple(t.shape) for _, t in flatten_tensors(output)]

        with hs.hooks(model, {"h.*.mlp": record, "h.*.attn": record}):
            assert torch.equal(model(ids).last_hidden_state, plain)
        assert shapes["h.0.mlp"] == [(2, 8, 32)]
        assert shapes["h.1.attn"][0] == (2, 8, 32)

        with hs.hooks(model, {"h.1.mlp": lambda m, a, o: torch.zeros_like(o)}):
            changed = model(ids).last_hidden_state
        assert not torch.equal(changed, plain)
        assert torch.equal(model(ids).last_hidden_state, plain)
        assert raw_hook_count(model) == 0

    def test_mixed_outputs_and_inplace(self) -> None:
        model = MixedOutputs()
        kinds: list[str] = []
        with hs.hooks(model, {"*": lambda m, a, o: kinds.append(type(o).__name__)}):
            model(torch.ones(2))
        assert kinds == ["tuple", "dict", "Pair", "Named", "NoneType"]

        inplace = LinearInplaceReLU()
        kept: list[torch.Tensor] = []
        with hs.hooks(inplace, {"fc": lambda m, a, o: kept.append(o.detach().clone())}):
            inplace(torch.randn(8, 4))
        assert (kept[0] < 0).any(), "a cloned output keeps the values the in-place ReLU overwrote"


class TestRemoveAll:
    def test_every_hookscope_hook_goes_and_a_raw_hook_stays(self) -> None:
        torch.manual_seed(0)
        model = SmallCNN()
        x = torch.randn(2, 3, 32, 32)
        with torch.no_grad():
            plain = model(x)
            conv1 = model.conv1(x)
        seen: list[torch.Size] = []
        raw = model.fc.register_forward_hook(lambda module, args, output: seen.append(output.shape))
        capture = hs.capture(model, "conv1")
        tracer = hs.tracing(model)
        editor = hs.edit(model, {"fc": hs.edits.zero()})
        with torch.no_grad():
            assert torch.equal(model(x), torch.zeros_like(plain))  # the edit is on
        listed = len(hs.attached(model))
        assert hs.remove_all(model) == listed > 0
        assert hs.attached(model) == []
        for name, module in model.named_modules():
            assert list(module._forward_hooks) == ([raw.id] if name == "fc" else []), name
            assert not module._forward_pre_hooks, name
            assert not module._load_state_dict_post_hooks, name  # the groups' anchors went too
        for feature in (capture, tracer, editor):
            assert not feature.live
            feature.remove()  # still safe: nothing more to do
        with torch.no_grad():
            assert torch.equal(model(x), plain)  # no edit, and the raw hook ran both times
        assert len(seen) == 2
        assert torch.equal(capture.cache["conv1"], conv1)  # what was captured stays readable
        assert hs.remove_all(model) == 0
        raw.remove()

    def test_a_submodule_takes_only_the_groups_that_hook_inside_it(self) -> None:
        model = SmallCNN()
        inside = hs.hooks(model.fc, {"": lambda module, args, output: None})
        outside = hs.capture(model, "conv1")
        assert hs.remove_all(model.fc) == 1
        assert not inside.live
        assert outside.live
        outside.remove()

    def test_a_capture_cut_short_by_ctrl_c_lets_go_of_its_write_guard(self) -> None:
        class Interrupted(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.conv = nn.Conv2d(3, 16, 3)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                self.conv(x)
                raise KeyboardInterrupt

        model = Interrupted()
        capture = hs.capture(model, "conv")
        with pytest.raises(KeyboardInterrupt):
            model(torch.randn(4, 3, 64, 64))  # a large output: the capture watches later writes to it
        assert torch.overrides._get_current_function_mode_stack()  # left on by the cut-short pass
        hs.remove_all(model)
        assert torch.overrides._get_current_function_mode_stack() == []
        assert not capture.live


class TestAttachedTable:
    def test_a_detector_prints_as_one_row_per_group(self) -> None:
        model = SmallCNN()
        modules = len(list(model.modules()))  # the root, conv1, relu, pool, fc
        with hs.detect_nonfinite(model):
            listed = hs.attached(model)
            in_torch = raw_hook_count(model)  # read from PyTorch's own hook dicts
            pre = sum(len(module._forward_pre_hooks) for module in model.modules())
            lines = repr(listed).splitlines()
            html = listed._repr_html_()
        assert len(listed) == in_torch == 4 * modules
        assert lines[0] == f"{in_torch} hookscope hooks in 1 group"
        assert lines[1].split() == ["group", "owner", "hooks", "modules", "also"]
        assert lines[3].split()[1:] == [
            "detect_nonfinite",
            f"forward_pre×{pre // 2}",  # its own; the other half count calls
            f"forward×{modules}",
            str(modules),
            str(2 * modules),
            "call",
            "counters",
        ]
        assert len(lines) == 5  # title, header, rule, the row, the note on removing
        assert str(listed) == repr(listed)
        assert '<td style="text-align:left">detect_nonfinite</td>' in html
        assert repr(hs.attached(model)) == "no hookscope hooks attached"

    def test_it_is_still_the_list_of_hooks(self) -> None:
        model = SmallCNN()
        with hs.hooks(model, {"fc": lambda module, args, output: None}) as group:
            listed = hs.attached(model)
            plain = attached_hooks(model)  # the core's plain list
        assert isinstance(listed, list)
        assert listed == plain
        assert plain == listed
        assert len(listed) == len(plain) == 1
        assert listed[0] == hs.AttachedHook("fc", "forward", "hooks", group, "hook")
        assert listed[-1:] == plain[-1:]
        assert [hook.module for hook in listed] == ["fc"]
        assert hs.attached(model) == []

"""The hard cases of keeping captured values right: writes the guard must see, passes, threads, stops."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import hookscope as hs
import hookscope._capture.keeper as keeper
from tests.conftest import raw_hook_count
from tests.models import LinearInplaceReLU, Looped, SmallCNN, Tracked


@pytest.fixture
def watch_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    """Watch every shared value instead of copying small ones outright, so the guard is exercised."""
    monkeypatch.setattr(keeper, "EAGER_COPY_BYTES", 0)


def mode_stack() -> list[object]:
    return list(torch.overrides._get_current_function_mode_stack())


class Writer(Tracked):
    """``fc`` then a write into its output, made in a way chosen per test; returns that output."""

    def __init__(self, write: str) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.write = write

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.write == "aten":
            torch.ops.aten.relu_.default(h)
        elif self.write == "packet":
            torch.ops.aten.relu_(h)
        elif self.write == "foreach":
            torch._foreach_mul_([h], 0.0)
        elif self.write == "view":
            h.view(-1)[::2] = 0.0
        elif self.write == "storage_fill":
            h.untyped_storage().fill_(0)
        elif self.write == "storage_copy":
            h.untyped_storage().copy_(torch.zeros_like(h).untyped_storage())
        elif self.write == "data":
            h.data.mul_(0.0)
        elif self.write == "numpy":
            h.numpy()[:] = 0.0
        elif self.write == "hidden":
            with torch._C.DisableTorchFunction():  # a write no torch function mode can see
                h.relu_()
        out: torch.Tensor = h
        return out


@pytest.mark.usefixtures("watch_everything")
class TestGuard:
    @pytest.mark.parametrize(
        "write", ["aten", "packet", "foreach", "view", "storage_fill", "storage_copy", "data", "numpy"]
    )
    def test_writes_through_ops_lists_and_views_are_seen(self, write: str) -> None:
        """In-place ops, lists, views, ``.data``, and memory handed out through the storage or
        numpy: the kept value is the one the layer returned."""
        model = Writer(write)
        x = torch.randn(4, 8)
        with torch.no_grad():
            reference = model.fc(x)
            _, cache = hs.run_with_capture(model, x, layers="fc")
        assert torch.equal(cache["fc"], reference)

    def test_copy_false_says_which_writes_it_cannot_see(self) -> None:
        """copy=False has no guard: a ``.data`` write does not bump the version counter, so it
        is not seen, as the option's documentation says; an in-place op is refused at read."""
        assert ".data" in hs.CaptureOptions.field_docs()["copy"]  # the option is documented on its field
        with torch.no_grad():
            _, cache = hs.run_with_capture(Writer("aten"), torch.randn(4, 8), layers="fc", copy=False)
        with pytest.raises(hs.CaptureError, match="changed in place"):
            cache["fc"]

    def test_a_write_nobody_saw_is_reported_not_laundered(self) -> None:
        model = Writer("hidden")
        with torch.no_grad():
            _, cache = hs.run_with_capture(model, torch.randn(4, 8), layers="fc")
        with pytest.raises(hs.CaptureError, match="changed in place after it was captured"):
            cache["fc"]

    @pytest.mark.transformers
    def test_sites_holding_one_view_share_one_copy(self) -> None:
        from tests.models import tiny_resnet

        model = tiny_resnet()
        x = torch.randn(1, 3, 32, 32)
        layer = "encoder.stages.0.layers.0.layer.1"
        with torch.no_grad():
            reference = model.encoder.stages[0].layers[0].layer(model.embedder(x))
            _, cache = hs.run_with_capture(model, x, layers=[f"{layer}.normalization", f"{layer}.activation"])
        norm, act = cache[f"{layer}.normalization"], cache[f"{layer}.activation"]
        assert torch.equal(norm, reference)
        assert torch.equal(act, reference)
        assert norm.data_ptr() == act.data_ptr(), "copied once, before `hidden_state += residual`"

    def test_the_root_captured_too_is_protected_from_later_writes(self) -> None:
        model = LinearInplaceReLU()
        x = torch.randn(4, 4)
        with torch.no_grad():
            out, cache = hs.run_with_capture(model, x, layers=["", "fc"])
            expected = out.clone()
            out.mul_(0)
        assert torch.equal(cache[""], expected)

    def test_stop_with_the_root_selected_keeps_the_output(self) -> None:
        model = SmallCNN()
        out, cache = hs.run_with_capture(model, SmallCNN.example(), layers=["", "conv1"], stop=True)
        assert out is None
        assert "conv1" in cache

    def test_parameters_are_read_at_the_end_of_each_pass(self) -> None:
        class Positions(Tracked):
            def __init__(self) -> None:
                super().__init__()
                self.register_buffer("table", torch.randn(64, 8))
                self.pos = nn.Identity()

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                out: torch.Tensor = x + self.pos(self.table[: x.shape[0]])
                return out

        model = Positions()
        with hs.capture(model, "pos") as cap:
            model.double()  # new storages after the capture was attached
            with torch.no_grad():
                model(torch.zeros(4, 8, dtype=torch.float64))
        kept = cap["pos"].clone()
        model.table.add_(1.0)
        assert torch.equal(cap["pos"], kept)


class TestPasses:
    def test_small_values_are_copied_and_the_guard_never_turns_on(self) -> None:
        model = SmallCNN()
        seen: list[int] = []
        with (
            hs.capture(model, "conv1", "relu"),
            hs.hooks(model, {"fc": lambda m, a, o: seen.append(len(mode_stack()))}),
        ):
            model(torch.randn(1, 3, 8, 8))
        assert seen == [0]

    def test_large_values_turn_the_guard_on_and_off_again(self) -> None:
        model = SmallCNN()
        seen: list[int] = []
        with hs.capture(model, "conv1"), hs.hooks(model, {"fc": lambda m, a, o: seen.append(len(mode_stack()))}):
            model(torch.randn(4, 3, 64, 64))
        assert seen == [1]
        assert mode_stack() == []

    @pytest.mark.parametrize("inner", ["run_with_capture", "diff", "extract", "edit", "capture"])
    def test_two_watching_features_at_once_leave_no_mode_behind(
        self, inner: str, watch_everything: None, tmp_path: Path
    ) -> None:
        """A capture watching large values while another feature watches too (nested in the same
        forward): one mode serves both, and it is gone once both are done, the values with it."""
        model = LinearInplaceReLU()
        x = torch.randn(64, 4)
        seen: list[int] = []
        with torch.no_grad(), hs.capture(model, "fc") as outer:
            if inner == "run_with_capture":
                hs.run_with_capture(model, x, layers="fc")
            elif inner == "diff":
                hs.diff(model, model, x)
            elif inner == "extract":
                hs.extract(model, x, tmp_path / "store", layers="fc", batch_size=64, progress=False)
            elif inner == "edit":
                with hs.edit(model, {"act": hs.edits.scale(1.0)}), hs.capture(model, "act"):
                    model(x)
            else:
                with (
                    hs.capture(model, "act", keep="input"),
                    hs.hooks(model, {"act": lambda m, a, o: seen.append(len(mode_stack()))}),
                ):
                    model(x)
            kept = outer["fc"]
        assert seen in ([], [1])  # one shared mode while both watch, never two
        assert mode_stack() == []
        torch.testing.assert_close(kept, model.fc(x).detach(), rtol=0, atol=0)

    def test_a_mode_pushed_above_the_guard_stays_when_the_guard_goes(self, watch_everything: None) -> None:
        """The forward leaves a user's mode on the stack above the guard: the guard still goes
        at the pass's end, and the user's mode stays where it was."""

        class Mine(torch.overrides.TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                return func(*args, **(kwargs or {}))

        mine = Mine()

        class LeavesAMode(LinearInplaceReLU):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                h = self.fc(x)
                mine.__enter__()
                return self.act(h)

        model = LeavesAMode()
        try:
            with torch.no_grad(), hs.capture(model, "fc") as cap:
                model(torch.randn(64, 4))
                assert mode_stack() == [mine]
                assert (cap["fc"] < 0).any()  # the pre-ReLU value, copied before the write
        finally:
            while mode_stack():
                torch.overrides._pop_mode()

    def test_a_selected_module_called_on_its_own_is_a_pass_of_its_own(self) -> None:
        model = SmallCNN()
        x = SmallCNN.example()
        with hs.capture(model, "fc") as cap, torch.no_grad():
            model(x)
            first = cap.cache
            before = first["fc"].clone()
            features = torch.ones(2, 16)
            model.fc(features)
        assert cap.cache is not first
        assert torch.equal(cap["fc"], model.fc(features).detach())
        assert torch.equal(first["fc"], before)

    def test_keyboard_interrupt_does_not_wedge_a_long_lived_capture(self) -> None:
        class Interrupting(Tracked):
            def __init__(self) -> None:
                super().__init__()
                self.fc = nn.Linear(4, 4)
                self.interrupt = True

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                h: torch.Tensor = self.fc(x)
                if self.interrupt:
                    raise KeyboardInterrupt
                return h

        model = Interrupting()
        cap = hs.capture(model, "fc")
        try:
            with pytest.raises(KeyboardInterrupt):
                model(torch.randn(2, 4))
            model.interrupt = False
            model(torch.randn(2, 4))
            first = cap.cache
            model(torch.randn(2, 4))
            assert cap.cache is not first, "passes start again"
            assert [str(site) for site in cap.sites()] == ["fc#0:output"]
            assert mode_stack() == []
        finally:
            cap.remove()
        assert raw_hook_count(model) == 0

    @pytest.mark.usefixtures("watch_everything")
    def test_a_second_thread_passes_through_and_leaves_the_first_pass_whole(self) -> None:
        errors: list[BaseException] = []
        inside: list[int] = []
        other_out: list[torch.Tensor] = []

        class CallsFromAThread(Tracked):
            def __init__(self) -> None:
                super().__init__()
                self.fc = nn.Linear(4, 4)
                self.spawn = True

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                h: torch.Tensor = self.fc(x)  # kept and watched: the guard is on in this thread now
                if self.spawn:
                    self.spawn = False
                    other = threading.Thread(target=self.other_thread, args=(x,))
                    other.start()
                    other.join(timeout=60)
                    inside.append(len(mode_stack()))
                    h.mul_(0)  # the guard must still be on to save the kept value
                return h

            def other_thread(self, x: torch.Tensor) -> None:
                try:
                    other_out.append(self(x))  # a plain forward on this thread: not captured
                except Exception as error:
                    errors.append(error)

        model = CallsFromAThread()
        x = torch.randn(2, 4)
        with torch.no_grad():
            expected = model.fc(x)
            with hs.capture(model, "fc") as cap:
                model(x)
        assert errors == []
        assert torch.equal(other_out[0], expected)  # the other thread's forward: plain, not captured
        assert inside == [1], "the first thread's pass stayed open, guard on"
        assert torch.equal(cap["fc"], expected)
        assert mode_stack() == []

    def test_train_eval_changes_made_inside_are_kept(self) -> None:
        model = SmallCNN().eval()
        with hs.capture(model, "fc"):
            model.train()
        assert model.training


class TestCallsAndStop:
    def test_last_call_with_recursion_pairs_input_and_output_of_one_call(self) -> None:
        class Recursive(Tracked):
            def __init__(self) -> None:
                super().__init__()
                self.fc = nn.Linear(4, 4)

            def forward(self, x: torch.Tensor, depth: int = 2) -> torch.Tensor:
                out: torch.Tensor = self(self.fc(x), depth - 1) if depth else x
                return out

        model = Recursive()
        _, cache = hs.run_with_capture(model, torch.randn(1, 4), layers="", keep="both", calls="last")
        assert sorted({site.call for site in cache.sites()}) == [2]

    def test_stop_needs_a_known_call(self) -> None:
        with pytest.raises(hs.SpecError, match="stop=True cannot keep calls='last'"):
            hs.capture(Looped(), "block", stop=True, calls="last")

    def test_a_model_that_swallows_the_stop_is_reported(self) -> None:
        class Fallback(Tracked):
            def __init__(self) -> None:
                super().__init__()
                self.fast = nn.Linear(4, 4)
                self.slow = nn.Linear(4, 4)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                try:
                    h: torch.Tensor = self.fast(x)
                except Exception:
                    h = self.slow(x)
                return h

        model = Fallback()
        with pytest.raises(hs.CaptureError, match="caught hookscope's stop signal"):
            hs.run_with_capture(model, torch.randn(1, 4), layers="fast", stop=True)
        assert raw_hook_count(model) == 0


class TestValuesAndMessages:
    def test_small_view_of_a_large_storage_is_copied(self) -> None:
        class Slice(Tracked):
            def __init__(self) -> None:
                super().__init__()
                self.head = nn.Identity()

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                out: torch.Tensor = self.head(x[:, :1])
                return out

        _, cache = hs.run_with_capture(Slice(), torch.randn(512, 512), layers="head")
        assert cache["head"].untyped_storage().nbytes() == 512 * 4

    def test_budget_is_checked_before_casting(self) -> None:
        with pytest.raises(
            hs.CaptureError,
            match=r"capture would hold 112 KiB, over max_bytes=100 KiB, at .conv1#0:output. \(112 KiB\)",
        ):
            hs.run_with_capture(SmallCNN(), SmallCNN.example(), layers="conv1", dtype=torch.float64, max_bytes="100KiB")

    def test_module_without_tensor_output_says_so(self) -> None:
        from tests.models import MixedOutputs

        _, cache = hs.run_with_capture(MixedOutputs(), torch.ones(2), layers=["none_out", "tuple_out"])
        with pytest.raises(hs.SiteNotFoundError, match=r"'none_out' ran, but its output held no tensor \(NoneType\)"):
            cache["none_out"]

    def test_reduce_that_does_not_fit_names_the_site(self) -> None:
        with pytest.raises(hs.SpecError, match=r"reduce='mean:2' failed on 'fc#0:output', a \(1, 10\) float32 tensor"):
            hs.run_with_capture(SmallCNN(), SmallCNN.example(), layers="fc", reduce="mean:2")

    def test_calls_ignores_a_call_index(self) -> None:
        _, cache = hs.run_with_capture(Looped(steps=3), torch.randn(1, 4), layers="block")
        assert len(cache.calls("block#2")) == 3

    def test_copy_false_under_inference_mode_is_refused(self) -> None:
        with torch.inference_mode(), pytest.raises(hs.CaptureError, match="no version counter"):
            hs.run_with_capture(LinearInplaceReLU(), torch.randn(2, 4), layers="fc", copy=False)

    def test_inference_mode_default_is_correct(self) -> None:
        model = LinearInplaceReLU()
        x = torch.randn(64, 4)
        with torch.inference_mode():
            reference = model.fc(x)
            _, cache = hs.run_with_capture(model, x, layers="fc")
        assert torch.equal(cache["fc"], reference)

    def test_meta_tensors(self) -> None:
        model = SmallCNN().to("meta")
        _, cache = hs.run_with_capture(model, SmallCNN.example().to("meta"), layers="conv1")
        assert cache["conv1"].device.type == "meta"
        assert cache["conv1"].shape == (1, 16, 30, 30)

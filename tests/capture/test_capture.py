"""capture() and run_with_capture(): values equal references computed by hand, whatever runs later."""

from __future__ import annotations

import gc
import warnings
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import hookscope as hs
import hookscope._capture.keeper as keeper
from hookscope._core.sites import Site
from tests.conftest import raw_hook_count
from tests.models import (
    KeywordOnly,
    LinearInplaceReLU,
    Looped,
    MixedOutputs,
    Nested,
    RaisesMidForward,
    Residual,
    SharedTwice,
    SmallCNN,
    gpt2_input,
    tiny_gpt2,
    tiny_resnet,
    track,
)


def function_mode_stack_depth() -> int:
    return len(torch.overrides._get_current_function_mode_stack())


@pytest.fixture(params=["small values copied", "every value watched"])
def both_paths(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run a test once as configured and once with the copy-on-write guard watching every value."""
    if request.param == "every value watched":
        monkeypatch.setattr(keeper, "EAGER_COPY_BYTES", 0)


@pytest.mark.usefixtures("both_paths")
class TestNeverSilentlyWrong:
    def test_inplace_relu_after_linear(self) -> None:
        model = LinearInplaceReLU()
        x = torch.randn(16, 4)
        reference = model.fc(x).detach()
        assert (reference < 0).any()
        with hs.capture(model, "fc") as cap:
            model(x)
        torch.testing.assert_close(cap["fc"], reference, rtol=0, atol=0)

    def test_residual_plus_equals(self) -> None:
        model = Residual().eval()
        x = Residual.example()
        reference = model.bn(model.conv(x)).detach()
        out, cache = hs.run_with_capture(model, x, layers=["bn", "conv"])
        assert torch.equal(cache["bn"], reference)
        assert not torch.equal(cache["bn"], out), "the model's own tensor did change"

    def test_inplace_relu_input_kept_as_it_came(self) -> None:
        model = LinearInplaceReLU()
        x = torch.randn(16, 4)
        reference = model.fc(x).detach()
        _, cache = hs.run_with_capture(model, x, layers="act", keep="both")
        assert torch.equal(cache["act:input"], reference)
        assert torch.equal(cache["act:output"], reference.relu())

    def test_setitem_and_out_kwarg_are_seen(self) -> None:
        class Writes(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.a = nn.Linear(3, 3)
                self.b = nn.Linear(3, 3)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                first = self.a(x)
                first[0] = 0.0
                second = self.b(x)
                torch.add(x, x, out=second)
                return first + second

        model = track(Writes())
        x = torch.randn(2, 3)
        with torch.no_grad():  # out= needs no_grad
            expected_a, expected_b = model.a(x), model.b(x)
            with hs.capture(model, "a", "b") as cap:
                model(x)
        assert torch.equal(cap["a"], expected_a)
        assert torch.equal(cap["b"], expected_b)

    def test_only_written_values_are_copied(self) -> None:
        model = track(nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4)))
        x = torch.randn(2, 4)
        with torch.no_grad():
            hidden = model[0](x)
        with hs.capture(model, "0", "2") as cap, torch.no_grad():
            out = model(x)
        assert torch.equal(cap["0"], hidden)
        assert cap["2"].untyped_storage().data_ptr() != out.untyped_storage().data_ptr(), (
            "a value that leaves the forward as the model's output is copied, so later writes cannot reach it"
        )

    def test_output_escaping_the_forward_is_protected(self) -> None:
        model = SmallCNN()
        x = SmallCNN.example()
        out, cache = hs.run_with_capture(model, x, layers="fc")
        kept = cache["fc"].clone()
        out.mul_(0)
        assert torch.equal(cache["fc"], kept)

    def test_no_copy_mode_raises_on_read_after_a_change(self) -> None:
        model = LinearInplaceReLU()
        x = torch.randn(16, 4)
        _, cache = hs.run_with_capture(model, x, layers="fc", copy=False)
        with pytest.raises(hs.CaptureError, match="changed in place after it was captured.*copy=True"):
            cache["fc"]

    def test_no_copy_mode_reads_untouched_values(self) -> None:
        model = SmallCNN()
        x = SmallCNN.example()
        _, cache = hs.run_with_capture(model, x, layers="conv1", copy=False)
        assert torch.equal(cache["conv1"], model.conv1(x).detach())

    def test_copy_true_copies_everything(self) -> None:
        model = SmallCNN()
        x = SmallCNN.example()
        with torch.no_grad():
            out, cache = hs.run_with_capture(model, x, layers="fc", copy=True)
        assert cache["fc"].untyped_storage().data_ptr() != out.untyped_storage().data_ptr()

    def test_guard_leaves_no_function_mode_behind_even_on_error(self) -> None:
        depth = function_mode_stack_depth()
        model = RaisesMidForward()
        with pytest.raises(RuntimeError, match="boom"), hs.capture(model, "first"):
            model(torch.ones(1, 4))
        assert function_mode_stack_depth() == depth
        assert raw_hook_count(model) == 0


class TestWhatIsKept:
    def test_module_called_three_times_keeps_every_call_in_order(self) -> None:
        model = Looped(steps=3)
        x = torch.randn(2, 4)
        expected, h = [], x
        with torch.no_grad():
            for _ in range(3):
                expected.append(model.block(h))
                h = torch.tanh(expected[-1])
        _, cache = hs.run_with_capture(model, x, layers="block")
        assert [s.call for s in cache.sites()] == [0, 1, 2]
        for got, want in zip(cache.calls("block"), expected, strict=True):
            assert torch.equal(got, want)
        assert torch.equal(cache["block"], expected[2]), "the last call by default"
        assert torch.equal(cache["block#0"], expected[0])

    @pytest.mark.parametrize(("calls", "kept"), [("first", [0]), ("last", [2]), (1, [1]), ("all", [0, 1, 2])])
    def test_calls_option(self, calls: hs.capture.__annotations__, kept: list[int]) -> None:  # type: ignore[name-defined]
        _, cache = hs.run_with_capture(Looped(steps=3), torch.randn(1, 4), layers="block", calls=calls)
        assert [site.call for site in cache.sites()] == kept

    def test_shared_module_calls(self) -> None:
        model = SharedTwice()
        x = torch.randn(1, 4)
        with torch.no_grad():
            first = model.shared(x)
            second = model.shared(torch.relu(first))
        _, cache = hs.run_with_capture(model, x, layers=model.alias)
        assert [torch.equal(a, b) for a, b in zip(cache.calls("shared"), [first, second], strict=True)] == [True, True]

    def test_structured_outputs_by_tree_path(self) -> None:
        model = MixedOutputs()
        x = torch.ones(2)
        _, cache = hs.run_with_capture(model, x, layers=["tuple_out", "dict_out", "dataclass_out", "named_out"])
        assert torch.equal(cache["tuple_out"], x * 2), "the only tensor of a tuple"
        assert torch.equal(cache["tuple_out:output[0]"], x * 2)
        assert torch.equal(cache["dict_out:output['b'][0]"], x * 2 - 1)
        assert torch.equal(cache["dataclass_out:output.value"], (x * 2 + 1) * 3)
        assert torch.equal(cache["named_out#0:output.hidden"], (x * 2 + 1) * 3 / 2)
        with pytest.raises(hs.SiteNotFoundError, match=r"holds 2 tensors; name one of: 'dict_out:output\['a'\]'"):
            cache["dict_out"]

    @pytest.mark.transformers
    def test_model_output_of_gpt2(self) -> None:
        model = tiny_gpt2()
        ids = gpt2_input()
        with torch.no_grad():
            reference = model(ids, output_hidden_states=True)
            tokens = model.wte(ids)
        out, cache = hs.run_with_capture(model, ids, layers=["", "wte", "h.0", "h.1.mlp"], output_hidden_states=True)
        assert torch.equal(cache["wte"], tokens)
        assert torch.equal(
            cache["h.0:output[0]"] if "h.0:output[0]" in cache else cache["h.0"], reference.hidden_states[1]
        )
        assert torch.equal(cache[":output.last_hidden_state"], reference.last_hidden_state)
        assert torch.equal(cache[":output.hidden_states[2]"], reference.hidden_states[2])
        assert torch.equal(out.last_hidden_state, reference.last_hidden_state)

    @pytest.mark.transformers
    def test_resnet_from_transformers_with_plus_equals(self) -> None:
        model = tiny_resnet()
        x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
        block = model.encoder.stages[0].layers[0]
        with torch.no_grad():
            embedded = model.embedder(x)
            reference = block.layer(embedded)
            after_block = block(embedded)
        name = "encoder.stages.0.layers.0"
        _, cache = hs.run_with_capture(model, x, layers=[f"{name}.layer.1", f"{name}.layer.1.activation", name])
        assert torch.equal(cache[f"{name}.layer.1"], reference)
        assert torch.equal(cache[f"{name}.layer.1.activation"], reference)
        assert torch.equal(cache[name], after_block)

    def test_keyword_inputs(self) -> None:
        model = KeywordOnly()
        x = torch.randn(2, 4)
        _, cache = hs.run_with_capture(model, x, layers="block", keep="input")
        assert torch.equal(cache["block:input[0]"], x)
        assert torch.equal(cache["block:input['scale']"], torch.full((1,), 2.0))
        assert {site.what for site in cache.sites()} == {"input"}
        assert torch.equal(cache["block:input[0]"], cache["block#0:input[0]"])

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    def test_half_precision_models(self, dtype: torch.dtype) -> None:
        model = SmallCNN().to(dtype)
        x = SmallCNN.example().to(dtype)
        with torch.no_grad():
            reference = model.relu(model.conv1(x))
        _, cache = hs.run_with_capture(model, x, layers="relu")
        assert cache["relu"].dtype == dtype
        assert torch.equal(cache["relu"], reference)
        _, wide = hs.run_with_capture(model, x, layers="relu", dtype=torch.float32)
        assert torch.equal(wide["relu"], reference.float())

    def test_reduce_on_device_before_keeping(self) -> None:
        model = SmallCNN()
        x = SmallCNN.example()
        with torch.no_grad():
            conv = model.conv1(x)
        _, cache = hs.run_with_capture(model, x, layers="conv1", reduce="mean:2,3")
        torch.testing.assert_close(cache["conv1"], conv.mean(dim=(2, 3)))
        _, custom = hs.run_with_capture(model, x, layers="conv1", reduce=lambda t: t[:, :2])
        assert custom["conv1"].shape == (1, 2, 30, 30)

    def test_detach_false_keeps_the_graph(self) -> None:
        model = SmallCNN()
        x = SmallCNN.example().requires_grad_()
        _, cache = hs.run_with_capture(model, x, layers="fc", detach=False)
        cache["fc"].sum().backward()
        assert x.grad is not None
        _, detached = hs.run_with_capture(model, x, layers="fc")
        assert detached["fc"].grad_fn is None
        assert not detached["fc"].requires_grad

    @pytest.mark.parametrize("batch", [1, 80])
    def test_detach_false_keeps_the_models_own_tensor_at_every_size(self, batch: int) -> None:
        """The gradient of a logit with respect to a kept block output equals the one taken from
        a raw hook's reference, for a value far under the eager-copy size and one over it."""
        model = tiny_gpt2()
        ids = torch.randint(0, 64, (batch, 8), generator=torch.Generator().manual_seed(1))
        with hs.capture(model, "h.0", detach=False) as cap:
            out = model(ids)
        assert (cap["h.0"].numel() * 4 <= keeper.EAGER_COPY_BYTES) == (batch == 1)
        grad = torch.autograd.grad(out.last_hidden_state[0, -1, 3], cap["h.0"])[0]
        seen: dict[str, torch.Tensor] = {}
        handle = model.h[0].register_forward_hook(
            lambda _m, _a, o: seen.update(v=o if isinstance(o, torch.Tensor) else o[0])
        )
        try:
            reference_out = model(ids)
        finally:
            handle.remove()
        reference = torch.autograd.grad(reference_out.last_hidden_state[0, -1, 3], seen["v"])[0]
        torch.testing.assert_close(grad, reference, rtol=0, atol=0)
        torch.testing.assert_close(out.last_hidden_state, reference_out.last_hidden_state, rtol=0, atol=0)

    def test_detach_false_value_survives_an_inplace_write_and_stays_in_the_graph(self) -> None:
        """Linear -> ReLU(inplace): the kept output is the pre-ReLU value, and its gradient is
        the one autograd gives for the unfused reference computation."""
        model = LinearInplaceReLU()
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(2))
        with hs.capture(model, "fc", detach=False) as cap:
            out = model(x)
        pre = model.fc(x)
        reference = torch.autograd.grad((model.act.__class__()(pre) * 2).sum(), pre)[0]
        torch.testing.assert_close(cap["fc"].detach(), pre.detach(), rtol=0, atol=0)
        torch.testing.assert_close(torch.autograd.grad((out * 2).sum(), cap["fc"])[0], reference, rtol=0, atol=0)

    def test_detach_false_input_is_in_the_graph(self) -> None:
        model = LinearInplaceReLU()
        x = torch.randn(3, 4, requires_grad=True, generator=torch.Generator().manual_seed(3))
        with hs.capture(model, "act", keep="input", detach=False) as cap:
            out = model(x)
        pre = model.fc(x)
        reference = torch.autograd.grad(torch.relu(pre).sum(), pre)[0]
        torch.testing.assert_close(torch.autograd.grad(out.sum(), cap["act"])[0], reference, rtol=0, atol=0)

    def test_device_cpu_keeps_cpu_values(self) -> None:
        _, cache = hs.run_with_capture(SmallCNN(), SmallCNN.example(), layers="fc", device="cpu")
        assert cache["fc"].device.type == "cpu"

    def test_each_forward_starts_a_new_cache(self) -> None:
        model = SmallCNN()
        with hs.capture(model, "fc") as cap:
            model(SmallCNN.example())
            first = cap.cache
            model(SmallCNN.example())
        assert cap.cache is not first
        assert len(cap) == 1
        assert len(first) == 1


class TestStop:
    @pytest.mark.transformers
    def test_stop_returns_the_same_values_as_a_full_run(self) -> None:
        model = tiny_gpt2()
        ids = gpt2_input()
        full_out, full = hs.run_with_capture(model, ids, layers=["wte", "h.0.mlp"])
        ran: list[str] = []
        with hs.hooks(model, {"h.1": lambda m, a, o: ran.append("h.1")}):
            out, stopped = hs.run_with_capture(model, ids, layers=["wte", "h.0.mlp"], stop=True)
        assert out is None
        assert full_out is not None
        assert ran == [], "the rest of the model did not run"
        assert list(stopped) == list(full)
        for key in full:
            assert torch.equal(stopped[key], full[key])
        assert raw_hook_count(model) == 0
        assert torch.equal(model(ids).last_hidden_state, full_out.last_hidden_state), "the model is left usable"

    def test_stop_in_a_with_block_ends_the_block(self) -> None:
        model = SmallCNN()
        after: list[str] = []
        with hs.capture(model, "conv1", stop=True) as cap:
            model(SmallCNN.example())
            after.append("not reached")
        assert after == []
        assert cap["conv1"].shape == (1, 16, 30, 30)
        assert function_mode_stack_depth() == 0

    def test_stop_at_a_chosen_call(self) -> None:
        _, cache = hs.run_with_capture(Looped(steps=4), torch.randn(1, 4), layers="block", calls=1, stop=True)
        assert [site.call for site in cache.sites()] == [1]


class TestBudget:
    def test_over_budget_names_sites_and_removes_hooks(self) -> None:
        model = SmallCNN()
        with pytest.raises(
            hs.CaptureError,
            match=r"hold 112 KiB, over max_bytes=58 KiB, at 'relu#0:output'.*largest kept: conv1#0:output \(56.2 KiB\)",
        ):
            hs.run_with_capture(model, SmallCNN.example(), layers=["conv1", "relu"], max_bytes=58 * 1024 - 1)
        assert raw_hook_count(model) == 0

    def test_budget_as_text_and_reduce_fits(self) -> None:
        _, cache = hs.run_with_capture(SmallCNN(), SmallCNN.example(), layers="conv1", reduce="mean", max_bytes="1KiB")
        assert cache.nbytes == 4


class TestMemory:
    @pytest.mark.slow
    def test_repeated_captures_hold_no_graph_and_do_not_grow(self) -> None:
        model = SmallCNN()

        def step() -> weakref.ref[torch.Tensor]:
            x = torch.randn(2, 3, 16, 16, requires_grad=True)
            out, cache = hs.run_with_capture(model, x, layers=["conv1", "relu", "fc"])
            assert all(not t.requires_grad and t.grad_fn is None for t in cache.values())
            return weakref.ref(out)

        for _ in range(1000):  # the allocator settles first; a leak would grow every block alike
            step()
        gc.collect()
        before = _rss()
        refs = [step() for _ in range(1000)]
        gc.collect()
        grown = _rss() - before
        assert all(ref() is None for ref in refs), "no output (and so no graph) is kept alive"
        assert grown < 1 << 20, f"memory grew by {grown} bytes over 1000 captures"


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


class TestCacheApi:
    def make(self) -> hs.Cache:
        _, cache = hs.run_with_capture(Nested(), torch.randn(2, 4), layers=["stem.0.0", "heads.*"])
        return cache

    def test_keys_sites_and_lookup_errors(self) -> None:
        cache = self.make()
        assert list(cache) == ["stem.0.0#0:output", "heads.main#0:output", "heads.aux#0:output"]
        assert cache.sites()[0] == Site("stem.0.0", 0, "output", "")
        assert cache[Site("heads.aux", 0)].shape == (2, 3)
        assert "heads.main" in cache
        assert "heads.mian" not in cache
        with pytest.raises(
            hs.SiteNotFoundError, match="nothing was captured for 'heads.mian'; did you mean 'heads.main'"
        ):
            cache["heads.mian"]
        with pytest.raises(hs.SiteNotFoundError, match=r"call 3 was not captured; calls kept: \[0\]"):
            cache["heads.main#3"]
        with pytest.raises(hs.SiteNotFoundError, match="'input' of 'heads.main' was not kept; kept: output"):
            cache["heads.main:input"]
        with pytest.raises(KeyError):
            cache["nope"]

    def test_the_root_is_named_as_tables_show_it(self) -> None:
        model = track(nn.Sequential(nn.Linear(4, 3), nn.ReLU()))
        output, cache = hs.run_with_capture(model, torch.randn(2, 4), layers=["", "0"])
        assert torch.equal(cache["(root)"], output)  # the label tables and messages give the model
        assert torch.equal(cache["(root)#0:output"], cache[""])

    def test_numpy_to_nbytes_repr(self) -> None:
        cache = self.make()
        arrays = cache.numpy()
        assert set(arrays) == {"stem.0.0", "heads.main", "heads.aux"}  # each module's only site: its name
        assert isinstance(arrays["heads.aux"], np.ndarray)
        assert cache.nbytes == sum(a.nbytes for a in arrays.values())
        assert cache.to("cpu")["heads.aux"].device.type == "cpu"
        text = repr(cache)
        assert text.splitlines()[0] == "Cache: 3 tensors, 104 B"
        assert "heads.aux#0:output    (2, 3)   float32   cpu      24 B" in text
        left = '<td style="text-align:left">'
        assert f"{left}heads.aux#0:output</td>{left}(2, 3)</td>" in cache._repr_html_()

    def test_bf16_numpy_is_converted_explicitly(self) -> None:
        model = SmallCNN().to(torch.bfloat16)
        _, cache = hs.run_with_capture(model, SmallCNN.example().bfloat16(), layers="fc")
        array = cache.numpy()["fc"]
        assert array.dtype == np.float32
        np.testing.assert_array_equal(array, cache["fc"].float().numpy())

    @pytest.mark.parametrize("suffix", [".safetensors", ".npz", ".pt"])
    def test_save_load_round_trip(self, tmp_path: Path, suffix: str) -> None:
        model = MixedOutputs()
        _, cache = hs.run_with_capture(model, torch.ones(2).bfloat16(), layers=["tuple_out", "dict_out"], keep="both")
        path = cache.save(tmp_path / f"feats{suffix}")
        loaded = hs.load(path)
        assert loaded.sites() == cache.sites()
        for key in cache:
            assert loaded[key].dtype == cache[key].dtype == torch.bfloat16
            assert torch.equal(loaded[key].view(torch.int16), cache[key].view(torch.int16))
        assert loaded.meta["hookscope"] == hs.__version__
        assert loaded.meta["torch"] == torch.__version__
        assert loaded.meta["keep"] == "both"
        assert [p.name for p in tmp_path.iterdir()] == [f"feats{suffix}"]

    def test_capture_object_reads_like_its_cache(self, tmp_path: Path) -> None:
        model = SmallCNN()
        with hs.capture(model, "conv1", "fc") as cap:
            model(SmallCNN.example())
            assert cap.live
        assert not cap.live
        assert list(cap) == list(cap.cache)
        assert len(cap) == 2
        assert cap.nbytes == cap.cache.nbytes
        assert set(cap.numpy()) == set(cap.cache.short_names().values())
        assert "fc" in cap
        assert cap.sites() == cap.cache.sites()
        assert hs.load(cap.save(tmp_path / "c.npz"))["fc"].shape == (1, 10)
        assert "removed" in repr(cap)


class TestBadInput:
    @pytest.mark.parametrize(
        ("options", "message"),
        [
            ({"keep": "outputs"}, "keep='outputs' is not one of"),
            ({"calls": -1}, "calls=-1 is not 'all'.*use calls='last'"),
            ({"calls": "every"}, "calls='every'"),
            ({"reduce": "avg:1"}, "reduce='avg:1' names no reduction"),
            ({"reduce": "mean:x"}, "dimensions must be integers"),
            ({"reduce": "first"}, "needs exactly one dimension"),
            ({"dtype": "half-ish"}, "dtype .half-ish. is not understood; expected one of"),
            ({"max_bytes": "lots"}, "size 'lots' is not understood"),
            ({"max_bytes": 0}, "must be positive"),
            ({"copy": "sometimes"}, "copy='sometimes' is not one of"),
        ],
    )
    def test_bad_options_attach_nothing(self, options: dict[str, object], message: str) -> None:
        model = SmallCNN()
        with pytest.raises(hs.SpecError, match=message):
            hs.capture(model, "fc", **options)  # type: ignore[arg-type]
        assert raw_hook_count(model) == 0

    def test_no_selector(self) -> None:
        with pytest.raises(hs.SpecError, match="at least one selector"):
            hs.capture(SmallCNN())

    def test_selector_typo(self) -> None:
        with pytest.raises(hs.SelectionError, match="did you mean 'conv1'"):
            hs.run_with_capture(SmallCNN(), SmallCNN.example(), layers="conv")

    def test_load_a_foreign_file(self, tmp_path: Path) -> None:
        path = tmp_path / "weights.npz"
        np.savez(path, weight=np.zeros(3))
        with pytest.raises(hs.FileFormatError, match="tensor named 'weight', not a hookscope site"):
            hs.load(path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_values_copied_to_pinned_cpu_memory() -> None:
    model = SmallCNN().cuda()
    x = SmallCNN.example().cuda()
    with torch.no_grad():
        reference = model.conv1(x).cpu()
    _, cache = hs.run_with_capture(model, x, layers=["conv1", "fc"], device="cpu")
    assert cache["conv1"].device.type == "cpu"
    assert cache["conv1"].is_pinned()
    assert torch.equal(cache["conv1"], reference)


class TestCastOverflow:
    """dtype=float16 turns values past 65504 into inf: said (count and site), refused, or kept."""

    @staticmethod
    def loud_gpt2() -> tuple[nn.Module, torch.Tensor, int]:
        """A GPT-2 whose embeddings are large enough that block outputs pass float16's range, and
        how many values of block 0's output numpy's own float16 cast turns into inf."""
        model = tiny_gpt2()
        with torch.no_grad():
            model.wte.weight.mul_(1e7)
        ids = gpt2_input()
        seen: dict[str, torch.Tensor] = {}
        handle = model.h[0].register_forward_hook(
            lambda _m, _a, o: seen.update(v=(o if isinstance(o, torch.Tensor) else o[0]).detach().clone())
        )
        try:
            with torch.no_grad():
                model(ids)
        finally:
            handle.remove()
        values = seen["v"].numpy()
        with np.errstate(over="ignore"):
            expected = int((np.isinf(values.astype(np.float16)) & np.isfinite(values)).sum())
        return model, ids, expected

    def test_a_warning_names_the_site_and_the_count(self) -> None:
        model, ids, expected = self.loud_gpt2()
        assert expected > 0
        with pytest.warns(hs.CastOverflowWarning, match=rf"h\.0#0:output \({expected:,}\)") as caught:
            _, cache = hs.run_with_capture(model, ids, layers="h.0", dtype="fp16")
        assert len(caught) == 1
        assert cache.overflowed == {"h.0#0:output": expected}
        assert int(torch.isinf(cache["h.0"]).sum()) == expected

    def test_error_refuses_and_ignore_keeps_quiet(self) -> None:
        model, ids, expected = self.loud_gpt2()
        with pytest.raises(hs.CaptureError, match="dtype=float16 turned"):
            hs.run_with_capture(model, ids, layers="h.0", dtype="fp16", overflow="error")
        assert raw_hook_count(model) == 0
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _, cache = hs.run_with_capture(model, ids, layers="h.0", dtype="fp16", overflow="ignore")
            _, wide = hs.run_with_capture(model, ids, layers="h.0", dtype="bf16")  # bf16 holds float32's range
        assert cache.overflowed == {"h.0#0:output": expected}
        assert wide.overflowed == {}

    def test_overflow_takes_three_words(self) -> None:
        with pytest.raises(hs.SpecError, match="overflow='loud' is not one of 'warn'"):
            hs.CaptureOptions(overflow="loud")  # type: ignore[arg-type]


class TestNamesHoldingSiteSyntax:
    """PyTorch allows '#' and ':' in module names; the site grammar escapes them."""

    @staticmethod
    def model() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential()
        model.add_module("fc", nn.Linear(2, 2))
        model.add_module("fc#1", nn.Linear(2, 2))
        model.add_module("a:b", nn.Linear(2, 2))
        return model

    def test_keys_name_the_module_they_spell(self) -> None:
        model, x = self.model(), torch.randn(3, 2)
        _, cache = hs.run_with_capture(model, x, layers=["fc", "fc#1", "a:b"])
        with torch.no_grad():
            first = model.get_submodule("fc")(x)
            second = model.get_submodule("fc#1")(first)
            third = model.get_submodule("a:b")(second)
        assert list(cache) == ["fc#0:output", "fc\\#1#0:output", "a\\:b#0:output"]
        assert torch.equal(cache["fc#1"], second)  # fc has no call 1: the module so named
        assert torch.equal(cache["fc\\#1"], second)
        assert torch.equal(cache["fc\\#1#0:output"], second)
        assert torch.equal(cache["a:b"], third)
        assert torch.equal(cache["fc"], first)

    def test_a_key_the_grammar_reads_two_ways_is_refused(self) -> None:
        model = nn.Sequential()
        model.add_module("fc", nn.Linear(2, 2))
        model.add_module("fc#1", nn.Identity())

        class Twice(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.inner = model

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return model.get_submodule("fc#1")(model.fc(model.fc(x)))

        _, cache = hs.run_with_capture(Twice(), torch.randn(1, 2), layers=["inner.fc", "inner.fc#1"])
        with pytest.raises(hs.SiteNotFoundError, match="names two things") as refused:
            cache["inner.fc#1"]
        assert refused.value.candidates == ("inner.fc\\#1", "inner.fc#1:output")
        assert cache["inner.fc\\#1"].shape == (1, 2)

    @pytest.mark.parametrize("suffix", [".npz", ".pt", ".safetensors"])
    def test_saved_files_load_under_the_same_names(self, tmp_path: Path, suffix: str) -> None:
        model, x = self.model(), torch.randn(3, 2)
        _, cache = hs.run_with_capture(model, x, layers=["fc", "fc#1", "a:b"])
        loaded = hs.load(cache.save(tmp_path / f"c{suffix}"))
        assert list(loaded) == list(cache)
        for key in cache:
            assert torch.equal(loaded[key], cache[key])


class TestLeafSelectors:
    """'block.0:output[0]' and 'layers.1:input[0]' pick one tensor of a structured value."""

    @staticmethod
    def t5() -> nn.Module:
        from transformers import T5Config, T5Model

        torch.manual_seed(0)
        config = T5Config(d_model=16, num_layers=2, num_heads=2, d_ff=32, d_kv=8, vocab_size=64)
        return T5Model(config).eval()

    @staticmethod
    def llama() -> nn.Module:
        from transformers import LlamaConfig, LlamaModel

        torch.manual_seed(0)
        config = LlamaConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            vocab_size=64,
        )
        return LlamaModel(config).eval()

    @staticmethod
    def raw(module: nn.Module, model: nn.Module, side: str, **inputs: Any) -> Any:
        seen: dict[str, Any] = {}
        if side == "output":
            handle = module.register_forward_hook(lambda _m, _a, o: seen.update(v=o))
        else:
            handle = module.register_forward_pre_hook(lambda _m, a, k: seen.update(v=(a, k)), with_kwargs=True)
        try:
            with torch.no_grad():
                model(**inputs)
        finally:
            handle.remove()
        return seen["v"]

    def test_one_tensor_of_a_t5_blocks_output(self) -> None:
        model, ids = self.t5(), gpt2_input()
        with torch.no_grad():  # as the raw reference runs: grad mode picks other kernels
            _, cache = hs.run_with_capture(
                model, input_ids=ids, decoder_input_ids=ids, layers="encoder.block.0:output[0]"
            )
        reference = self.raw(model.encoder.block[0], model, "output", input_ids=ids, decoder_input_ids=ids)
        assert list(cache) == ["encoder.block.0#0:output[0]"]  # not the position bias beside it
        assert torch.equal(cache["encoder.block.0"], reference[0])

    def test_one_input_of_a_llama_layer(self) -> None:
        model, ids = self.llama(), gpt2_input()
        with torch.no_grad():
            _, cache = hs.run_with_capture(model, ids, layers="layers.1:input[0]")
        args, kwargs = self.raw(model.layers[1], model, "input", input_ids=ids)
        hidden = args[0] if args else kwargs["hidden_states"]
        assert list(cache) == ["layers.1#0:input[0]"]  # no position_embeddings
        assert torch.equal(cache["layers.1"], hidden)

    def test_a_leaf_that_is_not_there_names_the_ones_that_are(self) -> None:
        model = self.llama()
        with pytest.raises(hs.CaptureError, match=r"'layers.1' input has no tensor at 'input\[3\]'.*position_ids"):
            hs.run_with_capture(model, gpt2_input(), layers="layers.1:input[3]")
        assert raw_hook_count(model) == 0

    def test_extract_stores_one_leaf(self, tmp_path: Path) -> None:
        model, ids = self.t5(), gpt2_input()
        store = hs.extract(
            model,
            {"input_ids": ids, "decoder_input_ids": ids},
            tmp_path / "t5.zarr",
            layers=["encoder.block.0:output[0]", "encoder.block.1:output[0]", "encoder.final_layer_norm"],
            batch_size=2,
            progress=False,
        )
        reference = self.raw(model.encoder.block[0], model, "output", input_ids=ids, decoder_input_ids=ids)
        assert store.sites == ["encoder.block.0", "encoder.block.1", "encoder.final_layer_norm"]  # one array each
        np.testing.assert_array_equal(store["encoder.block.0"][:], reference[0].numpy())


class TestReviewedEdges:
    """Edges of detach=False, leaf selectors, escaped names and overflow counts."""

    def test_detach_false_input_survives_the_callers_later_write(self) -> None:
        class Residual(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lin = nn.Linear(4, 4)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                x = x * 1
                h = self.lin(x)
                x += h  # the caller writes into what lin took, after lin ran
                return x

        torch.manual_seed(0)
        model, given = Residual(), torch.randn(2, 4, requires_grad=True)
        with hs.capture(model, "lin", keep="input", detach=False) as cap:
            model(given)
        torch.testing.assert_close(cap["lin"].detach(), given.detach(), rtol=0, atol=0)

    def test_leaf_selectors_inside_a_list_and_through_a_pattern(self) -> None:
        model = MixedOutputs()
        _, listed = hs.run_with_capture(model, torch.ones(2), layers=[["tuple_out:output[0]"]])
        assert list(listed) == ["tuple_out#0:output[0]"]
        _, patterned = hs.run_with_capture(model, torch.ones(2), layers="*_out:output[0]")  # kept where it exists
        assert "tuple_out#0:output[0]" in list(patterned)
        assert all(site.path.startswith("[0]") for site in patterned.sites())

    def test_escaped_names_under_a_wrapper_find_their_own_module(self) -> None:
        inner = nn.Sequential()
        inner.add_module("fc#1", nn.Linear(2, 2))
        inner.add_module("fc", nn.Linear(2, 2))
        wrapped = nn.DataParallel(inner)
        with torch.no_grad(), hs.capture(wrapped, "fc#1", "fc") as cap:
            wrapped(torch.randn(1, 2))
        own = cap["fc\\#1"]
        assert torch.equal(cap.cache.calls("module.fc#1")[0], own)
        assert torch.equal(cap["module.fc#1"], own)
        assert not torch.equal(own, cap["fc"])

    def test_overflow_counts_follow_the_kept_sites(self) -> None:
        model = SharedTwice()
        with torch.no_grad():
            model.shared.weight.fill_(0.0)
            model.shared.bias.fill_(1e5)  # the first call overflows float16; the second sees 1e5 too
        x = torch.zeros(1, 4)
        with pytest.warns(hs.CastOverflowWarning):
            _, cache = hs.run_with_capture(model, x, layers="shared", dtype="fp16", calls="last")
        assert [str(site) for site in cache.sites()] == ["shared#1:output"]
        assert set(cache.overflowed) == {"shared#1:output"}
        assert cache.to("cpu").overflowed == cache.overflowed


class CalledTwice(nn.Module):
    """``fc`` twice per forward, ``head`` once."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc(torch.relu(self.fc(x))))


def test_calls_that_keep_nothing_of_a_module_that_ran_are_an_error_at_the_pass_end() -> None:
    model, x = CalledTwice(), torch.randn(3, 4)
    with pytest.raises(hs.CaptureError, match=r"calls=1 kept nothing of 'head' ran 1 call in this pass"):
        hs.run_with_capture(model, x, layers=["fc", "head"], calls=1)
    with pytest.raises(hs.CaptureError, match=r"calls=\(2, 3\) kept nothing of 'fc' ran 2 calls"):
        hs.run_with_capture(model, x, layers="fc", calls=[2, 3])
    _, cache = hs.run_with_capture(model, x, layers=["fc", "head"], calls=[0, 1])  # head keeps call 0
    reference = model.fc(torch.relu(model.fc(x))).detach()
    assert torch.equal(cache["fc#1"], reference)
    assert torch.equal(cache["head#0"], model.head(reference).detach())

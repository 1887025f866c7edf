"""Capturing op sites (issue 19, second step): ``hs.capture(model, "h.0.attn:op[softmax#0]")``.

Every captured value is checked against a reference computed without hookscope: the attention
weights transformers returns, attention done by hand from the kernel's own inputs, a residual sum
done by hand, a plain forward.
"""

from __future__ import annotations

import importlib.util
import math
import threading
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional
from torch.utils.checkpoint import checkpoint

import hookscope as hs
from hookscope._core.sites import Site
from tests.models import Tracked, attention_gpt2, attention_tokens, track


def stack_depth() -> int:
    return int(torch._C._len_torch_function_stack())


class Residual(Tracked):
    """``out = conv(x); out += x; out.relu_()``: the kept ``add_`` is written again by ``relu_``."""

    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv(x)
        out += x
        out.relu_()
        return out


class Twice(Tracked):
    """One residual block called twice, then a split into two halves and a softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Residual()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.block(self.block(x))
        return tuple(functional.softmax(half, dim=1) for half in y.split(2, dim=1))


class Boom(Tracked):
    def __init__(self) -> None:
        super().__init__()
        self.block = Residual()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.block(x)
        raise ValueError("boom inside the forward")


def image(size: int = 64) -> torch.Tensor:
    """Large enough (128 KiB at 64) that the kept value is watched by the write guard, not copied at once."""
    return torch.randn(2, 4, size, size, generator=torch.Generator().manual_seed(0))


def by_hand(block: Residual, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return functional.conv2d(x, block.conv.weight, block.conv.bias, padding=1) + x


# -- in-place safety ------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [64, 4], ids=["watched", "copied-at-once"])
def test_an_inplace_add_is_kept_as_the_sum_and_a_later_relu_does_not_change_it(size: int) -> None:
    block = track(Residual())
    x = image(size)
    with torch.no_grad(), hs.capture(block, "(root):op[add_#0]", keep="both") as cap:
        out = block(x)
    want = by_hand(block, x)
    assert bool((want < 0).any()), "the relu_ after the add_ really changes the tensor"
    assert torch.equal(cap[":op[add_#0]"], want)
    assert torch.equal(cap[":op[add_]"], want)
    assert torch.equal(out, want.relu())
    assert torch.equal(cap[":op[add_#0]:input[1]"], x), "the added tensor is kept as an input"
    names = {str(site) for site in cap.sites()}
    assert names == {"#0:op[add_#0]", "#0:op[add_#0]:input[1]"}, "the written argument is the output, not an input"
    assert stack_depth() == 0


def test_a_kept_op_output_is_the_graph_s_own_with_detach_false() -> None:
    block = track(Residual())
    x = image(8).requires_grad_()
    with hs.capture(block, ":op[add_#0]", detach=False) as cap:
        out = block(x)
    kept = cap[":op[add_#0]"]
    assert kept.requires_grad
    torch.testing.assert_close(kept.detach(), by_hand(block, x.detach()))
    (grad,) = torch.autograd.grad(out.sum(), kept)
    assert torch.equal(grad, (out > 0).to(grad.dtype)), "the gradient through the kept add_ is the relu's"


# -- calls, structured outputs, options -----------------------------------------------------------


def test_per_call_indices_of_a_module_called_twice_and_split_leaves() -> None:
    model = track(Twice())
    x = image(8)
    with torch.no_grad(), hs.capture(model, "block:op[add_#0]", "(root):op[split#0]", "(root):op[softmax*]") as cap:
        halves = model(x)
    first = by_hand(model.block, x)
    second = by_hand(model.block, first.relu())
    assert torch.equal(cap["block#0:op[add_#0]"], first)
    assert torch.equal(cap["block#1:op[add_#0]"], second)
    assert torch.equal(cap["block:op[add_#0]"], second), "no call: the last, as for module sites"
    assert [torch.equal(a, b) for a, b in zip(cap.calls("block:op[add_#0]"), (first, second), strict=True)] == [1, 1]
    split = second.relu().split(2, dim=1)
    assert torch.equal(cap[":op[split#0][0]"], split[0])
    assert torch.equal(cap["(root)#0:op[split#0][1]"], split[1])
    assert torch.equal(cap[":op[softmax#1]"], halves[1])
    with pytest.raises(hs.SiteNotFoundError, match=r"names 2 op calls.*softmax#0.*softmax#1"):
        cap[":op[softmax]"]
    with pytest.raises(hs.SiteNotFoundError, match="holds 2 tensors"):
        cap[":op[split#0]"]


def test_calls_filter_reduce_dtype_and_max_bytes_apply_to_op_sites() -> None:
    model = track(Twice())
    x = image(8)
    with torch.no_grad(), hs.capture(model, "block:op[add_#0]", calls="first", reduce="mean:1", dtype="bf16") as cap:
        model(x)
    assert [site.call for site in cap.sites()] == [0]
    kept = cap["block:op[add_#0]"]
    assert kept.dtype == torch.bfloat16
    assert kept.shape == (2, 8, 8)
    torch.testing.assert_close(kept, by_hand(model.block, x).mean(1).bfloat16())
    with torch.no_grad(), hs.capture(model, "block:op[add_]", calls="last") as last:
        model(x)
    assert [str(site) for site in last.sites()] == ["block#1:op[add_#0]"]
    with (
        pytest.raises(hs.CaptureError, match=r"over max_bytes.*block#1:op\[add_#0\]"),
        torch.no_grad(),
        hs.capture(model, "block:op[add_]", max_bytes=2 * 4 * 8 * 8 * 4 + 1),
    ):
        model(x)
    assert stack_depth() == 0


def test_op_and_module_selectors_mix_and_keys_round_trip_through_save_and_load(tmp_path: Path) -> None:
    model = track(Twice())
    x = image(8)
    with torch.no_grad(), hs.capture(model, ["block", "block:op[add_#0]"], ":op[split#0]") as cap:
        model(x)
    assert torch.equal(cap["block#1"], by_hand(model.block, by_hand(model.block, x).relu()).relu())
    names = set(cap.numpy())
    assert {"block#0:output", "block#0:op[add_#0]", "block#1:op[add_#0]", "#0:op[split#0][1]"} <= names
    for site in cap.sites():
        assert Site.parse(str(site)) == site
        assert cap.cache.resolve(str(site)) == site
    suffixes = ["npz", "pt"] + (["safetensors"] if importlib.util.find_spec("safetensors") else [])
    for suffix in suffixes:
        loaded = hs.load(cap.save(tmp_path / f"ops.{suffix}"))
        assert loaded.sites() == cap.sites()
        assert torch.equal(loaded["block#0:op[add_]"], cap["block#0:op[add_#0]"])
        assert torch.equal(loaded[":op[split#0][1]"], cap[":op[split#0][1]"])


def test_passes_all_keeps_each_pass_s_op_values() -> None:
    block = track(Residual())
    xs = [image(4), image(4) * 2]
    with torch.no_grad(), hs.capture(block, ":op[add_#0]", passes="all") as cap:
        for x in xs:
            block(x)
    assert [torch.equal(p[":op[add_#0]"], by_hand(block, x)) for p, x in zip(cap.passes, xs, strict=True)] == [1, 1]


def test_checkpoint_recomputation_neither_adds_nor_replaces_op_values() -> None:
    class Outer(Tracked):
        def __init__(self) -> None:
            super().__init__()
            self.block = Residual()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.block, x, use_reentrant=False) * 3  # type: ignore[no-any-return]

    model = track(Outer())
    x = image(4).requires_grad_()
    with hs.capture(model, "block:op[add_#0]") as cap:
        model(x).sum().backward()
    assert [str(site) for site in cap.sites()] == ["block#0:op[add_#0]"]
    assert torch.equal(cap["block:op[add_#0]"], by_hand(model.block, x.detach()))


# -- errors and lifetime --------------------------------------------------------------------------


def test_an_op_selector_that_never_fired_names_the_ops_the_module_called() -> None:
    block = track(Residual())
    with (
        pytest.raises(hs.CaptureError, match=r"'\(root\):op\[relu\]'.*add_, relu_.*did you mean ':op\[relu_\]'"),
        hs.capture(block, "(root):op[relu]"),
    ):
        block(image(4))
    with (
        pytest.raises(hs.CaptureError, match=r"'add_' ran 1 time\(s\) per call: indices 0 to 0"),
        hs.capture(block, ":op[add_#2]"),
    ):
        block(image(4))
    assert stack_depth() == 0
    assert hs.attached(block) == []


def test_malformed_op_selectors_and_unknown_modules_are_refused_before_anything_attaches() -> None:
    block = track(Residual())
    with pytest.raises(hs.SpecError, match="is not of the form"):
        hs.capture(block, "conv:op[add_#]")
    with pytest.raises(hs.SelectionError):
        hs.capture(block, "convv:op[conv2d]")
    with pytest.raises(hs.SpecError, match="stop=True cannot be used with op selectors"):
        hs.capture(block, "conv:op[conv2d]", stop=True)
    assert hs.attached(block) == []


def test_a_forward_that_raises_leaves_no_hook_and_no_mode() -> None:
    model = track(Boom())
    with (
        pytest.raises(ValueError, match="boom"),
        hs.capture(model, "block:op[add_#0]", "block:op[relu_]"),
    ):
        model(image())
    assert stack_depth() == 0
    assert hs.attached(model) == []
    with pytest.raises(ValueError, match="boom"):
        hs.run_with_capture(model, image(), layers=["block:op[add_#0]"])
    assert stack_depth() == 0
    assert hs.attached(model) == []


def test_other_threads_forwards_pass_through_uncaptured() -> None:
    block = track(Residual())
    seen: list[torch.Tensor] = []
    with torch.no_grad(), hs.capture(block, ":op[add_#0]") as cap:
        thread = threading.Thread(target=lambda: seen.append(block(image(4) * 5)))
        thread.start()
        thread.join(30)
        block(image(4))
    assert torch.equal(seen[0], by_hand(block, image(4) * 5).relu())
    assert [str(site) for site in cap.sites()] == ["#0:op[add_#0]"]
    assert torch.equal(cap[":op[add_#0]"], by_hand(block, image(4)))


def test_run_with_capture_takes_op_selectors() -> None:
    block = track(Residual())
    x = image(4)
    out, cache = hs.run_with_capture(block, x, layers=":op[add_#0]")
    assert torch.equal(cache[":op[add_#0]"], by_hand(block, x))
    assert torch.equal(out, by_hand(block, x).relu())


def test_extract_stores_an_in_place_op_s_value_as_it_was(tmp_path: Path) -> None:
    pytest.importorskip("zarr")
    block = track(Residual())
    x = image(4)
    store = hs.extract(block, x, layers=["conv", ":op[add_#0]"], out=tmp_path / "x.zarr", batch_size=2, progress=False)
    assert store.sites == ["#0:op[add_#0]", "conv"]
    assert torch.equal(torch.from_numpy(store["#0:op[add_#0]"][:]), by_hand(block, x))  # before the relu_ wrote in it


@pytest.mark.slow
@pytest.mark.compile
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
def test_under_torch_compile_op_sites_equal_the_eager_model_s() -> None:
    torch._dynamo.reset()
    model = track(Twice())
    x = image(4)
    with hs.capture(model, "block:op[add_#0]") as eager:
        model(x)
    compiled = torch.compile(model, backend="eager")
    try:
        with hs.capture(compiled, "block:op[add_#0]") as cap:
            compiled(x)  # the watched block runs eagerly inside the compiled forward
        assert stack_depth() == 0
        assert hs.attached(model) == []
        assert sorted(cap) == sorted(eager)
        assert len(cap) == 2
        for site in eager:
            assert torch.equal(cap[site], eager[site])
        torch._dynamo.reset()  # code compiled with the capture's hooks would be stale for the next one
        with (
            pytest.raises(hs.CaptureError, match=r"'\(root\)', which ran and called: no torch op.*eager model's"),
            hs.capture(compiled, "(root):op[split#0]"),
        ):
            compiled(x)  # the wrapper's own forward is compiled code: it calls no op one by one
        assert stack_depth() == 0
        assert hs.attached(model) == []
    finally:
        torch._dynamo.reset()


# -- transformers ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.transformers
def test_gpt2_eager_softmax_op_site_is_the_attention_pattern() -> None:
    model = attention_gpt2("eager")
    with torch.no_grad(), hs.capture(model, "h.*.attn:op[softmax#0]") as cap:
        out = model(attention_tokens(), output_attentions=True)
    for layer in (0, 1):
        assert torch.equal(cap[f"h.{layer}.attn:op[softmax#0]"], out.attentions[layer])
    assert torch.equal(cap["h.0.attn#0:op[softmax#0]"], out.attentions[0])
    assert torch.equal(cap["h.1.attn:op[softmax]"], out.attentions[1])
    with pytest.raises(hs.SiteNotFoundError, match=r"did you mean 'h.0.attn:op\[softmax#0\]'"):
        cap["h.0.attn:op[softmx#0]"]


@pytest.mark.slow
@pytest.mark.transformers
def test_gpt2_sdpa_kernel_output_equals_attention_by_hand_from_its_captured_inputs() -> None:
    model = attention_gpt2("sdpa")
    with torch.no_grad(), hs.capture(model, "h.0.attn:op[scaled_dot_product_attention]", keep="both") as cap:
        model(attention_tokens())
    q, k, v = (cap[f"h.0.attn:op[scaled_dot_product_attention#0]:input[{i}]"] for i in range(3))
    assert q.shape == (2, 2, 8, 16)
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    scores = (q @ k.transpose(-1, -2) / math.sqrt(16)).masked_fill(~causal, float("-inf"))
    want = scores.softmax(-1) @ v
    torch.testing.assert_close(cap["h.0.attn:op[scaled_dot_product_attention]"], want, rtol=0, atol=1e-6)


def test_a_key_for_a_call_not_captured_names_the_op_calls_held() -> None:
    model = track(Twice())
    with torch.no_grad(), hs.capture(model, "block:op[add_#0]", calls="first") as cap:
        model(image(4))
    with pytest.raises(hs.SiteNotFoundError, match=r"call 1 was not captured") as caught:
        cap["block#1:op[add_#0]"]
    assert caught.value.candidates == ("block#0:op[add_#0]",)
    with pytest.raises(hs.SiteNotFoundError, match=r"only op sites of 'block'.*'block:op\[add_#0\]'"):
        cap["block"]
    with pytest.raises(hs.SiteNotFoundError, match=r"input of op 'add_#0' of 'block' was not kept.*keep='both'"):
        cap["block:op[add_#0]:input[1]"]


class FunctionalInplace(nn.Module):
    """``F.relu(x, inplace=True)``: an op named ``relu`` that writes into its argument."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return torch.nn.functional.relu(y, inplace=True) * 2


def test_a_functional_in_place_op_keeps_its_written_argument_as_the_output_only() -> None:
    torch.manual_seed(0)
    model = FunctionalInplace().eval()
    x = torch.randn(3, 4)
    with torch.no_grad():
        before = model.fc(x)
        cap = hs.capture(model, ":op[relu#0]", keep="both")
        with cap:
            model(x)
    cache = cap.cache
    assert torch.equal(cache[":op[relu#0]"], before.clamp(min=0))
    assert not any(key.endswith(":input[0]") for key in cache.numpy())  # the written tensor is the output


def test_an_empty_list_of_selectors_is_still_refused() -> None:
    with pytest.raises(hs.SpecError, match="an empty list selects nothing"):
        hs.capture(nn.Linear(2, 2), [])

"""Attention sub-sites in a capture (issue 19, third step): ``hs.capture(model, "h.*.attn:attn.pattern")``.

Every value is checked against a reference computed without hookscope: the eager twin's
``attn_weights`` (one set of weights built twice), and the arguments and output of each
``scaled_dot_product_attention`` call as a plain ``TorchFunctionMode`` written here sees them.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional
from torch.overrides import TorchFunctionMode

import hookscope as hs
from hookscope._core.op_sites import OpPattern, op_pattern
from hookscope._core.sites import Site
from tests.arch.test_attention_math import MODELS, twins
from tests.models import Tracked, attention_gpt2, attention_tokens, track


def stack_depth() -> int:
    return int(torch._C._len_torch_function_stack())


class Record(TorchFunctionMode):
    """Every ``scaled_dot_product_attention`` call: its arguments and output (no hookscope)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any], torch.Tensor]] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if getattr(func, "__name__", "") == "scaled_dot_product_attention":
            self.calls.append((tuple(args), dict(kwargs), out))
        return out


NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def by_name(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    named = dict(zip(NAMES, args, strict=False))
    named.update(kwargs)
    return named


def scores_by_hand(call: dict[str, Any]) -> torch.Tensor:
    q, k = call["query"], call["key"]
    if k.size(-3) != q.size(-3):
        k = k.repeat_interleave(q.size(-3) // k.size(-3), dim=-3)
    scale = call.get("scale")
    scores = (q @ k.transpose(-2, -1)) * (scale if scale is not None else 1 / math.sqrt(q.size(-1)))
    if call.get("is_causal"):
        scores = scores.masked_fill(~torch.ones(q.size(-2), k.size(-2), dtype=torch.bool).tril(), float("-inf"))
    mask = call.get("attn_mask")
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return scores


def pattern_times_value(pattern: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    if value.size(-3) != pattern.size(-3):
        value = value.repeat_interleave(pattern.size(-3) // value.size(-3), dim=-3)
    return pattern @ value


class TwoCalls(Tracked):
    """Two SDPA calls in one forward: causal self-attention, then attention under a boolean mask."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 24)
        self.fail = fail

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.proj(x).view(x.size(0), x.size(1), 3, 2, 4).permute(2, 0, 3, 1, 4)
        first = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        mask = torch.ones(x.size(1), x.size(1), dtype=torch.bool).triu()
        second = functional.scaled_dot_product_attention(first, k, v, attn_mask=mask)
        if self.fail:
            raise ValueError("boom after the kernel")
        return second.transpose(1, 2).reshape(x.size(0), x.size(1), 8)


def inputs() -> torch.Tensor:
    return torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0))


# -- grammar --------------------------------------------------------------------------------------


def test_sub_site_text_round_trips_and_leaves_out_index_0() -> None:
    site = Site("h.0.attn", 0, "output", "", op="attn.pattern#0")
    assert str(site) == "h.0.attn#0:attn.pattern"
    assert Site.parse("h.0.attn#0:attn.pattern") == site
    assert Site.parse("h.0.attn:attn.pattern") == site
    second = Site("h.0.attn", 1, "output", "", op="attn.z#1")
    assert str(second) == "h.0.attn#1:attn.z#1"
    assert Site.parse(str(second)) == second
    with pytest.raises(hs.SpecError, match=r"attn\.q, attn\.k, attn\.v, attn\.scores, attn\.pattern, attn\.z"):
        Site.parse("h.0.attn:attn.weights")


def test_sub_site_selectors_parse_to_the_kernel_s_op_calls() -> None:
    pattern = op_pattern("h.*.attn:attn.pattern")
    assert isinstance(pattern, OpPattern)
    assert (pattern.module, pattern.op, pattern.index) == ("h.*.attn", "scaled_dot_product_attention", None)
    assert pattern.sub == "pattern"
    assert str(pattern) == "h.*.attn:attn.pattern"
    assert str(op_pattern("h.0.attn#1:attn.z#1")) == "h.0.attn#1:attn.z#1"
    with pytest.raises(hs.SpecError, match="attn.scores"):
        op_pattern("h.0.attn:attn.weights")


# -- a module of our own: two kernel calls --------------------------------------------------------


def test_every_sub_site_of_two_kernel_calls_equals_the_reference() -> None:
    model = track(TwoCalls())
    x = inputs()
    selectors = [f":attn.{kind}" for kind in ("q", "k", "v", "scores", "pattern", "z")]
    with torch.no_grad(), hs.capture(model, selectors) as cap:
        model(x)
    record = Record()
    with torch.no_grad(), record:
        model(x)
    assert len(record.calls) == 2
    for index, (args, kwargs, out) in enumerate(record.calls):
        call = by_name(args, kwargs)
        suffix = f"#{index}" if index else ""
        for kind, name in (("q", "query"), ("k", "key"), ("v", "value")):
            assert torch.equal(cap[f":attn.{kind}{suffix}"], call[name])
        assert torch.equal(cap[f":attn.z{suffix}"], out)
        torch.testing.assert_close(cap[f":attn.scores{suffix}"], scores_by_hand(call), rtol=0, atol=1e-6)
        pattern = cap[f":attn.pattern{suffix}"]
        torch.testing.assert_close(pattern, scores_by_hand(call).softmax(-1), rtol=0, atol=1e-6)
        torch.testing.assert_close(pattern_times_value(pattern, call["value"]), out, rtol=0, atol=1e-6)
    assert "#0:attn.pattern" in set(cap.numpy())
    assert "#0:attn.pattern#1" in set(cap.numpy())
    assert stack_depth() == 0


def test_an_index_picks_one_kernel_call_and_keep_both_adds_nothing() -> None:
    model = track(TwoCalls())
    with torch.no_grad(), hs.capture(model, ":attn.pattern#1", keep="both") as cap:
        model(inputs())
    assert [str(site) for site in cap.sites()] == ["#0:attn.pattern#1"]


def test_reduce_dtype_calls_and_max_bytes_apply_to_a_sub_site() -> None:
    model = track(TwoCalls())
    x = inputs()
    with torch.no_grad(), hs.capture(model, ":attn.pattern#0", reduce="mean:1", dtype="bf16") as cap:
        model(x)
    with torch.no_grad(), hs.capture(model, ":attn.pattern#0") as full:
        model(x)
    kept = cap[":attn.pattern"]
    assert kept.dtype == torch.bfloat16
    assert kept.shape == (2, 5, 5)
    torch.testing.assert_close(kept, full[":attn.pattern"].mean(1).bfloat16())
    with (
        pytest.raises(hs.CaptureError, match=r"over max_bytes.*attn\.pattern"),
        torch.no_grad(),
        hs.capture(model, ":attn.pattern", max_bytes=2 * 2 * 5 * 5 * 4 + 1),
    ):
        model(x)
    assert stack_depth() == 0


def test_max_bytes_refuses_a_pattern_before_it_is_computed(monkeypatch: pytest.MonkeyPatch) -> None:
    import hookscope._arch.attention as attention

    computed: list[int] = []
    real = attention.attention_scores
    monkeypatch.setattr(attention, "attention_scores", lambda *a, **k: computed.append(1) or real(*a, **k))
    model = track(TwoCalls())
    with (
        pytest.raises(hs.CaptureError, match=r"over max_bytes.*'#0:attn\.scores' \(400 B"),
        torch.no_grad(),
        hs.capture(model, ":attn.scores#0", max_bytes=399),
    ):
        model(inputs())
    assert computed == []
    with torch.no_grad(), hs.capture(model, ":attn.scores#0", max_bytes=400) as cap:
        model(inputs())
    assert computed == [1]
    assert cap[":attn.scores"].shape == (2, 2, 5, 5)


def test_keys_round_trip_through_save_and_load(tmp_path: Path) -> None:
    model = track(TwoCalls())
    with torch.no_grad(), hs.capture(model, ":attn.pattern", ":attn.z#1", "proj") as cap:
        model(inputs())
    for site in cap.sites():
        assert Site.parse(str(site)) == site
        assert cap.cache.resolve(str(site)) == site
    suffixes = ["npz", "pt"] + (["safetensors"] if importlib.util.find_spec("safetensors") else [])
    for suffix in suffixes:
        loaded = hs.load(cap.save(tmp_path / f"attn.{suffix}"))
        assert loaded.sites() == cap.sites()
        assert torch.equal(loaded[":attn.pattern"], cap["(root)#0:attn.pattern#0"])
        assert torch.equal(loaded[":attn.z#1"], cap[":attn.z#1"])


def test_a_module_that_never_called_the_kernel_names_what_it_called_and_the_fix() -> None:
    model = track(nn.Sequential(nn.Linear(8, 8), nn.Softmax(dim=-1)))
    with (
        pytest.raises(hs.CaptureError, match=r"'1:attn\.pattern'.*softmax.*'sdpa'.*op\[softmax#0\]"),
        hs.capture(model, "1:attn.pattern"),
    ):
        model(torch.ones(2, 8))
    assert stack_depth() == 0
    assert hs.attached(model) == []


def test_multihead_attention_is_refused_with_the_reason() -> None:
    model = track(nn.Sequential(nn.MultiheadAttention(8, 2, batch_first=True)))
    with pytest.raises(hs.SpecError, match="MultiheadAttention.*need_weights"):
        hs.capture(model, "0:attn.pattern")
    assert hs.attached(model) == []


def test_an_exception_after_the_kernel_leaves_no_hook_and_no_mode() -> None:
    model = track(TwoCalls(fail=True))
    with pytest.raises(ValueError, match="boom"), hs.capture(model, ":attn.pattern", ":attn.z"):
        model(inputs())
    assert stack_depth() == 0
    assert hs.attached(model) == []
    with pytest.raises(ValueError, match="boom"):
        hs.run_with_capture(model, inputs(), layers=[":attn.scores"])
    assert stack_depth() == 0
    assert hs.attached(model) == []


# -- transformers: the pattern under SDPA equals the eager twin's attn_weights -------------------

ATTENTION = {
    "gpt2": "h.*.attn",
    "llama-gqa": "layers.*.self_attn",
    "mistral-window": "layers.*.self_attn",
    "t5-relative-bias": "encoder.block.*.layer.0.SelfAttention",
    "bert-padding": "encoder.layer.*.attention.self",
}


@pytest.mark.slow
@pytest.mark.transformers
@pytest.mark.parametrize("name", list(MODELS))
def test_sub_sites_of_every_layer_equal_the_eager_weights_and_the_kernel_s_call(name: str) -> None:
    config_class, model_class, config = MODELS[name]
    eager, sdpa = twins(config_class, model_class, **config)
    track(eager)
    track(sdpa)
    ids = torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 7:] = 0  # the second row is padded: its last three tokens are not real
    with torch.no_grad():
        expected = eager(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    record = Record()
    with torch.no_grad(), record:
        sdpa(input_ids=ids, attention_mask=mask)
    glob = ATTENTION[name]
    selectors = [f"{glob}:attn.{kind}" for kind in ("q", "k", "v", "scores", "pattern", "z")]
    with torch.no_grad():  # as the reference ran: with autograd on, SDPA may pick another kernel
        _, cache = hs.run_with_capture(sdpa, input_ids=ids, attention_mask=mask, layers=selectors)
    layers = sorted({site.module for site in cache.sites()})
    assert len(layers) == len(expected) == len(record.calls) == 2
    real = mask.bool()[:, None, :, None]  # padded queries: kernels differ, models ignore them
    heads = config.get("num_attention_heads", config.get("n_head", config.get("num_heads")))
    for layer, weights, (args, kwargs, out) in zip(layers, expected, record.calls, strict=True):
        call = by_name(args, kwargs)
        pattern = cache[f"{layer}:attn.pattern"]
        assert pattern.shape == weights.shape
        assert pattern.size(1) == heads
        assert torch.allclose(pattern[real.expand_as(pattern)], weights[real.expand_as(weights)], atol=1e-6)
        assert torch.equal(cache[f"{layer}:attn.q"], call["query"])
        kv_heads = config.get("num_key_value_heads", heads)
        for kind, arg in (("k", "key"), ("v", "value")):  # the model's key/value heads, also where it repeated them
            kept = cache[f"{layer}:attn.{kind}"]
            assert kept.shape == (2, kv_heads, 10, call[arg].size(-1))
            assert torch.equal(kept.repeat_interleave(call[arg].size(1) // kv_heads, dim=1), call[arg])
        assert cache[f"{layer}:attn.q"].shape == (2, heads, 10, call["query"].size(-1))
        torch.testing.assert_close(cache[f"{layer}:attn.scores"], scores_by_hand(call), rtol=0, atol=1e-6)
        z = cache[f"{layer}:attn.z"]
        assert torch.equal(z, out)
        by_pattern = pattern_times_value(pattern, call["value"])
        assert torch.allclose(by_pattern[real.expand_as(z)], z[real.expand_as(z)], atol=1e-6)
    assert stack_depth() == 0


@pytest.mark.slow
@pytest.mark.transformers
def test_an_eager_gpt2_refuses_sub_sites_naming_its_softmax_and_the_fix() -> None:
    config_class, model_class, config = MODELS["gpt2"]
    eager, _ = twins(config_class, model_class, **config)
    track(eager)
    ids = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(0))
    with (
        pytest.raises(hs.CaptureError, match=r"h\.\*\.attn:attn\.pattern.*softmax.*attn_implementation='sdpa'"),
        hs.capture(eager, "h.*.attn:attn.pattern"),
    ):
        eager(ids)
    assert stack_depth() == 0
    assert hs.attached(eager) == []


@pytest.mark.slow
@pytest.mark.transformers
def test_vit_pattern_under_sdpa_equals_the_eager_twin_s_attention_weights() -> None:
    eager, sdpa = twins(
        "ViTConfig",
        "ViTModel",
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=16,
        patch_size=4,
    )
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = eager(pixel_values=pixels, output_attentions=True).attentions
        _, cache = hs.run_with_capture(sdpa, pixel_values=pixels, layers="*.attention:attn.pattern")
    layers = sorted({site.module for site in cache.sites()})
    assert len(layers) == len(expected) == 2
    for layer, weights in zip(layers, expected, strict=True):
        pattern = cache[f"{layer}:attn.pattern"]
        assert pattern.shape == weights.shape == (2, 2, 17, 17)  # 16 patches and the class token
        torch.testing.assert_close(pattern, weights, rtol=0, atol=1e-6)
    assert stack_depth() == 0


@pytest.mark.transformers
def test_under_inference_mode_sub_sites_and_op_sites_equal_no_grad_s() -> None:
    model = attention_gpt2("sdpa")
    ids = attention_tokens()
    selectors = ["h.*.attn:attn.pattern", "h.0:op[add#0]"]
    with torch.no_grad():
        _, expected = hs.run_with_capture(model, ids, layers=selectors)
    with torch.inference_mode():
        _, cache = hs.run_with_capture(model, ids, layers=selectors)
    assert sorted(cache) == sorted(expected)
    assert len(cache) == 3
    for site in expected:
        assert torch.equal(cache[site], expected[site])
        assert cache[site].is_inference()
    assert stack_depth() == 0
    assert hs.attached(model) == []

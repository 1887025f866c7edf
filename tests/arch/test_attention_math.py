"""The attention pattern recomputed from a ``scaled_dot_product_attention`` call's arguments:
against the kernel's own output (float64), and against the eager implementation's
``attn_weights`` of real transformers models built twice from one set of weights."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.functional import scaled_dot_product_attention as sdpa

from hookscope._arch.attention import SdpaCall, attend, attention_pattern, attention_scores, sdpa_call
from hookscope._core.names import named_modules
from hookscope._core.ops import OpWatcher
from hookscope.errors import SpecError


def qkv(heads: int = 4, kv_heads: int = 4, queries: int = 5, keys: int = 7) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, queries, 8, dtype=torch.float64, generator=generator)
    k = torch.randn(2, kv_heads, keys, 8, dtype=torch.float64, generator=generator)
    v = torch.randn(2, kv_heads, keys, 8, dtype=torch.float64, generator=generator)
    return q, k, v


MASK = torch.rand(2, 1, 5, 7, generator=torch.Generator().manual_seed(1)) > 0.3
MASK[0, 0, 2] = False  # a query that may see no key at all


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"is_causal": True},
        {"attn_mask": MASK},
        {"attn_mask": torch.randn(2, 1, 5, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(2))},
        {"attn_mask": MASK, "scale": 0.3},
        {"is_causal": True, "enable_gqa": True},
    ],
    ids=["plain", "causal", "bool-mask", "float-mask", "scale", "gqa"],
)
def test_pattern_times_value_is_the_kernels_output(options: dict[str, Any]) -> None:
    q, k, v = qkv(kv_heads=2 if options.get("enable_gqa") else 4)
    expected = sdpa(q, k, v, **options)
    pattern = attention_pattern(q, k, **options)
    assert torch.allclose(attend(pattern, v), expected, atol=1e-12)
    assert torch.allclose(pattern.sum(-1)[pattern.sum(-1) > 0], torch.ones(1, dtype=torch.float64))


def test_scores_are_the_hand_computation_with_inf_where_masked() -> None:
    q, k, _ = qkv()
    scores = attention_scores(q, k, attn_mask=MASK, scale=0.25)
    by_hand = (q @ k.transpose(-2, -1)) * 0.25
    assert torch.equal(torch.isneginf(scores), ~MASK.expand_as(scores))
    assert torch.allclose(scores[MASK.expand_as(scores)], by_hand[MASK.expand_as(by_hand)])
    causal = attention_scores(q, k, is_causal=True)  # 5 queries, 7 keys: aligned at the top left, as the kernel
    assert torch.isneginf(causal[..., 0, 1:]).all()
    assert not torch.isneginf(causal[..., 4, :5]).any()
    assert torch.isneginf(causal[..., 4, 5:]).all()


def test_a_query_that_sees_no_key_gets_zeros_as_the_kernel_gives() -> None:
    q, k, v = qkv()
    pattern = attention_pattern(q, k, attn_mask=MASK)
    assert torch.equal(pattern[0, :, 2], torch.zeros_like(pattern[0, :, 2]))
    assert torch.equal(sdpa(q, k, v, attn_mask=MASK)[0, :, 2], attend(pattern, v)[0, :, 2])


def test_half_precision_is_computed_in_float32_and_returned_in_its_own_dtype() -> None:
    q, k, _ = (t.to(torch.bfloat16) for t in qkv())
    pattern = attention_pattern(q, k, is_causal=True)
    assert pattern.dtype == torch.bfloat16
    exact = attention_pattern(q.double(), k.double(), is_causal=True)
    assert torch.allclose(pattern.double(), exact, atol=1e-2)


def test_arguments_are_read_positionally_and_by_name_and_refused_when_short() -> None:
    q, k, v = qkv()
    call = sdpa_call((q, k), {"value": v, "is_causal": True, "scale": 0.5})
    assert call == SdpaCall(q, k, v, is_causal=True, scale=0.5)
    assert torch.equal(call.pattern, attention_pattern(q, k, is_causal=True, scale=0.5))
    with pytest.raises(SpecError, match="without 'value'"):
        sdpa_call((q, k), {})
    with pytest.raises(SpecError, match="'key' twice"):
        sdpa_call((q, k, v), {"key": k})
    with pytest.raises(SpecError, match="do not divide the query's 4"):
        attention_pattern(q, k[:, :3], enable_gqa=True)
    with pytest.raises(SpecError, match="enable_gqa=True"):
        attention_pattern(q, k[:, :2])


# -- real models: the pattern under SDPA equals the eager model's attn_weights -----------------------


def sdpa_calls(model: nn.Module, **inputs: Any) -> list[SdpaCall]:
    """Every ``scaled_dot_product_attention`` call of one forward, in order, read by an op watcher."""
    calls: list[SdpaCall] = []

    def listen(module: str, call: int, op: str, index: int, args: Any, kwargs: Any, output: Any) -> None:
        if op == "scaled_dot_product_attention":
            calls.append(sdpa_call(args, kwargs))

    with OpWatcher(model, named_modules(model), listen), torch.no_grad():
        model(**inputs)
    return calls


def twins(config_class: str, model_class: str, **config: Any) -> tuple[nn.Module, nn.Module]:
    """One set of random weights, as an eager-attention and an SDPA model."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    made = []
    for implementation in ("eager", "sdpa"):
        torch.manual_seed(0)
        cfg = getattr(transformers, config_class)(**config, attn_implementation=implementation)
        made.append(getattr(transformers, model_class)(cfg).eval())
    made[1].load_state_dict(made[0].state_dict())
    return made[0], made[1]


MODELS = {
    "gpt2": ("GPT2Config", "GPT2Model", {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 100}),
    "llama-gqa": (
        "LlamaConfig",
        "LlamaModel",
        {
            "num_hidden_layers": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 100,
        },
    ),
    "mistral-window": (
        "MistralConfig",
        "MistralModel",
        {
            "num_hidden_layers": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 100,
            "sliding_window": 4,
        },
    ),
    "t5-relative-bias": (
        "T5Config",
        "T5EncoderModel",
        {"num_layers": 2, "d_model": 32, "d_kv": 8, "d_ff": 64, "num_heads": 4, "vocab_size": 100},
    ),
    "bert-padding": (
        "BertConfig",
        "BertModel",
        {
            "num_hidden_layers": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "vocab_size": 100,
        },
    ),
}


@pytest.mark.transformers
@pytest.mark.parametrize("name", list(MODELS))
def test_the_pattern_under_sdpa_equals_the_eager_attn_weights(name: str) -> None:
    config_class, model_class, config = MODELS[name]
    eager, sdpa = twins(config_class, model_class, **config)
    ids = torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 7:] = 0  # the second row is padded: its last three tokens are not real
    with torch.no_grad():
        expected = eager(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    calls = sdpa_calls(sdpa, input_ids=ids, attention_mask=mask)
    assert len(calls) == len(expected) == 2
    for call, weights in zip(calls, expected, strict=True):
        pattern = call.pattern
        assert pattern.shape == weights.shape
        real = mask.bool()[:, None, :, None].expand_as(pattern)  # padded queries: kernels differ, models ignore them
        assert torch.allclose(pattern[real], weights[real], atol=1e-6), (pattern - weights).abs().max()

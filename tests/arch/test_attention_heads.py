"""Attention sub-sites in one layout whatever the kernel call's, their gradients, and eager attention.

Transformers' SDPA path hands the kernel grouped-query heads three ways (``enable_gqa``; key and
value repeated on a masked call; a one-query step's query heads packed along the query axis);
each sub-site is checked against a reference computed without hookscope in every one of them:
the eager twin's ``attn_weights`` (the same weights built twice), raw forward hooks on the
output projection, and autograd through the eager model.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional
from torch.overrides import TorchFunctionMode

import hookscope as hs
from tests.arch.test_attention_math import twins
from tests.models import track

pytestmark = pytest.mark.transformers

HEADS, KV_HEADS, SIZE = 4, 2, 8
LLAMA = {
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "vocab_size": 100,
    "pad_token_id": 0,
}
ATTN = "model.layers.*.self_attn"


def llama_twins() -> tuple[nn.Module, nn.Module]:
    eager, sdpa = twins("LlamaConfig", "LlamaForCausalLM", **LLAMA)
    return track(eager), track(sdpa)


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of six tokens, the second left-padded by two (as a batch for generation is)."""
    ids = torch.randint(1, 100, (2, 6), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0
    return ids, mask


class Kernel(TorchFunctionMode):
    """Every ``scaled_dot_product_attention`` call's argument shapes (no hookscope)."""

    def __init__(self) -> None:
        super().__init__()
        self.queries: list[tuple[int, ...]] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") == "scaled_dot_product_attention":
            self.queries.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


def heads_of_o_proj(model: nn.Module, layer: int) -> tuple[list[torch.Tensor], Any]:
    """A raw pre-hook on ``o_proj`` keeping its input as ``(batch, heads, queries, head size)``."""
    seen: list[torch.Tensor] = []

    def keep(_module: nn.Module, args: tuple[Any, ...]) -> None:
        merged = args[0]
        seen.append(merged.view(*merged.shape[:-1], HEADS, SIZE).transpose(1, 2).detach().clone())

    return seen, model.model.layers[layer].self_attn.o_proj.register_forward_pre_hook(keep)


def generate(model: nn.Module, **options: Any) -> Any:
    ids, mask = padded_batch()
    return model.generate(
        ids, attention_mask=mask, max_new_tokens=3, do_sample=False, cache_implementation="static",
        return_dict_in_generate=True, **options,
    )  # fmt: skip


# -- item: one layout under generation with a mask (packed one-query steps) ---------------------------


@pytest.mark.slow
def test_generation_with_a_static_cache_and_padding_reads_every_step_as_heads_queries() -> None:
    eager, sdpa = llama_twins()
    with torch.no_grad():
        expected = generate(eager, output_attentions=True)
        kernel = Kernel()
        seen, handle = heads_of_o_proj(sdpa, 0)
        try:
            with kernel, hs.capture(sdpa, f"{ATTN}:attn.pattern", f"{ATTN}:attn.z", passes="all") as cap:
                got = generate(sdpa)
        finally:
            handle.remove()
    assert torch.equal(got.sequences, expected.sequences)
    assert (2, KV_HEADS, HEADS // KV_HEADS, SIZE) in kernel.queries  # transformers packed the decoding steps
    passes = cap.passes
    assert len(passes) == len(expected.attentions) == len(seen) == 3
    real = padded_batch()[1].bool()
    for step, (cache, weights) in enumerate(zip(passes, expected.attentions, strict=True)):
        queries = 6 if step == 0 else 1
        pattern = cache["model.layers.0.self_attn:attn.pattern"]
        assert pattern.shape == weights[0].shape == (2, HEADS, queries, pattern.size(-1))
        rows = real[:, None, :, None].expand_as(pattern) if step == 0 else torch.ones_like(pattern, dtype=torch.bool)
        torch.testing.assert_close(pattern[rows], weights[0][rows], rtol=0, atol=1e-6)
        z = cache["model.layers.0.self_attn:attn.z"]
        assert z.shape == (2, HEADS, queries, SIZE)
        torch.testing.assert_close(z, seen[step], rtol=0, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("head", [1, 3])
def test_zeroing_a_head_in_packed_steps_zeroes_that_query_head_only(head: int) -> None:
    _, sdpa = llama_twins()

    def zero_head(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        merged = args[0].clone()
        merged[..., head * SIZE : (head + 1) * SIZE] = 0
        return (merged,)

    hooks = [layer.self_attn.o_proj.register_forward_pre_hook(zero_head) for layer in sdpa.model.layers]
    try:
        with torch.no_grad():
            expected = generate(sdpa, output_logits=True)
    finally:
        for hook in hooks:
            hook.remove()
    with torch.no_grad(), hs.edit(sdpa, {f"{ATTN}:attn.z": hs.edits.zero(heads=head)}) as editor:
        got = generate(sdpa, output_logits=True)
    assert editor.applied == {f"model.layers.{layer}.self_attn:attn.z": 3 for layer in range(2)}
    assert torch.equal(got.sequences, expected.sequences)
    for ours, theirs in zip(got.logits, expected.logits, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


# -- item: k and v keep the key/value heads, with a mask or without -----------------------------------


@pytest.mark.slow
def test_k_and_v_have_the_key_value_heads_with_and_without_a_padding_mask() -> None:
    _, sdpa = llama_twins()
    ids, mask = padded_batch()
    selectors = [f"{ATTN}:attn.k", f"{ATTN}:attn.v"]
    with torch.no_grad():
        _, plain = hs.run_with_capture(sdpa, ids[:1], layers=selectors)  # no padding: no mask, enable_gqa
        _, padded = hs.run_with_capture(sdpa, input_ids=ids, attention_mask=mask, layers=selectors)  # repeat_kv
    for site in plain:
        assert plain[site].shape == (1, KV_HEADS, 6, SIZE)
        assert padded[site].shape == (2, KV_HEADS, 6, SIZE)
        torch.testing.assert_close(padded[site][:1], plain[site], rtol=0, atol=1e-6)  # the unpadded row


@pytest.mark.slow
def test_an_edit_of_k_under_a_padding_mask_edits_that_key_value_head() -> None:
    _, sdpa = llama_twins()
    ids, mask = padded_batch()

    def zero_kv_head(_module: nn.Module, _args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        output = output.clone()  # rotary embedding mixes within a head: a zero head stays zero
        output[..., SIZE : 2 * SIZE] = 0
        return output

    hooks = [layer.self_attn.k_proj.register_forward_hook(zero_kv_head) for layer in sdpa.model.layers]
    try:
        with torch.no_grad():
            expected = sdpa(input_ids=ids, attention_mask=mask).logits
    finally:
        for hook in hooks:
            hook.remove()
    with torch.no_grad():
        got, _ = hs.run_with_edits(
            sdpa, input_ids=ids, attention_mask=mask, edits={f"{ATTN}:attn.k": hs.edits.zero(heads=1)}
        )
    torch.testing.assert_close(got.logits[mask.bool()], expected[mask.bool()], rtol=0, atol=1e-5)


# -- item: rows that see no key ------------------------------------------------------------------------


@pytest.mark.slow
def test_a_query_row_that_sees_no_key_is_zero_where_eager_gives_a_uniform_row() -> None:
    eager, sdpa = llama_twins()
    ids, mask = padded_batch()
    with torch.no_grad():
        expected = eager(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
        _, cache = hs.run_with_capture(
            sdpa, input_ids=ids, attention_mask=mask, layers=[f"{ATTN}:attn.pattern", f"{ATTN}:attn.z"]
        )
    for layer, weights in enumerate(expected):
        pattern = cache[f"model.layers.{layer}.self_attn:attn.pattern"]
        blind = pattern[1, :, :2]  # the padded row's first two queries: every key they may see is padding
        assert torch.equal(blind, torch.zeros_like(blind))
        assert torch.equal(cache[f"model.layers.{layer}.self_attn:attn.z"][1, :, :2], torch.zeros(HEADS, 2, SIZE))
        torch.testing.assert_close(weights[1, :, :2], torch.full_like(blind, 1 / 6), rtol=0, atol=1e-6)
        torch.testing.assert_close(pattern[0], weights[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(pattern[1, :, 2:], weights[1, :, 2:], rtol=0, atol=1e-6)


# -- item: gradients of the pattern and the scores -------------------------------------------------------


def eager_gradients(eager: nn.Module, weight: torch.Tensor, **inputs: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The eager model's ``attn_weights`` gradients under the metric ``(logits * weight).sum()``."""
    out = eager(**inputs, output_attentions=True)
    for weights in out.attentions:
        weights.retain_grad()
    (out.logits * weight).sum().backward()
    return out.logits.detach(), [weights.grad for weights in out.attentions]


def scores_gradient(pattern: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The softmax's backward, by hand: ``p * (g - sum(p * g))`` over the keys."""
    return pattern * (grad - (pattern * grad).sum(-1, keepdim=True))


@pytest.mark.slow
@pytest.mark.parametrize("padded", [False, True], ids=["enable-gqa", "repeat-kv"])
def test_pattern_and_scores_gradients_are_the_eager_attn_weights_gradients(padded: bool) -> None:
    eager, sdpa = llama_twins()
    ids, mask = padded_batch()
    inputs = {"input_ids": ids, "attention_mask": mask} if padded else {"input_ids": ids}
    real = mask.bool() if padded else torch.ones_like(mask, dtype=torch.bool)
    weight = torch.randn(2, 6, 100, generator=torch.Generator().manual_seed(1)) * real[..., None]
    logits, expected = eager_gradients(eager, weight, **inputs)
    selectors = [f"{ATTN}:attn.pattern", f"{ATTN}:attn.scores", f"{ATTN}:attn.z"]
    with hs.capture(sdpa, selectors, grads=True) as cap:
        out = sdpa(**inputs)
        (out.logits * weight).sum().backward()
    torch.testing.assert_close(out.logits[real], logits[real], rtol=0, atol=1e-5)  # the splice changes no value
    grads = cap.cache.grad
    rows = real[:, None, :, None]
    for layer, eager_grad in enumerate(expected):
        site = f"model.layers.{layer}.self_attn"
        pattern, grad = cap[f"{site}:attn.pattern"], grads[f"{site}:attn.pattern"]
        if layer:  # padded positions' values differ after layer 0 (eager's uniform rows), so their keys' grads do
            rows = rows & real[:, None, None, :]
        assert grad.shape == eager_grad.shape == (2, HEADS, 6, 6)
        scale = eager_grad.abs().max()
        assert scale > 0
        torch.testing.assert_close(grad * rows, eager_grad * rows, rtol=0, atol=1e-5 * float(scale))
        by_hand = scores_gradient(pattern, eager_grad) * rows
        torch.testing.assert_close(grads[f"{site}:attn.scores"] * rows, by_hand, rtol=0, atol=1e-5 * float(scale))
        assert grads[f"{site}:attn.z"].shape == (2, HEADS, 6, SIZE)


class KeyLeaves(TorchFunctionMode):
    """Each kernel call's key with the model's key/value heads, keeping its gradient (no hookscope):
    the call gets it repeated for the query heads, as transformers repeated it."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: list[torch.Tensor] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if getattr(func, "__name__", "") == "scaled_dot_product_attention":
            query, key, *rest = args
            leaf = key[:, :: HEADS // KV_HEADS]  # the first of each repeated run: the model's key/value head
            leaf.retain_grad()
            self.keys.append(leaf)
            return func(query, leaf.repeat_interleave(HEADS // KV_HEADS, dim=1), *rest, **kwargs)
        return func(*args, **kwargs)


@pytest.mark.slow
def test_the_gradient_of_a_repeated_k_is_the_sum_over_its_query_heads() -> None:
    _, sdpa = llama_twins()
    ids, mask = padded_batch()
    weight = torch.randn(2, 6, 100, generator=torch.Generator().manual_seed(1))
    leaves = KeyLeaves()
    with leaves:
        (sdpa(input_ids=ids, attention_mask=mask).logits * weight).sum().backward()
    with hs.capture(sdpa, f"{ATTN}:attn.k", grads=True) as cap:
        (sdpa(input_ids=ids, attention_mask=mask).logits * weight).sum().backward()
    for layer, leaf in enumerate(leaves.keys):
        grad = cap.cache.grad[f"model.layers.{layer}.self_attn:attn.k"]
        assert leaf.grad is not None
        assert grad.shape == (2, KV_HEADS, 6, SIZE)
        torch.testing.assert_close(grad, leaf.grad, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_gpt2_pattern_gradient_equals_eager_and_dropout_says_why_there_is_none() -> None:
    config = {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 100}
    eager, sdpa = twins("GPT2Config", "GPT2LMHeadModel", **config)
    ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(2))
    weight = torch.randn(2, 7, 100, generator=torch.Generator().manual_seed(3))
    _, expected = eager_gradients(eager, weight, input_ids=ids)
    metric = lambda out: (out.logits * weight).sum()  # noqa: E731
    _, cache = hs.run_with_capture(sdpa, ids, layers="transformer.h.*.attn:attn.pattern", backward=metric)
    for layer, eager_grad in enumerate(expected):
        torch.testing.assert_close(
            cache.grad[f"transformer.h.{layer}.attn:attn.pattern"], eager_grad, rtol=0, atol=1e-6
        )
    sdpa.train()  # attention dropout: the kernel's random mask is not recomputed
    try:
        with hs.capture(sdpa, "transformer.h.0.attn:attn.pattern", grads=True) as cap:
            sdpa(ids).logits.sum().backward()
    finally:
        sdpa.eval()
    with pytest.raises(hs.SiteNotFoundError, match=r"dropout_p=0\.1.*model\.eval\(\)"):
        cap.cache.grad["transformer.h.0.attn:attn.pattern"]


# -- item: eager attention that cannot be loaded with sdpa (Gemma 2) ----------------------------------


def tiny_gemma2() -> nn.Module:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=SIZE, vocab_size=100, sliding_window=4, attn_implementation="eager",
    )  # fmt: skip
    return track(Gemma2ForCausalLM(config).eval())


@pytest.mark.slow
def test_gemma2_eager_attention_gives_attn_z_and_names_the_fix_that_works() -> None:
    model = tiny_gemma2()
    ids = torch.randint(0, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    seen, handle = heads_of_o_proj(model, 1)
    try:
        with torch.no_grad():
            _, cache = hs.run_with_capture(model, ids, layers=["std:blocks.*.attn.z", "std:blocks.*.attn.pattern"])
    finally:
        handle.remove()
    z = cache["std:blocks.1.attn.z"]
    assert z.shape == (2, HEADS, 6, SIZE)
    assert torch.equal(z, seen[-1])  # seen[0]: the canonical map's check forward
    with torch.no_grad():  # the pattern is the eager softmax: the model's own attn_weights
        weights = model(ids, output_attentions=True).attentions[1]
    assert torch.equal(cache["std:blocks.1.attn.pattern"], weights)
    with pytest.raises(hs.CaptureError) as refused, hs.capture(model, "model.layers.0.self_attn:attn.z"):
        model(ids)
    message = str(refused.value)
    assert "transformers refuses attn_implementation='sdpa' for this model" in message
    assert "per head, std:blocks.0.attn.z" in message  # the map names it for this model
    assert "op[softmax#0]" in message
    assert hs.attached(model) == []
    with pytest.raises(hs.SelectionError, match=r"transformers refuses attn_implementation='sdpa' for this model"):
        hs.capture(model, "std:blocks.0.attn.k")


@pytest.mark.transformers
def test_bloom_eager_attention_is_told_where_its_heads_are() -> None:
    """BLOOM's product after the softmax is a bmm over batch x heads: no attn.z to name, and no
    sdpa to load. The advice given is followed here, and read against a raw pre-hook."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BloomConfig(n_layer=2, hidden_size=32, n_head=HEADS, vocab_size=64)
    model = track(transformers.BloomForCausalLM(config).eval())
    ids = torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(3))
    with pytest.raises(hs.CaptureError) as refused, hs.capture(model, "transformer.h.0.self_attention:attn.z"):
        model(ids)
    message = str(refused.value)
    assert "attn.z" not in message.split("matched nothing")[1]  # no site this model lacks
    assert "load a transformers model" not in message
    with pytest.raises(hs.SelectionError) as unnamed:
        hs.capture(model, "std:blocks.0.attn.z")
    assert "attn_implementation='sdpa' to" not in str(unnamed.value)
    advised = message.split("merged in the last dim, is '")[1].split("'")[0]
    assert advised == str(unnamed.value).split("merged in the last dim, is '")[1].split("'")[0]
    merged: list[torch.Tensor] = []
    handle = model.transformer.h[0].self_attention.dense.register_forward_pre_hook(
        lambda m, args: merged.append(args[0].clone())
    )
    try:
        with torch.no_grad():
            _, cache = hs.run_with_capture(model, ids, layers=[advised])
    finally:
        handle.remove()
    assert advised == "transformer.h.0.self_attention.dense:input[0]"
    assert torch.equal(cache[advised], merged[-1])
    assert f"num_heads={HEADS}" in message


def test_an_sdpa_call_of_our_own_reads_as_passed() -> None:
    """A module without grouped heads keeps its kernel calls' shapes, masked or not."""

    class Plain(nn.Module):
        def forward(self, q: torch.Tensor) -> torch.Tensor:
            mask = torch.ones(q.size(-2), q.size(-2), dtype=torch.bool).tril()
            return functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)

    model = track(Plain())
    q = torch.randn(1, 2, 2, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, cache = hs.run_with_capture(model, q, layers=[":attn.q", ":attn.z"])
    assert torch.equal(cache[":attn.q"], q)
    assert cache[":attn.z"].shape == (1, 2, 2, 4)

"""Attention values in a patching study, against GPT-2's attention written out by hand.

``attn.scores`` holds ``-inf`` at every masked entry of both runs (a causal model's upper
triangle): attribution patching must read those entries as no change, not ``-inf - -inf``. An
op site named by hand (eager attention's ``:op[softmax#0]``) is laid out as its canonical name
(``attn.pattern``, per head), and a 4-D value nothing says the layout of is refused. The
references run GPT-2's attention by hand in a raw forward hook (the query, key and value from
``c_attn``, the scores, the causal mask, the softmax, ``c_proj``), so the scores are tensors of
the reference's own graph: ``torch.autograd.grad`` gives their gradient, and a row of them can
be replaced.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import hookscope as hs
from tests.methods.test_patch_grid import (
    CHECKED,
    HEADS,
    METRIC,
    SEQ,
    SIZE,
    gpt2,
    pattern_of,
    projection_inputs,
    prompts,
    reference_grid,
    score,
    split_heads,
)

pytestmark = [pytest.mark.transformers]

ScoreEdit = Callable[[int, torch.Tensor], torch.Tensor]


def by_hand(model: nn.Module, ids: torch.Tensor, edit_scores: ScoreEdit) -> Any:
    """``model(ids)`` with every block's attention computed by hand; ``edit_scores(layer, scores)``
    sees (and may replace) the scaled scores ``(batch, heads, query, key)`` before the causal mask."""

    def hook(layer: int) -> Callable[..., Any]:
        def run(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
            hidden = args[0] if args else kwargs["hidden_states"]
            q, k, v = (split_heads(part) for part in module.c_attn(hidden).split(HEADS * SIZE, dim=2))
            scores = edit_scores(layer, q @ k.transpose(-1, -2) / math.sqrt(SIZE))
            causal = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
            z = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
            merged = z.transpose(1, 2).reshape(*hidden.shape[:2], HEADS * SIZE)
            return (module.c_proj(merged), *output[1:])

        return run

    handles = [
        block.attn.register_forward_hook(hook(layer), with_kwargs=True)
        for layer, block in enumerate(model.transformer.h)
    ]
    try:
        return model(ids)
    finally:
        for handle in handles:
            handle.remove()


def kept_scores(model: nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    kept: list[torch.Tensor] = []

    def keep(layer: int, scores: torch.Tensor) -> torch.Tensor:
        kept.append(scores.detach().clone())
        return scores

    with torch.no_grad():
        by_hand(model, ids, keep)
    return kept


@pytest.mark.slow
def test_attribution_and_sweep_of_masked_scores_are_finite_and_right() -> None:
    model = gpt2()
    clean, corrupted = prompts()
    with torch.no_grad():
        torch.testing.assert_close(by_hand(model, corrupted, lambda _, s: s).logits, model(corrupted).logits)
    clean_scores = kept_scores(model, clean)
    graph: list[torch.Tensor] = []

    def keep(layer: int, scores: torch.Tensor) -> torch.Tensor:
        graph.append(scores)
        return scores

    metric = METRIC(by_hand(model, corrupted, keep)).mean()
    grads = torch.autograd.grad(metric, graph)
    with torch.no_grad():
        high, low = score(model(clean)), float(metric.detach())
    # per layer and query position: grad . (clean - corrupted) over rows, heads and keys (the mask's
    # entries have a zero gradient: no contribution)
    expected = torch.stack(
        [
            (g.double() * (c.double() - s.detach().double())).sum((0, 1, 3))
            for g, c, s in zip(grads, clean_scores, graph, strict=True)
        ]
    ) / (high - low)
    sites = "transformer.h.*.attn:attn.scores"
    atp = hs.methods.attribution_patch(model, clean, corrupted, metric=METRIC, layers=sites)
    assert atp.values.shape == (2, SEQ)
    torch.testing.assert_close(atp.values, expected, rtol=1e-4, atol=1e-6)

    sweep = hs.methods.patch_sweep(model, clean, corrupted, metric=METRIC, layers=sites)
    for layer in range(2):
        for position in CHECKED:

            def patch(at: int, scores: torch.Tensor, layer: int = layer, position: int = position) -> torch.Tensor:
                if at != layer:
                    return scores
                scores = scores.clone()
                scores[:, :, position] = clean_scores[layer][:, :, position]
                return scores

            with torch.no_grad():
                patched = score(by_hand(model, corrupted, patch))
            # the metric itself: the runs score 0.0038 apart, so float32 rounding is 1e-5 of the normalised span
            assert float(sweep.raw[layer, position]) == pytest.approx(patched, abs=1e-6), (layer, position)


def eager_gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    model = gpt2()
    config = transformers.GPT2Config(**{**model.config.to_dict(), "attn_implementation": "eager"})
    eager = transformers.GPT2LMHeadModel(config).eval()
    eager.load_state_dict(model.state_dict())
    return eager


@pytest.mark.slow
def test_an_eager_softmax_op_site_is_swept_by_query_position_and_head() -> None:
    model = eager_gpt2()
    clean, corrupted = prompts()
    _, qkv = projection_inputs(model, clean)
    patterns = [pattern_of(value) for value in qkv]

    def clean_row(layer: int, position: int, head: int | None) -> Callable[[torch.Tensor, torch.Tensor], None]:
        def write(value: torch.Tensor, own_qkv: torch.Tensor) -> None:
            v = split_heads(own_qkv.split(HEADS * SIZE, dim=2)[2])
            row = (patterns[layer][:, :, position].unsqueeze(2) @ v)[:, :, 0].reshape(value.shape[0], HEADS * SIZE)
            columns = slice(None) if head is None else slice(head * SIZE, (head + 1) * SIZE)
            value[:, position, columns] = row[:, columns]

        return write

    softmax = "transformer.h.*.attn:op[softmax#0]"  # the site hookscope's own errors name for eager attention
    rows = hs.methods.patch_sweep(model, clean, corrupted, metric=METRIC, layers=softmax)
    assert rows.dims == ("site", "position")
    assert rows.coords["position"] == list(range(SEQ))  # not the 4 heads
    expected = reference_grid(model, clean, corrupted, [None], CHECKED, clean_row)[:, 0]
    torch.testing.assert_close(rows.values[:, CHECKED], expected, rtol=1e-4, atol=1e-5)
    by_head = hs.methods.patch_sweep(
        model, clean, corrupted, metric=METRIC, layers=softmax, heads=[1, 3], positions=[3, 8]
    )
    torch.testing.assert_close(
        by_head.values, reference_grid(model, clean, corrupted, [1, 3], [3, 8], clean_row), rtol=1e-4, atol=1e-5
    )
    with pytest.raises(hs.SpecError, match=r"num_heads=2, and every site holds its heads apart .*: 4 heads"):
        hs.methods.patch_sweep(model, clean, corrupted, metric=METRIC, layers=softmax, heads=True, num_heads=2)
    with pytest.raises(hs.SpecError, match=r"\(2, 4, 10, 10\): a value of 4 or more dims .* not guessed"):
        hs.methods.patch_sweep(model, clean, corrupted, metric=METRIC, layers="transformer.h.*.attn:op[matmul#0]")


@pytest.mark.slow
def test_a_query_sweep_is_the_query_columns_patched_by_raw_hooks() -> None:
    model = gpt2()
    clean, corrupted = prompts()
    _, qkv = projection_inputs(model, clean)
    with torch.no_grad():
        high, low = score(model(clean)), score(model(corrupted))
    sweep = hs.methods.patch_sweep(model, clean, corrupted, metric=METRIC, layers="std:blocks.*.attn.q")
    by_head = hs.methods.patch_sweep(
        model, clean, corrupted, metric=METRIC, layers="std:blocks.*.attn.q", heads=[0, 2], positions=[3, 9]
    )
    for layer, source in enumerate(qkv):
        for head in [None, 0, 2]:
            for position in CHECKED if head is None else [3, 9]:
                columns = slice(0, HEADS * SIZE) if head is None else slice(head * SIZE, (head + 1) * SIZE)

                def patch(
                    m: nn.Module, a: Any, out: torch.Tensor, at: int = position, cs: slice = columns, kept: Any = source
                ) -> Any:
                    out = out.clone()
                    out[:, at, cs] = kept[:, at, cs]
                    return out

                handle = model.transformer.h[layer].attn.c_attn.register_forward_hook(patch)
                with torch.no_grad():
                    expected = (score(model(corrupted)) - low) / (high - low)
                handle.remove()
                site = f"blocks.{layer}.attn.q"
                got = sweep.at(site, position) if head is None else by_head.at(site, head, position)
                assert float(got) == pytest.approx(expected, abs=1e-5), (layer, head, position)

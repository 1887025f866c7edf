"""Where a patching study reads positions and heads, its stacks, and the model's mode, against raw hooks.

A 4-head, 10-token GPT-2 tells heads from positions: each cell of ``patch_sweep`` and
``attribution_patch`` is compared with a forward whose attention output projection's input is
patched by a raw pre-hook (one head's columns, or every head's, at one position), or whose
pattern row is recomputed by hand from the query, key and value that ``c_attn`` returned; AtP
against ``torch.autograd.grad`` on the tensors those hooks kept.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import hookscope as hs

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB, HEADS, SIZE, SEQ = 64, 4, 8, 10
METRIC = hs.methods.logit_diff(3, 5)


def gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=HEADS * SIZE, n_head=HEADS, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0,
        attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).eval()


def prompts(seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    clean = torch.randint(1, VOCAB, (2, seq), generator=torch.Generator().manual_seed(3))
    corrupted = clean.clone()
    corrupted[:, 3] = torch.tensor([7, 9])
    return clean, corrupted


def score(output: Any) -> float:
    return float(METRIC(output).detach().double().mean())


# -- references, without hookscope --------------------------------------------------------------------


def projection_inputs(model: nn.Module, ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per block: the input of ``attn.c_proj`` (the heads merged) and the output of ``c_attn`` (q, k, v)."""
    merged: list[torch.Tensor] = []
    qkv: list[torch.Tensor] = []
    handles = []
    for block in model.transformer.h:
        handles.append(block.attn.c_proj.register_forward_pre_hook(lambda m, args: merged.append(args[0].clone())))
        handles.append(block.attn.c_attn.register_forward_hook(lambda m, args, out: qkv.append(out.clone())))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for handle in handles:
            handle.remove()
    return merged, qkv


def split_heads(value: torch.Tensor) -> torch.Tensor:
    """``(batch, seq, hidden)`` -> ``(batch, heads, seq, head size)``, as GPT-2 splits them."""
    return value.reshape(*value.shape[:2], HEADS, SIZE).transpose(1, 2)


def pattern_of(qkv: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention probabilities from ``c_attn``'s output, by hand."""
    q, k, _ = (split_heads(part) for part in qkv.split(HEADS * SIZE, dim=2))
    scores = q @ k.transpose(-1, -2) / math.sqrt(SIZE)
    seq = scores.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    return scores.masked_fill(~causal, float("-inf")).softmax(-1)


def patched_projection(
    model: nn.Module, ids: torch.Tensor, layer: int, write: Callable[[torch.Tensor, torch.Tensor], None]
) -> Any:
    """``model(ids)`` with block ``layer``'s ``c_proj`` input changed by ``write(merged, value)``, where
    ``value`` is that run's own ``c_attn`` output (its values ``v``)."""
    attn = model.transformer.h[layer].attn
    kept: list[torch.Tensor] = []

    def patch(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        merged = args[0].clone()
        write(merged, kept[-1])
        return (merged,)

    handles = [
        attn.c_attn.register_forward_hook(lambda m, args, out: kept.append(out)),
        attn.c_proj.register_forward_pre_hook(patch),
    ]
    try:
        with torch.no_grad():
            return model(ids)
    finally:
        for handle in handles:
            handle.remove()


def reference_grid(
    model: nn.Module,
    clean: torch.Tensor,
    corrupted: torch.Tensor,
    heads: list[int | None],
    positions: list[int],
    write: Callable[[int, int, int | None], Callable[[torch.Tensor, torch.Tensor], None]],
) -> torch.Tensor:
    """``(layer, head, position)`` normalised effects, one raw-hook forward per cell."""
    with torch.no_grad():
        high, low = score(model(clean)), score(model(corrupted))
    grid = torch.empty(2, len(heads), len(positions), dtype=torch.float64)
    for layer in range(2):
        for h, head in enumerate(heads):
            for p, position in enumerate(positions):
                patched = score(patched_projection(model, corrupted, layer, write(layer, position, head)))
                grid[layer, h, p] = (patched - low) / (high - low)
    return grid


#: Positions checked cell by cell: before, at and after the changed token, past the head count.
CHECKED = [0, 3, 6, 9]


def columns(head: int | None) -> slice:
    return slice(None) if head is None else slice(head * SIZE, (head + 1) * SIZE)


# -- item: the grid's layout comes from the site --------------------------------------------------------


@pytest.mark.transformers
@pytest.mark.slow
def test_heads_and_positions_come_from_the_site_not_the_option() -> None:
    model = gpt2()
    clean, corrupted = prompts()
    merged, _ = projection_inputs(model, clean)

    def from_clean(layer: int, position: int, head: int | None) -> Callable[[torch.Tensor, torch.Tensor], None]:
        def write(value: torch.Tensor, _qkv: torch.Tensor) -> None:
            value[:, position, columns(head)] = merged[layer][:, position, columns(head)]

        return write

    by_head = reference_grid(model, clean, corrupted, list(range(HEADS)), CHECKED, from_clean)
    every_head = reference_grid(model, clean, corrupted, [None], CHECKED, from_clean)[:, 0]

    projection = hs.methods.patch_sweep(
        model, clean, corrupted, metric=METRIC, layers="transformer.h.*.attn.c_proj:input[0]", heads=True,
        num_heads=HEADS,
    )  # fmt: skip
    assert projection.dims == ("site", "head", "position")
    assert projection.values.shape == (2, HEADS, SEQ)  # not 10 "heads" of 32 / 10 columns
    torch.testing.assert_close(projection.values[..., CHECKED], by_head, rtol=1e-4, atol=1e-5)

    z_by_head = hs.methods.patch_sweep(model, clean, corrupted, metric=METRIC, layers="std:blocks.*.attn.z", heads=True)
    torch.testing.assert_close(z_by_head.values[..., CHECKED], by_head, rtol=1e-4, atol=1e-5)

    z = hs.methods.patch_sweep(model, clean, corrupted, metric=METRIC, layers="std:blocks.*.attn.z")
    assert z.dims == ("site", "position")
    assert z.coords["position"] == list(range(SEQ))  # not the 4 heads
    torch.testing.assert_close(z.values[:, CHECKED], every_head, rtol=1e-4, atol=1e-5)


@pytest.mark.transformers
@pytest.mark.slow
def test_a_pattern_is_swept_by_query_position_and_head() -> None:
    """A pattern row patched: the block's heads read the clean row's weights over the run's own values."""
    model = gpt2()
    clean, corrupted = prompts()
    _, qkv = projection_inputs(model, clean)
    patterns = [pattern_of(value) for value in qkv]

    def clean_row(layer: int, position: int, head: int | None) -> Callable[[torch.Tensor, torch.Tensor], None]:
        def write(value: torch.Tensor, own_qkv: torch.Tensor) -> None:
            v = split_heads(own_qkv.split(HEADS * SIZE, dim=2)[2])  # (batch, heads, seq, size)
            z = patterns[layer][:, :, position].unsqueeze(2) @ v  # (batch, heads, 1, size)
            row = z[:, :, 0].reshape(z.shape[0], HEADS * SIZE)
            value[:, position, columns(head)] = row[:, columns(head)]

        return write

    effects = hs.methods.patch_sweep(model, clean, corrupted, metric=METRIC, layers="std:blocks.*.attn.pattern")
    assert effects.values.shape == (2, SEQ)
    expected = reference_grid(model, clean, corrupted, [None], CHECKED, clean_row)[:, 0]
    torch.testing.assert_close(effects.values[:, CHECKED], expected, rtol=1e-4, atol=1e-5)
    by_head = hs.methods.patch_sweep(
        model, clean, corrupted, metric=METRIC, layers="std:blocks.*.attn.pattern", heads=[0, 2], positions=[3, 8]
    )
    expected_heads = reference_grid(model, clean, corrupted, [0, 2], [3, 8], clean_row)
    torch.testing.assert_close(by_head.values, expected_heads, rtol=1e-4, atol=1e-5)


@pytest.mark.transformers
def test_attribution_reads_heads_and_positions_from_the_site() -> None:
    model = gpt2()
    clean, corrupted = prompts()
    merged_clean, _ = projection_inputs(model, clean)
    kept: list[torch.Tensor] = []
    handles = [
        block.attn.c_proj.register_forward_pre_hook(lambda m, args: kept.append(args[0]))
        for block in model.transformer.h
    ]
    try:
        output = model(corrupted)
    finally:
        for handle in handles:
            handle.remove()
    metric = METRIC(output).mean()
    grads = torch.autograd.grad(metric, kept)
    with torch.no_grad():
        span = score(model(clean)) - float(metric)
    # grad (of the mean over rows) · (clean - corrupted), summed over a head's columns (or all) and the rows
    products = [
        (g.double() * (c.double() - k.detach().double())) for g, c, k in zip(grads, merged_clean, kept, strict=True)
    ]
    by_head = torch.stack([p.reshape(2, SEQ, HEADS, SIZE).sum(-1).sum(0).T for p in products]) / span
    every_head = torch.stack([p.sum(-1).sum(0) for p in products]) / span

    atp = hs.methods.attribution_patch(
        model, clean, corrupted, metric=METRIC, layers="transformer.h.*.attn.c_proj:input[0]", heads=True,
        num_heads=HEADS,
    )  # fmt: skip
    assert atp.values.shape == (2, HEADS, SEQ)
    torch.testing.assert_close(atp.values, by_head, rtol=1e-4, atol=1e-6)
    z = hs.methods.attribution_patch(model, clean, corrupted, metric=METRIC, layers="std:blocks.*.attn.z")
    assert z.values.shape == (2, SEQ)
    torch.testing.assert_close(z.values, every_head, rtol=1e-4, atol=1e-6)
    z_heads = hs.methods.attribution_patch(model, clean, corrupted, metric=METRIC, heads=True)
    torch.testing.assert_close(z_heads.values, by_head, rtol=1e-4, atol=1e-6)


@pytest.mark.transformers
def test_a_merged_value_by_head_needs_num_heads_and_one_head_count() -> None:
    model = gpt2()
    clean, corrupted = prompts()
    merged = "transformer.h.*.attn.c_proj:input[0]"
    with pytest.raises(hs.SpecError, match=r"give num_heads= \(this model's config says num_attention_heads=4\)"):
        hs.methods.patch_sweep(model, clean, corrupted, metric=METRIC, layers=merged, heads=True)
    with pytest.raises(hs.SpecError, match="only heads= uses"):
        hs.methods.attribution_patch(model, clean, corrupted, metric=METRIC, layers=merged, num_heads=4)
    with pytest.raises(hs.SpecError, match="num_heads=0"):
        hs.methods.patch_sweep(model, clean, corrupted, metric=METRIC, layers=merged, heads=True, num_heads=0)
    with pytest.raises(hs.SpecError, match="hidden a multiple of num_heads"):
        hs.methods.patch_sweep(model, clean, corrupted, metric=METRIC, layers=merged, heads=True, num_heads=5)
    mixed = ["std:blocks.0.attn.z", "transformer.h.1.attn.c_proj:input[0]"]
    with pytest.raises(hs.SpecError, match="has 2 heads and an earlier site 4"):
        hs.methods.patch_sweep(model, clean, corrupted, metric=METRIC, layers=mixed, heads=True, num_heads=2)


# -- item: stack= for an encoder-decoder ------------------------------------------------------------------


def t5() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.T5Config(
        num_layers=2, num_decoder_layers=2, d_model=32, d_kv=8, num_heads=4, d_ff=64, vocab_size=VOCAB,
        decoder_start_token_id=0,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(config).eval()


def t5_inputs() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    clean, corrupted = prompts(7)
    decoder = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(4))
    return {"input_ids": clean, "decoder_input_ids": decoder}, {"input_ids": corrupted, "decoder_input_ids": decoder}


def block_hidden(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def t5_block_inputs(blocks: nn.ModuleList, model: nn.Module, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    kept: list[torch.Tensor] = []
    handles = [
        block.register_forward_pre_hook(lambda m, a, k: kept.append(block_hidden(a, k).clone()), with_kwargs=True)
        for block in blocks
    ]
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    return kept


def t5_patched(
    block: nn.Module, model: nn.Module, inputs: dict[str, torch.Tensor], source: torch.Tensor, at: int
) -> Any:
    def patch(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        hidden = block_hidden(args, kwargs).clone()
        hidden[:, at] = source[:, at]
        return ((hidden, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})

    handle = block.register_forward_pre_hook(patch, with_kwargs=True)
    try:
        with torch.no_grad():
            return model(**inputs)
    finally:
        handle.remove()


@pytest.mark.transformers
@pytest.mark.slow
@pytest.mark.parametrize(("stack", "seq"), [("decoder.", 5), ("encoder.", 7)])
def test_sweep_and_attribution_of_an_encoder_decoders_stack(stack: str, seq: int) -> None:
    model = t5()
    clean, corrupted = t5_inputs()
    blocks = (model.decoder if stack == "decoder." else model.encoder).block
    sources = t5_block_inputs(blocks, model, clean)
    with torch.no_grad():
        high, low = score(model(**clean)), score(model(**corrupted))
    expected = torch.tensor(
        [
            [
                (score(t5_patched(blocks[layer], model, corrupted, sources[layer], at)) - low) / (high - low)
                for at in range(seq)
            ]
            for layer in range(2)
        ],
        dtype=torch.float64,
    )
    sweep = hs.methods.patch_sweep(model, clean, corrupted, metric=METRIC, stack=stack)
    assert sweep.coords["site"] == [f"{stack}blocks.0.resid_pre", f"{stack}blocks.1.resid_pre"]
    torch.testing.assert_close(sweep.values, expected, rtol=1e-4, atol=1e-5)
    atp = hs.methods.attribution_patch(model, clean, corrupted, metric=METRIC, stack=stack)
    assert atp.coords == sweep.coords
    kept: list[torch.Tensor] = []
    handles = [
        block.register_forward_pre_hook(lambda m, a, k: kept.append(block_hidden(a, k)), with_kwargs=True)
        for block in blocks
    ]
    try:
        metric = METRIC(model(**corrupted)).mean()
    finally:
        for handle in handles:
            handle.remove()
    grads = torch.autograd.grad(metric, kept)  # grad . (clean - corrupted) per position, over rows and features
    by_autograd = torch.stack(
        [
            (g.double() * (c.double() - k.detach().double())).sum(-1).sum(0)
            for g, c, k in zip(grads, sources, kept, strict=True)
        ]
    ) / (high - float(metric.detach()))
    torch.testing.assert_close(atp.values, by_autograd, rtol=1e-4, atol=1e-6)


@pytest.mark.transformers
def test_an_encoder_decoder_without_a_stack_is_told_which_to_pass() -> None:
    model = t5()
    clean, corrupted = t5_inputs()
    with pytest.raises(
        hs.SpecError, match=r"encoder-decoder, whose blocks are in 'encoder\.' and 'decoder\.'; pass stack="
    ):
        hs.methods.patch_sweep(model, clean, corrupted, metric=METRIC)
    with pytest.raises(hs.SpecError, match=r"stack='dec\.' names no stack"):
        hs.methods.attribution_patch(model, clean, corrupted, metric=METRIC, stack="dec.")
    with pytest.raises(hs.SpecError, match="stack='decoder'"):
        hs.methods.patch_sweep(model, clean, corrupted, metric=METRIC, stack="decoder")
    with pytest.raises(hs.SpecError, match="picks the default sites, and layers= names its own"):
        hs.methods.patch_sweep(
            model, clean, corrupted, metric=METRIC, stack="decoder.", layers="std:decoder.blocks.0.resid_pre"
        )


# -- item: a study never runs a model in training mode ------------------------------------------------------


class Normed(nn.Module):
    """Batch norm over the features of a ``(batch, seq, features)`` value."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 8)
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.lin(x).transpose(1, 2)).transpose(1, 2)
        return self.head(torch.relu(h))


class FunctionalDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(nn.functional.dropout(x, 0.5, self.training))


def statistics(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: buffer.clone() for name, buffer in model.named_buffers()}


@pytest.mark.parametrize("build", [Normed, FunctionalDropout])
@pytest.mark.parametrize("method", [hs.methods.patch_sweep, hs.methods.attribution_patch])
def test_a_model_in_training_mode_is_refused_before_anything_moves(
    build: Callable[[], nn.Module], method: Callable[..., Any]
) -> None:
    torch.manual_seed(0)
    model = build().train()
    clean, corrupted = torch.randn(2, 5, 4), torch.randn(2, 5, 4)
    before, rng = statistics(model), torch.get_rng_state()
    with pytest.raises(hs.SpecError, match=r"training mode, e\.g\. .*call model\.eval\(\) first"):
        method(model, clean, corrupted, metric=hs.methods.logit_diff(0, 1), layers="lin")
    assert torch.equal(torch.get_rng_state(), rng)  # no dropout drawn
    for name, value in statistics(model).items():
        assert torch.equal(value, before[name]), name  # running statistics untouched
    assert model.training


def test_batch_norm_in_eval_mode_is_swept_and_its_statistics_stay() -> None:
    torch.manual_seed(0)
    model = Normed()
    for _ in range(3):
        model(torch.randn(4, 5, 4) * 3 + 1)  # running statistics away from their start
    model.eval()
    clean, corrupted = torch.randn(2, 5, 4), torch.randn(2, 5, 4)
    metric = hs.methods.logit_diff(0, 1)
    before = statistics(model)
    sweep = hs.methods.patch_sweep(model, clean, corrupted, metric=metric, layers="lin")
    atp = hs.methods.attribution_patch(model, clean, corrupted, metric=metric, layers="lin")
    for name, value in statistics(model).items():
        assert torch.equal(value, before[name]), name
    assert sweep.values.isfinite().all()
    assert atp.values.isfinite().all()
    kept: list[torch.Tensor] = []
    handle = model.lin.register_forward_hook(lambda m, a, out: kept.append(out.clone()))
    with torch.no_grad():
        high = float(metric(model(clean)).double().mean())
    handle.remove()
    with torch.no_grad():
        low = float(metric(model(corrupted)).double().mean())
    for position in range(5):

        def patch(m: nn.Module, a: Any, out: torch.Tensor, at: int = position) -> torch.Tensor:
            out = out.clone()
            out[:, at] = kept[0][:, at]
            return out

        handle = model.lin.register_forward_hook(patch)
        with torch.no_grad():
            patched = float(metric(model(corrupted)).double().mean())
        handle.remove()
        assert sweep.at("lin", position) == pytest.approx((patched - low) / (high - low), abs=1e-5)


# -- item: the default sites of a model that is not a transformer -------------------------------------------


def test_default_sites_on_a_model_without_blocks_name_sites() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).eval()
    clean, corrupted = torch.randn(2, 5, 4), torch.randn(2, 5, 4)
    with pytest.raises(
        hs.StdMapError, match=r"default sites .* are canonical names of transformer blocks.*pass layers="
    ):
        hs.methods.patch_sweep(model, clean, corrupted, metric=hs.methods.logit_diff(0, 1))
    given = hs.methods.patch_sweep(model, clean, corrupted, metric=hs.methods.logit_diff(0, 1), layers=["0", "1"])
    assert given.coords["site"] == ["0", "1"]

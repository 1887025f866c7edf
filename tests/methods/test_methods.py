"""The research methods against hand-written raw-hook loops and torch.autograd, on GPT-2, Llama and BERT.

Every reference here is computed without hookscope: forward pre-hooks that replace one position
of a block's input, ``torch.autograd.grad`` on tensors a raw hook kept, the final norm and LM head
called by hand.
"""

from __future__ import annotations

import os
import runpy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import hookscope as hs

pytestmark = [pytest.mark.transformers]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

VOCAB = 64


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


def llama() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


def bert() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, vocab_size=VOCAB
    )
    return transformers.BertForMaskedLM(config).eval()


def blocks(model: nn.Module) -> list[nn.Module]:
    if hasattr(model, "transformer"):
        return list(model.transformer.h)
    if hasattr(model, "bert"):
        return list(model.bert.encoder.layer)
    return list(model.model.layers)


def final_norm(model: nn.Module) -> nn.Module:
    return model.transformer.ln_f if hasattr(model, "transformer") else model.model.norm


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    clean = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    corrupted = clean.clone()
    corrupted[:, 2] = torch.tensor([7, 9])
    return clean, corrupted


MODELS = {"gpt2": gpt2, "llama": llama}


# -- references, without hookscope -------------------------------------------------------------------


def block_inputs(model: nn.Module, ids: torch.Tensor, *, keep_graph: bool = False) -> tuple[Any, list[torch.Tensor]]:
    """Each block's hidden-state input, kept by raw forward pre-hooks (with kwargs: Llama passes it by keyword)."""
    kept: list[torch.Tensor] = []

    def keep(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        value = args[0] if args else kwargs["hidden_states"]
        kept.append(value if keep_graph else value.detach().clone())

    handles = [block.register_forward_pre_hook(keep, with_kwargs=True) for block in blocks(model)]
    try:
        with torch.set_grad_enabled(keep_graph):
            output = model(ids)
    finally:
        for handle in handles:
            handle.remove()
    return output, kept


def patched_run(model: nn.Module, ids: torch.Tensor, layer: int, position: int | None, value: torch.Tensor) -> Any:
    """``model(ids)`` with block ``layer``'s input at ``position`` (None: all) replaced by ``value``'s."""

    def replace(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        hidden = (args[0] if args else kwargs["hidden_states"]).clone()
        where = slice(None) if position is None else position
        hidden[:, where] = value[:, where]
        if args:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}

    handle = blocks(model)[layer].register_forward_pre_hook(replace, with_kwargs=True)
    try:
        with torch.no_grad():
            return model(ids)
    finally:
        handle.remove()


def naive_sweep(
    model: nn.Module, clean: torch.Tensor, corrupted: torch.Tensor, metric: Callable[[Any], torch.Tensor]
) -> torch.Tensor:
    """One forward per (layer, position), denoising: the normalised effect of each."""
    clean_out, sources = block_inputs(model, clean)
    with torch.no_grad():
        low = metric(model(corrupted)).double().mean()
    high = metric(clean_out).double().mean()
    seq = clean.shape[1]
    grid = torch.empty(len(sources), seq, dtype=torch.float64)
    for layer, source in enumerate(sources):
        for position in range(seq):
            patched = metric(patched_run(model, corrupted, layer, position, source)).double().mean()
            grid[layer, position] = (patched - low) / (high - low)
    return grid


# -- gradients as tensors -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize(
    "rows", [2, 64]
)  # 2 x 6 x 32 floats: 1.5 KiB; 64 x 12 x 32: 96 KiB, over the 64 KiB copy threshold
def test_grads_equal_autograd_on_block_inputs(name: str, rows: int) -> None:
    model = MODELS[name]()
    ids = torch.randint(0, VOCAB, (rows, 6 if rows == 2 else 12), generator=torch.Generator().manual_seed(rows))
    metric = hs.methods.logit_diff(3, 5)
    output, kept = block_inputs(model, ids, keep_graph=True)
    reference = torch.autograd.grad(metric(output).sum(), kept)
    model.zero_grad(set_to_none=True)
    _, cache = hs.run_with_capture(model, ids, layers="std:blocks.*.resid_pre", backward=metric)
    for index, expected in enumerate(reference):
        torch.testing.assert_close(cache.grad[f"std:blocks.{index}.resid_pre"], expected, rtol=1e-5, atol=1e-7)
    assert all(p.grad is None for p in model.parameters())  # the backward reached the captured values only


def test_grads_fill_on_the_users_own_backward_and_accumulate() -> None:
    model = gpt2()
    ids, _ = prompts()
    with hs.capture(model, "transformer.h.1", grads=True) as cap:
        loss = model(ids).logits.pow(2).mean()
    first_output = cap.cache["transformer.h.1"]
    loss.backward(retain_graph=True)
    once = cap.cache.grad["transformer.h.1"].clone()
    loss.backward()
    torch.testing.assert_close(cap.cache.grad["transformer.h.1"], 2 * once)
    assert once.shape == first_output.shape
    assert once.abs().sum() > 0


def test_grads_are_of_the_value_as_kept_after_an_in_place_write() -> None:
    torch.manual_seed(0)
    in_place = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 1))
    plain = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    plain.load_state_dict(in_place.state_dict())
    x = torch.randn(5, 4)
    kept: list[torch.Tensor] = []
    handle = plain[0].register_forward_hook(lambda module, args, output: kept.append(output))
    (expected,) = torch.autograd.grad(plain(x).sum(), kept)
    handle.remove()
    _out, cache = hs.run_with_capture(in_place, x, layers="0", backward=lambda out: out.sum())
    assert bool((cache["0"] < 0).any())  # the kept value is the one before the ReLU wrote into it
    torch.testing.assert_close(cache.grad["0"], expected)
    assert bool((cache.grad["0"] == 0).any())  # the gradient through the ReLU, not around it


def test_a_missing_gradient_says_why() -> None:
    model = gpt2()
    ids, _ = prompts()
    with hs.capture(model, "transformer.h.0", grads=True) as cap:
        model(ids)
    with pytest.raises(hs.SiteNotFoundError, match="no backward has reached it"):
        cap.cache.grad["transformer.h.0"]
    with torch.no_grad(), hs.capture(model, "transformer.h.0", grads=True) as cap:
        model(ids)
    with pytest.raises(hs.SiteNotFoundError, match="not in autograd's graph"):
        cap.cache.grad["transformer.h.0"]
    with pytest.raises(hs.CaptureError, match="does not depend on anything"), torch.no_grad():
        hs.run_with_capture(model, ids, layers="transformer.h.0", backward=lambda out: out.logits.sum())


def test_grads_refuse_a_reduction_and_a_metric_that_raises_leaves_no_hook() -> None:
    model = gpt2()
    ids, _ = prompts()
    with pytest.raises(hs.SpecError, match="grads=True cannot keep gradients of reduced values"):
        hs.capture(model, "transformer.h.0", grads=True, reduce="mean:1")

    def broken(output: Any) -> torch.Tensor:
        raise RuntimeError("metric failed")

    with pytest.raises(RuntimeError, match="metric failed"):
        hs.run_with_capture(model, ids, layers="transformer.h.0", backward=broken)
    # the autouse fixture checks that no hook is left on the model


# -- metrics --------------------------------------------------------------------------------------------


def test_metrics_against_hand_arithmetic() -> None:
    logits = torch.randn(2, 5, VOCAB, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(hs.methods.logit_diff(3, 4)(logits), logits[:, -1, 3] - logits[:, -1, 4])
    per_row = hs.methods.logit_diff(torch.tensor([1, 2]), torch.tensor([5, 6]), position=torch.tensor([0, 3]))
    torch.testing.assert_close(
        per_row(logits), torch.stack([logits[0, 0, 1] - logits[0, 0, 5], logits[1, 3, 2] - logits[1, 3, 6]])
    )
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[0, 1:3] = True
    mask[1, 4] = True
    masked = hs.methods.logprob(7, position=mask)(logits)
    logprobs = logits.log_softmax(-1)[..., 7]
    torch.testing.assert_close(masked, torch.stack([logprobs[0, 1:3].mean(), logprobs[1, 4]]))
    assert float(hs.methods.kl_to(logits)(logits).abs().max()) < 1e-6
    # repeated rows (as a batched sweep runs them): per-row tokens repeat with them
    torch.testing.assert_close(per_row(logits.repeat(3, 1, 1)), per_row(logits).repeat(3))


def test_loss_metric_equals_the_models_own_loss() -> None:
    model = gpt2()
    ids, _ = prompts()
    with torch.no_grad():
        output = model(ids, labels=ids)
    torch.testing.assert_close(hs.methods.loss(ids)(output).mean(), output.loss)


def test_a_metric_that_reads_no_logits_or_a_bad_token_is_refused() -> None:
    with pytest.raises(hs.SpecError, match="without them"):
        hs.methods.logit_diff(1, 2)({"hidden": torch.zeros(1)})
    with pytest.raises(hs.SpecError, match="outside a vocabulary"):
        hs.methods.logit_diff(1, 99)(torch.zeros(1, 2, 8))
    with pytest.raises(hs.SpecError, match="position"):
        hs.methods.logprob(1, position=2.5)  # type: ignore[arg-type]


# -- patching sweeps ------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_sweep_cells_equal_one_patch_at_a_time(name: str) -> None:
    model = MODELS[name]()
    clean, corrupted = prompts()
    metric = hs.methods.logit_diff(3, 5)
    expected = naive_sweep(model, clean, corrupted, metric)
    for batch_rows in (None, 6):  # 32 patches per forward; 3 per forward, the last chunk short
        effects = hs.methods.patch_sweep(model, clean, corrupted, metric=metric, batch_rows=batch_rows)
        assert effects.dims == ("site", "position")
        assert effects.coords["site"] == ["blocks.0.resid_pre", "blocks.1.resid_pre"]
        torch.testing.assert_close(effects.values, expected, rtol=1e-4, atol=1e-5)
    assert effects.at("blocks.0.resid_pre", 2) == pytest.approx(1.0, abs=1e-5)  # the only changed token


def test_sweep_of_every_position_at_once_and_noising() -> None:
    model = gpt2()
    clean, corrupted = prompts()
    metric = hs.methods.logit_diff(3, 5)
    clean_out, sources = block_inputs(model, clean)
    corrupted_out, corrupted_sources = block_inputs(model, corrupted)
    high, low = metric(clean_out).double().mean(), metric(corrupted_out).double().mean()
    together = hs.methods.patch_sweep(model, clean, corrupted, metric=metric, positions="all")
    noised = hs.methods.patch_sweep(model, clean, corrupted, metric=metric, positions=[2, -1], direction="noise")
    for layer in range(2):
        whole = metric(patched_run(model, corrupted, layer, None, sources[layer])).double().mean()
        assert together.at(f"blocks.{layer}.resid_pre", "all") == pytest.approx(
            float((whole - low) / (high - low)), abs=1e-5
        )
        for position in (2, 5):
            broken = metric(patched_run(model, clean, layer, position, corrupted_sources[layer])).double().mean()
            cell = noised.at(f"blocks.{layer}.resid_pre", position)
            assert cell == pytest.approx(float((broken - low) / (high - low)), abs=1e-5)
    assert noised.coords["position"] == [2, 5]


def test_sweep_by_head_equals_a_raw_patch_of_the_heads_output() -> None:
    """attn.z by head: the reference patches the same head's slice of c_proj's input (heads merged)."""
    model = gpt2()
    clean, corrupted = prompts()
    metric = hs.methods.logit_diff(3, 5)
    effects = hs.methods.patch_sweep(model, clean, corrupted, metric=metric, heads=[1, 3], positions=[2, 4])
    assert effects.dims == ("site", "head", "position")
    assert effects.values.shape == (2, 2, 2)
    head_size = 8
    with torch.no_grad():
        high, low = metric(model(clean)).double().mean(), metric(model(corrupted)).double().mean()
    for layer in range(2):
        projection = model.transformer.h[layer].attn.c_proj
        merged_heads = head_inputs(model, projection, clean)
        for head in (1, 3):
            for position in (2, 4):
                columns = slice(head * head_size, (head + 1) * head_size)
                patched = metric(patched_heads(model, projection, corrupted, merged_heads, position, columns))
                expected = float((patched.double().mean() - low) / (high - low))
                assert effects.at(f"blocks.{layer}.attn.z", head, position) == pytest.approx(expected, abs=1e-4)


def head_inputs(model: nn.Module, projection: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    kept: list[torch.Tensor] = []
    handle = projection.register_forward_pre_hook(lambda m, args: kept.append(args[0].clone()))
    with torch.no_grad():
        model(ids)
    handle.remove()
    return kept[0]


def patched_heads(
    model: nn.Module, projection: nn.Module, ids: torch.Tensor, source: torch.Tensor, position: int, columns: slice
) -> Any:
    def patch(module: nn.Module, args: tuple[Any, ...]) -> Any:
        merged = args[0].clone()
        merged[:, position, columns] = source[:, position, columns]
        return (merged,)

    handle = projection.register_forward_pre_hook(patch)
    try:
        with torch.no_grad():
            return model(ids)
    finally:
        handle.remove()


@pytest.mark.slow
def test_sweep_on_an_encoder_model() -> None:
    model = bert()
    clean, corrupted = prompts()
    metric = hs.methods.logit_diff(3, 5, position=4)
    effects = hs.methods.patch_sweep(model, clean, corrupted, metric=metric, positions=[1, 2, 4])
    with torch.no_grad():
        high = metric(model(clean)).double().mean()
        low = metric(model(corrupted)).double().mean()
    _clean_out, sources = block_inputs(model, clean)
    for layer in range(2):
        for position in (1, 2, 4):
            patched = metric(patched_run(model, corrupted, layer, position, sources[layer])).double().mean()
            cell = effects.at(f"blocks.{layer}.resid_pre", position)
            assert cell == pytest.approx(float((patched - low) / (high - low)), abs=1e-4)


def test_sweep_refuses_inputs_of_two_shapes_and_unknown_positions() -> None:
    model = gpt2()
    clean, corrupted = prompts()
    metric = hs.methods.logit_diff(3, 5)
    with pytest.raises(hs.SpecError, match="patch between inputs of one shape"):
        hs.methods.patch_sweep(model, clean, corrupted[:, :5], metric=metric)
    with pytest.raises(hs.SpecError, match="rows"):
        hs.methods.patch_sweep(model, clean, corrupted[:1], metric=metric)
    with pytest.raises(hs.SpecError, match="not one of the 6 positions"):
        hs.methods.patch_sweep(model, clean, corrupted, metric=metric, positions=[9])
    with pytest.raises(hs.SpecError, match="call model.eval"):
        hs.methods.patch_sweep(gpt2().train(), clean, corrupted, metric=metric)
    with pytest.raises(hs.SpecError, match="direction"):
        hs.methods.patch_sweep(model, clean, corrupted, metric=metric, direction="sideways")  # type: ignore[arg-type]


def test_a_metric_that_raises_in_a_sweep_leaves_no_hook() -> None:
    model = gpt2()
    clean, corrupted = prompts()
    seen: list[int] = []

    def flaky(output: Any) -> torch.Tensor:
        seen.append(output.logits.shape[0])
        if output.logits.shape[0] > 4:  # the unpatched runs (2 + 2 rows) pass; the first patched forward fails
            raise RuntimeError("metric failed")
        return output.logits[:, -1, 3]

    with pytest.raises(RuntimeError, match="metric failed"):
        hs.methods.patch_sweep(model, clean, corrupted, metric=flaky)
    assert seen[-1] > 4
    # the autouse fixture checks that no hook is left on the model


# -- attribution patching ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_attribution_equals_grad_times_delta(name: str) -> None:
    model = MODELS[name]()
    clean, corrupted = prompts()
    metric = hs.methods.logit_diff(3, 5)
    clean_out, sources = block_inputs(model, clean)
    corrupted_out, targets = block_inputs(model, corrupted, keep_graph=True)
    grads = torch.autograd.grad(metric(corrupted_out).sum(), targets)
    high, low = metric(clean_out).double().mean(), metric(corrupted_out).detach().double().mean()
    atp = hs.methods.attribution_patch(model, clean, corrupted, metric=metric)
    for layer in range(2):
        estimate = (grads[layer] * (sources[layer] - targets[layer].detach())).sum(-1).double().mean(0)
        torch.testing.assert_close(atp.values[layer], estimate / (high - low), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(atp.raw, atp.values * (high - low) + low)


def test_attribution_verify_flags_exactly_the_sign_disagreements() -> None:
    model = gpt2()
    clean, corrupted = prompts()
    metric = hs.methods.logit_diff(3, 5)
    sweep = hs.methods.patch_sweep(model, clean, corrupted, metric=metric)
    atp = hs.methods.attribution_patch(model, clean, corrupted, metric=metric, verify=12)
    assert len(atp.verified) == 12
    for cell, exact in atp.verified.items():
        assert exact == pytest.approx(sweep.at(*cell), abs=1e-5)
    assert sorted(map(str, atp.flags)) == sorted(map(str, atp.compare(sweep)))
    assert 0.9 < atp.correlation(sweep) <= 1.0


class Bowl(nn.Module):
    """Logits ``[(h - 1)^2, 0]`` of ``h = proj(x)``: a metric whose slope at the corrupted value
    points away from the clean one, the curvature AtP cannot see."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(1, 1)
        with torch.no_grad():
            self.proj.weight.fill_(1.0)
            self.proj.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return torch.cat([(h - 1) ** 2, torch.zeros_like(h)], -1)


def test_attribution_flags_a_cell_whose_estimate_has_the_wrong_sign() -> None:
    clean = torch.tensor([[[0.0], [2.0]]])  # the metric reads the last position: (2 - 1)^2 = 1
    corrupted = torch.tensor([[[0.0], [0.5]]])  # (0.5 - 1)^2 = 0.25
    metric = hs.methods.logit_diff(0, 1)
    atp = hs.methods.attribution_patch(Bowl().eval(), clean, corrupted, metric=metric, layers="proj", verify=2)
    # the slope at 0.5 is 2 * (0.5 - 1) = -1, the change 1.5: estimate -1.5 / 0.75 = -2; the patch restores all: 1
    assert atp.at("proj", 1) == pytest.approx(-2.0)
    assert atp.verified[("proj", 1)] == pytest.approx(1.0)
    assert [flag.cell for flag in atp.flags] == [("proj", 1)]
    sweep = hs.methods.patch_sweep(Bowl().eval(), clean, corrupted, metric=metric, layers="proj")
    assert [flag.cell for flag in atp.compare(sweep)] == [("proj", 1)]


def test_attribution_by_head_and_noising_has_the_sweeps_cells() -> None:
    model = llama()
    clean, corrupted = prompts()
    metric = hs.methods.logit_diff(3, 5)
    atp = hs.methods.attribution_patch(model, clean, corrupted, metric=metric, heads=True, direction="noise")
    sweep = hs.methods.patch_sweep(
        model, clean, corrupted, metric=metric, heads=True, direction="noise", positions="each"
    )
    assert atp.coords == sweep.coords
    assert atp.values.shape == (2, 4, 6)
    assert torch.isfinite(atp.values).all()


# -- logit lens --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_logit_lens_equals_the_manual_projection(name: str) -> None:
    model = MODELS[name]()
    ids, _ = prompts()
    output, inputs = block_inputs(model, ids)
    lens = hs.methods.logit_lens(model, ids, layers="std:blocks.*.resid_pre", metric=hs.methods.logprob(4))
    with torch.no_grad():
        for layer, resid in enumerate(inputs):
            torch.testing.assert_close(lens.logits[layer], model.lm_head(final_norm(model)(resid)))
    last = hs.methods.logit_lens(model, ids)
    torch.testing.assert_close(last.logits[-1], output.logits)  # the last resid_post is the model's own logits
    best = last.top(3, position=2, row=1)[-1]
    expected = output.logits[1, 2].softmax(-1).topk(3)
    assert [token for token, _ in best] == expected.indices.tolist()
    torch.testing.assert_close(lens.scores, lens.logits.log_softmax(-1)[..., -1, 4].double().mean(1))


def test_a_tuned_lens_applies_each_translator() -> None:
    model = gpt2()
    ids, _ = prompts()
    torch.manual_seed(1)
    translator = nn.Linear(32, 32)
    plain = hs.methods.logit_lens(model, ids)
    tuned = hs.methods.logit_lens(model, ids, translators={"blocks.0.resid_post": translator})
    _, inputs = block_inputs(model, ids)
    with torch.no_grad():
        expected = model.lm_head(model.transformer.ln_f(translator(inputs[1])))
    torch.testing.assert_close(tuned.logits[0], expected)
    torch.testing.assert_close(tuned.logits[1], plain.logits[1])
    with pytest.raises(hs.SpecError, match="does not read"):
        hs.methods.logit_lens(model, ids, translators={"blocks.7.resid_post": translator})


def test_logit_lens_needs_an_lm_head() -> None:
    torch.manual_seed(0)
    bare = transformers.GPT2Model(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB)).eval()
    with pytest.raises(hs.SpecError, match="ForCausalLM"):
        hs.methods.logit_lens(bare, prompts()[0])


# -- the residual stream ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_decompose_resid_sums_to_the_last_resid_post(name: str) -> None:
    model = MODELS[name]()
    ids, _ = prompts()
    parts, labels = hs.methods.decompose_resid(model, ids)
    assert labels == ["embed", "blocks.0.attn", "blocks.0.mlp", "blocks.1.attn", "blocks.1.mlp"]
    kept: list[torch.Tensor] = []
    last = blocks(model)[-1]
    handle = last.register_forward_hook(lambda m, args, out: kept.append(out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        model(ids)
    handle.remove()
    torch.testing.assert_close(parts.sum(0), kept[0], rtol=1e-5, atol=1e-6)
    _, inputs = block_inputs(model, ids)
    torch.testing.assert_close(parts[0], inputs[0])
    resid, names = hs.methods.accumulated_resid(model, ids)
    assert names == ["blocks.0.resid_pre", "blocks.1.resid_pre", "blocks.1.resid_post"]
    torch.testing.assert_close(resid[:2], torch.stack(inputs))
    torch.testing.assert_close(resid[-1], kept[0])


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_apply_ln_linear_parts_sum_to_the_normalised_stream(name: str) -> None:
    model = MODELS[name]()
    ids, _ = prompts()
    parts = hs.methods.decompose_resid(model, ids)
    total = parts.tensor.sum(0)
    norm = final_norm(model)
    normed = hs.methods.apply_ln(parts, model, scale_of=total)
    bias = norm.bias if getattr(norm, "bias", None) is not None else torch.zeros(32)
    with torch.no_grad():
        torch.testing.assert_close(normed.tensor.sum(0) + bias, norm(total), rtol=1e-4, atol=1e-5)
        each = hs.methods.apply_ln(hs.methods.accumulated_resid(model, ids), model)
        torch.testing.assert_close(each.tensor[-1], norm(total))


def test_decompose_refuses_a_post_norm_model() -> None:
    with pytest.raises(hs.SpecError, match="post-norm"):
        hs.methods.decompose_resid(bert(), prompts()[0])


def test_cache_stack_labels_and_errors() -> None:
    model = gpt2()
    ids, _ = prompts()
    _, inputs = block_inputs(model, ids)
    with torch.no_grad():
        _, cache = hs.run_with_capture(model, ids, layers=["std:blocks.*.resid_pre", "transformer.h.*.mlp"])
    values, labels = cache.stack("std:blocks.*.resid_pre")
    assert labels == ["blocks.0.resid_pre", "blocks.1.resid_pre"]
    torch.testing.assert_close(values, torch.stack(inputs))
    mlps, names = cache.stack("transformer.h.*.mlp")
    assert names == ["transformer.h.0.mlp", "transformer.h.1.mlp"]
    assert mlps.shape == (2, 2, 6, 32)
    with pytest.raises(hs.SiteNotFoundError, match="matched no captured value"):
        cache.stack("transformer.h.*.attn")
    with pytest.raises(hs.SpecError, match="different shapes"):
        hs.Cache({hs.Site("a"): torch.zeros(2), hs.Site("b"): torch.zeros(3)}).stack("*")


# -- results ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_effects_to_pandas_and_plots() -> None:
    pytest.importorskip("matplotlib")
    pandas = pytest.importorskip("pandas")
    model = gpt2()
    clean, corrupted = prompts()
    metric = hs.methods.logit_diff(3, 5)
    effects = hs.methods.patch_sweep(model, clean, corrupted, metric=metric, positions=[1, 2])
    frame = effects.to_pandas()
    assert isinstance(frame, pandas.DataFrame)
    assert frame.shape == (2, 2)
    assert frame.loc["blocks.0.resid_pre", 2] == pytest.approx(effects.at("blocks.0.resid_pre", 2))
    figure = effects.plot()
    assert len(figure.axes) == 2  # the heatmap and its colour bar
    by_head = hs.methods.patch_sweep(model, clean, corrupted, metric=metric, heads=True, positions=[2])
    assert len(by_head.plot().axes) == 3
    assert by_head.to_pandas().shape == (8, 4)
    lens = hs.methods.logit_lens(model, clean, decode=[f"t{i}" for i in range(VOCAB)])
    assert "t" in repr(lens)
    assert len(lens.plot().axes) == 2
    assert "blocks.0.resid_pre" in repr(effects)


# -- the methods guide's worked study -----------------------------------------------------------------------------


@pytest.mark.slow
def test_the_worked_study_runs_and_the_methods_guide_names_it(
    tmp_path: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    root = Path(__file__).resolve().parents[2]
    script = root / "docs" / "examples" / "ioi_study.py"
    guide = (root / "docs" / "guides" / "methods.md").read_text()
    assert "`docs/examples/ioi_study.py`" in guide  # the guide's worked study points to the script
    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(script), run_name="__main__")
    printed = capsys.readouterr().out
    correlation = float(printed.split("AtP against the sweep: r = ")[1].split(";")[0])
    assert 0.9 < correlation <= 1.0
    assert "strongest head: blocks." in printed
    assert "Logit lens: 2 layers" in printed
    assert (tmp_path / "sweep.png").stat().st_size > 1000


# -- edges a review found -----------------------------------------------------------------------------------


class Twice(nn.Module):
    """One module called twice in a forward: its two calls are two sites with one selector."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.head = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.shared(torch.relu(self.shared(x))))


def test_a_module_called_twice_is_patched_at_each_call_on_its_own() -> None:
    torch.manual_seed(0)
    model = Twice().eval()
    clean, corrupted = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    metric = hs.methods.logit_diff(0, 1)
    batched = hs.methods.patch_sweep(model, clean, corrupted, metric=metric, layers="shared")
    assert batched.coords["site"] == ["shared#0:output", "shared#1:output"]
    kept: list[torch.Tensor] = []
    handle = model.shared.register_forward_hook(lambda m, args, out: kept.append(out.detach().clone()))
    with torch.no_grad():
        high = metric(model(clean)).double().mean()
        handle.remove()
        low = metric(model(corrupted)).double().mean()
    for call in (0, 1):
        for position in range(3):
            patched = metric(patched_call(model, corrupted, kept[call], call, position)).double().mean()
            expected = float((patched - low) / (high - low))
            assert batched.at(f"shared#{call}:output", position) == pytest.approx(expected, abs=1e-6)


def patched_call(model: Twice, ids: torch.Tensor, source: torch.Tensor, call: int, position: int) -> torch.Tensor:
    """``model(ids)`` with call ``call`` of ``model.shared`` patched at ``position`` from ``source``."""
    calls = iter(range(2))

    def patch(module: nn.Module, args: Any, out: torch.Tensor) -> Any:
        if next(calls) != call:
            return None
        out = out.clone()
        out[:, position] = source[:, position]
        return out

    handle = model.shared.register_forward_hook(patch)
    try:
        with torch.no_grad():
            return model(ids)
    finally:
        handle.remove()


def test_cells_whose_patch_changes_nothing_take_no_forward() -> None:
    """Positions before the changed token are equal in both runs at every causal layer: exact, skipped."""
    model = gpt2()
    clean, corrupted = prompts()  # token 2 differs
    metric = hs.methods.logit_diff(3, 5)
    effects = hs.methods.patch_sweep(model, clean, corrupted, metric=metric, batch_rows=2)
    # block 0: only position 2 differs; block 1: positions 2..5; one cell per forward here
    assert effects.forwards == 1 + 4
    assert effects.values[:, :2].abs().max() == 0
    torch.testing.assert_close(effects.values, naive_sweep(model, clean, corrupted, metric), rtol=1e-4, atol=1e-5)


def test_grads_read_in_capture_order_and_stack_alike() -> None:
    model = gpt2()
    ids, _ = prompts()
    _, cache = hs.run_with_capture(model, ids, layers="transformer.h.?", backward=hs.methods.logit_diff(3, 5))
    assert cache.grad.stack("transformer.h.?").labels == cache.stack("transformer.h.?").labels
    assert [str(site) for site in cache.grad.sites()] == [str(site) for site in cache.sites()]


def test_a_metric_that_is_nan_on_a_baseline_is_refused() -> None:
    model = gpt2()
    clean, corrupted = prompts()
    with pytest.raises(hs.SpecError, match="predicts no label"):
        hs.methods.loss(corrupted, position=-1)
    with pytest.raises(hs.SpecError, match="both must be finite"):
        hs.methods.patch_sweep(model, clean, corrupted, metric=lambda out: out.logits[:, -1, 0] * float("nan"))


def test_attribution_on_frozen_weights_leaves_them_frozen() -> None:
    model = gpt2().requires_grad_(False)
    clean, corrupted = prompts()
    metric = hs.methods.logit_diff(3, 5)
    frozen = hs.methods.attribution_patch(model, clean, corrupted, metric=metric)
    assert not any(p.requires_grad for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())
    torch.testing.assert_close(
        frozen.values, hs.methods.attribution_patch(gpt2(), clean, corrupted, metric=metric).values
    )


def test_logit_lens_of_an_encoder_decoders_decoder() -> None:
    torch.manual_seed(0)
    config = transformers.T5Config(
        num_layers=2, num_decoder_layers=2, d_model=32, d_kv=8, num_heads=4, d_ff=64, vocab_size=VOCAB,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.T5ForConditionalGeneration(config).eval()
    ids, _ = prompts()
    inputs = {"input_ids": ids, "decoder_input_ids": ids}
    lens = hs.methods.logit_lens(model, inputs, stack="decoder.")
    assert lens.layers == ["decoder.blocks.0.resid_post", "decoder.blocks.1.resid_post"]
    with torch.no_grad():
        torch.testing.assert_close(lens.logits[-1], model(**inputs).logits)
    with pytest.raises(hs.SpecError, match='stack="decoder."'):
        hs.methods.decompose_resid(model, inputs)


def test_a_metric_made_for_the_inputs_rows_alone_still_sweeps() -> None:
    """A metric that indexes the input's own rows cannot read the stacked clean+corrupted run: two runs."""
    model = gpt2()
    clean, corrupted = prompts()
    correct = torch.tensor([3, 4])
    metric = hs.methods.logit_diff(correct, 5)

    def rows_of_the_input(output: Any) -> torch.Tensor:
        return output.logits[torch.arange(2), -1, correct] - output.logits[:, -1, 5]

    expected = hs.methods.patch_sweep(model, clean, corrupted, metric=metric)
    got = hs.methods.patch_sweep(model, clean, corrupted, metric=rows_of_the_input, batch_rows=2)
    torch.testing.assert_close(got.values, expected.values, rtol=1e-4, atol=1e-5)


def test_frozen_weights_stay_frozen_when_thawing_fails() -> None:
    model = gpt2().requires_grad_(False)
    with torch.inference_mode():
        weight = model.transformer.h[1].mlp.c_fc.weight.detach().clone()
    model.transformer.h[1].mlp.c_fc.weight = nn.Parameter(weight, requires_grad=False)
    clean, corrupted = prompts()
    with pytest.raises(RuntimeError):
        hs.methods.attribution_patch(model, clean, corrupted, metric=hs.methods.logit_diff(3, 5))
    assert not any(p.requires_grad for p in model.parameters())


def test_inputs_with_a_broadcast_position_ids_and_a_list_input() -> None:
    model = gpt2()
    clean, corrupted = prompts()
    metric = hs.methods.logit_diff(3, 5)
    positions = torch.arange(6)[None]
    expected = hs.methods.patch_sweep(model, clean, corrupted, metric=metric)
    given = hs.methods.patch_sweep(
        model,
        {"position_ids": positions, "input_ids": clean},
        {"position_ids": positions, "input_ids": corrupted},
        metric=metric,
    )
    torch.testing.assert_close(given.values, expected.values, rtol=1e-4, atol=1e-5)
    from hookscope._methods.runs import Inputs

    mask = torch.ones(2, 6)
    one = Inputs.of({"input_ids": clean, "extra": [mask]}, "clean")
    assert one.stacked(Inputs.of({"input_ids": corrupted, "extra": [mask.clone()]}, "corrupted")) is None

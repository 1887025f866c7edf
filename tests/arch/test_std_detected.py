"""Canonical names the structural detector reads off real transformers architectures no family
table knows: norms after the sublayers (OLMo 2), an MLP that adds the residual itself (MPT),
post-norm blocks whose dropouts and norms carry sublayer names (GTE), a layer scale (BEiT), and
the refusals that say what a model has instead of attention blocks.

Every model is tiny, with random weights from its config. References are raw PyTorch hooks on
modules named here by hand, and the residual identities are computed here in float64.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import pytest
import torch
from torch import nn

import hookscope as hs

pytestmark = [pytest.mark.transformers]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

SMALL: dict[str, Any] = {
    "vocab_size": 100,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def build(config: str, model: str, **kwargs: Any) -> Any:
    torch.manual_seed(0)
    return getattr(transformers, model)(getattr(transformers, config)(**kwargs)).eval()


def ids() -> torch.Tensor:
    return torch.randint(0, 100, (2, 6), generator=torch.Generator().manual_seed(1))


def raw(model: nn.Module, names: list[str], run: Callable[[], object]) -> dict[str, torch.Tensor]:
    """``name:input`` and ``name:output`` (first tensors) of each module, with plain PyTorch hooks."""
    seen: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules())

    def keep(name: str) -> Any:
        def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            first = output[0] if isinstance(output, (tuple, list)) else output
            taken = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
            seen.setdefault(f"{name}:output", first.detach().clone())
            seen.setdefault(f"{name}:input", taken.detach().clone())

        return hook

    with ExitStack() as hooks, torch.no_grad():
        for n in names:
            hooks.callback(modules[n].register_forward_hook(keep(n), with_kwargs=True).remove)
        run()
    return seen


def captured(model: nn.Module, names: list[str], run: Callable[[], object]) -> dict[str, torch.Tensor]:
    with hs.capture(model, *(f"std:{n}" for n in names)) as cap, torch.no_grad():
        run()
    return {n: cap.cache[f"std:{n}"] for n in names}


def assert_sum(got: torch.Tensor, *parts: torch.Tensor) -> None:
    """``got`` is the sum of ``parts``, added here in float64."""
    expected = sum((p.double() for p in parts), torch.zeros_like(got, dtype=torch.float64))
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


_CONVNEXT = {"num_stages": 2, "depths": [2, 2], "hidden_sizes": [8, 16]}
BLOCK = ["blocks.1.resid_pre", "blocks.1.attn", "blocks.1.resid_mid", "blocks.1.mlp", "blocks.1.resid_post"]


def test_norms_after_each_sublayer_are_what_it_adds_olmo2() -> None:
    model = build("Olmo2Config", "Olmo2ForCausalLM", **SMALL)
    x = ids()
    std = hs.std_map(model, x)
    assert std.family == "detected"
    layer = "model.layers.1"
    hand = raw(
        model, [layer, f"{layer}.post_attention_layernorm", f"{layer}.post_feedforward_layernorm"], lambda: model(x)
    )
    got = captured(model, BLOCK, lambda: model(x))
    torch.testing.assert_close(got["blocks.1.attn"], hand[f"{layer}.post_attention_layernorm:output"], rtol=0, atol=0)
    torch.testing.assert_close(got["blocks.1.mlp"], hand[f"{layer}.post_feedforward_layernorm:output"], rtol=0, atol=0)
    torch.testing.assert_close(got["blocks.1.resid_pre"], hand[f"{layer}:input"], rtol=0, atol=0)
    assert_sum(got["blocks.1.resid_mid"], hand[f"{layer}:input"], hand[f"{layer}.post_attention_layernorm:output"])
    assert_sum(hand[f"{layer}:output"], got["blocks.1.resid_mid"], hand[f"{layer}.post_feedforward_layernorm:output"])
    assert "after them" in std.missing["blocks.1.ln1"]  # no norm reads the stream before attention


def test_an_mlp_that_adds_the_residual_itself_is_read_at_its_projection_mpt() -> None:
    model = build("MptConfig", "MptForCausalLM", vocab_size=100, d_model=32, n_layers=2, n_heads=4, expansion_ratio=2)
    x = ids()
    std = hs.std_map(model, x)
    assert std["blocks.1.mlp"].module == "transformer.blocks.1.ffn.down_proj"
    layer = "transformer.blocks.1"
    hand = raw(model, [layer, f"{layer}.attn", f"{layer}.ffn.down_proj"], lambda: model(x))
    got = captured(model, BLOCK, lambda: model(x))
    torch.testing.assert_close(got["blocks.1.mlp"], hand[f"{layer}.ffn.down_proj:output"], rtol=0, atol=0)
    assert_sum(got["blocks.1.resid_mid"], hand[f"{layer}:input"], hand[f"{layer}.attn:output"])
    assert_sum(hand[f"{layer}:output"], got["blocks.1.resid_mid"], hand[f"{layer}.ffn.down_proj:output"])


def test_a_post_norm_block_with_sublayer_named_dropouts_and_norms_gte() -> None:
    model = build("GteConfig", "GteForMaskedLM", **SMALL)
    x = ids()
    std = hs.std_map(model, x)
    assert std["blocks.1.attn"].module == "gte.layers.1.self_attn"  # not post_attention_dropout
    assert std["blocks.1.mlp"].module == "gte.layers.1.mlp"  # not post_mlp_dropout or post_mlp_layernorm
    layer = "gte.layers.1"
    names = [
        layer,
        f"{layer}.self_attn",
        f"{layer}.mlp",
        f"{layer}.post_attention_layernorm",
        f"{layer}.post_mlp_layernorm",
    ]
    hand = raw(model, names, lambda: model(x))
    got = captured(model, [*BLOCK, "blocks.1.ln1", "blocks.1.ln2"], lambda: model(x))
    assert_sum(
        hand[f"{layer}.post_attention_layernorm:input"], hand[f"{layer}:input"], hand[f"{layer}.self_attn:output"]
    )
    torch.testing.assert_close(
        got["blocks.1.resid_mid"], hand[f"{layer}.post_attention_layernorm:output"], rtol=0, atol=0
    )
    assert_sum(hand[f"{layer}.post_mlp_layernorm:input"], got["blocks.1.resid_mid"], hand[f"{layer}.mlp:output"])
    torch.testing.assert_close(got["blocks.1.resid_post"], hand[f"{layer}:output"], rtol=0, atol=0)
    torch.testing.assert_close(got["blocks.1.ln2"], hand[f"{layer}.post_mlp_layernorm:output"], rtol=0, atol=0)


def test_a_layer_scale_names_the_stream_and_says_why_attn_is_missing_beit() -> None:
    vision = {"image_size": 16, "patch_size": 8, "use_mean_pooling": True, "layer_scale_init_value": 0.1}
    model = build("BeitConfig", "BeitForImageClassification", **{**SMALL, **vision})
    with torch.no_grad():  # a layer scale that is not one number
        for layer in model.beit.layers:
            layer.lambda_1.uniform_(0.5, 1.5)
            layer.lambda_2.uniform_(0.5, 1.5)
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    std = hs.std_map(model, pixel_values=pixels)
    assert "layer scale" in std.missing["blocks.1.attn"]
    assert "layer scale" in std.missing["blocks.1.mlp"]
    assert "pooler" in std.missing["ln_final"]  # the pooler's norm reads the mean token, not the stream
    layer = "beit.layers.1"
    hand = raw(model, [layer, f"{layer}.attention", f"{layer}.mlp"], lambda: model(pixel_values=pixels))
    names = ["blocks.1.resid_pre", "blocks.1.resid_mid", "blocks.1.resid_post"]
    got = captured(model, names, lambda: model(pixel_values=pixels))
    block: Any = model.beit.layers[1]
    assert_sum(
        got["blocks.1.resid_mid"], hand[f"{layer}:input"], block.lambda_1.detach() * hand[f"{layer}.attention:output"]
    )
    assert_sum(
        hand[f"{layer}:output"], got["blocks.1.resid_mid"], block.lambda_2.detach() * hand[f"{layer}.mlp:output"]
    )


_BART = {"vocab_size": 100, "d_model": 32, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4}
_BART |= {
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
    "max_position_embeddings": 32,
    "pad_token_id": 1,
}


@pytest.mark.parametrize(
    ("config", "model", "post"), [("MBartConfig", "MBartModel", False), ("MarianConfig", "MarianModel", True)]
)
def test_an_mlp_of_layers_in_the_block_itself_is_read_at_its_last_one(config: str, model: str, post: bool) -> None:
    """mBART (pre-norm) and Marian (post-norm) blocks hold fc1, activation_fn and fc2 themselves."""
    built = build(config, model, **_BART)
    inputs = {"input_ids": ids(), "decoder_input_ids": ids()[:, :4]}
    std = hs.std_map(built, **inputs, family=None)
    layer = "encoder.layers.1"
    assert std["encoder.blocks.1.mlp"].module == f"{layer}.fc2"
    assert std["encoder.blocks.1.mlp.pre"].read == f"{layer}.activation_fn:input[0]"
    names = [f"{layer}.{m}" for m in ("self_attn", "self_attn_layer_norm", "fc2", "final_layer_norm")]
    hand = raw(built, [layer, *names], lambda: built(**inputs))
    got = captured(built, ["encoder.blocks.1.resid_mid", "encoder.blocks.1.mlp"], lambda: built(**inputs))
    torch.testing.assert_close(got["encoder.blocks.1.mlp"], hand[f"{layer}.fc2:output"], rtol=0, atol=0)
    if post:  # each norm reads the sum and its output is the stream
        assert_sum(
            hand[f"{layer}.self_attn_layer_norm:input"], hand[f"{layer}:input"], hand[f"{layer}.self_attn:output"]
        )
        torch.testing.assert_close(got["encoder.blocks.1.resid_mid"], hand[f"{layer}.self_attn_layer_norm:output"])
        assert_sum(
            hand[f"{layer}.final_layer_norm:input"], got["encoder.blocks.1.resid_mid"], hand[f"{layer}.fc2:output"]
        )
    else:
        assert_sum(got["encoder.blocks.1.resid_mid"], hand[f"{layer}:input"], hand[f"{layer}.self_attn:output"])
        assert_sum(hand[f"{layer}:output"], got["encoder.blocks.1.resid_mid"], hand[f"{layer}.fc2:output"])
        torch.testing.assert_close(got["encoder.blocks.1.resid_mid"], hand[f"{layer}.final_layer_norm:input"])


def test_a_decoder_run_without_encoder_states_skips_its_cross_attention_bart_causal() -> None:
    model = build("BartConfig", "BartForCausalLM", **_BART)
    x = ids()
    std = hs.std_map(model, x)
    assert "did not run" in std.missing["blocks.1.cross_attn"]
    layer = "model.decoder.layers.1"
    hand = raw(model, [layer, f"{layer}.fc2", f"{layer}.final_layer_norm"], lambda: model(x))
    got = captured(model, ["blocks.1.resid_mid", "blocks.1.mlp", "blocks.1.resid_post"], lambda: model(x))
    assert_sum(hand[f"{layer}.final_layer_norm:input"], got["blocks.1.resid_mid"], hand[f"{layer}.fc2:output"])
    torch.testing.assert_close(got["blocks.1.resid_post"], hand[f"{layer}:output"], rtol=0, atol=0)


def test_one_activation_object_in_every_block_is_missing_not_a_refusal_openai_gpt() -> None:
    gpt = {"vocab_size": 100, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 16}
    model = build("OpenAIGPTConfig", "OpenAIGPTLMHeadModel", **gpt)
    assert model.transformer.h[0].mlp.act is model.transformer.h[1].mlp.act  # one module, no weights
    x = ids()
    std = hs.std_map(model, x)
    assert "serves every block" in std.missing["blocks.1.mlp.pre"]
    layer = "transformer.h.1"
    hand = raw(model, [layer, f"{layer}.attn", f"{layer}.mlp", f"{layer}.ln_1", f"{layer}.ln_2"], lambda: model(x))
    got = captured(model, ["blocks.1.attn", "blocks.1.resid_mid", "blocks.1.mlp"], lambda: model(x))
    torch.testing.assert_close(got["blocks.1.mlp"], hand[f"{layer}.mlp:output"], rtol=0, atol=0)
    assert_sum(hand[f"{layer}.ln_1:input"], hand[f"{layer}:input"], got["blocks.1.attn"])  # post-norm
    torch.testing.assert_close(got["blocks.1.resid_mid"], hand[f"{layer}.ln_1:output"], rtol=0, atol=0)
    assert_sum(hand[f"{layer}.ln_2:input"], got["blocks.1.resid_mid"], hand[f"{layer}.mlp:output"])


def test_a_mixture_of_experts_names_its_router_and_no_activation_qwen2_moe() -> None:
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "num_key_value_heads": 2}
    moe["shared_expert_intermediate_size"] = 16
    model = build("Qwen2MoeConfig", "Qwen2MoeForCausalLM", **SMALL, **moe)
    x = ids()
    std = hs.std_map(model, x)
    assert std.family == "detected"
    # one expert's activation, or the shared expert's gate, is not "the MLP's" pre or post value
    assert "per expert, mlp.experts.{e}.pre" in std.missing["blocks.1.mlp.pre"]
    assert "per expert, mlp.experts.{e}.pre" in std.missing["blocks.1.mlp.post"]
    assert std["blocks.1.mlp.experts.3.post"].read == "model.layers.1.mlp.experts:expert.post#3"  # per expert instead
    layer = "model.layers.1"
    hand = raw(model, [layer, f"{layer}.mlp", f"{layer}.mlp.gate"], lambda: model(x))
    got = captured(model, [*BLOCK, "blocks.1.mlp.router"], lambda: model(x))
    torch.testing.assert_close(got["blocks.1.mlp.router"], hand[f"{layer}.mlp.gate:output"], rtol=0, atol=0)
    torch.testing.assert_close(got["blocks.1.mlp"], hand[f"{layer}.mlp:output"], rtol=0, atol=0)
    assert_sum(hand[f"{layer}:output"], got["blocks.1.resid_mid"], hand[f"{layer}.mlp:output"])


def test_a_sublayer_no_sum_checks_is_missing_not_guessed_roberta_prelayernorm() -> None:
    model = build("RobertaPreLayerNormConfig", "RobertaPreLayerNormForMaskedLM", **SMALL)
    std = hs.std_map(model, ids(), family=None)  # the detector's reading, not the family table's
    # the attention module's output already holds the residual: naming it "attn" would be wrong
    assert "blocks.1.attn" not in std
    assert "no residual sum" in std.missing["blocks.1.attn"]
    # the first norm the detector finds is the MLP's (inside intermediate): not what attention reads
    assert "not what the attention module reads" in std.missing["blocks.1.ln1"]
    table = hs.std_map(model, ids())  # the family table reads what is added, before the add
    assert table["blocks.1.attn"].module == "roberta_prelayernorm.encoder.layer.1.attention.output.dropout"


def test_two_towers_each_name_their_own_blocks_and_embedding_siglip() -> None:
    torch.manual_seed(0)
    text = {**SMALL, "max_position_embeddings": 16}
    config = transformers.SiglipConfig(text_config=text, vision_config={**text, "image_size": 16, "patch_size": 8})
    model = transformers.SiglipModel(config).eval()
    inputs: dict[str, Any] = {"input_ids": ids()}
    inputs["pixel_values"] = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    std = hs.std_map(model, **inputs)
    assert std["text.embed"].module == "text_model.embeddings.token_embedding"
    assert std["vision.embed"].module == "vision_model.embeddings"  # its own patch embedding, not the text tower's
    assert "projector" not in std.missing  # a dual encoder has no language model to project into
    towers = {"text": "text_model.encoder.layers.1", "vision": "vision_model.encoder.layers.1"}
    hand = raw(model, list(towers.values()), lambda: model(**inputs))
    names = [f"{tower}.blocks.1.{role}" for tower in towers for role in ("resid_pre", "resid_post")]
    got = captured(model, names, lambda: model(**inputs))
    for tower, layer in towers.items():
        torch.testing.assert_close(got[f"{tower}.blocks.1.resid_pre"], hand[f"{layer}:input"], rtol=0, atol=0)
        torch.testing.assert_close(got[f"{tower}.blocks.1.resid_post"], hand[f"{layer}:output"], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("config", "model", "kwargs", "says"),
    [
        ("MambaConfig", "MambaForCausalLM", {"vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 2},
         r"'backbone\.layers' holds MambaBlock layers .*state-space .* hs\.capture\(model, 'backbone\.layers\.\*'\)"),
        ("ConvNextConfig", "ConvNextForImageClassification", _CONVNEXT,
         r"ConvNextStage layers .*\(convolutions\)"),
        ("XLMConfig", "XLMWithLMHeadModel", {"vocab_size": 100, "emb_dim": 32, "n_layers": 2, "n_heads": 4},
         r"'transformer\.attentions' holds the attention modules themselves"),
    ],
    ids=["mamba", "convnext", "xlm"],
)  # fmt: skip
def test_a_model_without_attention_blocks_is_refused_saying_what_it_has(
    config: str, model: str, kwargs: dict[str, Any], says: str
) -> None:
    built = build(config, model, **kwargs)
    example = (torch.randn(1, 3, 32, 32),) if "ConvNext" in model else (ids(),)
    with pytest.raises(hs.StdMapError, match=says) as raised:
        hs.std_map(built, *example, family=None)  # the detector's answer (Mamba has a family table)
    assert raised.value.check == "no block list"

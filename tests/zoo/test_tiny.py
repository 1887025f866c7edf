"""The tiny builder: every shrunk model is small, its special ids fit its shrunk vocabulary, its
per-layer lists follow the layer count, and the class built is the one the ledger names."""

from __future__ import annotations

import pytest
import torch
from zoo.tiny import SAMPLE_TYPES, build_tiny, kind_of, model_types, tiny_config

pytestmark = pytest.mark.transformers


@pytest.mark.parametrize(
    ("model_type", "model_class", "kind", "most"),
    [
        ("gpt2", "GPT2LMHeadModel", "decoder-only", 300_000),
        ("bert", "BertModel", "encoder-only", 300_000),  # its causal-LM head is not what BERT is
        ("t5", "T5ForConditionalGeneration", "encoder-decoder", 300_000),
        ("vit", "ViTModel", "vision", 300_000),
    ],
)
def test_a_tiny_model_is_small_and_of_the_expected_class(
    model_type: str, model_class: str, kind: str, most: int
) -> None:
    tiny = build_tiny(model_type)
    assert tiny.model_class == model_class == type(tiny.model).__name__
    assert tiny.kind == kind
    assert tiny.level == 0
    assert tiny.parameters == sum(p.numel() for p in tiny.model.parameters()) <= most
    assert not tiny.model.training


def test_the_same_seed_builds_the_same_weights() -> None:
    first, second = build_tiny("llama", seed=5).model, build_tiny("llama", seed=5).model
    assert all(
        torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values(), strict=True)
    )
    other = build_tiny("llama", seed=6).model
    assert not torch.equal(first.lm_head.weight, other.lm_head.weight)


def test_per_layer_lists_follow_the_layer_count_and_strings_stay_whole() -> None:
    gemma = tiny_config("gemma2")
    assert gemma.num_hidden_layers == 2
    assert len(gemma.layer_types) == 2
    big_bird = tiny_config("big_bird")
    assert big_bird.attention_type == "block_sparse"  # 12 letters, like its 12 layers: not cut


def test_special_ids_fold_into_the_shrunk_vocabulary() -> None:
    config = tiny_config("qwen2_vl")
    vocab = config.text_config.vocab_size
    assert vocab <= 1000
    ids = [config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id]
    assert all(0 <= item < vocab for item in ids)
    assert len(set(ids)) == len(ids)  # distinct ids stay distinct
    gpt2 = tiny_config("gpt2")
    assert gpt2.bos_token_id == gpt2.eos_token_id == gpt2.vocab_size - 1  # equal ids stay equal


def test_the_sample_is_drawn_from_known_types() -> None:
    assert 25 <= len(SAMPLE_TYPES) <= 30
    assert set(SAMPLE_TYPES) <= set(model_types())


def test_kind_reads_composite_configs_as_vision_language() -> None:
    config = tiny_config("llava")
    assert kind_of("llava", config, "input_ids") == "vision-language"


def test_a_timm_backbone_becomes_a_tiny_resnet() -> None:
    tiny = build_tiny("detr")  # DETR's default backbone is timm's resnet50
    assert tiny.model.config.backbone_config.model_type == "resnet"
    assert tiny.parameters < 2_000_000


def test_latent_attention_dims_shrink_together() -> None:
    config = tiny_config("deepseek_v3")
    assert (config.qk_rope_head_dim, config.qk_nope_head_dim, config.v_head_dim) == (8, 8, 16)
    assert config.head_dim == config.qk_rope_head_dim


def test_a_hybrid_cut_to_two_layers_keeps_an_attention_layer() -> None:
    config = tiny_config("qwen3_next")
    assert config.layer_types == ["linear_attention", "full_attention"]


def test_the_text_model_of_a_vision_language_family_gets_rotary_sections_of_its_head() -> None:
    config = tiny_config("qwen2_vl_text")
    assert config.hidden_size // config.num_attention_heads == 16
    assert sum(config.rope_parameters["mrope_section"]) == 8  # half the head: the rotary frequencies

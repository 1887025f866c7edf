"""Build a tiny, randomly initialised transformers model of one model type, offline.

The zoo sweep must build every architecture transformers knows in seconds and in a few hundred
MiB, so each model type's default configuration is shrunk: two layers, width 64 with four heads
of 16, feed-forward width 128, at most four experts, a vocabulary of at most 1000 tokens (special
token ids folded into it), small images and position tables, and every sub-configuration
(``text_config``, ``vision_config``, ``encoder`` ...) the same way. Shrinking by names cannot know
every coupling between fields, so :func:`tiny_config` has two strengths: ``level=0`` shrinks
widths too, ``level=1`` only depths, experts, vocabularies and positions, for architectures whose
widths are tied together in ways the names do not show (stage widths, window sizes, ...).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "SAMPLE_TYPES",
    "TinyModel",
    "build_tiny",
    "kind_of",
    "model_class_name",
    "model_types",
    "tiny_config",
]

# ~25 architectures that each build tiny in a few seconds and together cover the families the
# sweep's ledger groups by: decoder-only, mixture of experts, encoder-only, encoder-decoder,
# vision, a vision-text dual encoder and a state-space model.
SAMPLE_TYPES = (
    "gpt2",
    "llama",
    "mistral",
    "qwen2",
    "gemma2",
    "phi",
    "falcon",
    "gpt_neox",
    "bloom",
    "opt",
    "mixtral",
    "qwen2_moe",
    "bert",
    "roberta",
    "distilbert",
    "electra",
    "deberta-v2",
    "t5",
    "bart",
    "whisper",
    "vit",
    "deit",
    "swin",
    "convnext",
    "clip",
    "mamba",
)

WIDTH = 64
HEADS = 4
HEAD_DIM = WIDTH // HEADS
FFN = 2 * WIDTH
LAYERS = 2
EXPERTS = 4
TOP_K = 2
VOCAB = 1000
POSITIONS = 512

_LAYER_KEYS = re.compile(
    r"^(num_|n_)?(hidden_|encoder_|decoder_|text_|vision_|audio_|backbone_|qformer_)?(num_)?(hidden_)?(layers?|blocks)$"
    r"|^(decoder_num_hidden_layers|decoder_num_layers|depth|memory_attention_num_layers|num_encoder_blocks)$"
)
_WIDTH_KEYS = frozenset(
    {
        "hidden_size",
        "d_model",
        "n_embd",
        "embed_dim",
        "dim",
        "word_embed_proj_dim",
        "projection_dim",
        "out_hidden_size",
        "text_hidden_size",
        "output_hidden_size",
        "encoder_hidden_size",
    }
)
_HEAD_KEYS = frozenset(
    {
        "num_attention_heads",
        "n_head",
        "n_heads",
        "num_heads",
        "encoder_attention_heads",
        "decoder_attention_heads",
        "attention_heads",
        "decoder_num_attention_heads",
        "encoder_num_attention_heads",
    }
)
_KV_HEAD_KEYS = frozenset({"num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num"})
_HEAD_DIM_KEYS = frozenset({"head_dim", "d_kv", "d_head", "attention_head_dim", "kv_channels"})
_FFN_KEYS = frozenset(
    {
        "intermediate_size",
        "ffn_dim",
        "n_inner",
        "d_ff",
        "encoder_ffn_dim",
        "decoder_ffn_dim",
        "ffn_hidden_size",
        "mlp_dim",
        "decoder_intermediate_size",
        "hidden_dim",
        "d_inner",
    }
)
_EXPERT_FFN_KEYS = frozenset({"moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size"})
_EXPERT_KEYS = frozenset({"num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"})
_TOP_K_KEYS = frozenset({"num_experts_per_tok", "moe_topk", "moe_k", "num_experts_per_token", "top_k"})
_POSITION_KEYS = frozenset({"max_position_embeddings", "n_positions", "max_target_positions"})
_SHORT_KEYS = {
    "max_source_positions": 64,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    # hybrids: an attention layer within the two layers (a cache of linear layers only is refused)
    "layer_group_size": LAYERS,
    "attn_layer_period": LAYERS,
    "attn_layer_offset": LAYERS - 1,
    "full_attention_interval": LAYERS,
}
# the text models of vision-language families, whose rotary sections default in code to a full head
_MROPE_TYPES = re.compile(r"vl|image|omni")
_ATTENTION_KINDS = frozenset({"full_attention", "attention", "sliding_attention", "hybrid"})
# fields a default config leaves empty that the model cannot be built or run without
_REQUIRED = {"attn_layer_indices": [LAYERS - 1], "prediction_length": 4}


@dataclass(frozen=True)
class TinyModel:
    """A built tiny model and what the ledger says about it."""

    model: nn.Module
    model_type: str
    config_class: str
    model_class: str
    kind: str
    level: int
    parameters: int


def model_types() -> list[str]:
    """Every model type the installed transformers has a configuration class for, sorted."""
    from transformers.models.auto import configuration_auto

    return sorted(vars(configuration_auto)["CONFIG_MAPPING_NAMES"])


def tiny_config(model_type: str, *, level: int = 0) -> Any:
    """The default configuration of ``model_type`` shrunk (see the module docstring).

    The shrunk values are passed to the configuration class's constructor, so derived fields
    (per-layer type lists, head dims) are recomputed consistently; where the constructor rejects
    them, they are set on a default instance instead.
    """
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    default = config_class()
    overrides = _overrides(default.to_dict(), level)
    try:
        config = config_class(**overrides)
    except Exception:  # a validator rejects the constructor form; fall back to setting the fields
        _assign(default, overrides)
        config = default
    _fit_layers(config, config_class())
    return config


def _per_layer(key: str, value: Any, layers: Any) -> bool:
    """Whether ``key`` holds one entry per layer (``layer_types``, a hybrid's block pattern)."""
    named = key != "depths" and re.search("layer|types|pattern|block", key) is not None
    return named and isinstance(value, (list, str)) and isinstance(layers, int) and len(value) == layers


def _fit_layers(config: Any, default: Any) -> None:
    """Per-layer lists the constructor did not recompute (as long as ``default``'s layer count),
    cut to the shrunk count, in sub-configurations too, so no list describes absent layers."""
    layers, old = getattr(config, "num_hidden_layers", None), getattr(default, "num_hidden_layers", None)
    for key, value in list(vars(config).items()):
        if hasattr(value, "to_dict") and value is not config:
            _fit_layers(value, getattr(default, key, None))
            continue
        if isinstance(layers, int) and layers != old and _per_layer(key, value, old):
            value = value[:layers]
            setattr(config, key, value)
        full = getattr(default, key, None)
        if key.endswith(("layer_types", "block_type")) and isinstance(value, list) and isinstance(full, list):
            _keep_an_attention_layer(config, key, value, full)


def _keep_an_attention_layer(config: Any, key: str, kinds: list[Any], default: list[Any]) -> None:
    """A hybrid cut to two linear or state-space layers has no attention layer left, and
    transformers refuses a cache without one: the last layer becomes the default's attention kind."""
    attention = [kind for kind in default if isinstance(kind, str) and kind in _ATTENTION_KINDS]
    if attention and kinds and not any(kind in _ATTENTION_KINDS for kind in kinds):
        setattr(config, key, [*kinds[:-1], attention[0]])


def _overrides(values: dict[str, Any], level: int) -> dict[str, Any]:
    """The shrunk fields of one configuration dict, sub-configurations included (recursively)."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict) and value.get("model_type") == "timm_backbone":
            out[key] = _resnet_backbone(value)
            continue
        if isinstance(value, dict) and isinstance(value.get("model_type"), str):
            # whole, so the parent's defaults for it stay; per-layer lists left out, to be recomputed
            kept = {
                name: item for name, item in value.items() if not _per_layer(name, item, value.get("num_hidden_layers"))
            }
            out[key] = {**kept, **_overrides(value, level)}
            continue
        new = _shrunk(key, value, values, level)
        if new is not None and new != value:
            out[key] = new
    if level == 0 and isinstance(values.get("qk_rope_head_dim"), int):
        out.update(_latent_attention(values))
    if level == 0:
        out.update(_ssd_heads(values, out))
        out.update(_image_tokens(values, out))
    found = out.get("text_config")
    text: dict[str, Any] = found if isinstance(found, dict) else {}
    multimodal = "vision_config" in values
    for part in (text, out) if multimodal else (out,) if _MROPE_TYPES.search(str(values.get("model_type"))) else ():
        rope = part.get("rope_parameters", values.get("rope_parameters") if part is out else None)
        if level == 0 and isinstance(rope, dict) and "mrope_section" not in rope:  # the modeling code's default
            part["rope_parameters"] = {**rope, "mrope_section": _sections([16, 24, 24], HEAD_DIM // 2)}
    out.update(_token_ids(values, out.get("vocab_size", text.get("vocab_size"))))
    return out


def _shrunk(key: str, value: Any, values: dict[str, Any], level: int) -> Any:
    """The tiny value of one field, or None to keep it."""
    if isinstance(value, bool):
        return None
    if key in _REQUIRED and (value is None or key == "attn_layer_indices"):
        return _REQUIRED[key]
    if isinstance(value, int):
        return _shrunk_int(key, value, values, level)
    if key == "depths" and isinstance(value, list) and all(isinstance(item, int) for item in value):
        return [1] * len(value)
    if level == 0 and isinstance(value, dict) and isinstance(value.get("mrope_section"), list):
        return {**value, "mrope_section": _sections(value["mrope_section"], HEAD_DIM // 2)}
    return None


def _resnet_backbone(timm: dict[str, Any]) -> dict[str, Any]:
    """A tiny transformers ResNet in place of a timm backbone (DETR and kin default to timm,
    which the zoo does not install), with the same feature maps out."""
    indices = timm.get("out_indices") or [4]
    return {
        "model_type": "resnet",
        "num_channels": timm.get("num_channels", 3),
        "embedding_size": 16,
        "hidden_sizes": [16, 32, 64, 128],
        "depths": [1, 1, 1, 1],
        "layer_type": "basic",
        "out_indices": list(indices),
    }


def _latent_attention(values: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek's latent attention: its rotary, plain and value head dims and its low ranks,
    shrunk together (``head_dim`` is the rotary part there)."""
    out: dict[str, Any] = {"qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": HEAD_DIM, "kv_lora_rank": 32}
    if "head_dim" in values:
        out["head_dim"] = 8
    if "qk_head_dim" in values:
        out["qk_head_dim"] = 16
    if isinstance(values.get("q_lora_rank"), int):
        out["q_lora_rank"] = 32
    return out


def _image_tokens(values: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3 pools the vision tower's patches to ``mm_tokens_per_image`` tokens, a square whose
    side must divide the patches per side: with a shrunk image, one token per 2 x 2 patches."""
    tokens, vision = values.get("mm_tokens_per_image"), out.get("vision_config")
    if not isinstance(tokens, int) or not isinstance(vision, dict):
        return {}
    image, patch = vision.get("image_size"), vision.get("patch_size")
    if not isinstance(image, int) or not isinstance(patch, int) or not patch or image // patch < 2:
        return {}
    return {"mm_tokens_per_image": (image // patch // 2) ** 2}


def _ssd_heads(values: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    """A Mamba-2 mixer's heads times their width must be ``expand * hidden_size``: the head count
    follows the shrunk width (Mamba-2 and kin name them ``num_heads``, ``head_dim``, ``expand``)."""
    if not all(isinstance(values.get(key), (int, float)) for key in ("expand", "num_heads", "head_dim")):
        return {}
    inner = int(values["expand"] * out.get("hidden_size", values.get("hidden_size", 0)))
    head = int(out.get("head_dim", values["head_dim"]))
    groups = int(out.get("n_groups", values.get("n_groups", 1)) or 1)
    heads = inner // head if head and inner % head == 0 else 0
    return {"num_heads": heads} if heads and heads % groups == 0 else {}


def _sections(sections: list[int], total: int) -> list[int]:
    """Multimodal rotary sections rescaled to sum to ``total`` (half the shrunk head dim)."""
    scaled = [max(1, item * total // sum(sections)) for item in sections]
    scaled[0] += total - sum(scaled)
    return scaled


def _shrunk_int(key: str, value: int, values: dict[str, Any], level: int) -> int | None:
    if _LAYER_KEYS.match(key) and value > LAYERS:
        return LAYERS
    if key in _EXPERT_KEYS:
        return min(value, EXPERTS)
    if key in _TOP_K_KEYS:
        return min(value, TOP_K)
    if key in ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"):
        return min(value, 1)
    if key == "vocab_size":
        return min(value, VOCAB)
    if key in _POSITION_KEYS:
        return min(value, POSITIONS)
    if key in _SHORT_KEYS:
        return min(value, _SHORT_KEYS[key])
    if level > 0:
        return None
    if key in _WIDTH_KEYS and value > WIDTH:
        return WIDTH
    if key in _HEAD_KEYS and value > HEADS:
        return HEADS
    if key in _KV_HEAD_KEYS:
        return min(value, 2) if HEADS % min(value, 2) == 0 else 1
    if key in _HEAD_DIM_KEYS:
        return HEAD_DIM
    if key in _FFN_KEYS:
        return min(value, FFN)
    if key in _EXPERT_FFN_KEYS:
        return min(value, WIDTH)
    if key == "image_size":
        patch = values.get("patch_size")
        return 4 * patch if isinstance(patch, int) and 4 * patch < value else None
    return None


def _token_ids(values: dict[str, Any], vocab: Any) -> dict[str, Any]:
    """Special token ids moved into a shrunk vocabulary: the largest ids fold onto its top, in
    order, so that distinct ids stay distinct and equal ones equal."""
    if not isinstance(vocab, int):
        return {}
    keys = [key for key in values if key.endswith(("token_id", "token_index", "token_ids")) and key != "vocab_size"]
    olds = sorted(
        {
            item
            for key in keys
            for item in (values[key] if isinstance(values[key], list) else [values[key]])
            if isinstance(item, int) and not isinstance(item, bool) and item >= vocab
        }
    )
    folded = {old: vocab - len(olds) + rank for rank, old in enumerate(olds)}

    def fold(item: Any) -> Any:
        return folded.get(item, item) if isinstance(item, int) and not isinstance(item, bool) else item

    out: dict[str, Any] = {}
    for key in keys:
        value = values[key]
        new = [fold(item) for item in value] if isinstance(value, list) else fold(value)
        if new != value:
            out[key] = new
    return out


def _assign(config: Any, overrides: dict[str, Any]) -> None:
    for key, value in overrides.items():
        current = getattr(config, key, None)
        if isinstance(value, dict) and hasattr(current, "to_dict"):
            _assign(current, {k: v for k, v in value.items() if k != "model_type"})
        else:
            setattr(config, key, value)


def model_class_name(model_type: str, config: Any) -> str:
    """The class the zoo builds: the sequence-to-sequence LM of an encoder-decoder model, the
    causal LM of a decoder, else the base model, else the first task class that exists."""
    from transformers.models.auto import modeling_auto

    mappings = [name for name in dir(modeling_auto) if name.endswith("_MAPPING_NAMES") and name.startswith("MODEL")]
    first = ["MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES"]
    if getattr(config, "is_encoder_decoder", False) is not True:
        first = [] if _is_encoder(model_type, config) else ["MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"]
    order = [*first, "MODEL_MAPPING_NAMES", *sorted(set(mappings) - {*first, "MODEL_MAPPING_NAMES"})]
    for mapping in order:
        name = getattr(modeling_auto, mapping).get(model_type)
        if isinstance(name, (list, tuple)):
            name = name[0]
        if isinstance(name, str):
            return name
    return _class_of_config(model_type, type(config))


def _class_of_config(model_type: str, config_class: type) -> str:
    """A sub-model type no auto mapping lists (``clip_text_model``): the model class beside its
    configuration class whose ``config_class`` it is, a plain ``...Model`` first."""
    import importlib

    import transformers

    module_name = config_class.__module__.replace(".configuration_", ".modeling_")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise LookupError(f"no model class for model type {model_type!r}: {module_name} does not import") from error
    names = [
        name
        for name, value in vars(module).items()
        if isinstance(value, type)
        and getattr(value, "config_class", None) is config_class
        and not name.endswith("PreTrainedModel")
        and hasattr(transformers, name)
    ]
    if not names:
        raise LookupError(f"no model class is registered for model type {model_type!r} in any auto mapping")
    return min(names, key=lambda name: (not name.endswith("Model"), "For" in name, len(name)))


def _is_encoder(model_type: str, config: Any) -> bool:
    """A bidirectional encoder (BERT): it has a masked-LM head and is not configured as a
    decoder, so its causal-LM class (BERT's ``BertLMHeadModel``) is not what it is."""
    from transformers.models.auto import modeling_auto

    masked = model_type in modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES
    return masked and getattr(config, "is_decoder", False) is not True


def kind_of(model_type: str, config: Any, main_input: str | None) -> str:
    """The family the ledger groups a model type under, from its config and the auto mappings
    it appears in."""
    from transformers.models.auto import modeling_auto as auto

    def listed(*mappings: str) -> bool:
        return any(model_type in getattr(auto, f"MODEL_FOR_{name}_MAPPING_NAMES", {}) for name in mappings)

    has_vision = any(hasattr(config, key) for key in ("vision_config", "vision_tower_config"))
    if listed("IMAGE_TEXT_TO_TEXT", "VISION_2_SEQ", "MULTIMODAL_LM", "VISUAL_QUESTION_ANSWERING") or (
        has_vision and hasattr(config, "text_config")
    ):
        return "vision-language"
    if main_input in ("input_values", "input_features") or listed("CTC", "AUDIO_CLASSIFICATION", "SPEECH_SEQ_2_SEQ"):
        return "audio"
    if getattr(config, "is_encoder_decoder", False) is True:
        return "encoder-decoder"
    if main_input == "pixel_values" or listed("IMAGE_CLASSIFICATION", "OBJECT_DETECTION", "BACKBONE"):
        return "vision"
    if main_input == "input_ids" and listed("CAUSAL_LM") and not _is_encoder(model_type, config):
        return "decoder-only"
    if main_input == "input_ids":
        return "encoder-only"
    return "other"


def build_tiny(model_type: str, *, seed: int = 0, level: int = 0) -> TinyModel:
    """A tiny ``model_type`` model with weights drawn after ``torch.manual_seed(seed)``, in eval mode."""
    import transformers

    config = tiny_config(model_type, level=level)
    class_name = model_class_name(model_type, config)
    model_class = getattr(transformers, class_name)
    torch.manual_seed(seed)
    model = model_class(config).eval()
    return TinyModel(
        model=model,
        model_type=model_type,
        config_class=type(config).__name__,
        model_class=class_name,
        kind=kind_of(model_type, config, getattr(model, "main_input_name", None)),
        level=level,
        parameters=sum(parameter.numel() for parameter in model.parameters()),
    )

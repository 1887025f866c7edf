"""The family tables: one :class:`~hookscope._arch.std.spec.Family` per architecture.

Data only. Each path is checked on the model when the map is made (a module that is not there,
or that never runs, makes its canonical names unavailable with the reason, never wrong), and
the values are checked against each other on one forward (:mod:`~hookscope._arch.std.resolve`).
Alternatives separated by ``|`` cover renames between transformers versions; the first present
wins. Tables are looked up by ``config.model_type``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hookscope._arch.std.spec import Block, Family, Stack

__all__ = ["FAMILIES", "family_of"]

_ROTARY = "rotary position embedding: positions are applied inside attention, not added as a module's output"
_RELATIVE = "relative position biases inside attention: no position embedding is added to the stream"
_ALIBI = "ALiBi position biases inside attention: no position embedding is added to the stream"

# Llama and the families that copied its layer: input_layernorm, self_attn, post_attention_layernorm, mlp.
_LLAMA_BLOCK = Block(
    ln1="input_layernorm",
    attn="self_attn",
    ln2="post_attention_layernorm",
    mlp="mlp",
    act="mlp.act_fn",
    mlp_proj="mlp.down_proj",
)
_LLAMA = Stack("", "layers", _LLAMA_BLOCK, embed="embed_tokens", ln_final="norm", no_pos_embed=_ROTARY)


def _llama_like(**changes: Any) -> Stack:
    """The Llama layer with some roles elsewhere: a family that copied it and changed a part."""
    return replace(_LLAMA, block=replace(_LLAMA_BLOCK, **changes))


# Gemma 2 and 3 norm both sides of each sublayer: what is added is the post-norm's output.
_GEMMA2 = _llama_like(
    attn_out="post_attention_layernorm", ln2="pre_feedforward_layernorm", mlp_out="post_feedforward_layernorm"
)

# BERT: what each sublayer adds is its dropout's output (the dense layer's in eval mode).
_BERT = Stack(
    "",
    "encoder.layer",
    Block(
        ln1="attention.output.LayerNorm",
        attn="attention.self",
        attn_out="attention.output.dropout|attention.output.dense",
        ln2="output.LayerNorm",
        mlp_out="output.dropout|output.dense",
        act="intermediate.intermediate_act_fn",
        mlp_proj="output.dense",
        layout="post",
    ),
    embed="embeddings.word_embeddings",
    pos_embed="embeddings.position_embeddings",
)


def _t5(prefix: str, cross: bool, mlp: str = "DenseReluDense", router: str | None = None) -> Stack:
    """What each T5 sublayer adds is its dropout's output (the same as the sublayer's in eval).
    Switch Transformers renamed the MLP (``mlp``) and make some of them experts with a router."""
    ff = "layer.2" if cross else "layer.1"
    return Stack(
        prefix,
        f"{prefix}.block",
        Block(
            ln1="layer.0.layer_norm",
            attn="layer.0.SelfAttention",
            attn_out="layer.0.dropout",
            resid_mid="layer.0",
            ln_cross="layer.1.layer_norm" if cross else None,
            cross_attn="layer.1.EncDecAttention" if cross else None,
            cross_attn_out="layer.1.dropout" if cross else None,
            resid_mid_cross="layer.1" if cross else None,
            ln2=f"{ff}.layer_norm",
            mlp=f"{ff}.{mlp}",
            mlp_out=f"{ff}.dropout",
            act=f"{ff}.{mlp}.act",
            mlp_proj=f"{ff}.{mlp}.wo",
            router=f"{ff}.{mlp}.{router}" if router else None,
        ),
        embed=f"{prefix}.embed_tokens",
        ln_final=f"{prefix}.final_layer_norm",
        no_pos_embed=_RELATIVE,
    )


def _bart_like(prefix: str, cross: bool, layout: str, ln_final: str | None, embed: str | None = None) -> Stack:
    block = Block(
        ln1="self_attn_layer_norm",
        attn="self_attn",
        ln_cross="encoder_attn_layer_norm" if cross else None,
        cross_attn="encoder_attn" if cross else None,
        ln2="final_layer_norm",
        mlp_out="fc2",
        act="activation_fn",
        mlp_proj="fc2",
        layout="post" if layout == "post" else "pre",
    )
    return Stack(
        prefix,
        f"{prefix}.layers",
        block,
        embed=embed if embed is not None else f"{prefix}.embed_tokens",
        pos_embed=f"{prefix}.embed_positions",
        ln_final=ln_final,
        no_embed="an audio front end (conv1, conv2) makes the stream: blocks.0.resid_pre is its first value",
    )


def _clip(prefix: str, *, vision: bool = False) -> Stack:
    """CLIP's text or vision tower; ``prefix`` names it inside a two-tower ``CLIPModel``."""
    base = f"{prefix}_model." if prefix else ""
    return Stack(
        prefix,
        f"{base}encoder.layers",
        Block(
            ln1="layer_norm1",
            attn="self_attn",
            ln2="layer_norm2",
            mlp="mlp",
            act="mlp.activation_fn",
            mlp_proj="mlp.fc2",
        ),
        embed=f"{base}embeddings" if vision else f"{base}embeddings.token_embedding",
        pos_embed=f"{base}embeddings.position_embedding",
        ln_final=f"{base}post_layernorm" if vision else f"{base}final_layer_norm",
    )


def _one(name: str, model_types: tuple[str, ...], stack: Stack, unembed: str | None = "lm_head") -> Family:
    """A family with one stack of blocks (decoder-only or encoder-only)."""
    return Family(name, model_types, (stack,), unembed=unembed)


def _mamba() -> Stack:
    """Mamba and Mamba-2: a norm, a state-space mixer, one residual add; no attention, no MLP."""
    return Stack(
        "",
        "layers",
        Block(ln1="norm", mixer="mixer"),
        embed="embeddings",
        ln_final="norm_f",
        no_pos_embed="a state-space model has no positions: the scan runs in token order",
    )


def _hybrid(ln2: str, mlp: str, *, mixer: str = "mamba", router: str | None = None) -> Stack:
    """A hybrid's blocks: each has attention or a state-space (or linear-attention) mixer, then an MLP."""
    return Stack(
        "",
        "layers",
        Block(ln1="input_layernorm", attn="self_attn", mixer=mixer, ln2=ln2, mlp=mlp, router=router),
        embed="embed_tokens",
        ln_final="final_layernorm|norm",
        no_pos_embed=_ROTARY,
    )


FAMILIES: tuple[Family, ...] = (
    _one(
        "GPT-2",
        ("gpt2",),
        Stack(
            "",
            "h",
            Block(ln1="ln_1", attn="attn", ln2="ln_2", mlp="mlp", act="mlp.act", mlp_proj="mlp.c_proj"),
            embed="wte",
            pos_embed="wpe",
            ln_final="ln_f",
        ),
    ),
    _one(
        "GPT-NeoX",
        ("gpt_neox",),
        Stack(
            "",
            "layers",
            Block(
                ln1="input_layernorm",
                attn="attention",
                attn_out="post_attention_dropout",
                ln2="post_attention_layernorm",
                mlp="mlp",
                mlp_out="post_mlp_dropout",
                act="mlp.act",
                mlp_proj="mlp.dense_4h_to_h",
                layout="parallel",
                why_parallel="use_parallel_residual=True: attention and the MLP both read the block's input",
            ),
            embed="embed_in",
            ln_final="final_layer_norm",
            no_pos_embed=_ROTARY,
        ),
        unembed="embed_out|lm_head",
    ),
    _one(
        "GPT-J",
        ("gptj",),
        Stack(
            "",
            "h",
            Block(ln1="ln_1", attn="attn", mlp="mlp", act="mlp.act", mlp_proj="mlp.fc_out", layout="parallel"),
            embed="wte",
            ln_final="ln_f",
            no_pos_embed=_ROTARY,
        ),
    ),
    _one(
        "OPT",
        ("opt",),
        Stack(
            "",
            "decoder.layers",
            Block(
                ln1="self_attn_layer_norm",
                attn="self_attn",
                ln2="final_layer_norm",
                mlp_out="fc2",
                act="activation_fn",
                mlp_proj="fc2",
            ),
            embed="decoder.embed_tokens",
            pos_embed="decoder.embed_positions",
            ln_final="decoder.final_layer_norm",
        ),
    ),
    _one("Mamba", ("mamba",), _mamba()),
    _one("Jamba", ("jamba",), _hybrid("pre_ff_layernorm", "feed_forward", router="feed_forward.router")),
    _one("Bamba", ("bamba",), _hybrid("pre_ff_layernorm", "feed_forward")),
    _one(
        "Qwen3-Next",
        ("qwen3_next",),
        _hybrid("post_attention_layernorm", "mlp", mixer="linear_attn", router="mlp.gate"),
    ),
    _one("Mamba-2", ("mamba2",), _mamba()),
    _one("Llama", ("llama",), _LLAMA),
    _one("Mistral", ("mistral",), _LLAMA),
    _one("Qwen2", ("qwen2",), _LLAMA),
    _one("Qwen3", ("qwen3",), _LLAMA),
    _one("Gemma", ("gemma",), _LLAMA),
    _one("Gemma 2", ("gemma2",), _GEMMA2),
    _one("Gemma 3", ("gemma3_text",), _GEMMA2),  # gemma3, the vision-language model: the detector's two stacks
    _one(
        "Mixtral",
        ("mixtral",),
        _llama_like(mlp="mlp|block_sparse_moe", act=None, mlp_proj=None, router="mlp.gate|block_sparse_moe.gate"),
    ),
    _one(
        "Phi-3",
        ("phi3",),
        _llama_like(attn_out="resid_attn_dropout", mlp_out="resid_mlp_dropout", act="mlp.activation_fn"),
    ),
    _one(
        "Phi",
        ("phi",),
        Stack(
            "",
            "layers",
            Block(
                ln1="input_layernorm",
                attn="self_attn",
                mlp="mlp",
                act="mlp.activation_fn",
                mlp_proj="mlp.fc2",
                layout="parallel",
            ),
            embed="embed_tokens",
            ln_final="final_layernorm",
            no_pos_embed=_ROTARY,
        ),
    ),
    _one(
        "Falcon",
        ("falcon",),
        Stack(
            "",
            "h",
            Block(
                ln1="input_layernorm|ln_attn",
                attn="self_attention",
                ln2="ln_mlp|post_attention_layernorm",
                mlp="mlp",
                act="mlp.act",
                mlp_proj="mlp.dense_4h_to_h",
                layout="parallel",
            ),
            embed="word_embeddings",
            ln_final="ln_f",
            no_pos_embed=_ROTARY,
        ),
    ),
    _one(
        "BLOOM",
        ("bloom",),
        Stack(
            "",
            "h",
            Block(
                ln1="input_layernorm",
                attn="self_attention",
                attn_out="self_attention.dense",
                resid_mid="self_attention",
                ln2="post_attention_layernorm",
                mlp="mlp",
                mlp_out="mlp.dense_4h_to_h",
                act="mlp.gelu_impl",
                mlp_proj="mlp.dense_4h_to_h",
            ),
            embed="word_embeddings",
            ln_final="ln_f",
            no_pos_embed=_ALIBI,
        ),
    ),
    _one("BERT", ("bert",), _BERT, unembed="cls.predictions"),
    _one("RoBERTa", ("roberta", "xlm-roberta"), _BERT, unembed="lm_head"),
    _one(
        "BERT-like",  # BERT's layer under other names: the table is checked on the forward like any other
        (
            "bert-generation",
            "big_bird",
            "camembert",
            "convbert",
            "data2vec-text",
            "deberta",
            "deberta-v2",
            "electra",
            "ernie",
            "ibert",
            "layoutlm",
            "lilt",
            "luke",
            "markuplm",
            "mra",
            "nystromformer",
            "rembert",
            "roc_bert",
            "roformer",
            "splinter",
            "tapas",
            "xmod",
            "yoso",
        ),
        _BERT,
        unembed="cls.predictions|lm_head|generator_lm_head|cls",
    ),
    _one(
        "RoBERTa-PreLayerNorm",
        ("roberta-prelayernorm",),
        Stack(
            "",
            "encoder.layer",
            Block(  # pre-norm, and each sublayer's output module adds the residual itself
                ln1="attention.LayerNorm",
                attn="attention.self",
                attn_out="attention.output.dropout|attention.output.dense",
                resid_mid="attention",
                ln2="intermediate.LayerNorm",
                mlp_out="output.dropout|output.dense",
                act="intermediate.intermediate_act_fn",
                mlp_proj="output.dense",
            ),
            embed="embeddings.word_embeddings",
            pos_embed="embeddings.position_embeddings",
            ln_final="LayerNorm",
        ),
        unembed="lm_head",
    ),
    _one(
        "DistilBERT",
        ("distilbert",),
        Stack(
            "",
            "transformer.layer",
            Block(
                ln1="sa_layer_norm",
                attn="attention",
                ln2="output_layer_norm",
                mlp="ffn",
                act="ffn.activation",
                mlp_proj="ffn.lin2",
                layout="post",
            ),
            embed="embeddings.word_embeddings",
            pos_embed="embeddings.position_embeddings",
        ),
        unembed="vocab_projector",
    ),
    Family("T5", ("t5", "mt5", "umt5"), (_t5("encoder", False), _t5("decoder", True))),
    Family(
        "Switch Transformers",
        ("switch_transformers",),
        (_t5("encoder", False, "mlp", "router"), _t5("decoder", True, "mlp", "router")),
    ),
    Family(
        "BART",
        ("bart", "mbart"),
        (
            _bart_like("encoder", False, "post", "encoder.layer_norm"),
            _bart_like("decoder", True, "post", "decoder.layer_norm"),
        ),
    ),
    Family(
        "Whisper",
        ("whisper",),
        (
            _bart_like("encoder", False, "pre", "encoder.layer_norm", embed=""),
            _bart_like("decoder", True, "pre", "decoder.layer_norm"),
        ),
        unembed="proj_out",
    ),
    _one(
        "ViT",
        ("vit",),
        Stack(
            "",
            "layers|encoder.layer",
            Block(
                ln1="layernorm_before",
                attn="attention.attention|attention",
                attn_out="attention",
                ln2="layernorm_after",
                mlp="mlp",
                mlp_out="mlp|output.dense",
                act="mlp.activation_fn|intermediate.intermediate_act_fn",
                mlp_proj="mlp.fc2|output.dense",
            ),
            embed="embeddings",
            ln_final="layernorm",
            no_pos_embed="position embeddings are a parameter added inside embed",
        ),
        unembed=None,
    ),
    _one("CLIP text", ("clip_text_model",), _clip(""), unembed=None),
    _one("CLIP vision", ("clip_vision_model",), _clip("", vision=True), unembed=None),
    Family("CLIP", ("clip",), (_clip("text"), _clip("vision", vision=True)), unembed=None),
)

_BY_TYPE = {model_type: family for family in FAMILIES for model_type in family.model_types}


def family_of(model_type: str | None) -> Family | None:
    """The table for a ``config.model_type``, or None for an architecture no table knows."""
    return _BY_TYPE.get(model_type) if model_type else None

"""Canonical site names ("std:" selectors) across 29 transformers families, checked against
values read without hookscope: raw PyTorch hooks on modules named here by hand, per family.

Every model is tiny (hidden 32, 2 layers, 4 heads, vocabulary 100) with random weights from a
config, built once per test. The hand-written block paths below are the point of the file: a
family table in hookscope that names the wrong module fails here, because nothing here is read
from the map to decide where the reference values come from.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import pytest
import torch
from torch import nn

import hookscope as hs
from tests.models import track

pytestmark = [pytest.mark.transformers]

transformers = pytest.importorskip("transformers")

Layout = Literal["pre", "post", "parallel"]
Feed = Literal["text", "seq2seq", "pixels", "audio"]

HIDDEN, LAYERS, HEADS, VOCAB, FFN = 32, 2, 4, 100, 64
BATCH, TOKENS, DECODER_TOKENS = 2, 6, 5

_LLAMA_LIKE: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": FFN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
_BERT_LIKE: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "intermediate_size": FFN,
    "max_position_embeddings": 64,
}
_BART_LIKE: dict[str, Any] = {
    "vocab_size": VOCAB,
    "d_model": HIDDEN,
    "encoder_layers": LAYERS,
    "decoder_layers": LAYERS,
    "encoder_attention_heads": HEADS,
    "decoder_attention_heads": HEADS,
    "encoder_ffn_dim": FFN,
    "decoder_ffn_dim": FFN,
}
_VISION: dict[str, Any] = {
    "hidden_size": HIDDEN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "intermediate_size": FFN,
    "image_size": 16,
    "patch_size": 8,
}


@dataclass(frozen=True)
class Ref:
    """One stack of blocks, named by hand (module paths as ``named_modules()`` spells them).

    Attributes:
        prefix: the canonical prefix (``""``, ``"encoder."``, ``"decoder."``).
        block: the block module's path, with ``{i}`` for its index.
        mid: where resid_mid can be read without hookscope: (module relative to the block,
            ``"input"`` or ``"output"``); None for a parallel block.
        ln1, ln2: the sublayer norms, relative to the block (post-norm checks read their inputs).
        ln_cross: the cross-attention norm of a decoder block.
    """

    prefix: str
    block: str
    mid: tuple[str, Literal["input", "output"]] | None
    ln1: str
    ln2: str | None
    ln_cross: str | None = None


@dataclass(frozen=True)
class Spec:
    config: str
    model: str
    kwargs: dict[str, Any]
    layout: Layout
    stacks: tuple[Ref, ...]
    feed: Feed = "text"
    use_cache: bool = True  # the forward takes use_cache (passed as False)
    embed: frozenset[str] = field(default_factory=lambda: frozenset({""}))  # prefixes that have "embed"


def _causal(block: str, ln1: str, ln2: str | None, mid: tuple[str, Literal["input", "output"]] | None) -> Ref:
    return Ref("", block, mid, ln1, ln2)


_LLAMA_REF = _causal(
    "model.layers.{i}", "input_layernorm", "post_attention_layernorm", ("post_attention_layernorm", "input")
)
_GEMMA2_REF = _causal(
    "model.layers.{i}", "input_layernorm", "pre_feedforward_layernorm", ("pre_feedforward_layernorm", "input")
)
_CLIP_REF = Ref("", "encoder.layers.{i}", ("layer_norm2", "input"), "layer_norm1", "layer_norm2")

# BERT and RoBERTa blocks, named by hand: post-norm, resid_mid is the attention sublayer's norm.
_BERT_REF = Ref(
    "",
    "encoder.layer.{i}",
    ("attention.output.LayerNorm", "output"),
    "attention.output.LayerNorm",
    "output.LayerNorm",
)

# T5 blocks, named by hand: each sublayer module returns the stream after its add.
_T5_REFS = (
    Ref("encoder.", "encoder.block.{i}", ("layer.1.layer_norm", "input"), "layer.0.layer_norm", "layer.1.layer_norm"),
    Ref(
        "decoder.",
        "decoder.block.{i}",
        ("layer.1.layer_norm", "input"),
        "layer.0.layer_norm",
        "layer.2.layer_norm",
        ln_cross="layer.1.layer_norm",
    ),
)

FAMILIES: dict[str, Spec] = {
    "gpt2": Spec(
        "GPT2Config",
        "GPT2LMHeadModel",
        {"vocab_size": VOCAB, "n_embd": HIDDEN, "n_layer": LAYERS, "n_head": HEADS, "n_positions": 64},
        "pre",
        (_causal("transformer.h.{i}", "ln_1", "ln_2", ("ln_2", "input")),),
    ),
    "gpt_neox": Spec(
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        {**_BERT_LIKE},
        "parallel",
        (_causal("gpt_neox.layers.{i}", "input_layernorm", "post_attention_layernorm", None),),
    ),
    "gptj": Spec(
        "GPTJConfig",
        "GPTJForCausalLM",
        {"vocab_size": VOCAB, "n_embd": HIDDEN, "n_layer": LAYERS, "n_head": HEADS, "rotary_dim": 4, "n_positions": 64},
        "parallel",
        (_causal("transformer.h.{i}", "ln_1", None, None),),
    ),
    "opt": Spec(
        "OPTConfig",
        "OPTForCausalLM",
        {
            "vocab_size": VOCAB,
            "hidden_size": HIDDEN,
            "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS,
            "ffn_dim": FFN,
            "word_embed_proj_dim": HIDDEN,
            "max_position_embeddings": 64,
        },
        "pre",
        # OPT runs its MLP on (batch * seq, d) rows: the final norm's input is resid_mid, flattened
        (
            _causal(
                "model.decoder.layers.{i}", "self_attn_layer_norm", "final_layer_norm", ("final_layer_norm", "input")
            ),
        ),
    ),
    "llama": Spec("LlamaConfig", "LlamaForCausalLM", _LLAMA_LIKE, "pre", (_LLAMA_REF,)),
    "mistral": Spec("MistralConfig", "MistralForCausalLM", _LLAMA_LIKE, "pre", (_LLAMA_REF,)),
    "mixtral": Spec(
        "MixtralConfig",
        "MixtralForCausalLM",
        {**_LLAMA_LIKE, "num_local_experts": 4, "num_experts_per_tok": 2},
        "pre",
        (_LLAMA_REF,),
    ),
    "qwen2": Spec("Qwen2Config", "Qwen2ForCausalLM", _LLAMA_LIKE, "pre", (_LLAMA_REF,)),
    "qwen3": Spec("Qwen3Config", "Qwen3ForCausalLM", {**_LLAMA_LIKE, "head_dim": 8}, "pre", (_LLAMA_REF,)),
    "gemma": Spec("GemmaConfig", "GemmaForCausalLM", {**_LLAMA_LIKE, "head_dim": 8}, "pre", (_LLAMA_REF,)),
    "gemma2": Spec("Gemma2Config", "Gemma2ForCausalLM", {**_LLAMA_LIKE, "head_dim": 8}, "pre", (_GEMMA2_REF,)),
    "gemma3": Spec("Gemma3TextConfig", "Gemma3ForCausalLM", {**_LLAMA_LIKE, "head_dim": 8}, "pre", (_GEMMA2_REF,)),
    "phi3": Spec("Phi3Config", "Phi3ForCausalLM", {**_LLAMA_LIKE, "pad_token_id": 0}, "pre", (_LLAMA_REF,)),
    "phi": Spec(
        "PhiConfig",
        "PhiForCausalLM",
        _LLAMA_LIKE,
        "parallel",
        (_causal("model.layers.{i}", "input_layernorm", None, None),),
    ),
    "falcon": Spec(
        "FalconConfig",
        "FalconForCausalLM",
        {"vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS},
        "parallel",
        (_causal("transformer.h.{i}", "input_layernorm", None, None),),
    ),
    "bloom": Spec(
        "BloomConfig",
        "BloomForCausalLM",
        {"vocab_size": VOCAB, "hidden_size": HIDDEN, "n_layer": LAYERS, "n_head": HEADS},
        "pre",
        (
            _causal(
                "transformer.h.{i}",
                "input_layernorm",
                "post_attention_layernorm",
                ("post_attention_layernorm", "input"),
            ),
        ),
    ),
    "bert": Spec(
        "BertConfig",
        "BertModel",
        _BERT_LIKE,
        "post",
        (_BERT_REF,),
        use_cache=False,
    ),
    "roberta": Spec(
        "RobertaConfig",
        "RobertaModel",
        _BERT_LIKE,
        "post",
        (_BERT_REF,),
        use_cache=False,
    ),
    "electra": Spec("ElectraConfig", "ElectraModel", {**_BERT_LIKE, "embedding_size": HIDDEN}, "post", (_BERT_REF,)),
    "deberta-v2": Spec("DebertaV2Config", "DebertaV2Model", _BERT_LIKE, "post", (_BERT_REF,), use_cache=False),
    "roberta-prelayernorm": Spec(
        "RobertaPreLayerNormConfig",
        "RobertaPreLayerNormModel",
        _BERT_LIKE,
        "pre",
        (Ref("", "encoder.layer.{i}", ("attention", "output"), "attention.LayerNorm", "intermediate.LayerNorm"),),
        use_cache=False,
    ),
    "distilbert": Spec(
        "DistilBertConfig",
        "DistilBertModel",
        {
            "vocab_size": VOCAB,
            "dim": HIDDEN,
            "n_layers": LAYERS,
            "n_heads": HEADS,
            "hidden_dim": FFN,
            "max_position_embeddings": 64,
        },
        "post",
        (Ref("", "transformer.layer.{i}", ("sa_layer_norm", "output"), "sa_layer_norm", "output_layer_norm"),),
        use_cache=False,
    ),
    "t5": Spec(
        "T5Config",
        "T5ForConditionalGeneration",
        {"vocab_size": VOCAB, "d_model": HIDDEN, "d_ff": FFN, "num_layers": LAYERS, "num_heads": HEADS, "d_kv": 8},
        "pre",
        _T5_REFS,
        feed="seq2seq",
        embed=frozenset({"encoder.", "decoder."}),
    ),
    "switch_transformers": Spec(  # T5 blocks with renamed MLPs, every second one a mixture of experts
        "SwitchTransformersConfig",
        "SwitchTransformersForConditionalGeneration",
        {
            "vocab_size": VOCAB,
            "d_model": HIDDEN,
            "d_ff": FFN,
            "num_layers": LAYERS,
            "num_heads": HEADS,
            "d_kv": 8,
            "num_experts": 4,
            "num_decoder_layers": LAYERS,
            "encoder_sparse_step": 2,
            "decoder_sparse_step": 2,
        },
        "pre",
        _T5_REFS,
        feed="seq2seq",
        embed=frozenset({"encoder.", "decoder."}),
    ),
    "bart": Spec(
        "BartConfig",
        "BartForConditionalGeneration",
        {**_BART_LIKE, "max_position_embeddings": 64},
        "post",
        (
            Ref(
                "encoder.",
                "model.encoder.layers.{i}",
                ("self_attn_layer_norm", "output"),
                "self_attn_layer_norm",
                "final_layer_norm",
            ),
            Ref(
                "decoder.",
                "model.decoder.layers.{i}",
                ("self_attn_layer_norm", "output"),
                "self_attn_layer_norm",
                "final_layer_norm",
                ln_cross="encoder_attn_layer_norm",
            ),
        ),
        feed="seq2seq",
        embed=frozenset({"encoder.", "decoder."}),
    ),
    "whisper": Spec(
        "WhisperConfig",
        "WhisperForConditionalGeneration",
        {
            **_BART_LIKE,
            "num_mel_bins": 8,
            "max_source_positions": 16,
            "max_target_positions": 32,
            "pad_token_id": 0,
            "decoder_start_token_id": 1,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
        "pre",
        (
            Ref(
                "encoder.",
                "model.encoder.layers.{i}",
                ("final_layer_norm", "input"),
                "self_attn_layer_norm",
                "final_layer_norm",
            ),
            Ref(
                "decoder.",
                "model.decoder.layers.{i}",
                ("encoder_attn_layer_norm", "input"),
                "self_attn_layer_norm",
                "final_layer_norm",
                ln_cross="encoder_attn_layer_norm",
            ),
        ),
        feed="audio",
        embed=frozenset({"decoder."}),  # the encoder's stream starts at its convolutions
    ),
    "vit": Spec(
        "ViTConfig",
        "ViTModel",
        _VISION,
        "pre",
        (Ref("", "layers.{i}", ("layernorm_after", "input"), "layernorm_before", "layernorm_after"),),
        feed="pixels",
        use_cache=False,
    ),
    "clip_text": Spec("CLIPTextConfig", "CLIPTextModel", _BERT_LIKE, "pre", (_CLIP_REF,), use_cache=False),
    "clip_vision": Spec(
        "CLIPVisionConfig", "CLIPVisionModel", _VISION, "pre", (_CLIP_REF,), feed="pixels", use_cache=False
    ),
}

NAMES = list(FAMILIES)
SEQUENTIAL = [name for name, spec in FAMILIES.items() if spec.layout == "pre"]
POST_NORM = [name for name, spec in FAMILIES.items() if spec.layout == "post"]
PARALLEL = [name for name, spec in FAMILIES.items() if spec.layout == "parallel"]
ENCODER_DECODER = [name for name, spec in FAMILIES.items() if len(spec.stacks) == 2]

# Every canonical name of one block, written out here rather than read from hookscope.
_ATTN_SUBS = ("q", "k", "v", "scores", "pattern", "z")
BLOCK_NAMES = (
    "resid_pre", "ln1", "attn", *(f"attn.{s}" for s in _ATTN_SUBS), "resid_mid",
    "ln_cross", "cross_attn", *(f"cross_attn.{s}" for s in _ATTN_SUBS), "resid_mid_cross",
    "ln2", "mlp", "mlp.pre", "mlp.post", "mlp.router", "resid_post",
)  # fmt: skip


def build(name: str, attn_implementation: str | None = None) -> nn.Module:
    """The family's tiny model, random weights from seed 0, in eval mode (and tracked for the leak check)."""
    spec = FAMILIES[name]
    config = getattr(transformers, spec.config)(**spec.kwargs)
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    torch.manual_seed(0)
    model = getattr(transformers, spec.model)(config).eval()
    track(model)
    return model


def inputs_for(name: str) -> dict[str, Any]:
    spec = FAMILIES[name]
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (BATCH, TOKENS), generator=generator)
    decoder_ids = torch.randint(3, VOCAB, (BATCH, DECODER_TOKENS), generator=generator)
    inputs: dict[str, Any]
    if spec.feed == "text":
        inputs = {"input_ids": ids}
    elif spec.feed == "seq2seq":
        inputs = {"input_ids": ids, "decoder_input_ids": decoder_ids}
    elif spec.feed == "pixels":
        inputs = {"pixel_values": torch.randn(BATCH, 3, 16, 16, generator=generator)}
    else:  # 8 mel bins, 32 frames: the convolutions halve them to max_source_positions=16
        inputs = {"input_features": torch.randn(BATCH, 8, 32, generator=generator), "decoder_input_ids": decoder_ids}
    if spec.use_cache:
        inputs["use_cache"] = False
    return inputs


def hidden_in(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """The hidden states a block or a norm is called with: its first positional input, or
    ``hidden_states=`` where the caller names it."""
    value = args[0] if args else kwargs["hidden_states"]
    assert isinstance(value, torch.Tensor)
    return value


def first_out(output: Any) -> torch.Tensor:
    value = output if isinstance(output, torch.Tensor) else output[0]
    assert isinstance(value, torch.Tensor)
    return value


@contextmanager
def raw_taps(
    model: nn.Module, taps: dict[str, tuple[str, Literal["input", "output"]]]
) -> Iterator[dict[str, torch.Tensor]]:
    """Plain PyTorch hooks, no hookscope: ``{key: (module path, side)}`` -> ``{key: first value}``."""
    seen: dict[str, torch.Tensor] = {}
    handles: list[torch.utils.hooks.RemovableHandle] = []

    def on_input(key: str) -> Callable[..., None]:
        def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            seen.setdefault(key, hidden_in(args, kwargs).detach().clone())

        return hook

    def on_output(key: str) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: tuple[Any, ...], output: Any) -> None:
            seen.setdefault(key, first_out(output).detach().clone())

        return hook

    try:
        for key, (path, side) in taps.items():
            target = model.get_submodule(path)
            if side == "input":
                handles.append(target.register_forward_pre_hook(on_input(key), with_kwargs=True))
            else:
                handles.append(target.register_forward_hook(on_output(key)))
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def run_capture(model: nn.Module, inputs: dict[str, Any], *selectors: str) -> dict[str, torch.Tensor]:
    """``cache.std`` of one forward under ``hs.capture(model, *selectors)``."""
    with torch.no_grad(), hs.capture(model, *selectors) as cap:
        model(**inputs)
    return cap.cache.std


def selectors(spec: Spec, *roles: str) -> list[str]:
    return [f"std:{ref.prefix}blocks.*.{role}" for ref in spec.stacks for role in roles]


def assert_sum(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal up to the rounding of one add: atol 1e-6 relative to the values' scale."""
    assert got.shape == expected.shape, f"{what}: {tuple(got.shape)} != {tuple(expected.shape)}"
    scale = max(1.0, float(expected.abs().max()))
    torch.testing.assert_close(got, expected, rtol=0.0, atol=1e-6 * scale, msg=lambda m: f"{what}: {m}")


# -- 1. every family resolves, with every base name or a reason ----------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_std_map_names_every_block_role_or_says_why_not(name: str) -> None:
    spec = FAMILIES[name]
    model = build(name)
    std = hs.std_map(model)
    assert isinstance(std, hs.StdMap)
    names = set(std)  # membership through the names (``in std`` is tested on its own below)
    assert len(names) == len(std)
    assert not names & set(std.missing), "a name both resolved and missing"
    assert all(isinstance(why, str) and why.strip() for why in std.missing.values())
    for ref in spec.stacks:
        p = ref.prefix
        assert (f"{p}embed" in names) == (p in spec.embed), f"{p}embed"
        if p not in spec.embed:
            assert std.missing[f"{p}embed"]
        for i in range(LAYERS):
            block = f"{p}blocks.{i}"
            assert std[block].module == ref.block.format(i=i), "blocks.{i} is not the hand-named block"
            required = ["resid_pre", "resid_post", "attn", "mlp", "ln1"]
            required += [] if spec.layout == "parallel" else ["resid_mid"]
            required += [] if ref.ln2 is None else ["ln2"]
            for role in required:
                assert f"{block}.{role}" in names, f"{block}.{role} missing: {std.missing.get(f'{block}.{role}')}"
            lacking = [] if ref.ln2 is not None else ["ln2"]
            lacking += ["resid_mid"] if spec.layout == "parallel" else []
            lacking += [] if ref.ln_cross else ["cross_attn", "ln_cross", "resid_mid_cross"]
            for role in lacking:
                assert f"{block}.{role}" not in names
                assert std.missing[f"{block}.{role}"].strip()
            for role in BLOCK_NAMES:  # every canonical name is either resolved or explained
                assert (f"{block}.{role}" in names) != (f"{block}.{role}" in std.missing), f"{block}.{role}"
            assert std[f"{block}.resid_pre"].read != std[f"{block}.resid_post"].read
        assert f"{p}blocks.{LAYERS}" not in names
        assert f"{p}blocks.{LAYERS}.resid_pre" not in names
    assert "std:" in str(std)  # the printed table tells how to select the names


def test_std_map_is_a_mapping_whose_absent_names_are_not_in_it() -> None:
    """``in`` and ``.get`` answer for a missing name and for a typo as for any Mapping: no error."""
    std = hs.std_map(build("gptj"))
    assert "blocks.0.resid_post" in std
    assert std.get("blocks.0.resid_post") == std["blocks.0.resid_post"]
    for absent in ("blocks.0.resid_mid", "blocks.0.resid_psot", "blocks.7.resid_post"):
        assert absent not in std
        assert std.get(absent) is None
        with pytest.raises(hs.SelectionError):  # indexing says why
            std[absent]


# -- 2. resid_pre / resid_mid / resid_post equal raw hooks on hand-named modules -------------------


@pytest.mark.parametrize("name", NAMES)
def test_residual_stream_equals_raw_hooks_on_hand_named_modules(name: str) -> None:
    spec = FAMILIES[name]
    model = build(name)
    inputs = inputs_for(name)
    taps: dict[str, tuple[str, Literal["input", "output"]]] = {}
    for ref in spec.stacks:
        for i in range(LAYERS):
            block = ref.block.format(i=i)
            taps[f"{ref.prefix}blocks.{i}.resid_pre"] = (block, "input")
            taps[f"{ref.prefix}blocks.{i}.resid_post"] = (block, "output")
            if ref.mid is not None:
                taps[f"{ref.prefix}blocks.{i}.resid_mid"] = (f"{block}.{ref.mid[0]}", ref.mid[1])
    with torch.no_grad(), raw_taps(model, taps) as expected:
        model(**inputs)
    assert len(expected) == len(taps)
    roles = ["resid_pre", "resid_post"] + ([] if spec.layout == "parallel" else ["resid_mid"])
    with torch.no_grad(), hs.capture(model, *selectors(spec, *roles)) as cap:
        model(**inputs)
    got = cap.cache.std
    assert sorted(got) == sorted(expected)
    for key, raw in expected.items():
        value = raw.view(got[key].shape) if raw.dim() == 2 else raw  # OPT's final norm reads flat (batch * seq) rows
        assert got[key].dim() == 3, key
        assert (got[key].shape[0], got[key].shape[-1]) == (BATCH, HIDDEN), key
        assert torch.equal(got[key], value), key
        assert torch.equal(cap.cache[f"std:{key}"], got[key])


# -- 3. one block's output is the next block's input -----------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_resid_post_of_a_block_is_resid_pre_of_the_next(name: str) -> None:
    spec = FAMILIES[name]
    model = build(name)
    got = run_capture(model, inputs_for(name), *selectors(spec, "resid_pre", "resid_post"))
    assert len(got) == 2 * LAYERS * len(spec.stacks)
    for ref in spec.stacks:
        for i in range(LAYERS - 1):
            post, pre = got[f"{ref.prefix}blocks.{i}.resid_post"], got[f"{ref.prefix}blocks.{i + 1}.resid_pre"]
            assert torch.equal(post, pre)
            assert not torch.equal(post, got[f"{ref.prefix}blocks.{i}.resid_pre"])  # the block did something


# -- 4. what attention and the MLP add -------------------------------------------------------------


def _mlp(got: dict[str, torch.Tensor], block: str) -> torch.Tensor:
    mlp = got[f"{block}.mlp"]
    post = got[f"{block}.resid_post"]
    return mlp.reshape(post.shape)  # OPT runs its MLP on (batch * seq, d) rows


@pytest.mark.parametrize("name", SEQUENTIAL)
def test_pre_norm_attn_and_mlp_add_up_to_resid_mid_and_resid_post(name: str) -> None:
    spec = FAMILIES[name]
    model = build(name)
    roles = ("resid_pre", "attn", "resid_mid", "mlp", "resid_post")
    cross = [ref.prefix for ref in spec.stacks if ref.ln_cross]
    extra = [f"std:{p}blocks.*.resid_mid_cross" for p in cross]
    got = run_capture(model, inputs_for(name), *selectors(spec, *roles), *extra)
    for ref in spec.stacks:
        for i in range(LAYERS):
            b = f"{ref.prefix}blocks.{i}"
            assert_sum(got[f"{b}.resid_pre"] + got[f"{b}.attn"], got[f"{b}.resid_mid"], f"{b}: resid_pre + attn")
            before_mlp = got[f"{b}.resid_mid_cross"] if ref.ln_cross else got[f"{b}.resid_mid"]
            assert_sum(before_mlp + _mlp(got, b), got[f"{b}.resid_post"], f"{b}: resid_mid + mlp")
            assert got[f"{b}.attn"].abs().max() > 0
            assert got[f"{b}.mlp"].abs().max() > 0


@pytest.mark.parametrize("name", POST_NORM)
def test_post_norm_attn_plus_resid_pre_is_the_input_of_ln1(name: str) -> None:
    spec = FAMILIES[name]
    model = build(name)
    inputs = inputs_for(name)
    taps: dict[str, tuple[str, Literal["input", "output"]]] = {}
    for ref in spec.stacks:
        assert ref.ln2 is not None
        for i in range(LAYERS):
            block = ref.block.format(i=i)
            taps[f"{ref.prefix}{i}.ln1_in"] = (f"{block}.{ref.ln1}", "input")
            taps[f"{ref.prefix}{i}.ln2_in"] = (f"{block}.{ref.ln2}", "input")
            taps[f"{ref.prefix}{i}.ln2_out"] = (f"{block}.{ref.ln2}", "output")
    roles = ("resid_pre", "attn", "resid_mid", "mlp", "resid_post")
    cross = [f"std:{ref.prefix}blocks.*.resid_mid_cross" for ref in spec.stacks if ref.ln_cross]
    hs.std_map(model)  # its check forward (on an input of its own) runs before the raw hooks are on
    with torch.no_grad(), raw_taps(model, taps) as raw, hs.capture(model, *selectors(spec, *roles), *cross) as cap:
        model(**inputs)
    got = cap.cache.std
    for ref in spec.stacks:
        for i in range(LAYERS):
            b = f"{ref.prefix}blocks.{i}"
            assert_sum(got[f"{b}.resid_pre"] + got[f"{b}.attn"], raw[f"{ref.prefix}{i}.ln1_in"], f"{b}: ln1's input")
            before_mlp = got[f"{b}.resid_mid_cross"] if ref.ln_cross else got[f"{b}.resid_mid"]
            assert_sum(before_mlp + _mlp(got, b), raw[f"{ref.prefix}{i}.ln2_in"], f"{b}: ln2's input")
            assert torch.equal(got[f"{b}.resid_post"], raw[f"{ref.prefix}{i}.ln2_out"])


@pytest.mark.parametrize("name", PARALLEL)
def test_parallel_resid_post_is_resid_pre_plus_attn_plus_mlp(name: str) -> None:
    spec = FAMILIES[name]
    model = build(name)
    got = run_capture(model, inputs_for(name), *selectors(spec, "resid_pre", "attn", "mlp", "resid_post"))
    for i in range(LAYERS):
        b = f"blocks.{i}"
        expected = got[f"{b}.resid_pre"] + got[f"{b}.attn"] + _mlp(got, b)
        assert_sum(expected, got[f"{b}.resid_post"], f"{b}: resid_pre + attn + mlp")
        # neither alone: the block really adds both, read from the same input
        assert not torch.allclose(got[f"{b}.resid_pre"] + got[f"{b}.attn"], got[f"{b}.resid_post"], atol=1e-4)


# -- 5. decoders' cross-attention ------------------------------------------------------------------


@pytest.mark.parametrize("name", ENCODER_DECODER)
def test_decoder_cross_attention_adds_up_to_resid_mid_cross(name: str) -> None:
    spec = FAMILIES[name]
    decoder = next(ref for ref in spec.stacks if ref.prefix == "decoder.")
    assert decoder.ln_cross is not None
    model = build(name)
    std = hs.std_map(model)
    assert "decoder.blocks.0.cross_attn" in std
    assert "encoder.blocks.0.cross_attn" in std.missing
    taps: dict[str, tuple[str, Literal["input", "output"]]] = {
        f"{i}.{side}": (f"{decoder.block.format(i=i)}.{decoder.ln_cross}", side)
        for i in range(LAYERS)
        for side in ("input", "output")
    }
    roles = ["resid_mid", "cross_attn", "cross_attn.pattern", "resid_mid_cross"]
    chosen = [f"std:decoder.blocks.*.{role}" for role in roles] + ["std:encoder.blocks.1.resid_post"]
    with torch.no_grad(), raw_taps(model, taps) as raw, hs.capture(model, *chosen) as cap:
        model(**inputs_for(name))
    got = cap.cache.std
    encoder_len = got["encoder.blocks.1.resid_post"].shape[1]
    for i in range(LAYERS):
        b = f"decoder.blocks.{i}"
        cross = got[f"{b}.cross_attn"]
        assert cross.shape == (BATCH, DECODER_TOKENS, HIDDEN)
        pattern = got[f"{b}.cross_attn.pattern"]
        assert pattern.shape == (
            BATCH,
            HEADS,
            DECODER_TOKENS,
            encoder_len,
        )  # queries from the decoder, keys from the encoder
        torch.testing.assert_close(pattern.sum(-1), torch.ones(BATCH, HEADS, DECODER_TOKENS))
        summed = got[f"{b}.resid_mid"] + cross
        if spec.layout == "pre":
            assert_sum(summed, got[f"{b}.resid_mid_cross"], f"{b}: resid_mid + cross_attn")
            assert torch.equal(got[f"{b}.resid_mid"], raw[f"{i}.input"])  # pre-norm: the cross norm reads resid_mid
        else:  # post-norm: the sum enters the cross norm, whose output is resid_mid_cross
            assert_sum(summed, raw[f"{i}.input"], f"{b}: the cross norm's input")
            assert torch.equal(got[f"{b}.resid_mid_cross"], raw[f"{i}.output"])


# -- 6. the attention pattern under SDPA is the eager model's attention ---------------------------


def test_llama_pattern_equals_the_eager_twin_s_output_attentions() -> None:
    sdpa = build("llama")
    eager = build("llama", attn_implementation="eager")
    eager.load_state_dict(sdpa.state_dict())
    inputs = inputs_for("llama")
    with torch.no_grad():
        weights = eager(**inputs, output_attentions=True).attentions
    assert len(weights) == LAYERS
    got = run_capture(sdpa, inputs, "std:blocks.*.attn.pattern")
    for i in range(LAYERS):
        pattern = got[f"blocks.{i}.attn.pattern"]
        assert pattern.shape == weights[i].shape == (BATCH, HEADS, TOKENS, TOKENS)
        torch.testing.assert_close(pattern, weights[i], rtol=0.0, atol=1e-6)
        assert torch.all(pattern.triu(1) == 0)  # causal: nothing attends ahead


# -- 7. names that name nothing say why ------------------------------------------------------------


def test_a_name_the_family_lacks_raises_saying_why() -> None:
    model = build("gptj")
    with (
        pytest.raises(hs.SelectionError, match=r"blocks\.0\.resid_mid") as raised,
        hs.capture(model, "std:blocks.0.resid_mid"),
    ):
        model(**inputs_for("gptj"))
    message = str(raised.value)
    assert "parallel" in message or "both read the block's input" in message, message


def test_a_typo_raises_suggesting_the_name() -> None:
    model = build("gptj")
    with pytest.raises(hs.SelectionError) as raised, hs.capture(model, "std:blocks.0.resid_psot"):
        model(**inputs_for("gptj"))
    assert "std:blocks.*.resid_post" in str(raised.value)
    assert "std:blocks.*.resid_post" in raised.value.suggestions


# -- 8. a map is made once per model ---------------------------------------------------------------


@pytest.mark.parametrize("explicit", [True, False], ids=["std_map-first", "capture-first"])
def test_the_check_forward_runs_once_per_model(explicit: bool) -> None:
    model = build("gpt2")
    inputs = inputs_for("gpt2")
    calls: list[int] = []
    handle = model.register_forward_hook(lambda *_: calls.append(1))
    try:
        if explicit:
            hs.std_map(model)
            assert len(calls) == 1
        with torch.no_grad():
            for chosen in ("std:blocks.*.resid_post", "std:blocks.0.attn"):
                with hs.capture(model, chosen) as cap:
                    model(**inputs)
                assert cap.cache.std
    finally:
        handle.remove()
    assert len(calls) == 2 + 1  # the user's two forwards and one check forward


def test_making_a_map_leaves_train_mode_and_the_random_state_alone() -> None:
    model = build("gpt2").train()
    state = torch.random.get_rng_state()
    hs.std_map(model)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert model.training
    assert all(sub.training for sub in model.modules())

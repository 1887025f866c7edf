"""The logit lens against each model's own logits, the one metric contract, and the residual stream
in low precision, on T5, Granite, BART, Gemma 2, GPT-2 and Llama.

References are computed without hookscope: a plain forward's logits, raw forward hooks on the
blocks, the final norm and LM head called by hand.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope._core.attach import live_groups

pytestmark = [pytest.mark.transformers]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

VOCAB = 64
SMALL = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4}


def ids() -> torch.Tensor:
    return torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))


def t5(**extra: Any) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.T5Config(
        num_layers=2, num_decoder_layers=2, d_model=32, d_kv=8, num_heads=4, d_ff=64, vocab_size=VOCAB, **extra
    )
    return transformers.T5ForConditionalGeneration(config).eval()


def granite() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GraniteConfig(vocab_size=VOCAB, num_key_value_heads=2, logits_scaling=4.0, **SMALL)
    return transformers.GraniteForCausalLM(config).eval()


def bart() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
    )  # fmt: skip
    model = transformers.BartForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.final_logits_bias.normal_()  # zero when built; a trained model's need not be
    return model


def gemma2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.Gemma2Config(vocab_size=VOCAB, num_key_value_heads=2, head_dim=8, **SMALL)
    return transformers.Gemma2ForCausalLM(config).eval()


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


def llama(dtype: torch.dtype = torch.float32, layers: int = 2, width: int = 32) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=width, intermediate_size=2 * width, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval().to(dtype)


def encoder_decoder_inputs() -> dict[str, torch.Tensor]:
    return {"input_ids": ids(), "decoder_input_ids": ids()}


def kept_outputs(modules: list[nn.Module], run: Callable[[], Any]) -> tuple[Any, list[torch.Tensor]]:
    """``run()``'s output and each module's hidden-state output, kept by raw forward hooks."""
    kept: list[torch.Tensor] = []
    handles = [
        module.register_forward_hook(lambda m, a, out: kept.append((out[0] if isinstance(out, tuple) else out).clone()))
        for module in modules
    ]
    try:
        with torch.no_grad():
            output = run()
    finally:
        for handle in handles:
            handle.remove()
    return output, kept


# -- item: every linear step between the last residual and the logits ------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("build", "stack", "applied"),
    [
        (t5, "decoder.", "x 0.176777"),  # tied embeddings: the decoder's output times d_model ** -0.5
        (granite, "", "x 0.25"),  # the logits divided by logits_scaling
        (bart, "decoder.", "bias"),  # final_logits_bias added to the head's output
    ],
)
def test_the_last_layer_through_the_lens_is_the_models_own_logits(
    build: Callable[[], nn.Module], stack: str, applied: str
) -> None:
    model = build()
    inputs: Any = encoder_decoder_inputs() if stack else ids()
    lens = hs.methods.logit_lens(model, inputs, stack=stack)
    with torch.no_grad():
        own = (model(**inputs) if stack else model(inputs)).logits
    torch.testing.assert_close(lens.logits[-1], own)
    assert applied in lens.readout
    assert "left out" not in lens.readout
    assert applied in repr(lens)


def test_t5_lens_of_an_earlier_layer_scales_before_the_head() -> None:
    model = t5()
    inputs = encoder_decoder_inputs()
    _, blocks = kept_outputs([model.decoder.block[0]], lambda: model(**inputs))
    lens = hs.methods.logit_lens(model, inputs, stack="decoder.")
    with torch.no_grad():
        expected = model.lm_head(model.decoder.final_layer_norm(blocks[0]) * 32**-0.5)
    torch.testing.assert_close(lens.logits[0], expected)


@pytest.mark.parametrize("build", [gpt2, llama, lambda: t5(tie_word_embeddings=False)])
def test_models_that_do_nothing_after_the_norm_get_nothing_applied(build: Callable[[], nn.Module]) -> None:
    model = build()
    stack = "decoder." if isinstance(model, transformers.T5ForConditionalGeneration) else ""
    inputs: Any = encoder_decoder_inputs() if stack else ids()
    lens = hs.methods.logit_lens(model, inputs, stack=stack)
    with torch.no_grad():
        own = (model(**inputs) if stack else model(inputs)).logits
    assert torch.equal(lens.logits[-1], own)
    assert lens.readout == f"read through std:{stack}ln_final then std:unembed"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_soft_cap_is_named_as_left_out_in_every_dtype(dtype: torch.dtype) -> None:
    model = gemma2().to(dtype)  # small logits: the cap is a scale of 1 to within bf16's rounding, and not one
    _, blocks = kept_outputs([model.model.layers[-1]], lambda: model(ids()))
    lens = hs.methods.logit_lens(model, ids())
    with torch.no_grad():
        expected = model.lm_head(model.model.norm(blocks[0]))  # the head's output, before the soft-cap
    torch.testing.assert_close(lens.logits[-1], expected)
    assert "left out" in lens.readout
    assert "soft-cap" in lens.readout
    assert "soft-cap" in repr(lens)
    assert "std:unembed then x" not in lens.readout


@pytest.mark.slow
def test_the_encoders_lens_takes_the_decoders_steps_to_the_head() -> None:
    model = t5()
    inputs = encoder_decoder_inputs()
    _, blocks = kept_outputs(list(model.encoder.block), lambda: model(**inputs))
    lens = hs.methods.logit_lens(model, inputs, stack="encoder.")
    with torch.no_grad():  # T5 scales the decoder's normed output by d_model ** -0.5 before its tied head
        expected = torch.stack([model.lm_head(model.encoder.final_layer_norm(b) * 32**-0.5) for b in blocks])
    torch.testing.assert_close(lens.logits, expected)
    assert "left out" not in lens.readout
    assert "x 0.176777" in lens.readout
    assert "decoder" in lens.readout


def opt() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.OPTConfig(
        num_hidden_layers=2, hidden_size=32, ffn_dim=64, num_attention_heads=4, vocab_size=VOCAB, word_embed_proj_dim=16
    )
    return transformers.OPTForCausalLM(config).eval()


@pytest.mark.slow
def test_a_projection_between_the_norm_and_a_narrower_head_is_applied() -> None:
    model = opt()
    output, blocks = kept_outputs(list(model.model.decoder.layers), lambda: model(ids()))
    lens = hs.methods.logit_lens(model, ids())
    decoder = model.model.decoder
    with torch.no_grad():
        expected = torch.stack([model.lm_head(decoder.project_out(decoder.final_layer_norm(b))) for b in blocks])
    torch.testing.assert_close(lens.logits, expected)
    torch.testing.assert_close(lens.logits[-1], output.logits)
    assert "model.decoder.project_out" in lens.readout
    assert "left out" not in lens.readout

    class Halves(nn.Module):  # a step between the norm and the head that no linear module makes
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[..., ::2] * 2

    decoder.project_out = Halves().eval()
    with pytest.raises(hs.SpecError, match=r"head takes values of width 16 and the final norm gives 32.*project_out"):
        hs.methods.logit_lens(model, ids())
    assert not live_groups()


# -- item: one metric contract ---------------------------------------------------------------------


def test_a_metric_of_the_output_reads_each_layer_of_the_lens() -> None:
    model = gpt2()
    _, blocks = kept_outputs(list(model.transformer.h), lambda: model(ids()))
    with torch.no_grad():
        layer_logits = [model.lm_head(model.transformer.ln_f(block)) for block in blocks]

    def metric(output: Any) -> torch.Tensor:  # written for the model's output, as patch_sweep takes it
        return output.logits[:, -1, 4] - output.logits[:, -1, 5]

    lens = hs.methods.logit_lens(model, ids(), metric=metric)
    expected = torch.stack([(logits[:, -1, 4] - logits[:, -1, 5]).double().mean() for logits in layer_logits])
    assert lens.scores is not None
    torch.testing.assert_close(lens.scores, expected)
    assert lens.metric == "metric"
    scalar = hs.methods.logit_lens(model, ids(), metric=lambda output: output.logits[..., 4].mean())
    assert scalar.scores is not None
    torch.testing.assert_close(scalar.scores, torch.stack([logits[..., 4].double().mean() for logits in layer_logits]))


def test_a_metric_of_a_seq2seq_output_and_a_tuple_output() -> None:
    model = t5()
    inputs = encoder_decoder_inputs()
    _, blocks = kept_outputs(list(model.decoder.block), lambda: model(**inputs))
    with torch.no_grad():
        by_hand = [model.lm_head(model.decoder.final_layer_norm(b) * 32**-0.5)[:, -1, 3] for b in blocks]
    lens = hs.methods.logit_lens(model, inputs, stack="decoder.", metric=lambda out: out.logits[:, -1, 3])
    assert lens.scores is not None
    torch.testing.assert_close(lens.scores, torch.stack([value.double().mean() for value in by_hand]))
    tuples = hs.methods.logit_lens(
        model, inputs, stack="decoder.", metric=lambda out: out[0][:, -1, 3], model_kwargs={"return_dict": False}
    )
    assert tuples.scores is not None
    torch.testing.assert_close(tuples.scores, lens.scores)


def test_a_metric_that_cannot_be_called_or_scored_is_refused() -> None:
    model = gpt2()
    with pytest.raises(hs.SpecError, match="expected hs.methods.logit_diff"):
        hs.methods.logit_lens(model, ids(), metric="logit_diff")  # type: ignore[arg-type]
    with pytest.raises(hs.SpecError, match=r"returned shape \(2, 6\) for a batch of 2 rows"):
        hs.methods.logit_lens(model, ids(), metric=lambda out: out.logits[..., 4])
    assert not live_groups()


# -- item: train mode refused, decoded top tokens ------------------------------------------------------


def test_the_lens_refuses_a_model_in_training_mode_and_leaves_it_so() -> None:
    model = gpt2().train()
    before = [module.training for module in model.modules()]
    with pytest.raises(hs.SpecError, match=r"training mode.*call model.eval\(\) first"):
        hs.methods.logit_lens(model, ids())
    assert [module.training for module in model.modules()] == before
    model.eval()
    model.transformer.h[1].attn.train()  # one module left training is refused too
    with pytest.raises(hs.SpecError, match="transformer.h.1.attn"):
        hs.methods.logit_lens(model, ids())


@pytest.mark.slow
def test_top_gives_text_where_the_lens_decodes() -> None:
    model = gpt2()
    words = [f"w{i}" for i in range(VOCAB)]
    _, blocks = kept_outputs([model.transformer.h[-1]], lambda: model(ids()))
    with torch.no_grad():
        probs = model.lm_head(model.transformer.ln_f(blocks[0]))[1, 2].softmax(-1)
    expected = probs.topk(3)
    lens = hs.methods.logit_lens(model, ids(), decode=words)
    best = lens.top(3, position=2, row=1)[-1]
    assert [token for token, _ in best] == [words[i] for i in expected.indices.tolist()]
    torch.testing.assert_close(torch.tensor([p for _, p in best]), expected.values)
    by_function = hs.methods.logit_lens(model, ids(), decode=lambda i: f"<{i}>").top(1)[-1][0][0]
    assert isinstance(by_function, str)
    assert by_function.startswith("<")
    assert all(isinstance(token, int) for token, _ in hs.methods.logit_lens(model, ids()).top(3)[0])


# -- items: the residual stream in bf16; apply_ln on a tensor -------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(("layers", "width"), [(2, 32), (16, 128)])
def test_decompose_resid_of_a_bf16_llama_sums_within_bf16_rounding(layers: int, width: int) -> None:
    model = llama(torch.bfloat16, layers, width)
    _, blocks = kept_outputs([model.model.layers[-1]], lambda: model(ids()))
    parts, labels = hs.methods.decompose_resid(model, ids())
    assert parts.dtype == torch.bfloat16
    assert len(labels) == 2 * layers + 1
    total, final = parts.double().sum(0), blocks[0].double()
    assert 0 < float((total - final).abs().max()) <= 0.02 * float(final.abs().max())  # rounding, and only that


def bert() -> nn.Module:
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(transformers.BertConfig(vocab_size=VOCAB, **SMALL)).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("build", "stack"), [(bert, ""), (bart, "decoder.")])
def test_decompose_resid_refuses_a_post_norm_model_in_every_dtype(
    build: Callable[[], nn.Module], stack: str, dtype: torch.dtype
) -> None:
    model = build().to(dtype)  # default initialisation: block norms that barely move the stream
    inputs: Any = encoder_decoder_inputs() if stack else ids()
    with pytest.raises(hs.SpecError, match="post-norm"):
        hs.methods.decompose_resid(model, inputs, stack=stack)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decompose_resid_of_a_parallel_block_in_low_precision(dtype: torch.dtype) -> None:
    torch.manual_seed(0)  # the block adds attn + mlp first, then the stream: another order of rounding
    config = transformers.GPTNeoXConfig(vocab_size=VOCAB, use_parallel_residual=True, **SMALL)
    model = transformers.GPTNeoXForCausalLM(config).eval().to(dtype)
    _, blocks = kept_outputs([model.gpt_neox.layers[-1]], lambda: model(ids()))
    parts, _ = hs.methods.decompose_resid(model, ids())
    total, final = parts.double().sum(0), blocks[0].double()
    assert float((total - final).abs().max()) <= 0.02 * float(final.abs().max())


@pytest.mark.parametrize("build", [gpt2, llama])
def test_apply_ln_takes_the_tensor_decompose_resid_unpacks_to(build: Callable[[], nn.Module]) -> None:
    model = build()
    norm = model.transformer.ln_f if hasattr(model, "transformer") else model.model.norm
    parts, labels = hs.methods.decompose_resid(model, ids())
    each = hs.methods.apply_ln(parts, model)
    assert isinstance(each, torch.Tensor)
    with torch.no_grad():
        torch.testing.assert_close(each, torch.stack([norm(part) for part in parts]))
        total = parts.sum(0)
        linear = hs.methods.apply_ln(parts, model, scale_of=total)
        bias = norm.bias if getattr(norm, "bias", None) is not None else torch.zeros(32)
        torch.testing.assert_close(linear.sum(0) + bias, norm(total), rtol=1e-4, atol=1e-5)
    stacked = hs.methods.apply_ln(hs.methods.Stacked(parts, labels), model)
    assert stacked.labels == labels
    assert torch.equal(stacked.tensor, each)
    with pytest.raises(hs.SpecError, match="expected a Stacked"):
        hs.methods.apply_ln([parts], model)  # type: ignore[call-overload]

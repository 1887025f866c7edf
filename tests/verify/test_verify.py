"""hs.verify: every row on real models, and the checks themselves failing on a broken hookscope.

A verification that cannot fail proves nothing: each test in the second half breaks one feature of
hookscope on purpose (a dropped call's value, an edit of the wrong call, an edit that never
reaches the output, a doubled gradient, a NaN blamed nowhere, a wrong attention pattern) and
asserts the report says SILENTLY_WRONG for that feature and for no other.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope._capture.cache import Cache
from hookscope._edit.options import EditOptions
from tests.models import LinearInplaceReLU, MixedOutputs, SharedTwice, attention_gpt2, attention_tokens, track

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def statuses(report: hs.VerifyReport, check: str) -> set[str]:
    found = {row.status for row in report if row.check == check}
    assert found, f"no row {check!r} in {[row.check for row in report]}"
    return found


def raw_hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


# -- small models: every check that applies is SUPPORTED ----------------------------------------


@pytest.mark.parametrize("make", [SharedTwice, LinearInplaceReLU, MixedOutputs], ids=lambda m: m.__name__)
def test_small_models_with_shared_in_place_and_structured_outputs_verify_clean(make: Any) -> None:
    model = make()
    report = hs.verify(model, torch.randn(2, 4), compile=False)
    assert report.ok, report.table()
    for check in ("capture inputs and outputs", "edit zero", "edit patch", "trace calls and statistics"):
        assert statuses(report, check) == {"SUPPORTED"}, report.table()
    assert statuses(report, "attention op sites") == {"REFUSED"}
    assert report.forwards > 0
    assert report.backwards == (1 if list(model.parameters()) else 0)


def test_verify_leaves_the_model_as_it_was() -> None:
    model = SharedTwice().train()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    hooks = raw_hooks(model)
    hs.verify(model, torch.randn(2, 4), compile=False)
    assert model.training
    assert all(m.training for m in model.modules())
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())  # the NaN was put back
    assert all(p.grad is None for p in model.parameters())  # the backward's gradients were put back
    assert raw_hooks(model) == hooks
    assert hs.attached(model) == []


def test_the_report_as_data_and_as_text() -> None:
    report = hs.verify(SharedTwice(), torch.randn(2, 4), checks=["capture", "trace"], compile=False)
    data = json.loads(report.to_json())
    assert data["ok"] is True
    assert data["counts"]["SUPPORTED"] == len(report) == len(data["rows"])
    assert {row["check"] for row in data["rows"]} == {
        "capture inputs and outputs",
        "trace calls and statistics",
        "trace first NaN",
    }
    assert data["forwards"] == report.forwards == 5  # clean twice, capture, clean trace, NaN trace
    text = str(report)
    assert text.splitlines()[-1].startswith("ok: 3 SUPPORTED")
    assert "SharedTwice" in text
    assert "<table>" in report._repr_html_()
    wrong = hs.VerifyReport("M", [hs.VerifyReport.Row("edit zero", "fc", "ERROR", "TypeError: x")])
    assert not wrong.ok
    assert "NOT OK: 1 ERROR" in wrong.table()


class Noisy(nn.Module):
    """Draws random numbers in eval mode, as a random mask would."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc(x) + torch.randn_like(x))


class Drifting(nn.Module):
    """Computes something else on every call: no two forwards agree, whatever the seed."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(4, 4), nn.Linear(4, 2)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.head(self.fc(x) * self.calls)


def test_a_model_drawing_random_numbers_is_verified_with_the_generator_reseeded() -> None:
    model, x = track(Noisy()), torch.randn(2, 4)
    state = torch.get_rng_state()
    report = hs.verify(model, x, compile=False)
    assert report.ok, report.table()
    assert statuses(report, "edit zero") == {"SUPPORTED"}
    assert torch.equal(torch.get_rng_state(), state)  # the user's generator is as it was


def test_a_model_that_drifts_between_forwards_gets_refusals_not_wrong_rows() -> None:
    report = hs.verify(track(Drifting()), torch.randn(2, 4), compile="eager")
    assert report.ok, report.table()
    for check in ("edit", "torch.compile"):
        assert statuses(report, check) == {"REFUSED"}
        assert "two forwards on the same input differ" in next(r for r in report if r.check == check).detail
    assert statuses(report, "capture inputs and outputs") == {"SUPPORTED"}  # one forward: no assumption


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"example": object()}, "not a model input"),
        ({"example": torch.randn(2, 4), "checks": ["capture", "nope"]}, "names no check"),
        ({"example": torch.randn(2, 4), "sample": 0}, "not a count of modules"),
        ({"example": torch.randn(2, 5)}, "did not run on the example"),
        ({"example": torch.randn(2, 4), "compile": 3}, "not a torch.compile backend"),
    ],
)
def test_bad_input_is_a_spec_error_saying_what_to_pass(kwargs: dict[str, Any], needle: str) -> None:
    model = SharedTwice()
    with pytest.raises(hs.SpecError, match=needle):
        hs.verify(model, **kwargs)
    assert raw_hooks(model) == 0


# -- a hookscope broken on purpose: the check of that feature says SILENTLY_WRONG ----------------


def _only_wrong(report: hs.VerifyReport, *checks: str) -> None:
    wrong = {row.check for row in report.select("SILENTLY_WRONG")}
    assert wrong == set(checks), report.table()


def test_a_dropped_call_value_is_silently_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    put = Cache._put

    def drop_second_call(self: Cache, site: hs.Site, tensor: torch.Tensor, version: int | None) -> None:
        if not (site.module == "shared" and site.call == 1 and site.what == "output"):
            put(self, site, tensor, version)

    monkeypatch.setattr(Cache, "_put", drop_second_call)
    report = hs.verify(SharedTwice(), torch.randn(2, 4), checks=["capture"], compile=False)
    assert not report.ok
    _only_wrong(report, "capture inputs and outputs")
    assert "1 values not kept, e.g. shared#1:output" in report.select("SILENTLY_WRONG")[0].detail


def test_an_edit_of_the_wrong_call_is_silently_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(EditOptions, "wants", lambda self, call: call == 1)
    report = hs.verify(SharedTwice(), torch.randn(2, 4), checks=["edits"], sample=2, compile=False)
    wrong = report.select("SILENTLY_WRONG")
    assert {row.check for row in wrong} == {"edit zero", "edit patch"}
    assert any("edited 1 calls; the module ran 2" in row.detail for row in wrong), report.table()
    assert {row.subject for row in wrong} == {"shared", "head"} or "shared" in {row.subject for row in wrong}


def test_an_edit_that_never_reaches_the_output_is_silently_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    import hookscope._edit.editor as editor

    monkeypatch.setattr(editor, "map_tensors_with_paths", lambda fn, value, root="output": value)
    report = hs.verify(SharedTwice(), torch.randn(2, 4), checks=["edits"], compile=False)
    wrong = report.select("SILENTLY_WRONG")
    assert wrong
    assert all(row.check in ("edit zero", "edit patch") for row in wrong)
    assert any("the edit did not reach the output" in row.detail for row in wrong), report.table()


def test_a_wrong_gradient_is_silently_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    add = Cache._add_grad
    monkeypatch.setattr(Cache, "_add_grad", lambda self, site, grad: add(self, site, grad * 2))
    report = hs.verify(SharedTwice(), torch.randn(2, 4), checks=["gradients"], compile=False)
    _only_wrong(report, "gradients of kept values")


def test_a_nan_blamed_nowhere_is_silently_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hs.Trace, "first_nonfinite", lambda self, *a, **k: None)
    report = hs.verify(SharedTwice(), torch.randn(2, 4), checks=["trace"], compile=False)
    _only_wrong(report, "trace first NaN")
    assert "the trace found no NaN; raw hooks see" in report.select("SILENTLY_WRONG")[0].detail


@pytest.mark.transformers
@pytest.mark.slow
def test_a_wrong_attention_pattern_is_silently_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    from hookscope._capture import attn_sites

    softmax = attn_sites.pattern_of_scores
    monkeypatch.setattr(attn_sites, "pattern_of_scores", lambda scores: softmax(scores).transpose(-1, -2))
    model = attention_gpt2("sdpa")
    report = hs.verify(model, attention_tokens(), checks=["attention", "std"], compile=False)
    wrong = report.select("SILENTLY_WRONG")
    assert {row.check for row in wrong} == {"attention sub-sites", "std names"}, report.table()
    assert (
        "attn.pattern differs from the kernel call's"
        in next(r for r in wrong if r.check == "attention sub-sites").detail
    )


# -- real transformers models --------------------------------------------------------------------


@pytest.mark.transformers
@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "llama", "bert", "t5"])
def test_tiny_transformers_models_verify_with_no_wrong_row(family: str) -> None:
    import transformers as tf

    torch.manual_seed(0)
    small = {"vocab_size": 96}
    built: dict[str, Any] = {
        "gpt2": lambda: tf.GPT2LMHeadModel(
            tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, bos_token_id=0, eos_token_id=0, **small)
        ),
        "llama": lambda: tf.LlamaForCausalLM(
            tf.LlamaConfig(
                num_hidden_layers=2,
                hidden_size=32,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=64,
                **small,
            )
        ),
        "bert": lambda: tf.BertModel(
            tf.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64, **small)
        ),
        "t5": lambda: tf.T5ForConditionalGeneration(
            tf.T5Config(num_layers=2, d_model=32, d_kv=8, num_heads=4, d_ff=64, **small)
        ),
    }
    model = track(built[family]())
    torch.compiler.reset()  # a Llama compiled by an earlier test would leave the compile check nothing to check
    report = hs.verify(model, compile="eager" if family == "llama" else False)
    assert report.ok, report.table()
    assert report.counts["SILENTLY_WRONG"] == report.counts["ERROR"] == 0
    supported = {row.check for row in report.select("SUPPORTED")}
    assert {
        "capture inputs and outputs",
        "gradients of kept values",
        "edit zero",
        "edit patch",
        "trace calls and statistics",
        "trace first NaN",
        "attention op sites",
        "std names",
    } <= supported
    if family != "t5":  # T5's attention is eager only: its sub-sites are refused, with the reason
        assert "attention sub-sites" in supported
    if family == "llama":
        assert "torch.compile" in supported
    assert hs.attached(model) == []


@pytest.mark.transformers
@pytest.mark.slow
@pytest.mark.parametrize("family", ["falcon", "opt", "bloom"])
def test_sweep_findings_multi_query_heads_residual_adds_and_eager_softmax_verify_clean(family: str) -> None:
    """Falcon repeats one key/value head for the kernel (the sub-sites keep one per group); OPT's
    resid_mid is an add inside the block's code; BLOOM's pattern is the softmax of its eager
    attention: each name is checked against a raw function mode or the raw kernel call."""
    import transformers as tf

    torch.manual_seed(0)
    built: dict[str, Any] = {
        "falcon": lambda: tf.FalconForCausalLM(
            tf.FalconConfig(
                num_hidden_layers=2,
                hidden_size=64,
                num_attention_heads=4,
                multi_query=True,
                vocab_size=128,
                new_decoder_architecture=False,
                bos_token_id=0,
                eos_token_id=0,
            )
        ),
        "opt": lambda: tf.OPTForCausalLM(
            tf.OPTConfig(
                num_hidden_layers=2,
                hidden_size=64,
                num_attention_heads=4,
                ffn_dim=128,
                vocab_size=128,
                word_embed_proj_dim=64,
                bos_token_id=0,
                eos_token_id=0,
                pad_token_id=1,
            )
        ),
        "bloom": lambda: tf.BloomForCausalLM(
            tf.BloomConfig(n_layer=2, hidden_size=64, n_head=4, vocab_size=128, bos_token_id=0, eos_token_id=0)
        ),
    }
    model = track(built[family]())
    report = hs.verify(model, checks=["attention", "std"], compile=False)
    assert report.ok, report.table()
    std_row = next(row for row in report if row.check == "std names" and row.subject == "resolved")
    assert std_row.status == "SUPPORTED", report.table()
    assert "not checked" not in std_row.detail  # every resolved name had a reference
    if family == "falcon":
        assert statuses(report, "attention sub-sites") == {"SUPPORTED"}


class SharedAttention(nn.Module):
    """One attention module run twice (ALBERT shares its layer), writing into ``new_empty`` memory
    (DeepSeek-V3 builds its rotary query so), beside a module whose output needs no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = Attention()
        self.positions = Positions()
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.positions(x)
        return self.head(self.attention(self.attention(x)))


class Positions(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.arange(x.shape[1], dtype=x.dtype)[:, None].expand_as(x).sin()


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 4).permute(2, 0, 3, 1, 4)
        scratch = q.new_empty(q.shape)
        scratch[...] = q
        z = torch.nn.functional.scaled_dot_product_attention(scratch, k, v, is_causal=True)
        return x + z.transpose(1, 2).reshape(x.shape)


def test_sweep_findings_shared_attention_scratch_memory_and_values_without_gradient() -> None:
    """The sweep's ALBERT, DeepSeek-V3 and rotary-embedding rows: each module call's kernel is its
    own reference, ops reading unwritten memory are compared by shape, and a value no gradient
    reaches is not asked for one."""
    model = track(SharedAttention())
    report = hs.verify(model, torch.randn(2, 5, 8), checks=["gradients", "attention"], sample=3, compile=False)
    assert report.ok, report.table()
    assert statuses(report, "attention sub-sites") == {"SUPPORTED"}
    assert "12 sub-site values" in next(r for r in report if r.check == "attention sub-sites").detail  # 2 calls x 6
    assert statuses(report, "gradients of kept values") == {"SUPPORTED"}


class Validating(nn.Module):
    """Checks its own values, as a torch.distributions argument check does."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.head(self.fc(x))
        if torch.isnan(out).any():
            raise ValueError("found invalid values")
        return out


def test_a_model_that_raises_on_the_injected_nan_is_a_refusal() -> None:
    report = hs.verify(track(Validating()), torch.randn(2, 4), checks=["trace"], compile=False)
    row = next(r for r in report if r.check == "trace first NaN")
    assert row.status == "REFUSED"
    assert "the model raises on a NaN in" in row.detail
    assert "ValueError: found invalid values" in row.detail


class Argmax(nn.Module):
    """Returns class ids only: an edit reaches the output as a changed argmax, not a float."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))).argmax(-1)


def test_an_edit_that_leaves_a_trace_of_the_value_is_silently_wrong_even_behind_an_argmax(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hookscope import edits

    monkeypatch.setattr(edits.Zero, "apply", lambda self, value, mask, ctx: value * 1e-5)
    report = hs.verify(track(Argmax()), torch.randn(6, 4), checks=["edits"], compile=False)
    zero_rows = [row for row in report if row.check == "edit zero"]
    assert {row.status for row in zero_rows} == {"SILENTLY_WRONG"}, report.table()
    assert all("handed on a value that is not the edit's" in row.detail for row in zero_rows)
    assert statuses(report, "edit patch") == {"SUPPORTED"}


def test_trace_statistics_under_the_wrong_leaf_are_silently_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    from hookscope._trace import rows

    built = rows.TensorInfo.__init__

    def elsewhere(self: Any, path: str, *args: Any, **kwargs: Any) -> None:
        built(self, path + "[9]", *args, **kwargs)

    monkeypatch.setattr(rows.TensorInfo, "__init__", elsewhere)
    report = hs.verify(SharedTwice(), torch.randn(2, 4), checks=["trace"], compile=False)
    row = next(r for r in report if r.check == "trace calls and statistics")
    assert row.status == "SILENTLY_WRONG"
    assert "the trace has no statistics of it" in row.detail


class InPlaceAfterUse(nn.Module):
    """Writes into a value autograd saved: no backward runs, with or without hookscope."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.a(x))
        out = self.b(y)
        y.add_(1)
        return out


def test_a_model_autograd_cannot_differentiate_is_a_refusal_not_an_error() -> None:
    report = hs.verify(track(InPlaceAfterUse()), torch.randn(2, 4), checks=["gradients"], compile=False)
    row = next(r for r in report if r.check == "gradients of kept values")
    assert row.status == "REFUSED", report.table()
    assert "autograd cannot differentiate this model without hookscope either" in row.detail


def test_a_mistyped_backend_and_an_empty_check_list_are_bad_input() -> None:
    with pytest.raises(hs.SpecError, match="'inductr' is not a torch.compile backend; expected one of"):
        hs.verify(SharedTwice(), torch.randn(2, 4), compile="inductr")
    with pytest.raises(hs.SpecError, match="checks= is empty"):
        hs.verify(SharedTwice(), torch.randn(2, 4), checks=[])
    report = hs.verify(SharedTwice(), torch.randn(2, 4), checks="capture, trace", compile="none")
    assert {row.check for row in report} == {
        "capture inputs and outputs",
        "trace calls and statistics",
        "trace first NaN",
    }


def test_the_reference_comparison_tells_infinity_from_the_largest_float() -> None:
    from hookscope._verify.reference import same

    big = torch.finfo(torch.float32).max
    assert not same(torch.tensor([float("inf")]), torch.tensor([big]))
    assert not same(torch.tensor([float("-inf")]), torch.tensor([-big]))
    assert same(torch.tensor([float("nan"), float("inf")]), torch.tensor([float("nan"), float("inf")]))


@pytest.mark.transformers
def test_a_block_name_answering_for_another_block_is_silently_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    from hookscope._core.site_index import SiteIndex

    lookup = SiteIndex._std_site
    monkeypatch.setattr(
        SiteIndex, "_std_site", lambda self, key: lookup(self, "std:blocks.1" if key == "std:blocks.0" else key)
    )
    report = hs.verify(attention_gpt2("sdpa"), attention_tokens(), checks=["std"], compile=False)
    row = next(r for r in report if r.check == "std names" and r.subject == "resolved")
    assert row.status == "SILENTLY_WRONG", report.table()
    assert "std:blocks.0 is not the raw value at h.0" in row.detail


@pytest.mark.slow
def test_the_compile_check_leaves_no_compiled_code_behind_when_none_was_there() -> None:
    """Dynamo's code for the model's classes would make every later hook run the model eagerly,
    with a StaleCompiledCodeWarning; the check clears what it compiled."""
    import warnings

    torch.compiler.reset()
    model, x = track(SharedTwice()), torch.randn(2, 4)
    report = hs.verify(model, x, checks=["compile"])
    assert statuses(report, "torch.compile") == {"SUPPORTED"}
    with warnings.catch_warnings():
        warnings.simplefilter("error", hs.StaleCompiledCodeWarning)
        with hs.capture(model, "shared") as cap:
            model(x)
    assert len(cap.calls("shared")) == 2


class MasksWithInfinity(nn.Module):
    """Masks logits with -inf, as Grounding DINO's encoder class head does."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.fc(x)
        return logits.masked_fill(torch.arange(6) >= 4, float("-inf"))


def test_statistics_of_values_with_infinities_are_checked_over_every_value() -> None:
    """The sweep's Grounding DINO row: min is -inf there, as hs.Stats documents (over all values)."""
    report = hs.verify(track(MasksWithInfinity()), torch.randn(3, 4), checks=["trace"], compile=False)
    row = next(r for r in report if r.check == "trace calls and statistics")
    assert row.status == "SUPPORTED", report.table()


@pytest.mark.slow
def test_code_compiled_before_from_the_model_s_class_makes_the_compile_check_a_refusal() -> None:
    torch.compiler.reset()
    x = torch.randn(2, 4)
    other = track(SharedTwice())
    torch.compile(other, backend="eager")(x)  # the class's forward now has compiled code
    try:
        report = hs.verify(track(SharedTwice()), x, checks=["compile"])
    finally:
        torch.compiler.reset()
    row = next(r for r in report if r.check == "torch.compile")
    assert row.status == "REFUSED", report.table()
    assert "Dynamo already holds code compiled from this model's classes" in row.detail

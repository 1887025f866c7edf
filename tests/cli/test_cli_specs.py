"""Model specs and sample inputs from command-line text, and the ``layers`` command built on them."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope.cli.parse.specs import load_model, make_input, parse_shape
from hookscope.demo.models import SmallCNN
from hookscope.errors import SpecError, UnsupportedModelError
from hookscope.tensors import parse_dtype
from tests.cli.test_cli import run_cli

GPT2 = "hf-config:gpt2?n_layer=2&n_embd=32&n_head=2&vocab_size=64&n_positions=32&bos_token_id=0&eos_token_id=0"
BERT = "hf-config:bert?num_hidden_layers=1&hidden_size=32&num_attention_heads=2&intermediate_size=64&vocab_size=64"
VIT = (
    "hf-config:vit?num_hidden_layers=1&hidden_size=32&num_attention_heads=2&intermediate_size=64"
    "&image_size=32&patch_size=8"
)

FACTORIES = """
import torch
from torch import nn
from specs_test_helper import WIDTH  # a sibling module: importable while the file runs, as with `python file.py`

def build():
    return nn.Sequential(nn.Linear(WIDTH, 3), nn.Dropout(0.5))

class Builder:
    @staticmethod
    def build():
        return nn.Linear(WIDTH, 2)

instance = nn.Linear(2, 2)
number = 3

def broken():
    raise ValueError("no weights here")

def returns_int():
    return 7

def scripted():
    return torch.jit.script(nn.Linear(2, 2))
"""


@pytest.fixture
def factories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A folder with ``factories.py`` (and a sibling it imports), made the current directory."""
    (tmp_path / "factories.py").write_text(FACTORIES)
    (tmp_path / "specs_test_helper.py").write_text("WIDTH = 4\n")
    monkeypatch.chdir(tmp_path)
    yield tmp_path / "factories.py"
    sys.modules.pop("specs_test_helper", None)  # the next test's tmp_path has its own copy


# --- load_model: each form ---------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["demo:cnn", "hookscope.demo.models:SmallCNN", "  demo:cnn  "])
def test_demo_and_module_specs_build_a_small_cnn_in_eval_mode(spec: str) -> None:
    model = load_model(spec)
    assert type(model) is SmallCNN
    assert not model.training


def test_file_spec_calls_the_factory_relative_to_the_current_directory(factories: Path) -> None:
    model = load_model("factories.py:build")
    assert isinstance(model, nn.Sequential)
    assert model[0].in_features == 4  # the sibling import ran
    assert not model[1].training  # dropout off: eval mode reaches every submodule


def test_file_spec_accepts_an_absolute_path_and_a_dotted_attribute(factories: Path) -> None:
    model = load_model(f"{factories}:Builder.build")
    assert isinstance(model, nn.Linear)
    assert model.out_features == 2


def test_a_module_instance_is_used_as_it_is(factories: Path) -> None:
    first, second = load_model("factories.py:instance"), load_model("factories.py:instance")
    assert isinstance(first, nn.Linear)
    assert first is not second  # the file is loaded afresh under its own private module name


@pytest.mark.transformers
def test_hf_config_builds_random_weights_with_overrides() -> None:
    gpt2 = load_model(GPT2)
    assert type(gpt2).__name__ == "GPT2Model"
    config: Any = gpt2.config  # transformers' config type, without importing transformers here
    assert (config.n_layer, config.n_embd, config.vocab_size) == (2, 32, 64)
    assert not gpt2.training
    bert = load_model(BERT)
    assert type(bert).__name__ == "BertModel"
    assert getattr(bert.config, "num_hidden_layers", None) == 1


@pytest.mark.transformers
def test_hf_config_override_values_are_typed() -> None:
    model = load_model(GPT2 + "&layer_norm_epsilon=0.001&scale_attn_weights=false&activation_function=relu")
    config: Any = model.config
    assert config.layer_norm_epsilon == pytest.approx(0.001)
    assert config.scale_attn_weights is False
    assert config.activation_function == "relu"


# --- load_model: bad specs -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "hints"),
    [
        ("demo", ["names no factory", "'package.module:factory'", "'hf-config:<model_type>"]),
        ("hookscope.demo.models:", ["names no factory"]),
        ("demo:rnn", ["no demo model 'rnn'", "known demo models: cnn"]),
        ("nope_module_xyz:build", ["module 'nope_module_xyz' cannot be imported", "No module named", "'demo:<name>'"]),
        ("hf_config:gpt2", ["did you mean 'hf-config:...'?"]),
        ("hookscope.demo.models:SmallCNNN", ["'hookscope.demo.models' has no attribute 'SmallCNNN'", "'SmallCNN'"]),
        ("hookscope.demo.models:SmallCNN.nope", ["'hookscope.demo.models:SmallCNN' has no attribute 'nope'"]),
        ("missing.py:build", ["file 'missing.py' not found", "relative to the current directory"]),
        ("torch.nn:Linear", ["factory 'Linear' raised TypeError", "called with no arguments"]),
        ("hookscope.errors:__doc__", ["'__doc__' is str", "a factory function"]),
        ("hf-config:gtp2", ["transformers knows no model_type 'gtp2'", "did you mean 'gpt2'"]),
        ("hf-config:gpt2?n_layer", ["override 'n_layer' is not key=value"]),
        pytest.param(
            "hf-config:gpt2?n_embd=30&n_head=4",
            ["building 'gpt2' raised", "check the overrides"],
            marks=pytest.mark.transformers,
        ),
    ],
)
def test_bad_specs_say_what_was_given_and_how_to_fix_it(spec: str, hints: list[str]) -> None:
    with pytest.raises(SpecError) as caught:
        load_model(spec)
    message = str(caught.value)
    assert message.startswith(f"model {spec.strip()!r}: ")
    assert "\n" not in message
    for hint in hints:
        assert hint in message


@pytest.mark.parametrize(
    ("attribute", "hint"),
    [
        ("broken", "factory 'broken' raised ValueError: no weights here"),
        ("returns_int", "factory returned int; expected a torch.nn.Module"),
        ("number", "'number' is int"),
        ("nothing", "'factories.py' has no attribute 'nothing'"),
        ("Builder.nothing", "'factories.py:Builder' has no attribute 'nothing'; known: build"),
    ],
)
def test_bad_factories_in_a_file(factories: Path, attribute: str, hint: str) -> None:
    with pytest.raises(SpecError, match=hint):
        load_model(f"factories.py:{attribute}")


def test_a_file_that_fails_to_run_is_named(tmp_path: Path) -> None:
    (tmp_path / "bad.py").write_text("raise RuntimeError('half written')\n")
    with pytest.raises(SpecError, match=r"running file '.*bad.py' raised RuntimeError: half written"):
        load_model(f"{tmp_path / 'bad.py'}:build")


def test_a_torchscript_result_is_unsupported(factories: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="TorchScript"):
        load_model("factories.py:scripted")


# --- parse_shape, parse_dtype --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "shape"),
    [("1x3x32x32", (1, 3, 32, 32)), ("1,16", (1, 16)), (" 2 X 4 ", (2, 4)), ("(1, 8)", (1, 8)), ("5", (5,))],
)
def test_parse_shape(text: str, shape: tuple[int, ...]) -> None:
    assert parse_shape(text) == shape


@pytest.mark.parametrize("text", ["", "1x", "1xax3", "1x-3", "1x0", "1.5x2"])
def test_parse_shape_refuses(text: str) -> None:
    with pytest.raises(SpecError, match=r"e\.g\. 1x3x224x224"):
        parse_shape(text)


@pytest.mark.parametrize(
    ("text", "dtype"),
    [
        ("float32", torch.float32),
        ("FP32", torch.float32),
        ("f32", torch.float32),
        ("fp16", torch.float16),
        ("half", torch.float16),
        ("float16", torch.float16),
        ("bf16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        ("float64", torch.float64),
        ("torch.float64", torch.float64),
    ],
)
def test_parse_dtype(text: str, dtype: torch.dtype) -> None:
    assert parse_dtype(text) == dtype


@pytest.mark.parametrize("text", ["int8", "fp8", ""])
def test_parse_dtype_refuses(text: str) -> None:
    with pytest.raises(SpecError, match="expected one of float32, fp32"):
        parse_dtype(text)


# --- make_input ----------------------------------------------------------------------------------


def test_cnn_gets_its_example_shape_and_a_seeded_input() -> None:
    model = load_model("demo:cnn")
    args, kwargs = make_input(model, None)
    assert kwargs == {}
    assert args[0].shape == (1, 3, 32, 32)
    assert model(*args).shape == (1, 10)
    assert torch.equal(args[0], make_input(model, None)[0][0])
    assert not torch.equal(args[0], make_input(model, None, seed=1)[0][0])


def test_explicit_shape_and_dtype() -> None:
    model = load_model("demo:cnn").to(torch.bfloat16)
    args, _ = make_input(model, "2x3x8x8", dtype="bf16")
    assert args[0].dtype == torch.bfloat16
    assert model(*args).shape == (2, 10)


def test_a_class_can_declare_its_example_input_shape() -> None:
    class Declared(nn.Linear):
        example_input_shape = (3, 5)

    args, _ = make_input(Declared(5, 2), None)
    assert args[0].shape == (3, 5)


def test_no_default_input_asks_for_a_shape() -> None:
    with pytest.raises(SpecError, match=r"pass --input-shape, e\.g\. 1x3x224x224"):
        make_input(nn.Linear(4, 2), None)
    args, _ = make_input(nn.Linear(4, 2), "2x4")
    assert args[0].shape == (2, 4)


@pytest.mark.transformers
def test_token_model_gets_input_ids_within_the_vocabulary() -> None:
    model = load_model(GPT2)
    args, kwargs = make_input(model, None, dtype="bf16")  # dtype leaves token ids alone
    ids = kwargs["input_ids"]
    assert args == ()
    assert (ids.shape, ids.dtype) == ((1, 16), torch.int64)
    assert int(ids.min()) >= 0
    assert int(ids.max()) < 64
    assert model(**kwargs).last_hidden_state.shape == (1, 16, 32)
    _, kwargs = make_input(model, "2x8")
    assert model(**kwargs).last_hidden_state.shape == (2, 8, 32)
    with pytest.raises(SpecError, match="batch x sequence"):
        make_input(model, "1x3x8")


@pytest.mark.transformers
def test_pixel_model_gets_pixel_values_of_its_configured_size() -> None:
    model = load_model(VIT)
    args, kwargs = make_input(model, None)
    assert args == ()
    assert kwargs["pixel_values"].shape == (1, 3, 32, 32)
    assert model(**kwargs).last_hidden_state.shape == (1, 17, 32)


# --- the layers command --------------------------------------------------------------------------


def test_layers_demo_cnn_counts_calls(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "layers", "demo:cnn")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "input: (1, 3, 32, 32) float32"
    assert lines[1].split() == ["name", "class", "params", "calls"]
    assert "conv1    Conv2d                 448       1" in out
    assert "5 modules · 618 parameters (618 trainable)" in out


def test_layers_no_run_and_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "layers", "demo:cnn", "--no-run")
    assert code == 0
    assert out.splitlines()[0].split() == ["name", "class", "params"]
    code, out, err = run_cli(capsys, "layers", "demo:cnn", "--dtype", "bf16", "--input-shape", "2x3x8x8")
    assert code == 0, err
    assert out.startswith("input: (2, 3, 8, 8) bfloat16\n")


@pytest.mark.transformers
def test_layers_hf_config_gpt2(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "layers", GPT2)
    assert code == 0, err
    assert out.startswith("input: input_ids (1, 16) int64\n")
    assert "h.1.mlp.c_fc" in out
    assert "32 modules" in out


def test_layers_without_a_default_input_lists_modules_and_says_why(
    capsys: pytest.CaptureFixture[str], factories: Path
) -> None:
    code, out, err = run_cli(capsys, "layers", "factories.py:build")
    assert code == 0
    assert out.splitlines()[0].split() == ["name", "class", "params"]
    assert err.startswith("note: no calls counted;")
    code, out, _ = run_cli(capsys, "layers", "factories.py:build", "-s", "2x4")
    assert code == 0
    assert out.splitlines()[1].split() == ["name", "class", "params", "calls"]


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["nope:x"], "module 'nope' cannot be imported"),
        (["demo:cnn", "--input-shape", "1x4"], "the forward pass on the sample input raised RuntimeError"),
        (["demo:cnn", "--dtype", "int8"], "dtype 'int8' is not understood"),
        (["demo:cnn", "--no-run", "-s", "1x3x8x8"], "--no-run and --input-shape contradict"),
    ],
)
def test_layers_bad_input_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], hint: str
) -> None:
    code, out, err = run_cli(capsys, "layers", *argv)
    assert code == 2
    assert len(err.splitlines()) == 1
    assert err.startswith("error: ")
    assert hint in err
    assert "Traceback" not in out + err


@pytest.mark.parametrize(
    ("spec", "hint"),
    [
        ("builtins:exit", "calling 'exit' raised SystemExit(None): it ends the program"),
        ("builtins:len", "'len' is the builtin function len(), not a model factory"),
        ("os:getcwd", "'getcwd' is the builtin function getcwd(), not a model factory"),
        ("pathlib:Path", "'Path' is the class pathlib.Path, which is not a torch.nn.Module subclass"),
        ("factories.py:Builder", "'Builder' is the class Builder, which is not a torch.nn.Module subclass"),
    ],
)
def test_a_spec_that_names_no_model_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], factories: Path, spec: str, hint: str
) -> None:
    code, out, err = run_cli(capsys, "layers", spec)
    assert code == 2
    assert err.splitlines() == [err.strip()]
    assert err.startswith(f"error: model {spec!r}: ")
    assert hint in err
    assert "expected" in err or "name an nn.Module, an nn.Module subclass or a factory function" in err
    assert out == ""


# --- hf-config: checked overrides, list values, heads --------------------------------------------


@pytest.mark.transformers
def test_hf_config_refuses_an_override_that_names_no_config_field() -> None:
    with pytest.raises(SpecError) as caught:
        load_model("hf-config:gpt2?n_layers=2")  # typo for n_layer: would build the full 12-layer model
    message = str(caught.value)
    assert message.startswith("model 'hf-config:gpt2?n_layers=2': GPT2Config has no field 'n_layers'")
    assert "did you mean 'n_layer'" in message


@pytest.mark.transformers
def test_hf_config_accepts_aliases_and_init_keywords() -> None:
    config: Any = load_model("hf-config:gpt2?num_hidden_layers=1&hidden_size=16&n_head=2&vocab_size=64").config
    assert (config.n_layer, config.n_embd) == (1, 16)


@pytest.mark.transformers
def test_hf_config_list_values() -> None:
    model = load_model("hf-config:resnet?hidden_sizes=[16,32]&depths=[1,1]&embedding_size=8")
    config: Any = model.config
    assert list(config.hidden_sizes) == [16, 32]
    assert list(config.depths) == [1, 1]
    assert model.encoder.stages[1].layers[0].shortcut.convolution.out_channels == 32  # type: ignore[union-attr,index]


@pytest.mark.transformers
@pytest.mark.parametrize(
    ("spec", "cls"),
    [
        (GPT2.replace("gpt2?", "gpt2/causal-lm?"), "GPT2LMHeadModel"),
        (BERT.replace("bert?", "bert/masked-lm?"), "BertForMaskedLM"),
        (BERT.replace("bert?", "bert/sequence-classification?"), "BertForSequenceClassification"),
        (VIT.replace("vit?", "vit/image-classification?"), "ViTForImageClassification"),
        (GPT2.replace("gpt2?", "gpt2/base?"), "GPT2Model"),
    ],
)
def test_hf_config_head_picks_the_auto_class(spec: str, cls: str) -> None:
    assert type(load_model(spec)).__name__ == cls


@pytest.mark.transformers
@pytest.mark.parametrize(
    ("spec", "hints"),
    [
        ("hf-config:gpt2/lm", ["no head 'lm'", "heads: base, causal-lm, masked-lm, seq2seq-lm"]),
        ("hf-config:gpt2/seq2seq-lm", ["'gpt2' has no 'seq2seq-lm' head", "its heads: base, causal-lm"]),
    ],
)
def test_hf_config_refuses_an_unknown_head(spec: str, hints: list[str]) -> None:
    with pytest.raises(SpecError) as caught:
        load_model(spec)
    for hint in hints:
        assert hint in str(caught.value)


@pytest.mark.transformers
def test_edit_of_a_causal_lm_head_compares_logits(capsys: pytest.CaptureFixture[str]) -> None:
    spec = GPT2.replace("gpt2?", "gpt2/causal-lm?")
    code, out, err = run_cli(capsys, "edit", spec, "-e", "transformer.h.0.mlp=zero")
    assert code == 0, err
    assert "output.logits (1, 16, 64)" in out


def test_help_states_the_hf_config_grammar(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "layers", "--help")
    assert code == 0
    text = " ".join(out.replace("│", " ").split())
    assert "hf-config:<model_type>/<head>?key=value&..." in text
    assert "hidden_sizes=[16,32]" in text
    assert "causal-lm" in text


@pytest.mark.transformers
def test_sample_input_feeds_a_speech_model_its_features_and_decoder_start_tokens() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.WhisperConfig(
        d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=100, num_mel_bins=8, max_source_positions=16,
        max_target_positions=32, pad_token_id=0, decoder_start_token_id=7, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = transformers.WhisperForConditionalGeneration(config).eval()
    assert hs.default_input_shape(model) == (1, 8, 32)  # the convolutions halve 32 frames to 16 positions
    args, kwargs = hs.sample_input(model)
    assert args == ()
    assert kwargs["input_features"].shape == (1, 8, 32)
    assert kwargs["decoder_input_ids"].tolist() == [[7, 7, 7, 7]]
    with torch.no_grad():
        assert model(**kwargs).logits.shape == (1, 4, 100)
    assert make_input(model, None)[1]["input_features"].shape == (1, 8, 32)  # the command line's too

"""Encoder-decoder models (T5) on the command line: the sample input holds a decoder input too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import hookscope as hs
from hookscope.cli.parse.data_specs import RandomRows
from hookscope.cli.parse.specs import load_model, make_input
from hookscope.io import load_tensors
from tests.cli.test_cli import run_cli

pytestmark = pytest.mark.transformers

T5 = "hf-config:t5?d_model=16&num_layers=1&num_heads=2&d_ff=32&d_kv=8&vocab_size=64"


def test_sample_input_has_decoder_start_tokens_and_the_model_runs_on_it() -> None:
    model = load_model(T5)
    config: Any = model.config
    args, kwargs = make_input(model, "2x10")
    assert args == ()
    assert set(kwargs) == {"input_ids", "decoder_input_ids"}
    assert kwargs["input_ids"].shape == (2, 10)
    decoder = kwargs["decoder_input_ids"]
    assert decoder.shape == (2, 4)
    assert bool((decoder == config.pad_token_id).all())  # T5 starts its decoder with its pad token
    with torch.no_grad():
        output = model(**kwargs)
    assert output.last_hidden_state.shape == (2, 4, 16)
    assert output.encoder_last_hidden_state.shape == (2, 10, 16)


def test_a_short_encoder_input_gets_a_decoder_input_no_longer() -> None:
    _, kwargs = make_input(load_model(T5), "1x2")
    assert kwargs["decoder_input_ids"].shape == (1, 2)


def test_layers_counts_encoder_and_decoder_calls(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "layers", T5)
    assert code == 0, err
    assert out.startswith("input: input_ids (1, 16) int64, decoder_input_ids (1, 4) int64\n")
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:] if line.strip()}
    assert rows["encoder.block.0"][-1] == "1"
    assert rows["decoder.block.0"][-1] == "1"


def test_capture_of_a_decoder_layer(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "t5.safetensors"
    code, _, err = run_cli(
        capsys, "capture", T5, "-l", "decoder.final_layer_norm,encoder.final_layer_norm", "-o", str(out)
    )
    assert code == 0, err
    tensors, _ = load_tensors(out)
    shapes = {key.split("#")[0]: tuple(value.shape) for key, value in tensors.items()}
    assert shapes == {"decoder.final_layer_norm": (1, 4, 16), "encoder.final_layer_norm": (1, 16, 16)}


def test_trace_runs_through_the_decoder(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "trace", T5, "-s", "1x8")
    assert code == 0, err
    decoder_rows = [line for line in out.splitlines() if " decoder.block.0 " in line]
    assert decoder_rows
    assert "[1, 4, 16]" in decoder_rows[0]
    assert "[1, 8, 16]" in next(line for line in out.splitlines() if " encoder.block.0 " in line)


def test_extract_random_tokens_matches_a_plain_forward(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "t5.zarr"
    argv = ["extract", T5, "--data", "random:12:6", "-l", "decoder.final_layer_norm", "-o", str(out), "-b", "4"]
    code, _, err = run_cli(capsys, *argv, "--no-progress")
    assert code == 0, err
    torch.manual_seed(0)  # extract's --seed: the same random weights
    model = load_model(T5)
    input_ids = RandomRows(12, (6,), seed=0, vocab_size=64).__getitems__(range(12))
    seen: list[torch.Tensor] = []
    handle = model.get_submodule("decoder.final_layer_norm").register_forward_hook(lambda m, i, o: seen.append(o))
    with torch.no_grad():
        model(input_ids=input_ids, decoder_input_ids=torch.zeros(12, 4, dtype=torch.long))
    handle.remove()
    stored = hs.open_store(out)["decoder.final_layer_norm"][:]
    torch.testing.assert_close(torch.from_numpy(stored), seen[0])


T5_LM = "hf-config:t5/seq2seq-lm?d_model=16&num_layers=2&num_heads=2&d_ff=32&d_kv=8&vocab_size=64"


def lens_rows(out: str) -> dict[str, list[int]]:
    """Layer name -> the token ids the lens table prints for it."""
    rows = {}
    for line in out.splitlines():
        cells = line.split()
        if cells and cells[0].startswith(("decoder.blocks.", "blocks.", "encoder.blocks.")):
            rows[cells[0]] = [int(token) for token in cells[1::2]]
    return rows


@pytest.mark.slow
@pytest.mark.parametrize(
    ("argv", "decoder_ids"),
    [
        (["--decoder-prompt", "0,5,6;0,9,10", "--position", "1", "--row", "1"], [[0, 5, 6], [0, 9, 10]]),
        (["--stack", "decoder."], [[0], [0]]),  # no decoder ids: its start token (T5's pad id, 0), one per row
        ([], [[0], [0]]),  # an encoder-decoder's decoder is the default stack
    ],
)
def test_lens_reads_an_encoder_decoders_decoder(
    capsys: pytest.CaptureFixture[str], argv: list[str], decoder_ids: list[list[int]]
) -> None:
    code, out, err = run_cli(capsys, "lens", T5_LM, "--prompt", "5,6,7,8;9,10,11,12", "--top", "3", *argv)
    assert code == 0, err
    rows = lens_rows(out)
    assert list(rows) == ["decoder.blocks.0.resid_post", "decoder.blocks.1.resid_post"]
    torch.manual_seed(0)  # the command's --seed: the same random weights
    model = load_model(T5_LM)
    with torch.no_grad():
        logits = model(
            input_ids=torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]]), decoder_input_ids=torch.tensor(decoder_ids)
        ).logits
    row, position = (1, 1) if "--row" in argv else (0, -1)
    assert rows["decoder.blocks.1.resid_post"] == logits[row, position].topk(3).indices.tolist()
    assert "x 0.25" in out  # T5's d_model ** -0.5 before its tied head, applied and said


@pytest.mark.parametrize(
    ("model", "argv", "message"),
    [
        (T5_LM, ["--decoder-prompt", "0,1;0,2"], "--decoder-prompt has 2 rows and --prompt 1"),
        (T5_LM, ["--position", "2"], "--position 2: the decoder's input (its start token"),
        (T5_LM, ["--decoder-prompt", "0,1", "--position", "2"], "--position 2: --decoder-prompt has 2 positions"),
        (
            "hf-config:gpt2/causal-lm?n_layer=1&n_embd=16&n_head=2&vocab_size=32&bos_token_id=0&eos_token_id=0",
            ["--decoder-prompt", "0"],
            "not an",
        ),
    ],
)
def test_bad_encoder_decoder_lens_input_is_a_one_line_error(
    capsys: pytest.CaptureFixture[str], model: str, argv: list[str], message: str
) -> None:
    code, _, err = run_cli(capsys, "lens", model, "--prompt", "5,6,7,8", *argv)
    assert code == 2
    assert message in err
    assert "Traceback" not in err

"""``hookscope patch`` and the list options of every command: regex selectors in --sites, --num-heads,
what --verify found, an encoder-decoder's --stack and --decoder-prompt, and errors in the command's
own flag names, against the library."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope.cli.parse.specs import load_model
from tests.cli.test_cli import run_cli
from tests.cli.test_cli_methods import CLEAN, CLEAN_IDS, CORRUPTED, CORRUPTED_IDS, MODEL, gpt2, table_rows

__all__ = ["gpt2"]  # the fixture, used by name

pytestmark = [pytest.mark.transformers]


def test_split_selectors_keeps_a_comma_inside_brackets() -> None:
    from hookscope.cli.parse.method_specs import split_selectors

    assert split_selectors([r"re:h\.[0-9]{1,2}\.attn, std:blocks.0.resid_pre", "mlp"]) == [
        r"re:h\.[0-9]{1,2}\.attn",
        "std:blocks.0.resid_pre",
        "mlp",
    ]
    assert split_selectors([r"re:h\.(0|1)$,h.[0,1].mlp", r"re:a\(,b"]) == [
        r"re:h\.(0|1)$",
        "h.[0,1].mlp",
        r"re:a\(",
        "b",
    ]
    assert split_selectors([r"re:x[,]y", " , "]) == [r"re:x[,]y"]


@pytest.mark.slow
def test_a_regex_with_a_comma_in_sites_is_one_selector(capsys: pytest.CaptureFixture[str], gpt2: nn.Module) -> None:
    code, out, err = run_cli(
        capsys, "patch", MODEL, "--clean", CLEAN, "--corrupted", CORRUPTED, "-m", "logit_diff:3,4",
        "--sites", r"re:transformer\.h\.[01]{1,1}$,transformer.ln_f", "--top", "12",
    )  # fmt: skip
    assert code == 0, err
    expected = hs.methods.patch_sweep(
        gpt2, CLEAN_IDS, CORRUPTED_IDS, metric=hs.methods.logit_diff(3, 4),
        layers=["transformer.h.0", "transformer.h.1", "transformer.ln_f"],
    )  # fmt: skip
    rows = table_rows(out, 3)
    assert [(site, int(position)) for site, position, _ in rows] == [labels for labels, _ in expected.top(12)]
    assert {site for site, _, _ in rows} == {"transformer.h.0", "transformer.h.1", "transformer.ln_f"}


@pytest.mark.slow
def test_num_heads_splits_a_merged_value(capsys: pytest.CaptureFixture[str], gpt2: nn.Module) -> None:
    argv = ["--clean", CLEAN, "--corrupted", CORRUPTED, "-m", "logit_diff:3,4", "--heads", "--top", "16"]
    merged = "transformer.h.*.attn.c_proj:input[0]"
    code, out, err = run_cli(capsys, "patch", MODEL, *argv, "--sites", merged, "--num-heads", "2")
    assert code == 0, err
    assert out.startswith("patch_sweep (denoise) of logit_diff(3, 4): 2 x 2 x 4 cells")  # 2 heads, 4 positions
    expected = hs.methods.patch_sweep(
        gpt2, CLEAN_IDS, CORRUPTED_IDS, metric=hs.methods.logit_diff(3, 4), layers=merged, heads=True, num_heads=2
    )
    rows = table_rows(out, 4)
    assert [(site, int(head), int(position)) for site, head, position, _ in rows] == [c for c, _ in expected.top(16)]
    code, _, err = run_cli(capsys, "patch", MODEL, *argv, "--sites", merged)
    assert code == 2
    assert "give --num-heads (this model's config says num_attention_heads=2)" in err
    code, _, err = run_cli(capsys, "patch", MODEL, *argv[:6], "--sites", merged, "--num-heads", "2")
    assert code == 2
    assert "--num-heads 2 reads a merged value's last dim as heads, which only --heads uses" in err
    assert "num_heads=" not in err


@pytest.mark.slow
def test_verify_says_when_no_cell_flips(capsys: pytest.CaptureFixture[str], gpt2: nn.Module) -> None:
    code, out, err = run_cli(
        capsys, "patch", MODEL, "--clean", CLEAN, "--corrupted", CORRUPTED, "-m", "logit_diff:3,4", "--atp",
        "--verify", "5",
    )  # fmt: skip
    assert code == 0, err
    expected = hs.methods.attribution_patch(
        gpt2, CLEAN_IDS, CORRUPTED_IDS, metric=hs.methods.logit_diff(3, 4), verify=5
    )
    assert expected.flags == []
    assert len(expected.verified) == 5
    assert "verified: no flag; the 5 largest cells patched exactly agree in sign with the estimate" in out
    assert "flag: " not in out


T5 = "hf-config:t5/seq2seq-lm?d_model=16&num_layers=2&num_heads=2&d_ff=32&d_kv=8&vocab_size=64"


@pytest.mark.slow
def test_patch_reads_an_encoder_decoders_stack_and_names_its_own_flags(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--clean", CLEAN, "--corrupted", CORRUPTED, "-m", "logit_diff:3,4"]
    code, _, err = run_cli(capsys, "patch", T5, *argv)
    assert code == 2
    assert "pass --stack decoder. (or another of them), or --layers" in err
    assert "stack=" not in err
    decoded = ["--stack", "decoder", "--decoder-prompt", "0,3;0,4", "-k", "4"]  # decoder: no dot
    code, out, err = run_cli(capsys, "patch", T5, *argv, *decoded)
    assert code == 0, err
    torch.manual_seed(0)
    model = load_model(T5)
    decoder = torch.tensor([[0, 3], [0, 4]])
    expected = hs.methods.patch_sweep(
        model, {"input_ids": CLEAN_IDS, "decoder_input_ids": decoder},
        {"input_ids": CORRUPTED_IDS, "decoder_input_ids": decoder}, metric=hs.methods.logit_diff(3, 4),
        stack="decoder.",
    )  # fmt: skip
    assert out.startswith("patch_sweep (denoise) of logit_diff(3, 4): 2 x 2 cells")  # 2 blocks x 2 decoder positions
    rows = table_rows(out, 3)
    assert [(site, int(position), float(v)) for site, position, v in rows] == [
        (site, position, round(value, 3)) for (site, position), value in expected.top(4)
    ]
    code, _, err = run_cli(
        capsys, "patch", T5, *argv, "--stack", "decoder.", "--sites", "std:decoder.blocks.0.resid_pre"
    )
    assert code == 2
    assert "--stack decoder. picks the default sites, and --layers names its own: drop --stack" in err


@pytest.mark.slow
def test_lens_reads_stack_without_its_dot_before_checking_positions(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["lens", T5, "--prompt", "5,6,7,8", "--decoder-prompt", "0", "--position", "3"]
    code, out, err = run_cli(capsys, *argv, "--stack", "encoder")  # position 3 of the encoder's 4, not the decoder's 1
    assert code == 0, err
    code, dotted, err = run_cli(capsys, *argv, "--stack", "encoder.")
    assert code == 0, err
    assert out == dotted
    assert "encoder.blocks.1.resid_post" in out


@pytest.mark.slow
def test_list_options_keep_a_comma_inside_brackets(capsys: pytest.CaptureFixture[str], gpt2: nn.Module) -> None:
    code, out, err = run_cli(capsys, "trace", MODEL, "--filter", r"re:^transformer\.h\.[0-9]{1,2}$")
    assert code == 0, err
    shown = [line.split()[1] for line in out.splitlines() if re.match(r"\s*\d+\s+transformer", line)]
    assert shown == ["transformer.h.0", "transformer.h.1"]
    code, out, err = run_cli(capsys, "lens", MODEL, "--prompt", "5,6,7", "--layers", "blocks.[0,1].resid_post")
    assert code == 0, err
    expected = hs.methods.logit_lens(gpt2, torch.tensor([[5, 6, 7]]), layers="std:blocks.[0,1].resid_post")
    assert expected.layers == ["blocks.0.resid_post", "blocks.1.resid_post"]
    assert [row[0] for row in table_rows(out, 2)] == expected.layers

"""``hookscope patch`` and ``hookscope lens``: the same numbers as the library calls, the HTML page,
and bad ids, metrics and positions as one-line errors with exit code 2."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope.cli.parse.method_specs import parse_ids, parse_metric, parse_positions
from hookscope.cli.parse.specs import load_model
from hookscope.errors import SpecError
from tests.cli.test_cli import run_cli

#: The smallest GPT-2 with an LM head: 2 blocks, 2 heads, 64 tokens (ids inside it: no warnings).
MODEL = (
    "hf-config:gpt2/causal-lm?n_layer=2&n_embd=32&n_head=2&vocab_size=64&n_positions=16&bos_token_id=0&eos_token_id=0"
)
CLEAN, CORRUPTED = "5,6,7,8;9,10,11,12", "5,20,7,8;9,21,11,12"
CLEAN_IDS = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
CORRUPTED_IDS = torch.tensor([[5, 20, 7, 8], [9, 21, 11, 12]])

transformers_cli = [pytest.mark.transformers, pytest.mark.slow]


@pytest.fixture(scope="module")
def gpt2() -> nn.Module:
    """The model the CLI builds from MODEL with its default --seed 0."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    return load_model(MODEL)


def table_rows(out: str, columns: int) -> list[list[str]]:
    """The data rows of a printed table: the lines after the rule, split where 3 spaces part the columns."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if re.fullmatch(r"-+", line)) + 1
    rows = []
    for line in lines[start:]:
        cells = re.split(r"\s{3,}", line.strip())
        if len(cells) != columns:
            break
        rows.append(cells)
    return rows


@pytest.mark.transformers
@pytest.mark.slow
def test_patch_prints_the_library_sweep_and_writes_one_html_page(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, gpt2: nn.Module
) -> None:
    page = tmp_path / "out" / "sweep.html"
    code, out, err = run_cli(
        capsys, "patch", MODEL, "--clean", CLEAN, "--corrupted", CORRUPTED, "-m", "logit_diff:3,4", "--top", "5",
        "--out", str(page),
    )  # fmt: skip
    assert code == 0, err
    expected = hs.methods.patch_sweep(gpt2, CLEAN_IDS, CORRUPTED_IDS, metric=hs.methods.logit_diff(3, 4))
    assert out.splitlines()[0].startswith("patch_sweep (denoise) of logit_diff(3, 4): 2 x 4 cells")
    rows = table_rows(out, 3)
    assert len(rows) == 5
    (site, position), value = expected.top(1)[0]
    assert rows[0] == [site, str(position), f"{value:+.3f}"]
    assert [(r[0], int(r[1])) for r in rows] == [labels for labels, _ in expected.top(5)]
    assert f"wrote {page}" in out
    text = page.read_text()
    assert text.startswith("<!doctype html>")
    assert '<img alt="patch_sweep heatmap" src="data:image/png;base64,' in text
    for label in expected.coords["site"]:
        assert f"<td>{label}</td>" in text
    assert "n_layer=2&amp;n_embd=32" in text  # escaped, the & of the model spec too
    assert text.count("<tr><td>") == expected.values.numel()  # every cell


@pytest.mark.transformers
@pytest.mark.slow
def test_patch_atp_by_head_writes_every_cell_to_csv(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, gpt2: nn.Module
) -> None:
    table = tmp_path / "atp.csv"
    code, out, err = run_cli(
        capsys, "patch", MODEL, "--clean", CLEAN, "--corrupted", CORRUPTED, "-m", "logprob:8", "--heads",
        "--positions", "1,3", "--atp", "--verify", "2", "-o", str(table),
    )  # fmt: skip
    assert code == 0, err
    expected = hs.methods.attribution_patch(
        gpt2, CLEAN_IDS, CORRUPTED_IDS, metric=hs.methods.logprob(8), heads=True, positions=[1, 3], verify=2
    )
    assert out.startswith("attribution_patch (denoise) of logprob(8): 2 x 2 x 2 cells")
    with table.open() as file:
        written = list(csv.DictReader(file))
    assert [(r["site"], int(r["head"]), int(r["position"])) for r in written] == [c for c, _ in expected.cells()]
    assert [float(r["effect"]) for r in written] == pytest.approx([v for _, v in expected.cells()], abs=1e-9)
    assert [line for line in out.splitlines() if line.startswith("flag: ")] == [
        f"flag: {flag} (the estimate and the exact patch disagree in sign)" for flag in expected.flags
    ]


@pytest.mark.transformers
@pytest.mark.slow
def test_lens_prints_each_layer_and_the_library_top_tokens(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, gpt2: nn.Module
) -> None:
    picture = tmp_path / "lens.png"
    code, out, err = run_cli(
        capsys, "lens", MODEL, "--prompt", CLEAN, "--top", "3", "--position", "2", "-o", str(picture)
    )
    assert code == 0, err
    lens = hs.methods.logit_lens(gpt2, CLEAN_IDS)
    rows = table_rows(out, 2)
    assert [name for name, _ in rows] == lens.layers == ["blocks.0.resid_post", "blocks.1.resid_post"]
    for (_, tokens), best in zip(rows, lens.top(3, position=2), strict=True):
        assert [int(token) for token in tokens.split()[::2]] == [token for token, _ in best]
    assert picture.read_bytes().startswith(b"\x89PNG")


@pytest.mark.transformers
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--clean", "5,6,x", "--corrupted", "5,6,7"], "row 1 holds 'x', which is not a token id"),
        (["--clean", "5,6;7", "--corrupted", "5,6;7,8"], "row 2 has 1 token and row 1 has 2"),
        (["--clean", CLEAN, "--corrupted", "5,6,7,8"], "--clean is 2 rows of 4 tokens and --corrupted 1 row"),
        (["--clean", "5,6", "--corrupted", "5,99"], "the model raised IndexError on the token ids given"),
        (["--clean", "5,6", "--corrupted", "5,7", "-m", "logit_diff:3"], "expected logit_diff:A,B"),
        (["--clean", "5,6", "--corrupted", "5,7", "-m", "bleu"], "unknown metric 'bleu'"),
        (["--clean", "5,6", "--corrupted", "5,7", "--positions", "x"], "--positions 'x' is not understood"),
        (["--clean", "5,6", "--corrupted", "5,7", "--positions", "5"], "position 5 is not one of the 2 positions"),
        (["--clean", "5,6", "--corrupted", "5,7", "--verify", "2"], "add --atp or drop --verify"),
        (["--clean", "5,6", "--corrupted", "5,7", "--out", "sweep.txt"], "expected a file name ending in .html"),
    ],
)
def test_bad_patch_input_is_a_one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    pytest.importorskip("transformers")
    if "-m" not in argv:
        argv = [*argv, "-m", "logit_diff:3,4"]
    code, _, err = run_cli(capsys, "patch", MODEL, *argv)
    assert code == 2
    assert message in err
    assert "Traceback" not in err


@pytest.mark.transformers
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prompt", "5,6,7", "--position", "3"], "--position 3: the prompt has 3 positions"),
        (["--prompt", "5,6,7", "--row", "1"], "--row 1: the prompt has 1 row"),
        (["--prompt", ""], "holds no token ids"),
    ],
)
def test_bad_lens_input_is_a_one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    code, _, err = run_cli(capsys, "lens", MODEL, *argv)
    assert code == 2
    assert message in err


@pytest.mark.transformers
def test_lens_needs_an_lm_head(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "lens", "hf-config:gpt2?n_layer=1&n_embd=16&n_head=2&vocab_size=32", "-p", "1,2")
    assert code == 2
    assert "no std:unembed" in err


def test_parse_ids_positions_and_metrics() -> None:
    ids = parse_ids(" 1, 2 ;3,4; ", what="--prompt")
    assert ids.tolist() == [[1, 2], [3, 4]]
    assert ids.dtype == torch.long
    assert parse_positions("EACH") == "each"
    assert parse_positions("0,-1") == [0, -1]
    clean, corrupted = torch.tensor([[1, 2, 3]]), torch.tensor([[1, 2, 0]])
    logits = torch.randn(1, 3, 5)
    metric = parse_metric("logit_diff:3,4@1", clean=clean, corrupted=corrupted, direction="denoise")
    assert torch.equal(metric(logits), logits[:, 1, 3] - logits[:, 1, 4])
    own = parse_metric("loss", clean=clean, corrupted=corrupted, direction="denoise")
    assert torch.equal(own(logits), hs.methods.loss(corrupted)(logits))  # denoising patches the corrupted run
    noised = parse_metric("loss", clean=clean, corrupted=corrupted, direction="noise")
    assert torch.equal(noised(logits), hs.methods.loss(clean)(logits))
    with pytest.raises(SpecError, match="loss takes no argument, 'clean' or 'corrupted'"):
        parse_metric("loss:both", clean=clean, corrupted=corrupted, direction="noise")
    with pytest.raises(SpecError, match="position 'last' is not an int"):
        parse_metric("logprob:3@last", clean=clean, corrupted=corrupted, direction="noise")


@pytest.mark.parametrize("command", ["patch", "lens"])
def test_an_out_below_a_file_exits_2_before_the_model_is_built(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str
) -> None:
    (tmp_path / "file").write_text("")
    argv = ["--clean", "1,2", "--corrupted", "1,3", "-m", "logprob:1"] if command == "patch" else ["-p", "1,2"]
    code, _, err = run_cli(capsys, command, "demo:nothing", *argv, "-o", str(tmp_path / "file" / "x.png"))
    assert code == 2
    assert "is a file, not a folder" in err  # not the unknown demo model: the model was never built


@pytest.mark.transformers
def test_runs_that_score_the_same_are_named_not_shown_as_zero(capsys: pytest.CaptureFixture[str]) -> None:
    # the loss of the patched run on its own ids: the last token predicts nothing, so both runs score the same
    code, _, err = run_cli(capsys, "patch", MODEL, "--clean", "5,6,7,8", "--corrupted", "5,6,7,9", "-m", "loss")
    assert code == 0, err
    assert "so no effect can be normalised (every cell is NaN)" in err

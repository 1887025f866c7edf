"""``hookscope patch``: regex selectors in --sites, --num-heads, and what --verify found, against the library."""

from __future__ import annotations

import pytest
from torch import nn

import hookscope as hs
from tests.test_cli import run_cli
from tests.test_cli_methods import CLEAN, CLEAN_IDS, CORRUPTED, CORRUPTED_IDS, MODEL, gpt2, table_rows

__all__ = ["gpt2"]  # the fixture, used by name

pytestmark = [pytest.mark.transformers]


def test_split_selectors_keeps_a_comma_inside_brackets() -> None:
    from hookscope.cli.method_specs import split_selectors

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
        sites=["transformer.h.0", "transformer.h.1", "transformer.ln_f"],
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
        gpt2, CLEAN_IDS, CORRUPTED_IDS, metric=hs.methods.logit_diff(3, 4), sites=merged, heads=True, num_heads=2
    )
    rows = table_rows(out, 4)
    assert [(site, int(head), int(position)) for site, head, position, _ in rows] == [c for c, _ in expected.top(16)]
    code, _, err = run_cli(capsys, "patch", MODEL, *argv, "--sites", merged)
    assert code == 2
    assert "give num_heads= (this model's config says num_attention_heads=2)" in err


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

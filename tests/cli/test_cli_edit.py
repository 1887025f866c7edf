"""``hookscope edit``: edit specs, the output change, and bad specs as one-line errors."""

from __future__ import annotations

import pytest

from hookscope.cli.parse.edit_specs import parse_edit
from hookscope.errors import SpecError
from tests.cli.test_cli import run_cli


def test_zero_two_channels_of_the_demo_cnn(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "edit", "demo:cnn", "-s", "2x3x32x32", "--edit", "conv1=zero:channels=0,3")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[1] == "edits on conv1 (1 edit)"
    assert lines[2].startswith("output (2, 10): max |delta| ")
    assert "cosine similarity 0.9" in lines[2]


def test_an_edit_that_changes_nothing_reports_zero(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "edit", "demo:cnn", "--edit", "fc=scale:factor=1")
    assert code == 0
    assert "max |delta| 0, mean |delta| 0, cosine similarity 1.000000" in out


@pytest.mark.transformers
def test_several_edits_on_gpt2(capsys: pytest.CaptureFixture[str]) -> None:
    model = "hf-config:gpt2?n_layer=2&n_embd=32&n_head=2"
    code, out, err = run_cli(
        capsys, "edit", model, "-s", "1x8", "-e", r"re:h\.\d+=scale:factor=0.5:neurons=7", "-e", "h.0=noise:std=0.1"
    )
    assert code == 0, err
    assert "edits on h.0 (2 edits), h.1 (1 edit)" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--edit", "conv1"], "is not SELECTOR=KIND"),
        (["--edit", "conv1=zap"], "unknown kind 'zap'"),
        (["--edit", "conv1=scale"], "scale needs factor="),
        (["--edit", "conv1=zero:channels=a"], "is not a number"),
        (["--edit", "conv1=zero:colour=1"], "unknown option 'colour'"),
        (["--edit", "conv1=zero:channels=99"], "channels=[99] outside the 16"),
        (["--edit", "conv9=zero"], "did you mean 'conv1'"),
        (["--edit", "conv1=zero:std=1"], "unknown keyword 'std' for this edit"),
    ],
)
def test_bad_edit_specs_are_one_line_errors(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    code, _, err = run_cli(capsys, "edit", "demo:cnn", *argv)
    assert code == 2
    assert message in err
    assert "Traceback" not in err


def test_parse_edit_builds_the_built_ins() -> None:
    selector, edit = parse_edit("h.0=clamp:min=-1:max=2:positions=0,1:path=output[0]")
    assert selector == "h.0"
    assert repr(edit) == "hs.edits.clamp(min=-1.0, max=2.0, positions=[0, 1], path='output[0]')"
    with pytest.raises(SpecError, match="noise needs std="):
        parse_edit("x=noise")

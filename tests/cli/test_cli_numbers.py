"""Whole numbers on the command line: every integer option of every command, and the ints inside
option texts (token ids, shapes, row counts), given values past what torch holds. Bad input exits 2
with a line naming the option; a raw ``ValueError``/``OverflowError`` (exit 1) is a defect."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import typer

from hookscope.cli import main
from hookscope.cli.app import app

GPT2 = (
    "hf-config:gpt2/causal-lm?n_layer=1&n_embd=16&n_head=2&vocab_size=64&n_positions=16&bos_token_id=0&eos_token_id=0"
)
HUGE = 2**64
RAW = ("ValueError", "OverflowError", "RuntimeError", "Traceback")
transformers_cli = [pytest.mark.transformers, pytest.mark.slow]


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as done:
        main(list(argv))
    out, err = capsys.readouterr()
    code = done.value.code
    text = " ".join((out + err).replace("│", " ").split())  # usage errors come in a box, wrapped
    return (code if isinstance(code, int) else 0), text


def base_args(command: str, tmp: Path) -> list[str]:
    """A command line of ``command`` that runs as it is (the option under test is appended)."""
    return {
        "capture": ["demo:cnn", "-l", "fc", "--out", str(tmp / "x.pt")],
        "trace": ["demo:cnn"],
        "grads": ["demo:cnn", "-n", "1"],
        "edit": ["demo:cnn", "-e", "fc=zero"],
        "report": ["demo:cnn", "--out", str(tmp / "r.html")],
        "diff": ["demo:cnn", "demo:cnn"],
        "train-check": ["demo:cnn", "-n", "1"],
        "patch": [GPT2, "--clean", "5,6,7", "--corrupted", "5,6,8", "-m", "logit_diff:3,4", "--atp"],
        "lens": [GPT2, "--prompt", "5,6,7"],
        "extract": ["demo:cnn", "-D", "random:2", "-l", "fc", "--out", str(tmp / "s.zarr")],
        "verify": [GPT2, "--checks", "capture,edits", "--compile-backend", "none"],
    }[command]


def integer_options() -> list[tuple[str, str]]:
    """``(command, option)`` for every option of every command whose value is an int."""
    group: Any = typer.main.get_command(app)
    found = []
    for name, command in sorted(group.commands.items()):
        for param in command.params:
            annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
            if annotation in (int, int | None) and param.opts[0].startswith("--"):
                found.append((name, param.opts[0]))
    return found


#: Options where a huge value asks for a run that long, not for something that cannot be.
RUNS_THAT_LONG = {("grads", "--steps"), ("train-check", "--steps")}


def test_every_integer_option_is_covered() -> None:
    options = integer_options()
    assert ("patch", "--seed") in options
    assert ("extract", "--num-workers") in options
    for command, _ in options:
        base_args(command, Path("."))  # a KeyError names a command with integer options and no case here


def _cases() -> list[Any]:
    cases = []
    for command, option in integer_options():
        if (command, option) in RUNS_THAT_LONG:
            continue
        marks = transformers_cli if command in ("patch", "lens", "verify") else [pytest.mark.slow]
        if option == "--seed":
            marks = []  # refused while the line is read: nothing runs
        cases.append(pytest.param(command, option, marks=marks, id=f"{command}{option}"))
    return cases


@pytest.mark.parametrize(("command", "option"), _cases())
def test_an_integer_option_past_int64_is_bad_input_or_works(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str, option: str
) -> None:
    code, text = run_cli(capsys, command, *base_args(command, tmp_path), option, str(HUGE))
    assert code in (0, 2), text
    assert not any(word in text for word in RAW), text
    if code == 2:
        assert option in text, text  # the line names what was wrong


@pytest.mark.parametrize("command", ["trace", "capture", "diff", "extract"])
@pytest.mark.parametrize("seed", [-1, 2**64, 10**30])
def test_a_seed_outside_torchs_range_says_the_range(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str, seed: int
) -> None:
    code, text = run_cli(capsys, command, *base_args(command, tmp_path), "--seed", str(seed))
    assert code == 2
    bound = "greater than or equal to 0" if seed < 0 else "less than or equal to 18446744073709551615"
    assert f"Invalid value for '--seed': Input should be {bound}" in text
    assert not any(word in text for word in RAW)


def test_the_largest_seed_still_runs(capsys: pytest.CaptureFixture[str]) -> None:
    code, text = run_cli(capsys, "trace", "demo:cnn", "--seed", str(2**64 - 1), "--depth", "0")
    assert code == 0, text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["trace", "demo:cnn", "-s", f"1x3x{HUGE}x3"], "more values than a tensor can index"),
        (["trace", "demo:cnn", "-s", f"{10**30}x3x3x3"], "more values than a tensor can index"),
        (["extract", "demo:cnn", "-D", f"random:{HUGE}", "-l", "fc", "--out", "{tmp}/s.zarr"], "2**63 - 1"),
        (["extract", "demo:cnn", "-D", f"random:2:3x{HUGE}x3", "-l", "fc", "--out", "{tmp}/s.zarr"], "can index"),
        (
            ["extract", "demo:cnn", "-D", "random:2", "-l", "fc", "--out", "{tmp}/s.zarr", "-b", str(HUGE)],
            "--batch-size",
        ),
    ],
)
def test_numbers_inside_texts_past_int64_are_bad_input(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], message: str
) -> None:
    code, text = run_cli(capsys, *[part.format(tmp=tmp_path) for part in argv])
    assert code == 2, text
    assert message in text
    assert not any(word in text for word in RAW)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["patch", GPT2, "--clean", f"5,6,{HUGE}", "--corrupted", "5,6,8", "-m", "loss"], "2**63 - 1"),
        (["patch", GPT2, "--clean", "5,6,7", "--corrupted", "5,6,8", "-m", f"logit_diff:3,{HUGE}"], "logit_diff:A,B"),
        (["patch", GPT2, "--clean", "5,6,7", "--corrupted", "5,6,8", "-m", f"logprob:{HUGE}"], "logprob:T"),
        (["lens", GPT2, "--prompt", f"5,{HUGE}"], "2**63 - 1"),
    ],
)
def test_token_ids_past_int64_are_bad_input(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    code, text = run_cli(capsys, *argv)
    assert code == 2, text
    assert message in text
    assert not any(word in text for word in RAW)


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 1.5, True])
def test_sample_input_refuses_a_seed_torch_cannot_take(seed: Any) -> None:
    import hookscope as hs
    from hookscope.demo.models import SmallCNN

    with pytest.raises(hs.SpecError, match="is not a torch seed; expected a whole number from 0 to 2\\*\\*64 - 1"):
        hs.sample_input(SmallCNN(), (1, 3, 32, 32), seed=seed)

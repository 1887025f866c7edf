"""Flags declared once, on the options classes' fields; help text a terminal can show."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from typing import Any, get_args

import pytest
import torch
import typer

import hookscope as hs
from hookscope.cli.app import app
from hookscope.cli.parse.flags import plain

#: Each command whose options class declares some of its flags, and the fields it takes as flags.
DERIVED = {
    "capture": (hs.CaptureOptions, {"keep", "calls", "reduce", "stop", "max_bytes"}),
    "edit": (hs.EditOptions, {"on"}),
    "extract": (hs.CaptureOptions, {"keep", "calls"}),
    "trace": (hs.TraceOptions, {"timing", "experts"}),
    "train-check": (hs.MonitorOptions, {"precision", "flag_above"}),
}

#: Flags whose default is the command's own: train-check's report counts bf16 unless told.
OWN_DEFAULT = {("train-check", "precision"): "bf16"}


def command(name: str) -> Any:
    return next(info.callback for info in app.registered_commands if info.name == name)


def flag_of(callback: Any, parameter: str) -> tuple[Any, Any]:
    """The ``typer.Option`` and the default of one parameter of a command."""
    found = inspect.signature(callback, eval_str=True).parameters[parameter]
    option = next(extra for extra in get_args(found.annotation)[1:] if isinstance(extra, typer.models.OptionInfo))
    return option, found.default


@pytest.mark.parametrize("name", sorted(DERIVED))
def test_a_flag_named_after_an_option_is_that_option_s_field(name: str) -> None:
    options, fields = DERIVED[name]
    callback = command(name)
    docs = options.field_docs()
    defaults = {field.name: field.default for field in dataclasses.fields(options)}
    for field in fields:
        option, default = flag_of(callback, field)
        declared = [word for word in (option.default, *option.param_decls) if isinstance(word, str)]
        assert declared == [f"--{field.replace('_', '-')}"]  # typer takes the first flag as the "default"
        assert option.help == plain(docs[field])
        assert default == OWN_DEFAULT.get((name, field), defaults[field])


#: Flags that share an option's name but not its form: a model's cast, a comma list of words.
OWN_FORM = {
    "capture": {"dtype"},  # --dtype casts the model and its input, as on every command
    "extract": {"dtype", "reduce", "device"},  # the storage dtype; reductions per layer; where inputs go
    "trace": {"stats", "ops"},  # 'min,max' or 'none'; repeatable selectors
}


@pytest.mark.parametrize("name", sorted(DERIVED))
def test_no_other_flag_of_a_command_redeclares_one_of_its_options(name: str) -> None:
    options, fields = DERIVED[name]
    taken = set(inspect.signature(command(name)).parameters) & set(options.option_names())
    assert taken - OWN_FORM.get(name, set()) == fields


@pytest.mark.parametrize("options", [hs.CaptureOptions, hs.TraceOptions, hs.EditOptions, hs.MonitorOptions])
def test_every_option_is_documented_on_its_field(options: Any) -> None:
    docs = options.field_docs()
    assert list(docs) == list(options.option_names())
    assert all(len(text) > 20 and "\n" not in text for text in docs.values())


def test_field_docs_read_a_class_defined_outside_the_package(tmp_path: Any) -> None:
    from hookscope._shared.options import Options

    @dataclasses.dataclass(frozen=True)
    class Local(Options):
        size: int = 1
        """How many, at least one."""
        name: str = "x"

    assert Local.field_docs() == {"size": "How many, at least one."}


def test_plain_unmarks_roles_literals_and_joins_lines() -> None:
    text = 'a ``"word"`` and\n`literal` see :func:`~hookscope.capture`\n\nnext ``x``'
    assert plain(text) == "a word and literal see capture\n\nnext x"


def every_help(capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    from hookscope.cli import main

    shown = {}
    for name in ["", *(info.name for info in app.registered_commands)]:
        with pytest.raises(SystemExit):
            main([*([name] if name else []), "--help"])
        shown[name or "hookscope"] = capsys.readouterr().out
    return shown


def test_help_shows_no_rest_markup(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    for name, text in every_help(capsys).items():
        assert "``" not in text, name
        for role in (":class:", ":func:", ":meth:", ":mod:"):
            assert role not in text, name
        assert "`" not in text, name


def test_help_paragraphs_are_wrapped_to_the_terminal(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A paragraph of a command's description fills its lines: no line ends far short of the width
    while the next line of the same paragraph has a word that would have fit (source line breaks)."""
    monkeypatch.setenv("COLUMNS", "100")
    for name, text in every_help(capsys).items():
        description = text.split("╭")[0].splitlines()[3:]  # after the usage line
        lines = [line.rstrip() for line in description]
        for line, following in itertools.pairwise(lines):
            if line.strip() and following.strip():
                first_word = following.split()[0]
                assert len(line) + 1 + len(first_word) > 99, (name, line, following)


TWICE = """
import torch


class Twice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.fc(x)))


def make():
    torch.manual_seed(0)
    return Twice()
"""


def test_calls_takes_a_list_of_indices(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    from safetensors.torch import load_file

    from hookscope.cli import main

    (tmp_path / "twice.py").write_text(TWICE)
    out = tmp_path / "a.safetensors"
    with pytest.raises(SystemExit) as done:
        main(["capture", f"{tmp_path / 'twice.py'}:make", "-s", "2x4", "-l", "fc", "--calls", "0,1", "-o", str(out)])
    assert done.value.code in (0, None), capsys.readouterr().err
    saved = load_file(out)
    assert sorted(saved) == ["fc#0:output", "fc#1:output"]
    assert not torch.equal(saved["fc#0:output"], saved["fc#1:output"])

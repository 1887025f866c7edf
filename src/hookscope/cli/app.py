"""The typer application and the one place that turns errors into exit codes (``EXIT_CODES``).

Exit codes: 0 success; 2 bad input, which changing the command fixes (usage errors, every
``HookscopeError`` but a few, and a model that refuses its input: the sample input of any command,
or the first batch of ``extract``'s data); 1 a failure at run time, which the command cannot help
(the disk, data that broke its promises, a model that raised on a later batch); 130 after Ctrl-C,
with a line saying what was kept. Errors print one line, no traceback; ``HOOKSCOPE_TRACEBACK=1`` shows it.
The library's errors know nothing of exit codes: what an error means to a shell is decided here.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

import hookscope as hs
from hookscope.cli.commands.capture import capture_command
from hookscope.cli.commands.demo import demo
from hookscope.cli.commands.diff import diff_command
from hookscope.cli.commands.edit import edit_command
from hookscope.cli.commands.extract import extract_command
from hookscope.cli.commands.grads import grads_command
from hookscope.cli.commands.info import info_command
from hookscope.cli.commands.layers import layers_command
from hookscope.cli.commands.lens import lens_command
from hookscope.cli.commands.patch import patch_command
from hookscope.cli.commands.report import report_command
from hookscope.cli.commands.trace import trace_command
from hookscope.cli.commands.train_check import train_check_command
from hookscope.cli.commands.verify import verify_command
from hookscope.cli.common import EXIT_BAD_INPUT, EXIT_FAILURE, EXIT_INTERRUPTED, interrupt_note
from hookscope.cli.parse.flags import plain
from hookscope.errors import (
    ConcurrentPassError,
    DataError,
    HookscopeError,
    OutputWriteError,
    SinkError,
    StoreBusyError,
    StoreReadError,
    StoreWriteError,
)
from hookscope.redaction import scrub, secrets_of

__all__ = ["EXIT_CODES", "app", "exit_code", "main"]

#: The exit code of each error class. An error takes the code of the first class of its MRO
#: listed here, so a subclass listed overrides its base: every ``HookscopeError`` is bad input
#: except those that happen however right the command was.
EXIT_CODES: dict[type[BaseException], int] = {
    HookscopeError: EXIT_BAD_INPUT,  # a spec, selector, option, file or store the command named
    DataError: EXIT_FAILURE,  # the data broke a promise part-way (fewer rows than its len(), ...)
    StoreBusyError: EXIT_FAILURE,  # another process is writing the store now: run again once it is done
    StoreWriteError: EXIT_FAILURE,  # writing failed part-way (disk full); the same command resumes
    StoreReadError: EXIT_FAILURE,  # a chunk could not be fetched (the network): the store is not known to be damaged
    OutputWriteError: EXIT_FAILURE,  # a file's write failed part-way (disk full); nothing was left
    ConcurrentPassError: EXIT_FAILURE,  # a replica or autograd thread would mix into the pass: nothing the command did
    SinkError: EXIT_FAILURE,  # a metrics sink failed to write (disk full); the other sinks have the step
    KeyboardInterrupt: EXIT_INTERRUPTED,
    Exception: EXIT_FAILURE,  # anything else: the model, torch, the system failed while running
}


def exit_code(error: BaseException) -> int:
    """The code the command line exits with after ``error``: the first entry of its MRO in ``EXIT_CODES``.

    >>> exit_code(hs.SpecError("bad")), exit_code(hs.DataError("short")), exit_code(KeyboardInterrupt())
    (2, 1, 130)
    """
    return next((EXIT_CODES[cls] for cls in type(error).__mro__ if cls in EXIT_CODES), EXIT_FAILURE)


class _Commands(TyperGroup):
    """The group of commands; a Ctrl-C in any of them prints what was kept and exits 130.

    Here rather than in :func:`main` because typer turns a ``KeyboardInterrupt`` into a silent
    exit before ``main`` could see it.
    """

    def invoke(self, ctx: Any) -> Any:  # click's Context: typer vendors click from 0.29 on, under a private name
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as stop:
            typer.echo(f"error: {interrupt_note(ctx)}", err=True)
            raise typer.Exit(exit_code(stop)) from None


app = typer.Typer(
    name="hookscope",
    cls=_Commands,
    help="Look inside PyTorch models and change what happens there, through module hooks.",
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"hookscope {hs.__version__}")
        raise typer.Exit()


@app.callback(invoke_without_command=True)
def _root(
    ctx: typer.Context,
    version: Annotated[
        bool, typer.Option("--version", help="Print the version and exit.", callback=_print_version, is_eager=True)
    ] = False,
) -> None:
    """Look inside PyTorch models and change what happens there, through module hooks."""
    if ctx.invoked_subcommand is None:  # no subcommand: help, and the exit code of a usage error
        typer.echo(ctx.get_help())
        raise typer.Exit(EXIT_BAD_INPUT)


#: Each command and its function, in the order help lists them: the tour, looking, changing,
#: the studies, data sets.
COMMANDS: tuple[tuple[str, Callable[..., None]], ...] = (
    ("demo", demo),
    ("info", info_command),
    ("layers", layers_command),
    ("capture", capture_command),
    ("trace", trace_command),
    ("grads", grads_command),
    ("edit", edit_command),
    ("report", report_command),
    ("diff", diff_command),
    ("train-check", train_check_command),
    ("patch", patch_command),
    ("lens", lens_command),
    ("extract", extract_command),
    ("verify", verify_command),
)

for _name, _command in COMMANDS:  # help as plain text: no reST, paragraphs wrapped by the terminal
    app.command(_name, help=plain(_command.__doc__ or ""))(_command)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``hookscope`` console script; exits with the codes of ``EXIT_CODES``."""
    try:  # usage errors (unknown command or option) are typer's: usage text and exit code 2
        given = list(sys.argv[1:] if argv is None else argv)
        app(args=given, prog_name="hookscope", obj={"argv": given})  # extract records its command line
    except Exception as error:  # one line, not a traceback
        _fail(error, exit_code(error), secrets_of(argv=given))


def _fail(error: Exception, code: int, secrets: tuple[str, ...] = ()) -> None:
    if os.environ.get("HOOKSCOPE_TRACEBACK"):
        raise error
    if isinstance(error, HookscopeError):  # another library's error may quote a credential it was given
        typer.echo(scrub(f"error: {error}", secrets), err=True)
    else:
        typer.echo(scrub(f"error: {type(error).__name__}: {error}", secrets), err=True)
        typer.echo("(set HOOKSCOPE_TRACEBACK=1 to see where it happened)", err=True)
    sys.exit(code)

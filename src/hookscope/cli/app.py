"""The typer application and the one place that turns errors into exit codes.

Exit codes: 0 success, 2 bad input (usage errors and every ``HookscopeError``), 1 a failure at
run time. Errors print one line, no traceback; ``HOOKSCOPE_TRACEBACK=1`` shows it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from hookscope import __version__
from hookscope.errors import HookscopeError

__all__ = ["app", "main"]

EXIT_BAD_INPUT = 2
EXIT_FAILURE = 1

app = typer.Typer(
    name="hookscope",
    help="Look inside PyTorch models and change what happens there, through module hooks.",
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"hookscope {__version__}")
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


@app.command()
def demo(
    out: Annotated[
        Path, typer.Option("--out", "-o", help="Folder for the files the demo writes.", file_okay=False)
    ] = Path("hookscope-demo"),
) -> None:
    """Run the guided tour on the built-in SmallCNN: shapes, features to numpy, ranges, clean-up."""
    from hookscope.demo.tour import run_tour

    run_tour(out, write=typer.echo)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``hookscope`` console script; exits with the codes in the module doc."""
    try:  # usage errors (unknown command or option) are typer's: usage text and exit code 2
        app(args=argv, prog_name="hookscope")
    except HookscopeError as error:
        _fail(error, EXIT_BAD_INPUT)
    except Exception as error:  # a failure at run time: one line, not a traceback
        _fail(error, EXIT_FAILURE)


def _fail(error: Exception, code: int) -> None:
    if os.environ.get("HOOKSCOPE_TRACEBACK"):
        raise error
    if isinstance(error, HookscopeError):
        typer.echo(f"error: {error}", err=True)
    else:
        typer.echo(f"error: {type(error).__name__}: {error}", err=True)
        typer.echo("(set HOOKSCOPE_TRACEBACK=1 to see where it happened)", err=True)
    sys.exit(code)

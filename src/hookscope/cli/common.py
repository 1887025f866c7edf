"""What the app and every command share: the exit codes by name, and what Ctrl-C leaves behind.

The table that maps errors to these codes is :data:`hookscope.cli.app.EXIT_CODES`; a command
names a code here only where it exits on its own (``trace`` after printing a partial table).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import typer

__all__ = [
    "EXIT_BAD_INPUT",
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "NOTHING_KEPT",
    "SAMPLE_FIX",
    "interrupt_note",
    "on_interrupt",
]

EXIT_BAD_INPUT = 2
EXIT_FAILURE = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a process stopped by Ctrl-C

#: What every command says when its model raises on the sample input it made up (exit 2).
SAMPLE_FIX = "pass an --input-shape the model accepts"

#: What Ctrl-C leaves behind, unless a command says otherwise (:func:`on_interrupt`).
NOTHING_KEPT = "interrupted (Ctrl-C) before the command finished; run it again to do it all"


def on_interrupt(ctx: typer.Context, note: str | Callable[[], str]) -> None:
    """Say what a Ctrl-C from now on leaves behind (the line printed before exit code 130).

    A function is called after the Ctrl-C, so the line can say what was kept by then.
    """
    ctx.ensure_object(dict)["on_interrupt"] = note


def interrupt_note(ctx: Any) -> str:
    """The line a command left for Ctrl-C (text, or a function that reads what was kept), or the default."""
    note = (ctx.obj or {}).get("on_interrupt", NOTHING_KEPT)
    if not callable(note):
        return str(note)
    try:
        return str(note())
    except Exception:  # what was kept cannot be read now: say the general truth
        return NOTHING_KEPT

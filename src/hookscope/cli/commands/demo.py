"""``hookscope demo``: the guided tour of the shapes classifier."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

__all__ = ["demo"]


def demo(
    out: Annotated[
        Path, typer.Option("--out", "-o", help="Folder for the files the demo writes.", file_okay=False)
    ] = Path("hookscope-demo"),
) -> None:
    """Run the guided tour: hooks, capture, trace, gradients, edits, extraction, and an HTML report
    of the built-in shapes classifier (written to OUT/report.html)."""
    from hookscope.demo.tour import run_tour

    run_tour(out, write=typer.echo)

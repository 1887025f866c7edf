"""``hookscope info``: what this installation runs on, and which path computes CPU statistics."""

from __future__ import annotations

import sys

import typer

import hookscope as hs
import hookscope.info

__all__ = ["info_command"]


def info_command() -> None:
    """Print what this installation runs on: versions, and which path computes CPU statistics."""
    import torch

    typer.echo(f"hookscope {hs.__version__}")
    typer.echo(f"python {sys.version.split()[0]}, torch {torch.__version__}")
    typer.echo(f"statistics: {hookscope.info.statistics_path()}")

"""``hookscope info``: what this installation runs on, and which path computes CPU statistics."""

from __future__ import annotations

import typer

import hookscope as hs

__all__ = ["info_command"]


def info_command() -> None:
    """Print what this installation runs on: versions, optional packages, memory policy, statistics path."""
    typer.echo(str(hs.info()))

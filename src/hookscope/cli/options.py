"""Arguments shared by the commands that build and run a model (typer annotations)."""

from __future__ import annotations

from typing import Annotated

import typer

__all__ = ["Dtype", "InputShape", "ModelSpec"]

ModelSpec = Annotated[
    str,
    typer.Argument(
        metavar="MODEL",
        help="package.module:factory, path/to/file.py:factory, demo:cnn, demo:shapes or "
        "hf-config:<model_type>[?key=value&...]",
        show_default=False,
    ),
]
InputShape = Annotated[
    str | None,
    typer.Option("--input-shape", "-s", help="Shape of a random sample input, e.g. 1x3x32x32 (tokens: 1x16)."),
]
Dtype = Annotated[
    str | None, typer.Option("--dtype", help="Cast the model and its float input: fp32, fp16, bf16, fp64.")
]

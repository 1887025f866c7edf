"""``hookscope grads``: a few training steps and the layers whose gradients look wrong."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

import hookscope as hs
from hookscope.cli.parse.options import Dtype, InputShape, ModelSpec, seed_option
from hookscope.errors import SpecError

__all__ = ["grads_command"]


def grads_command(
    model: ModelSpec,
    input_shape: InputShape = None,
    dtype: Dtype = None,
    steps: Annotated[int, typer.Option("--steps", "-n", min=1, help="Training steps to run.")] = 3,
    lr: Annotated[float, typer.Option("--lr", min=0.0, help="SGD learning rate.")] = 0.01,
    png: Annotated[Path | None, typer.Option("--png", help="Save the gradient-flow plot of the last step.")] = None,
    seed: Annotated[int, seed_option("Seed of the random inputs and targets.")] = 0,
) -> None:
    """Train MODEL for a few SGD steps on random data and print the layers whose gradients look wrong.

    The loss is synthetic: cross-entropy against random labels for a (batch, classes) output,
    else mean squared error against random targets. For a quick look at gradient flow at init.
    """
    from hookscope.cli.sample import prepare
    from hookscope.cli.training import train_steps

    if png is not None and png.suffix.lower() != ".png":
        raise SpecError(f"--png {png}: expected a file name ending in .png")
    if png is not None:
        hs.check_output_path(png, what="--png")
    sample = prepare(model, input_shape, dtype, seed)
    typer.echo(sample.describe_input())
    with hs.watch_grads(sample.model) as monitor:
        sample.run(
            lambda _net, _args, _kwargs: train_steps(
                sample,
                monitor,
                steps=steps,
                lr=lr,
                shape=input_shape,
                dtype=dtype,
                seed=seed,
                report=lambda index, loss: typer.echo(f"step {index}: loss {loss:.4g}"),
            )
        )
    typer.echo(str(monitor.summary()))
    if png is not None:
        hs.plots.grad_flow(monitor).savefig(png, dpi=100)
        typer.echo(f"wrote {png}")

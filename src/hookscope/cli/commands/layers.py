"""``hookscope layers``: every module of a model, its parameters and calls."""

from __future__ import annotations

from typing import Annotated, Any

import typer

import hookscope as hs
from hookscope.cli.parse.options import Dtype, InputShape, ModelSpec
from hookscope.cli.parse.values import selector_list
from hookscope.errors import SpecError

__all__ = ["layers_command"]


def layers_command(
    model: ModelSpec,
    input_shape: InputShape = None,
    dtype: Dtype = None,
    no_run: Annotated[
        bool, typer.Option("--no-run", help="List names and parameters only; do not run a forward pass.")
    ] = False,
    ops: Annotated[
        bool,
        typer.Option("--ops", help="Also list the op sites (the torch calls of each module's own code) that ran."),
    ] = False,
    ops_in: Annotated[
        list[str] | None,
        typer.Option(
            "--ops-in",
            help="With --ops: only these modules' op sites (names, globs, 're:'; repeat or separate with commas).",
            show_default=False,
        ),
    ] = None,
    std: Annotated[
        bool,
        typer.Option(
            "--std",
            help="Also print the canonical names (std:blocks.3.resid_post, ...) and the site each is on this model.",
        ),
    ] = False,
) -> None:
    """List every module of MODEL: name, class, own parameters, and calls in one forward pass."""
    from hookscope.cli.parse.specs import make_input
    from hookscope.cli.sample import SampleRun, build_model

    if no_run and input_shape is not None:
        raise SpecError("--no-run and --input-shape contradict each other; drop one")
    if no_run and (ops or ops_in):
        raise SpecError("--ops lists the op sites a forward pass ran, and --no-run runs none; drop one")
    if ops_in and not ops:
        raise SpecError("--ops-in chooses whose op sites --ops lists; add --ops")
    if no_run and std:
        raise SpecError("--std checks the canonical names on a forward pass, and --no-run runs none; drop one")
    chosen: Any = selector_list(ops_in) if ops_in else ops
    net = build_model(model, dtype)
    if no_run:
        typer.echo(str(hs.layers(net)))
        return
    try:
        sample = SampleRun(net, *make_input(net, input_shape, dtype=dtype))
    except SpecError as error:
        if input_shape is not None:
            raise
        typer.echo(f"note: no calls counted; {error}", err=True)  # the table is still worth printing
        typer.echo(str(hs.layers(net)))
        return
    typer.echo(sample.describe_input())
    typer.echo(str(sample.run(lambda net, args, kwargs: hs.layers(net, *args, ops=chosen, std=std, **kwargs))))

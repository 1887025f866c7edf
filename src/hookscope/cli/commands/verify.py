"""``hookscope verify MODEL``: what hookscope does on a model, each feature checked against raw
hooks and autograd, with an exit code for CI."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

import hookscope as hs
from hookscope.cli.common import EXIT_FAILURE
from hookscope.cli.parse.options import Dtype, InputShape, ModelSpec, seed_option
from hookscope.io import check_output_path

__all__ = ["verify_command"]


def verify_command(
    model: ModelSpec,
    input_shape: InputShape = None,
    dtype: Dtype = None,
    checks: Annotated[
        str | None,
        typer.Option(
            "--checks",
            help="Only these checks, comma-separated: capture, gradients, edits, trace, attention, experts, ssm, std, "
            "compile.",
            show_default=False,
        ),
    ] = None,
    sample: Annotated[
        int, typer.Option("--sample", min=1, help="How many modules the edit, gradient and compile checks use.")
    ] = 3,
    compile_backend: Annotated[
        str,
        typer.Option(
            "--compile-backend", help="torch.compile backend of the compile check: eager, inductor, ... or 'none'."
        ),
    ] = "eager",
    json: Annotated[bool, typer.Option("--json", help="Print the report as JSON instead of the table.")] = False,
    out: Annotated[Path | None, typer.Option("--out", help="Also write the JSON report to this file.")] = None,
    seed: Annotated[int, seed_option("Seed of the sample input and of random weights.")] = 0,
) -> None:
    """Check every feature of hookscope on MODEL against references made without it.

    One row per check: SUPPORTED (equal to the reference: raw hooks, torch.autograd, float64, the
    eager twin), REFUSED (hookscope declined, with the reason), SILENTLY_WRONG (a value that differs
    from the reference, or one missing), ERROR (something raised; its last line). Exit 0 when no row
    is SILENTLY_WRONG or ERROR, 1 otherwise, 2 for bad input (a model that does not run on its input).

    Example: hookscope verify 'hf-config:gpt2/causal-lm?n_layer=2&n_embd=64&n_head=4'
    """
    import torch

    from hookscope.cli.parse.specs import make_input
    from hookscope.cli.sample import build_model

    if out is not None:
        check_output_path(out, what="--out")
    torch.manual_seed(seed)  # the random weights of an hf-config: model
    net = build_model(model, dtype)
    example = make_input(net, input_shape, dtype=dtype, seed=seed)
    backend: str | bool = False if compile_backend.lower() == "none" else compile_backend
    report = hs.verify(net, example, checks=checks, sample=sample, compile=backend, seed=seed)
    typer.echo(report.to_json() if json else report.table())
    if out is not None:
        out.write_text(report.to_json() + "\n", encoding="utf-8")
    if not report.ok:
        raise typer.Exit(EXIT_FAILURE)

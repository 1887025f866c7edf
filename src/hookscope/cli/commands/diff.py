"""``hookscope diff MODEL_A MODEL_B``: where two models part, with an exit code for CI."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

import hookscope as hs
from hookscope.cli.parse.options import InputShape, seed_option, split_selectors
from hookscope.errors import HookscopeError, SpecError

__all__ = ["diff_command"]

EXIT_DIFFERENT = 1


def diff_command(
    model_a: Annotated[str, typer.Argument(metavar="MODEL_A", help="The reference model (same forms as MODEL).")],
    model_b: Annotated[str, typer.Argument(metavar="MODEL_B", help="The model compared against it.")],
    input_shape: InputShape = None,
    dtype: Annotated[
        str | None, typer.Option("--dtype", help="Cast model B and its float input: bf16, fp16, ...")
    ] = None,
    mapping: Annotated[
        list[str] | None,
        typer.Option(
            "--map",
            "-m",
            help="Pair names by pattern, A=B: 'model.layers.*=transformer.h.*' (repeat).",
            show_default=False,
        ),
    ] = None,
    by_order: Annotated[bool, typer.Option("--by-order", help="Pair calls by execution order, not by name.")] = False,
    rtol: Annotated[
        float | None,
        typer.Option(
            "--rtol", min=0.0, help="Relative tolerance (of max|a|); default by dtype: 1e-5, or 1e-2 for bf16/fp16."
        ),
    ] = None,
    atol: Annotated[
        float | None,
        typer.Option("--atol", min=0.0, help="Absolute tolerance; default by dtype: 1e-8, or 1e-3 for bf16/fp16."),
    ] = None,
    csv: Annotated[Path | None, typer.Option("--csv", help="Also write one row per site to this CSV file.")] = None,
    seed: Annotated[int, seed_option("Seed of the sample input and of random weights.")] = 0,
) -> None:
    """Run MODEL_A and MODEL_B on the same input and compare them layer by layer.

    Prints the table and the first divergence. Exit 0 when every site is within tolerance
    (max|a-b| <= atol + rtol * max|a|; the tolerances default by the models' dtypes, as in
    hs.diff, and the table's footer shows them), 1 when one is not or a call has no counterpart, 2 for
    bad input, including a model whose forward fails on the sample input (the message names
    it): usable as a check in the CI of a model port.
    """
    import torch

    from hookscope.cli.parse.specs import load_model, make_input

    if csv is not None:
        if not csv.parent.exists():
            raise SpecError(f"--csv {csv}: folder {csv.parent} does not exist; create it or pick another path")
        hs.check_output_path(csv, what="--csv")  # below a file or read-only: before the models run
    if mapping and by_order:
        raise SpecError("--map and --by-order pair sites in two different ways; pass one")
    pairing: Literal["name", "order"] = "order" if by_order else "name"
    match = _mapping(mapping) if mapping else pairing
    torch.manual_seed(seed)  # the same random weights for the same spec on both sides
    net_a = load_model(model_a)
    torch.manual_seed(seed)
    net_b = load_model(model_b)
    args, kwargs = make_input(net_a, input_shape, seed=seed)
    inputs_b = None
    if dtype is not None:  # b and its floating inputs cast: the same seeded values, in b's dtype
        net_b = net_b.to(hs.parse_dtype(dtype))
        inputs_b = make_input(net_a, input_shape, dtype=dtype, seed=seed)
    typer.echo("input: " + ", ".join(f"{tuple(t.shape)} {hs.dtype_name(t.dtype)}" for t in [*args, *kwargs.values()]))
    try:
        result = hs.diff(net_a, net_b, *args, match=match, rtol=rtol, atol=atol, model_kwargs=kwargs, inputs_b=inputs_b)
    except (HookscopeError, OSError):
        raise
    except Exception as error:  # a model failed on the made-up input: the likeliest culprit
        notes = " ".join(getattr(error, "__notes__", []))
        which = model_a if "model a's" in notes else model_b if "model b's" in notes else "a model"
        raise SpecError(
            f"the forward pass of {which} on the sample input raised {type(error).__name__}: {error}; "
            "pass an --input-shape both models accept"
        ) from error
    typer.echo(result.table())
    if csv is not None:
        result.to_csv(csv)
        typer.echo(f"wrote {csv}")
    if not result.within():
        raise typer.Exit(EXIT_DIFFERENT)


def _mapping(options: list[str]) -> dict[str, str]:
    pairs = {}
    for option in options:
        for item in split_selectors([option]):  # a glob's [0,1] keeps its comma
            source, equals, target = item.partition("=")
            if not equals or not source.strip() or not target.strip():
                raise SpecError(f"--map {item!r} is not A=B; write e.g. --map 'model.layers.*=transformer.h.*'")
            pairs[source.strip()] = target.strip()
    return pairs

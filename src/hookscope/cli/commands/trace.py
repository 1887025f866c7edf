"""``hookscope trace``: every module call of one forward, with statistics and the failure."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

import hookscope as hs
from hookscope.cli.common import EXIT_BAD_INPUT, SAMPLE_FIX
from hookscope.cli.parse.flags import option_default, option_flag
from hookscope.cli.parse.options import Dtype, InputShape, ModelSpec, seed_option
from hookscope.cli.parse.values import selector_list
from hookscope.io import check_output_path

__all__ = ["trace_command"]


def trace_command(
    model: ModelSpec,
    input_shape: InputShape = None,
    dtype: Dtype = None,
    depth: Annotated[
        int | None,
        typer.Option(
            "--depth", "-d", min=0, help="Show calls nested at most this deep (0: the model only); --ops rows always."
        ),
    ] = None,
    only: Annotated[
        list[str] | None,
        typer.Option(
            "--filter", "-f", help="Show only these modules: names, globs or 're:' regexes.", show_default=False
        ),
    ] = None,
    timing: Annotated[bool, option_flag(hs.TraceOptions, "timing")] = option_default(hs.TraceOptions, "timing"),
    experts: Annotated[bool, option_flag(hs.TraceOptions, "experts")] = option_default(hs.TraceOptions, "experts"),
    stats: Annotated[
        str | None,
        typer.Option(
            "--stats",
            help="The statistics to keep, comma-separated, among min, max, mean, std, abs_mean, zeros, nonfinite "
            "(NaN/Inf counts are always kept); 'none' for shapes only. Default: all.",
            show_default=False,
        ),
    ] = None,
    ops: Annotated[
        list[str] | None,
        typer.Option(
            "--ops",
            help="Add a row per call of these op sites, under their module's row: 'h.*.attn:op[softmax]', "
            "'h.0.attn:attn.pattern' (repeatable, or comma-separated; 'hookscope layers MODEL --ops' lists them).",
            show_default=False,
        ),
    ] = None,
    csv: Annotated[Path | None, typer.Option("--csv", help="Also write one row per call to this CSV file.")] = None,
    json: Annotated[
        Path | None, typer.Option("--json", help="Also write every row and tensor to this JSON file.")
    ] = None,
    seed: Annotated[int, seed_option("Seed of the random sample input.")] = 0,
) -> None:
    """Run MODEL once (eval mode, no grad) and print every module call: shapes, dtypes, value ranges.

    ``--ops`` adds a row per call of the op sites it selects (``h.*.attn:op[softmax]``, an
    attention sub-site ``h.0.attn:attn.pattern``) under its module's row; a selector that
    matched no op call of a module that ran is an error. ``--experts`` adds a row per expert of
    every fused mixture-of-experts module and prints the tokens per expert and each router's entropy.

    Exit 0 when the forward ran; when it raised, the calls up to the failure are printed, then
    the module where it raised and the shapes that went in, and the exit code is 2, as for every
    command whose model refuses the sample input.
    """
    import torch

    from hookscope.cli.sample import prepare

    for option, path in (("--csv", csv), ("--json", json)):
        if path is not None:
            check_output_path(path, what=option)  # before the model runs, not after
    op_selectors = [str(selector) for selector in selector_list(ops or [])]
    chosen: bool | list[str] = True
    if stats is not None:
        chosen = False if stats.strip() == "none" else [str(part) for part in selector_list([stats])]
    # a malformed op selector or statistic fails now
    options = hs.TraceOptions(timing=timing, ops=op_selectors or False, stats=chosen, experts=experts)
    sample = prepare(model, input_shape, dtype, seed)
    typer.echo(sample.describe_input())
    selectors = selector_list(only or [])
    net = sample.model.eval()
    if selectors:
        hs.select(net, selectors)  # a mistyped --filter fails now, not after the forward
    with hs.tracing(net, options=options) as tracer:
        try:
            with torch.no_grad():
                net(*sample.args, **sample.kwargs)
            failed: tuple[Exception, hs.TraceRow] | None = None
        except Exception as error:
            failure = tracer.latest.failure if tracer.latest is not None else None
            if failure is None:
                raise
            failed = (error, failure)
    result = tracer.trace
    typer.echo(result.table(max_depth=depth, filter=selectors or None))
    if experts and failed is None:
        typer.echo(str(result.experts()))  # refused, with the reason, on a model without fused experts
    for path, write in ((csv, result.to_csv), (json, result.to_json)):
        if path is not None:
            write(path)
            typer.echo(f"wrote {path}")
    if failed is not None:  # the partial trace is shown and written; then the error, and exit 2
        raised, where = failed
        typer.echo(f"error: {type(raised).__name__}: {raised}", err=True)
        typer.echo(f"the forward raised in {where.describe()}", err=True)
        typer.echo(f"the model refuses the sample input; {SAMPLE_FIX}", err=True)
        raise typer.Exit(EXIT_BAD_INPUT)

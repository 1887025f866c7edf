"""``hookscope report``: the HTML report of one forward (and backward)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

import hookscope as hs
from hookscope.cli.common import SAMPLE_FIX
from hookscope.cli.parse.options import Dtype, InputShape, ModelSpec, seed_option
from hookscope.cli.parse.values import selector_list
from hookscope.errors import HookscopeError, SpecError

__all__ = ["report_command"]


def report_command(
    model: ModelSpec,
    input_shape: InputShape = None,
    dtype: Dtype = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="The HTML file to write.")] = Path("report.html"),
    layers: Annotated[
        list[str] | None,
        typer.Option(
            "--layers",
            "--sites",
            "-l",
            help="Layers to draw: names, globs or 're:' regexes (default: a spread).",
            show_default=False,
        ),
    ] = None,
    max_sites: Annotated[int, typer.Option("--max-sites", min=0, help="Most layers in the histograms.")] = 16,
    feature_maps: Annotated[
        int, typer.Option("--feature-maps", min=0, help="Most conv-like layers drawn as feature maps.")
    ] = 6,
    loss: Annotated[
        str | None,
        typer.Option("--loss", help="Add gradients: mean or norm of the output, or package.module:function."),
    ] = None,
    title: Annotated[str | None, typer.Option("--title", help="The page's title.")] = None,
    seed: Annotated[int, seed_option("Seed of the random sample input.")] = 0,
) -> None:
    """Run MODEL once and write a self-contained HTML report: model, trace table, plots, gradients."""
    from hookscope.cli.report_run import loss_from_spec
    from hookscope.cli.sample import prepare

    loss_fn = loss_from_spec(loss) if loss is not None else None
    hs.check_output_path(out, what="-o")  # before the model is loaded
    sample = prepare(model, input_shape, dtype, seed)
    typer.echo(sample.describe_input())
    options: dict[str, Any] = {"max_sites": max_sites, "feature_maps": feature_maps, "title": title}
    try:
        written = hs.report(
            sample.model,
            *sample.args,
            out=out,
            loss_fn=loss_fn,
            layers=selector_list(layers or []) or None,
            model_kwargs=sample.kwargs,
            **options,
        )
    except (HookscopeError, OSError):
        raise  # bad input, or a file that cannot be written (exit 1)
    except Exception as error:  # the model failed on the made-up input: the likeliest culprit
        raise SpecError(
            f"the forward pass on the sample input raised {type(error).__name__}: {error}; {SAMPLE_FIX}"
        ) from error
    typer.echo(f"wrote {written} ({written.stat().st_size / 1024:,.0f} KiB)")

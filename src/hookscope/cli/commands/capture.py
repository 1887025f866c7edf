"""``hookscope capture``: one forward on a sample input, chosen values saved to a file."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

import hookscope as hs
from hookscope.cli.parse.flags import option_default, option_flag
from hookscope.cli.parse.options import Dtype, InputShape, ModelSpec, seed_option
from hookscope.cli.parse.values import calls_value, counted, selector_list

__all__ = ["capture_command"]

#: The options whose flags (--keep ... --max-bytes) are their fields' own.
CAPTURE = hs.CaptureOptions


def capture_command(
    model: ModelSpec,
    layers: Annotated[
        list[str],
        typer.Option(
            "--layers",
            "-l",
            help="Modules to capture: names, globs ('h.*.mlp') or 're:' regexes; "
            "repeat the option or separate with commas.",
            show_default=False,
        ),
    ],
    out: Annotated[
        Path, typer.Option("--out", "-o", help="File to write: .safetensors, .npz or .pt.", show_default=False)
    ],
    input_shape: InputShape = None,
    dtype: Dtype = None,
    keep: Annotated[str, option_flag(CAPTURE, "keep")] = option_default(CAPTURE, "keep"),
    calls: Annotated[str, option_flag(CAPTURE, "calls")] = option_default(CAPTURE, "calls"),
    reduce: Annotated[str | None, option_flag(CAPTURE, "reduce")] = option_default(hs.CaptureOptions, "reduce"),
    stop: Annotated[bool, option_flag(CAPTURE, "stop")] = option_default(CAPTURE, "stop"),
    max_bytes: Annotated[str | None, option_flag(CAPTURE, "max_bytes")] = option_default(
        hs.CaptureOptions, "max_bytes"
    ),
    seed: Annotated[int, seed_option("Seed of the random sample input.")] = 0,
) -> None:
    """Run MODEL once on a sample input and save the chosen layers' values to a file."""
    from hookscope.cli.sample import prepare

    hs.tensor_file_format(out)  # a mistyped extension fails before the model runs, not after
    hs.check_output_path(out, what="-o")  # so does a path that cannot be written
    selectors = selector_list(layers)
    sample = prepare(model, input_shape, dtype, seed)
    typer.echo(sample.describe_input())
    options = hs.CaptureOptions(
        keep=keep,  # type: ignore[arg-type]  # a word the options check
        calls=calls_value(calls),
        reduce=reduce,
        stop=stop,
        max_bytes=max_bytes,
    )
    _, cache = sample.run(
        lambda net, args, kwargs: hs.run_with_capture(
            net, *args, layers=selectors, options=options, model_kwargs=kwargs
        )
    )
    typer.echo(repr(cache))
    saved = cache.save(out)
    typer.echo(f"saved {counted(len(cache), 'tensor')} to {saved} ({counted(saved.stat().st_size, 'byte')})")

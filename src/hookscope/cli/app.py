"""The typer application and the one place that turns errors into exit codes (``EXIT_CODES``).

Exit codes: 0 success; 2 bad input, which changing the command fixes (usage errors, every
``HookscopeError`` but a few, and a model that refuses its input: the sample input of any command,
or the first batch of ``extract``'s data); 1 a failure at run time, which the command cannot help
(the disk, data that broke its promises, a model that raised on a later batch); 130 after Ctrl-C,
with a line saying what was kept. Errors print one line, no traceback; ``HOOKSCOPE_TRACEBACK=1`` shows it.
The library's errors know nothing of exit codes: what an error means to a shell is decided here.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from typer.core import TyperGroup

import hookscope as hs
from hookscope.cli.diff_command import diff_command
from hookscope.cli.methods_commands import lens_command, patch_command
from hookscope.cli.options import MAX_WORKERS, Dtype, InputShape, ModelSpec, seed_option, split_selectors
from hookscope.cli.specs import COUNT_MAX
from hookscope.cli.train_check import train_check_command
from hookscope.errors import (
    ConcurrentPassError,
    DataError,
    HookscopeError,
    OutputWriteError,
    SinkError,
    SpecError,
    StoreBusyError,
    StoreReadError,
    StoreWriteError,
)
from hookscope.redaction import scrub, secrets_of

__all__ = ["EXIT_CODES", "app", "exit_code", "main"]

EXIT_BAD_INPUT = 2
EXIT_FAILURE = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a process stopped by Ctrl-C

#: The exit code of each error class. An error takes the code of the first class of its MRO
#: listed here, so a subclass listed overrides its base: every ``HookscopeError`` is bad input
#: except those that happen however right the command was.
EXIT_CODES: dict[type[BaseException], int] = {
    HookscopeError: EXIT_BAD_INPUT,  # a spec, selector, option, file or store the command named
    DataError: EXIT_FAILURE,  # the data broke a promise part-way (fewer rows than its len(), ...)
    StoreBusyError: EXIT_FAILURE,  # another process is writing the store now: run again once it is done
    StoreWriteError: EXIT_FAILURE,  # writing failed part-way (disk full); the same command resumes
    StoreReadError: EXIT_FAILURE,  # a chunk could not be fetched (the network): the store is not known to be damaged
    OutputWriteError: EXIT_FAILURE,  # a file's write failed part-way (disk full); nothing was left
    ConcurrentPassError: EXIT_FAILURE,  # a replica or autograd thread would mix into the pass: nothing the command did
    SinkError: EXIT_FAILURE,  # a metrics sink failed to write (disk full); the other sinks have the step
    KeyboardInterrupt: EXIT_INTERRUPTED,
    Exception: EXIT_FAILURE,  # anything else: the model, torch, the system failed while running
}

#: What every command says when its model raises on the sample input it made up (exit 2).
_SAMPLE_FIX = "pass an --input-shape the model accepts"

#: What Ctrl-C leaves behind, unless a command says otherwise (``_on_interrupt``).
_NOTHING_KEPT = "interrupted (Ctrl-C) before the command finished; run it again to do it all"


def exit_code(error: BaseException) -> int:
    """The code the command line exits with after ``error``: the first entry of its MRO in ``EXIT_CODES``.

    >>> exit_code(hs.SpecError("bad")), exit_code(hs.DataError("short")), exit_code(KeyboardInterrupt())
    (2, 1, 130)
    """
    return next((EXIT_CODES[cls] for cls in type(error).__mro__ if cls in EXIT_CODES), EXIT_FAILURE)


class _Commands(TyperGroup):
    """The group of commands; a Ctrl-C in any of them prints what was kept and exits 130.

    Here rather than in :func:`main` because typer turns a ``KeyboardInterrupt`` into a silent
    exit before ``main`` could see it.
    """

    def invoke(self, ctx: Any) -> Any:  # click's Context: typer vendors click from 0.29 on, under a private name
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as stop:
            typer.echo(f"error: {_interrupt_note(ctx)}", err=True)
            raise typer.Exit(exit_code(stop)) from None


def _interrupt_note(ctx: Any) -> str:
    """The line a command left for Ctrl-C (text, or a function that reads what was kept), or the default."""
    note = (ctx.obj or {}).get("on_interrupt", _NOTHING_KEPT)
    if not callable(note):
        return str(note)
    try:
        return str(note())
    except Exception:  # what was kept cannot be read now: say the general truth
        return _NOTHING_KEPT


app = typer.Typer(
    name="hookscope",
    cls=_Commands,
    help="Look inside PyTorch models and change what happens there, through module hooks.",
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"hookscope {hs.__version__}")
        raise typer.Exit()


def _on_interrupt(ctx: typer.Context, note: str | Callable[[], str]) -> None:
    """Say what a Ctrl-C from now on leaves behind (the line printed before exit code 130).

    A function is called after the Ctrl-C, so the line can say what was kept by then.
    """
    ctx.ensure_object(dict)["on_interrupt"] = note


@app.callback(invoke_without_command=True)
def _root(
    ctx: typer.Context,
    version: Annotated[
        bool, typer.Option("--version", help="Print the version and exit.", callback=_print_version, is_eager=True)
    ] = False,
) -> None:
    """Look inside PyTorch models and change what happens there, through module hooks."""
    if ctx.invoked_subcommand is None:  # no subcommand: help, and the exit code of a usage error
        typer.echo(ctx.get_help())
        raise typer.Exit(EXIT_BAD_INPUT)


@app.command()
def demo(
    out: Annotated[
        Path, typer.Option("--out", "-o", help="Folder for the files the demo writes.", file_okay=False)
    ] = Path("hookscope-demo"),
) -> None:
    """Run the guided tour: hooks, capture, trace, gradients, edits, extraction, and an HTML report
    of the built-in shapes classifier (written to OUT/report.html)."""
    from hookscope.demo.tour import run_tour

    run_tour(out, write=typer.echo)


@app.command("layers")
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
    from hookscope.cli.sample import SampleRun, build_model
    from hookscope.cli.specs import make_input

    if no_run and input_shape is not None:
        raise SpecError("--no-run and --input-shape contradict each other; drop one")
    if no_run and (ops or ops_in):
        raise SpecError("--ops lists the op sites a forward pass ran, and --no-run runs none; drop one")
    if ops_in and not ops:
        raise SpecError("--ops-in chooses whose op sites --ops lists; add --ops")
    if no_run and std:
        raise SpecError("--std checks the canonical names on a forward pass, and --no-run runs none; drop one")
    chosen: Any = _selectors(ops_in) if ops_in else ops
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


@app.command("capture")
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
    keep: Annotated[str, typer.Option("--keep", help="output, input or both.")] = "output",
    calls: Annotated[str, typer.Option("--calls", help="all, first, last, or a call index.")] = "all",
    reduce: Annotated[
        str | None, typer.Option("--reduce", help="Reduce on the device first, e.g. mean:1, sum:2,3, first:1.")
    ] = None,
    stop: Annotated[bool, typer.Option("--stop", help="Skip the rest of the model after the last layer.")] = False,
    max_bytes: Annotated[
        str | None, typer.Option("--max-bytes", help="Memory budget for the capture, e.g. 512MiB.")
    ] = None,
    seed: Annotated[int, seed_option("Seed of the random sample input.")] = 0,
) -> None:
    """Run MODEL once on a sample input and save the chosen layers' values to a file."""
    from hookscope.cli.sample import prepare

    hs.tensor_file_format(out)  # a mistyped extension fails before the model runs, not after
    hs.check_output_path(out, what="-o")  # so does a path that cannot be written
    selectors = _selectors(layers)
    sample = prepare(model, input_shape, dtype, seed)
    typer.echo(sample.describe_input())
    options = hs.CaptureOptions(
        keep=keep,  # type: ignore[arg-type]  # a word the options check
        calls=_calls(calls),
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
    typer.echo(f"saved {_counted(len(cache), 'tensor')} to {saved} ({_counted(saved.stat().st_size, 'byte')})")


@app.command("trace")
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
    timing: Annotated[bool, typer.Option("--timing", help="Time each call (and its own share).")] = False,
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
    matched no op call of a module that ran is an error.

    Exit 0 when the forward ran; when it raised, the calls up to the failure are printed, then
    the module where it raised and the shapes that went in, and the exit code is 2, as for every
    command whose model refuses the sample input.
    """
    import torch

    from hookscope.cli.sample import prepare

    for option, path in (("--csv", csv), ("--json", json)):
        if path is not None:
            hs.check_output_path(path, what=option)  # before the model runs, not after
    op_selectors = [str(selector) for selector in _selectors(ops or [])]
    chosen: bool | list[str] = True
    if stats is not None:
        chosen = False if stats.strip() == "none" else [str(part) for part in _selectors([stats])]
    # a malformed op selector or statistic fails now
    options = hs.TraceOptions(timing=timing, ops=op_selectors or False, stats=chosen)
    sample = prepare(model, input_shape, dtype, seed)
    typer.echo(sample.describe_input())
    selectors = _selectors(only or [])
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
    for path, write in ((csv, result.to_csv), (json, result.to_json)):
        if path is not None:
            write(path)
            typer.echo(f"wrote {path}")
    if failed is not None:  # the partial trace is shown and written; then the error, and exit 2
        raised, where = failed
        typer.echo(f"error: {type(raised).__name__}: {raised}", err=True)
        typer.echo(f"the forward raised in {where.describe()}", err=True)
        typer.echo(f"the model refuses the sample input; {_SAMPLE_FIX}", err=True)
        raise typer.Exit(EXIT_BAD_INPUT)


@app.command("grads")
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


@app.command("edit")
def edit_command(
    model: ModelSpec,
    edit: Annotated[
        list[str],
        typer.Option(
            "--edit",
            "-e",
            help="SELECTOR=KIND[:key=value]..., e.g. 'layer1.0.conv2=zero:channels=0,3'; SELECTOR may be an op "
            "site ('h.0.attn:op[softmax#0]', 'h.*:op[add#0]') or an attention sub-site "
            "('h.0.attn:attn.z=zero:heads=3', 'h.0.attn:attn.pattern=scale:factor=0.5'); kinds: zero, scale "
            "(factor=), clamp (min=, max=), noise (std=, seed=). Repeat for several edits, applied in order.",
            show_default=False,
        ),
    ],
    input_shape: InputShape = None,
    dtype: Dtype = None,
    on: Annotated[str, typer.Option("--on", help="Edit what the modules return (output) or take (input).")] = "output",
    seed: Annotated[int, seed_option("Seed of the random sample input.")] = 0,
) -> None:
    """Run MODEL with and without edits and print how much the final output changed."""
    import torch

    from hookscope.cli.edit_specs import parse_edit
    from hookscope.cli.sample import prepare

    parsed: dict[Any, list[Any]] = {}
    for text in edit:
        selector, built = parse_edit(text)
        parsed.setdefault(selector, []).append(built)
    if on not in ("output", "input"):
        raise SpecError(f"--on {on!r} is not 'output' or 'input'")
    options = hs.EditOptions(on=on)  # type: ignore[arg-type]  # checked just above
    sample = prepare(model, input_shape, dtype, seed)
    typer.echo(sample.describe_input())
    net = sample.model.eval()
    with torch.no_grad():
        plain = sample.run(lambda m, args, kwargs: m(*args, **kwargs))
        with hs.edit(net, parsed, options=options) as editor:
            typer.echo(f"edits on {', '.join(editor.sites)}")
            edited = sample.run(lambda m, args, kwargs: m(*args, **kwargs))
    before = [(p, t) for p, t in hs.flatten_tensors(plain) if t.is_floating_point()]
    after = [t for _, t in hs.flatten_tensors(edited) if t.is_floating_point()]
    if not before or len(before) != len(after):
        raise SpecError("the model's output holds no floating-point tensor to compare")
    path, first = before[0]
    a, b = first.double().flatten(), after[0].double().flatten()
    delta = (b - a).abs()
    cosine = torch.nn.functional.cosine_similarity(a, b, dim=0).item()
    typer.echo(
        f"{path} {tuple(first.shape)}: max |delta| {delta.max().item():.4g}, mean |delta| "
        f"{delta.mean().item():.4g}, cosine similarity {cosine:.6f}"
    )


@app.command("report")
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
            layers=_selectors(layers or []) or None,
            model_kwargs=sample.kwargs,
            **options,
        )
    except (HookscopeError, OSError):
        raise  # bad input, or a file that cannot be written (exit 1)
    except Exception as error:  # the model failed on the made-up input: the likeliest culprit
        raise SpecError(
            f"the forward pass on the sample input raised {type(error).__name__}: {error}; {_SAMPLE_FIX}"
        ) from error
    typer.echo(f"wrote {written} ({written.stat().st_size / 1024:,.0f} KiB)")


app.command("diff")(diff_command)
app.command("train-check")(train_check_command)
app.command("patch")(patch_command)
app.command("lens")(lens_command)


@app.command("extract")
def extract_command(
    ctx: typer.Context,
    model: ModelSpec,
    data: Annotated[
        str,
        typer.Option(
            "--data",
            "-D",
            help="random:N[:SHAPE], a .npy/.npz/.pt/.safetensors file, or package.module:factory "
            "(a Dataset, DataLoader or iterable of batches).",
            show_default=False,
        ),
    ],
    layers: Annotated[
        list[str],
        typer.Option(
            "--layers",
            "-l",
            help="Modules to store: names, globs or 're:' regexes; repeat or comma-separate.",
            show_default=False,
        ),
    ],
    out: Annotated[
        str,
        typer.Option(
            "--out",
            "-o",
            help="The zarr store to write: a path (feats.zarr) or an fsspec URL (s3://bucket/feats.zarr).",
            show_default=False,
        ),
    ],
    storage_options: Annotated[
        list[str] | None,
        typer.Option(
            "--storage-option",
            help="KEY=VALUE for the file system of an --out URL (endpoint_url=..., key=..., anon=true); repeat.",
            show_default=False,
        ),
    ] = None,
    tokens: Annotated[
        str,
        typer.Option("--tokens", help="Keep each row's token ids: auto (when the data has some), yes, or no."),
    ] = "auto",
    reduce: Annotated[
        list[str] | None,
        typer.Option(
            "--reduce",
            "-r",
            help="Reduce before storing: mean:1, cls, last, max:1, ... for every layer, or SELECTOR=SPEC for some "
            "(repeat; the first that selects a layer applies).",
            show_default=False,
        ),
    ] = None,
    dtype: Annotated[
        str | None, typer.Option("--dtype", help="Store floating values as fp16, bf16, fp32 or fp64.")
    ] = None,
    model_dtype: Annotated[
        str | None, typer.Option("--model-dtype", help="Cast the model first: fp16, bf16, ...")
    ] = None,
    device: Annotated[
        str | None,
        typer.Option(
            "--device", help="Run on this device (cuda, cuda:1, cpu); under torchrun, cuda means each rank's own GPU."
        ),
    ] = None,
    batch_size: Annotated[
        int | None,
        typer.Option("--batch-size", "-b", min=1, max=COUNT_MAX, help="Rows per forward of a data set (default 32)."),
    ] = None,
    num_workers: Annotated[
        int | None,
        typer.Option(
            "--num-workers",
            min=0,
            max=MAX_WORKERS,
            help="DataLoader worker processes (default: a loader's own, else 0).",
        ),
    ] = None,
    chunk_rows: Annotated[
        int | None,
        typer.Option("--chunk-rows", min=1, max=COUNT_MAX, help="Rows per chunk, a multiple of the batch size."),
    ] = None,
    keep: Annotated[str, typer.Option("--keep", help="output, input or both.")] = "output",
    calls: Annotated[str, typer.Option("--calls", help="all, first, last, or a call index.")] = "all",
    mask: Annotated[
        str, typer.Option("--mask", help="Batch key of the padding mask for token reductions; 'none' to ignore it.")
    ] = "auto",
    compression: Annotated[str, typer.Option("--compression-level", help="zstd level (1-22), or 'none'.")] = "3",
    progress: Annotated[
        bool | None, typer.Option("--progress/--no-progress", help="Show progress (default: on a terminal).")
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume/--no-resume", help="Continue a store a stopped run left (default).")
    ] = True,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a store made another way.")] = False,
    seed: Annotated[int, seed_option("Seed of random weights (hf-config) and random: data.")] = 0,
) -> None:
    """Run MODEL over a data set and store the chosen layers' values for every row in a zarr store.

    Resumable: run the same command again after a crash and it continues. Under
    `torchrun --nproc-per-node N -m hookscope extract ...` the ranks share the chunks.
    """
    import shlex
    import time

    import torch

    from hookscope.cli.data_specs import load_data
    from hookscope.cli.extract_run import (
        distributed_job,
        done_line,
        interrupted_note,
        parse_reductions,
        parse_storage_options,
        recorded,
        refused_first_batch,
        store_size,
    )
    from hookscope.cli.sample import build_model

    level = None if compression.strip().lower() == "none" else _int_option("--compression-level", compression)
    reductions = parse_reductions(reduce or [])
    storage = parse_storage_options(storage_options or [])
    keep_tokens = _tokens_choice(tokens)
    # recorded by the store with credentials redacted (hs.extract); shown back as typed after Ctrl-C
    command = "hookscope " + shlex.join((ctx.obj or {}).get("argv", sys.argv[1:]))
    _on_interrupt(ctx, lambda: interrupted_note(out, command, storage))
    with distributed_job(device) as (rank, run_on):
        torch.manual_seed(seed)  # random weights of a config-built model: the same in every run and rank
        net = build_model(model, model_dtype).to(run_on)
        dataset = load_data(data, net, seed=seed)
        started = time.perf_counter()
        options = hs.ExtractConfig(
            reduce=reductions,
            dtype=dtype,
            device=run_on,
            batch_size=batch_size,
            num_workers=num_workers,
            chunk_rows=chunk_rows,
            keep=keep,  # type: ignore[arg-type]  # a word the options check
            calls=_calls(calls),
            mask=None if mask.strip().lower() == "none" else mask,
            progress=progress,
            resume=resume,
            overwrite=overwrite,
            compression_level=level,
            model_spec=model,
            command=command,
            storage_options=storage,
            tokens=keep_tokens,
        )

        kept = recorded(out, storage) if resume and not overwrite else None  # what an earlier run left, to resume after
        if rank == 0 and kept is not None and kept.done and kept.done < kept.chunks:
            typer.echo(
                f"resumed after {kept.done:,} chunks: {kept.done_rows:,} of {kept.rows:,} rows were recorded by an "
                "earlier run"
            )
        with refused_first_batch(net, data):
            store = hs.extract(net, dataset, _selectors(layers), out, options=options)
        elapsed = time.perf_counter() - started
        if rank == 0:
            typer.echo(repr(store))
            typer.echo(done_line(store, out, elapsed, store_size(out)))


def _tokens_choice(text: str) -> bool | Literal["auto"]:
    choice = {"auto": "auto", "yes": True, "true": True, "no": False, "false": False}.get(text.strip().lower())
    if choice is None:
        raise SpecError(f"--tokens {text!r} is not auto, yes or no")
    return choice  # type: ignore[return-value]


def _int_option(name: str, text: str) -> int:
    if not text.strip().lstrip("-").isdecimal():
        raise SpecError(f"{name} {text!r} is not an integer")
    return int(text)


def _counted(count: int, noun: str) -> str:
    """``1 site``, ``2 sites``: a count with its noun, plural unless one."""
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def _calls(text: str) -> Any:
    """``--calls``: a call index, or a word the options check (all, first, last)."""
    return int(text) if text.isdigit() else text


def _selectors(options: list[str]) -> list[hs.Selector]:
    """Selectors from a repeatable option whose values may also be comma-separated (a comma
    inside a regex's ``{1,2}`` or a glob's ``[0,1]`` stays in its selector)."""
    return list(split_selectors(options))


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``hookscope`` console script; exits with the codes of ``EXIT_CODES``."""
    try:  # usage errors (unknown command or option) are typer's: usage text and exit code 2
        given = list(sys.argv[1:] if argv is None else argv)
        app(args=given, prog_name="hookscope", obj={"argv": given})  # extract records its command line
    except Exception as error:  # one line, not a traceback
        _fail(error, exit_code(error), secrets_of(argv=given))


def _fail(error: Exception, code: int, secrets: tuple[str, ...] = ()) -> None:
    if os.environ.get("HOOKSCOPE_TRACEBACK"):
        raise error
    if isinstance(error, HookscopeError):  # another library's error may quote a credential it was given
        typer.echo(scrub(f"error: {error}", secrets), err=True)
    else:
        typer.echo(scrub(f"error: {type(error).__name__}: {error}", secrets), err=True)
        typer.echo("(set HOOKSCOPE_TRACEBACK=1 to see where it happened)", err=True)
    sys.exit(code)

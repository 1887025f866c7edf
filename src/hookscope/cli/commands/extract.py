"""``hookscope extract``: a data set's values of chosen layers, stored in a zarr store."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

import hookscope as hs
from hookscope.cli.common import on_interrupt
from hookscope.cli.parse.flags import option_default, option_flag
from hookscope.cli.parse.options import MAX_WORKERS, ModelSpec, seed_option
from hookscope.cli.parse.specs import COUNT_MAX
from hookscope.cli.parse.values import calls_value, int_option, selector_list, tokens_choice

__all__ = ["extract_command"]

#: The capture options of every stored site (--keep, --calls), whose flags are their fields' own.
CAPTURE = hs.CaptureOptions


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
            help=(
                "Modules to store (names, globs or 're:' regexes), op sites ('h.0:op[add#0]') and attention "
                "sub-sites ('h.*.attn:attn.pattern'); repeat or comma-separate."
            ),
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
        typer.Option(
            "--tokens",
            help="Keep each row's token ids: auto (when a layer is stored per token and the data has ids), yes, no.",
        ),
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
    keep: Annotated[str, option_flag(CAPTURE, "keep")] = option_default(CAPTURE, "keep"),
    calls: Annotated[str, option_flag(CAPTURE, "calls")] = option_default(CAPTURE, "calls"),
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
    from hookscope.cli.parse.data_specs import load_data
    from hookscope.cli.sample import build_model

    level = None if compression.strip().lower() == "none" else int_option("--compression-level", compression)
    reductions = parse_reductions(reduce or [], selector_list(layers))
    storage = parse_storage_options(storage_options or [])
    keep_tokens = tokens_choice(tokens)
    # recorded by the store with credentials redacted (hs.extract); shown back as typed after Ctrl-C
    command = "hookscope " + shlex.join((ctx.obj or {}).get("argv", sys.argv[1:]))
    on_interrupt(ctx, lambda: interrupted_note(out, command, storage))
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
            calls=calls_value(calls),
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
            store = hs.extract(net, dataset, out, layers=selector_list(layers), options=options)
        elapsed = time.perf_counter() - started
        if rank == 0:
            typer.echo(repr(store))
            typer.echo(done_line(store, out, elapsed, store_size(out)))

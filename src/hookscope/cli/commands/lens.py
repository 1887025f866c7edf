"""``hookscope lens``: the logit lens from a shell line."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

import hookscope as hs
from hookscope.cli.method_run import (
    FIGURE_OUTPUTS,
    Seed,
    check_out,
    check_read,
    figure_bytes,
    parse_decoder_ids,
    refused,
    seeded,
    stack_prefix,
    text_table,
    with_decoder,
    write_file,
)
from hookscope.cli.parse.options import Dtype, ModelSpec

__all__ = ["lens_command", "lens_table"]


def lens_command(
    model: ModelSpec,
    prompt: Annotated[
        str,
        typer.Option(
            "--prompt", "-p", help="Token ids: ints joined by ',', rows by ';' (e.g. '5,6,7,8').", show_default=False
        ),
    ],
    top: Annotated[int, typer.Option("--top", "-k", min=1, help="Tokens to print per layer.")] = 5,
    position: Annotated[int, typer.Option("--position", help="The position read (negative: from the end).")] = -1,
    row: Annotated[int, typer.Option("--row", min=0, help="The row of the prompt batch read.")] = 0,
    layers: Annotated[
        list[str] | None,
        typer.Option(
            "--layers",
            "-l",
            help="Canonical residual names to read (default std:blocks.*.resid_post; e.g. std:blocks.*.resid_pre).",
            show_default=False,
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out", "-o", help="Also draw the lens (layers x positions): .png, .svg or .pdf.", show_default=False
        ),
    ] = None,
    stack: Annotated[
        str | None,
        typer.Option(
            "--stack",
            help="The stack read: 'decoder.' (the default for an encoder-decoder model such as T5) or 'encoder.'.",
            show_default=False,
        ),
    ] = None,
    decoder_prompt: Annotated[
        str | None,
        typer.Option(
            "--decoder-prompt",
            help="An encoder-decoder's decoder token ids, one row per --prompt row (default: its start token).",
            show_default=False,
        ),
    ] = None,
    dtype: Dtype = None,
    seed: Seed = 0,
) -> None:
    """The logit lens: what each layer's residual stream would predict, read through the final norm and unembedding.

    Prints, per layer, the most likely token ids at one position with their probabilities: where
    in the depth of the model a prediction forms. MODEL needs an LM head (a ...ForCausalLM model,
    e.g. hf-config:gpt2/causal-lm, or an encoder-decoder's, hf-config:t5/seq2seq-lm, whose decoder
    is read: --prompt feeds the encoder, --decoder-prompt the decoder).

    Example: hookscope lens 'hf-config:gpt2/causal-lm?n_layer=2' --prompt 5,6,7,8 --top 3 --out lens.png
    """
    from hookscope.cli.parse.method_specs import LENS_FLAGS, parse_ids, split_selectors

    if out is not None:
        check_out(out, FIGURE_OUTPUTS)
    stack = stack_prefix(stack)  # before anything reads it: --stack encoder is --stack encoder.
    ids = parse_ids(prompt, what="--prompt")
    decoder_ids = parse_decoder_ids(decoder_prompt, ids.shape[0], "--prompt")
    read_decoder = decoder_ids is not None and stack != "encoder."
    check_read(
        decoder_ids if read_decoder else ids, row, position, "--decoder-prompt" if read_decoder else "the prompt"
    )
    chosen = split_selectors(layers or []) or None
    net = seeded(model, dtype, seed)
    inputs = with_decoder(net, ids, decoder_ids)
    if isinstance(inputs, dict) and stack is None:
        stack = "decoder."  # an encoder-decoder's decoder feeds the head
    if decoder_ids is None and stack == "decoder.":
        check_read(
            inputs["decoder_input_ids"],
            row,
            position,
            "the decoder's input (its start token; --decoder-prompt gives more)",
        )
    lens = refused(lambda: hs.methods.logit_lens(net, inputs, layers=chosen, stack=stack or ""), LENS_FLAGS)
    typer.echo(lens_table(lens, top, position=position, row=row))
    if out is not None:
        write_file(out, figure_bytes(lens.plot(row=row), out.suffix.lower()[1:]))
        typer.echo(f"wrote {out}")


def lens_table(lens: hs.methods.Lens, k: int, *, position: int, row: int) -> str:
    """Per layer, the ``k`` most likely tokens at ``position`` of ``row`` with their probabilities."""
    best = lens.top(k, position=position, row=row)
    rows = [
        [name, "  ".join(f"{token} {p:.3f}" for token, p in tokens)]
        for name, tokens in zip(lens.layers, best, strict=True)
    ]
    title = f"logit lens: {len(lens.layers)} layers, position {position} of row {row}"
    return title + "\n" + text_table(["layer", f"top {k} tokens (id probability)"], rows) + "\n" + lens.readout

"""``hookscope patch`` and ``hookscope lens``: the patching sweep and the logit lens from a shell line.

Both take token ids written out (``--clean "5,6,7,8;9,10,11,12"``, see
:mod:`hookscope.cli.method_specs`), since a model spec brings no tokenizer: the weights of an
``hf-config:`` model are random, and ids are what a study pins down anyway. A model that refuses
the ids (an id outside its vocabulary, a sequence longer than its positions) is bad input: exit 2.
"""

from __future__ import annotations

import base64
import html
import io
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import typer

import hookscope as hs
from hookscope.cli.options import Dtype, ModelSpec, seed_option
from hookscope.errors import HookscopeError, OutputWriteError, SpecError

__all__ = ["lens_command", "patch_command"]

T = TypeVar("T")

_PATCH_OUTPUTS = (".html", ".htm", ".csv", ".png")
_FIGURE_OUTPUTS = (".png", ".svg", ".pdf")

Seed = Annotated[int, seed_option("Seed of the random weights of an hf-config: model.")]


def patch_command(
    model: ModelSpec,
    clean: Annotated[
        str,
        typer.Option(
            "--clean",
            help="Token ids of the clean run: ints joined by ',', rows by ';' (e.g. '5,6,7;9,10,11').",
            show_default=False,
        ),
    ],
    corrupted: Annotated[
        str,
        typer.Option(
            "--corrupted", help="Token ids of the corrupted run, the same shape as --clean.", show_default=False
        ),
    ],
    metric: Annotated[
        str,
        typer.Option(
            "--metric",
            "-m",
            help="What a patch moves: 'logit_diff:A,B', 'logprob:T', 'loss' (the patched run's own ids; "
            "'loss:clean', 'loss:corrupted'), at the last position unless '@P' follows (logit_diff:3,4@2).",
            show_default=False,
        ),
    ],
    sites: Annotated[
        list[str] | None,
        typer.Option(
            "--sites",
            "-l",
            help="Values to patch: canonical names or selectors, repeat or comma-separate; a comma inside (), [] "
            "or {} stays in its selector, as in 're:h[.][0-9]{1,2}' (default std:blocks.*.resid_pre; with --heads "
            "std:blocks.*.attn.z).",
            show_default=False,
        ),
    ] = None,
    positions: Annotated[
        str, typer.Option("--positions", help="'each' (a column per position), 'all' (all at once) or '3,4'.")
    ] = "each",
    heads: Annotated[bool, typer.Option("--heads", help="Patch each attention head on its own.")] = False,
    num_heads: Annotated[
        int | None,
        typer.Option(
            "--num-heads",
            min=1,
            help="With --heads on a value whose heads are merged in its last dim (e.g. an output projection's "
            "input): how many heads it holds.",
            show_default=False,
        ),
    ] = None,
    noise: Annotated[
        bool, typer.Option("--noise", help="Patch corrupted values into the clean run (default: clean into corrupted).")
    ] = False,
    atp: Annotated[
        bool, typer.Option("--atp", help="Estimate the grid by attribution patching: one forward and backward.")
    ] = False,
    verify: Annotated[
        int, typer.Option("--verify", min=0, help="With --atp: patch the largest N cells exactly; flag disagreements.")
    ] = 0,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out", "-o", help="Also write the grid: .html (heatmap and every cell), .csv or .png.", show_default=False
        ),
    ] = None,
    top: Annotated[int, typer.Option("--top", "-k", min=1, help="Cells to print, largest effect first.")] = 10,
    batch_rows: Annotated[
        int | None, typer.Option("--batch-rows", min=1, help="Rows per forward of the sweep (default 64).")
    ] = None,
    stack: Annotated[
        str | None,
        typer.Option(
            "--stack",
            help="An encoder-decoder's stack whose blocks are patched by default: 'decoder.' or 'encoder.'.",
            show_default=False,
        ),
    ] = None,
    decoder_prompt: Annotated[
        str | None,
        typer.Option(
            "--decoder-prompt",
            help="An encoder-decoder's decoder token ids, the same in both runs, one row per --clean row "
            "(default: its start token). --clean and --corrupted feed the encoder.",
            show_default=False,
        ),
    ] = None,
    dtype: Dtype = None,
    seed: Seed = 0,
) -> None:
    """Activation patching: the effect of each site x position (x head) on a metric, patched on its own.

    Runs the clean and the corrupted ids, then the corrupted run once per cell with that one
    value taken from the clean run (--noise: the other way round), many cells per forward, and
    prints the cells that moved the metric most, normalised: 1 restores the clean score, 0
    changes nothing. --atp estimates the same grid from one backward pass instead.

    Example: hookscope patch 'hf-config:gpt2/causal-lm?n_layer=2' --clean 5,6,7,8 --corrupted 5,6,9,8 -m logit_diff:3,4
    """
    from hookscope.cli.method_specs import (
        PATCH_FLAGS,
        check_pair,
        parse_ids,
        parse_metric,
        parse_positions,
        split_selectors,
    )

    if verify and not atp:
        raise SpecError("--verify checks an --atp estimate by exact patches; add --atp or drop --verify")
    if out is not None:
        _check_out(out, _PATCH_OUTPUTS)
    clean_ids, corrupted_ids = parse_ids(clean, what="--clean"), parse_ids(corrupted, what="--corrupted")
    check_pair(clean_ids, corrupted_ids)
    direction: Literal["denoise", "noise"] = "noise" if noise else "denoise"
    scorer = parse_metric(metric, clean=clean_ids, corrupted=corrupted_ids, direction=direction)
    chosen = split_selectors(sites or []) or None
    where = parse_positions(positions)
    stack = _stack(stack)
    decoder_ids = _decoder_ids(decoder_prompt, clean_ids.shape[0], "--clean")
    net = _seeded(model, dtype, seed)
    clean_in, corrupted_in = (_with_decoder(net, ids, decoder_ids) for ids in (clean_ids, corrupted_ids))
    if atp:
        effects = _refused(
            lambda: hs.methods.attribution_patch(
                net, clean_in, corrupted_in, metric=scorer, sites=chosen, positions=where, heads=heads,
                num_heads=num_heads, stack=stack or "", direction=direction, verify=verify,
            ), PATCH_FLAGS,
        )  # fmt: skip
    else:
        effects = _refused(
            lambda: hs.methods.patch_sweep(
                net, clean_in, corrupted_in, metric=scorer, sites=chosen, positions=where, heads=heads,
                num_heads=num_heads, stack=stack or "", direction=direction, batch_rows=batch_rows,
            ), PATCH_FLAGS,
        )  # fmt: skip
    typer.echo(effects_table(effects, top))
    if effects.clean == effects.corrupted:  # the grid is NaN, which the table shows as 0
        typer.echo(
            f"note: the clean and corrupted runs both score {effects.clean:.6g}, so no effect can be normalised "
            "(every cell is NaN); pick ids or a metric that tell the runs apart",
            err=True,
        )
    for flag in effects.flags:
        typer.echo(f"flag: {flag} (the estimate and the exact patch disagree in sign)")
    if verify and not effects.flags:
        checked = len(effects.verified)
        typer.echo(
            f"verified: no flag; the {checked} largest cell{'' if checked == 1 else 's'} patched exactly agree in "
            "sign with the estimate (or move the metric by less than 0.05)"
        )
    if out is not None:
        settings = {
            "model": model,
            "clean": clean,
            "corrupted": corrupted,
            "metric": f"{metric} ({effects.metric})",
            "sites": ", ".join(chosen or []) or "(default)",
            "positions": positions,
            "heads": ("each on its own" + (f" ({num_heads} merged)" if num_heads else "")) if heads else "no",
            "direction": direction,
            "stack": stack or "(default)",
            "decoder prompt": decoder_prompt or "(start token)" if isinstance(clean_in, dict) else "(none)",
            "method": effects.method + (f", verify={verify}" if atp else ""),
            "clean score": f"{effects.clean:.6g}",
            "corrupted score": f"{effects.corrupted:.6g}",
            "seed": str(seed),
        }
        _write_effects(effects, out, settings)
        typer.echo(f"wrote {out}")


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
    from hookscope.cli.method_specs import LENS_FLAGS, parse_ids, split_selectors

    if out is not None:
        _check_out(out, _FIGURE_OUTPUTS)
    stack = _stack(stack)  # before anything reads it: --stack encoder is --stack encoder.
    ids = parse_ids(prompt, what="--prompt")
    decoder_ids = _decoder_ids(decoder_prompt, ids.shape[0], "--prompt")
    read_decoder = decoder_ids is not None and stack != "encoder."
    _check_read(
        decoder_ids if read_decoder else ids, row, position, "--decoder-prompt" if read_decoder else "the prompt"
    )
    chosen = split_selectors(layers or []) or None
    net = _seeded(model, dtype, seed)
    inputs = _with_decoder(net, ids, decoder_ids)
    if isinstance(inputs, dict) and stack is None:
        stack = "decoder."  # an encoder-decoder's decoder feeds the head
    if decoder_ids is None and stack == "decoder.":
        _check_read(
            inputs["decoder_input_ids"],
            row,
            position,
            "the decoder's input (its start token; --decoder-prompt gives more)",
        )
    lens = _refused(lambda: hs.methods.logit_lens(net, inputs, layers=chosen, stack=stack or ""), LENS_FLAGS)
    typer.echo(lens_table(lens, top, position=position, row=row))
    if out is not None:
        _write(out, _figure_bytes(lens.plot(row=row), out.suffix.lower()[1:]))
        typer.echo(f"wrote {out}")


def _check_read(ids: Any, row: int, position: int, what: str) -> None:
    """Refuse a --row or --position outside the ids the lens reads, before the model runs."""
    rows, seq = ids.shape
    if row >= rows:
        raise SpecError(f"--row {row}: {what} has {rows} row{'' if rows == 1 else 's'} (0 to {rows - 1})")
    if not -seq <= position < seq:
        plural = "" if seq == 1 else "s"
        raise SpecError(f"--position {position}: {what} has {seq} position{plural} (0 to {seq - 1}, or -1 to -{seq})")


def _stack(stack: str | None) -> str | None:
    """``--stack`` as the library spells it: ``decoder`` is ``decoder.``; ``''`` reads one stack."""
    return stack + "." if stack and not stack.endswith(".") else stack


def _decoder_ids(text: str | None, rows: int, paired: str) -> Any:
    """``--decoder-prompt``'s ids (None where not given), one row per row of ``paired``."""
    from hookscope.cli.method_specs import parse_ids

    if text is None:
        return None
    ids = parse_ids(text, what="--decoder-prompt")
    if ids.shape[0] != rows:
        raise SpecError(
            f"--decoder-prompt has {ids.shape[0]} rows and {paired} {rows}: give the decoder one row per {paired} row"
        )
    return ids


def _with_decoder(net: Any, ids: Any, decoder_ids: Any) -> Any:
    """The model's input: ``ids``, or for an encoder-decoder the encoder's ``ids`` with the
    decoder's (``decoder_ids``, or its start token, one per row)."""
    encoder_decoder = getattr(getattr(net, "config", None), "is_encoder_decoder", False) is True
    if not encoder_decoder:
        if decoder_ids is not None:
            raise SpecError(f"--decoder-prompt: {type(net).__name__} is not an encoder-decoder; drop the option")
        return ids
    if decoder_ids is None:
        _, sample = hs.sample_input(net, (ids.shape[0], 1))
        decoder_ids = sample.get("decoder_input_ids")
        if decoder_ids is None:
            raise SpecError(f"{type(net).__name__} takes no decoder_input_ids; pass --stack '' to read it as one stack")
    return {"input_ids": ids, "decoder_input_ids": decoder_ids}


# -- printing --------------------------------------------------------------------------------------


def effects_table(effects: hs.methods.Effects, k: int) -> str:
    """The ``k`` cells of largest effect as a text table under a line saying what was run."""
    cells = " x ".join(str(size) for size in effects.values.shape)
    title = (
        f"{effects.method} ({effects.direction}) of {effects.metric}: {cells} cells, "
        f"clean {effects.clean:.4g}, corrupted {effects.corrupted:.4g}"
    )
    rows = [[*map(str, labels), f"{round(value, 3) + 0.0:+.3f}"] for labels, value in effects.top(k)]  # no -0.000
    return title + "\n" + _text_table([*effects.dims, "effect"], rows, right={len(effects.dims)})


def lens_table(lens: hs.methods.Lens, k: int, *, position: int, row: int) -> str:
    """Per layer, the ``k`` most likely tokens at ``position`` of ``row`` with their probabilities."""
    best = lens.top(k, position=position, row=row)
    rows = [
        [name, "  ".join(f"{token} {p:.3f}" for token, p in tokens)]
        for name, tokens in zip(lens.layers, best, strict=True)
    ]
    title = f"logit lens: {len(lens.layers)} layers, position {position} of row {row}"
    return title + "\n" + _text_table(["layer", f"top {k} tokens (id probability)"], rows) + "\n" + lens.readout


def _text_table(header: list[str], rows: list[list[str]], *, right: set[int] | None = None) -> str:
    widths = [max(len(line[i]) for line in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        shown = [
            c.rjust(w) if i in (right or set()) else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "   ".join(shown).rstrip()

    rule = "-" * len(line(header))
    return "\n".join([line(header), rule, *map(line, rows)])


# -- writing ---------------------------------------------------------------------------------------


def _write_effects(effects: hs.methods.Effects, out: Path, settings: dict[str, str]) -> None:
    suffix = out.suffix.lower()
    if suffix == ".csv":  # one CSV writer for the package: names quoted, formula-like text marked
        effects.to_csv(out)
    elif suffix == ".png":
        _write(out, _figure_bytes(effects.plot(), "png"))
    else:
        _write(out, effects_page(effects, settings).encode("utf-8"))


def _figure_bytes(figure: Any, file_format: str) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format=file_format, dpi=100)
    return buffer.getvalue()


def _write(out: Path, data: bytes) -> None:
    """Write ``data`` through a temporary file beside ``out``: a failed write leaves nothing, and an
    earlier file stays as it was (:class:`~hookscope.errors.OutputWriteError`, exit 1)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial")
    try:
        partial.write_bytes(data)
        os.replace(partial, out)
    except OSError as error:
        partial.unlink(missing_ok=True)
        raise OutputWriteError(
            f"cannot write --out {os.fspath(out)!r}: {error.strerror or error}; nothing was written",
            path=out,
            errno=error.errno,
        ) from error


def _cells(effects: hs.methods.Effects) -> list[tuple[tuple[tuple[Any, ...], float], float]]:
    """Every cell's labels and normalised effect, with the metric itself (``raw``), in order."""
    return list(zip(effects.cells(), effects.raw.reshape(-1).tolist(), strict=True))


def effects_page(effects: hs.methods.Effects, settings: dict[str, str]) -> str:
    """One self-contained HTML page: the settings, the heatmap (an inline PNG) and every cell."""
    image = base64.b64encode(_figure_bytes(effects.plot(), "png")).decode("ascii")
    title = html.escape(f"hookscope patch: {effects.method} of {effects.metric}")
    setting_rows = "".join(
        f"<tr><th>{html.escape(key)}</th><td>{html.escape(value)}</td></tr>" for key, value in settings.items()
    )
    header = "".join(f"<th>{html.escape(name)}</th>" for name in [*effects.dims, "effect", "metric"])
    body = "".join(
        "<tr>"
        + "".join(f"<td>{html.escape(str(label))}</td>" for label in labels)
        + f'<td class="num">{value:+.4f}</td><td class="num">{raw:.6g}</td></tr>'
        for (labels, value), raw in _cells(effects)
    )
    flags = "".join(f"<li>{html.escape(str(flag))}</li>" for flag in effects.flags)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }}
th, td {{ border: 1px solid #ccc; padding: 0.2em 0.6em; text-align: left; }}
td.num {{ text-align: right; font-family: monospace; }}
img {{ max-width: 100%; }}
</style></head>
<body>
<h1>{title}</h1>
<h2>Settings</h2>
<table>{setting_rows}</table>
<h2>Heatmap</h2>
<p>Normalised effect: (patched - corrupted) / (clean - corrupted); 1 restores the clean score, 0 changes nothing.</p>
<img alt="{html.escape(effects.method)} heatmap" src="data:image/png;base64,{image}">
{f"<h2>Flags</h2><ul>{flags}</ul>" if flags else ""}
<h2>Every cell</h2>
<table><thead><tr>{header}</tr></thead><tbody>{body}</tbody></table>
</body></html>
"""


# -- shared steps ----------------------------------------------------------------------------------


def _check_out(out: Path, suffixes: Sequence[str]) -> None:
    """Refuse an output of another kind, or one that cannot be written, before the model runs."""
    if out.suffix.lower() not in suffixes:
        raise SpecError(f"--out {out}: expected a file name ending in {', '.join(suffixes)}")
    hs.check_output_path(out, what="--out")


def _seeded(model: str, dtype: str | None, seed: int) -> Any:
    """The model ``model`` names, its random weights (an hf-config: model's) drawn after ``torch.manual_seed(seed)``."""
    import torch

    from hookscope.cli.sample import build_model

    torch.manual_seed(seed)
    return build_model(model, dtype)


def _refused(call: Callable[[], T], flags: dict[str, str]) -> T:
    """``call()``; a failure that is not hookscope's is the model refusing the ids given (exit 2).
    A hookscope error names the library's arguments: they are written as the command's ``flags``."""
    from hookscope.cli.method_specs import flag_words

    try:
        return call()
    except HookscopeError as error:
        if error.args and isinstance(error.args[0], str):
            error.args = (flag_words(error.args[0], flags), *error.args[1:])
        raise
    except Exception as error:
        raise SpecError(
            f"the model raised {type(error).__name__} on the token ids given: {error}; pass ids inside its "
            "vocabulary and sequences no longer than its positions"
        ) from error

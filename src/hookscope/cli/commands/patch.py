"""``hookscope patch``: the patching sweep (or attribution patching) from a shell line."""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Annotated, Any, Literal

import typer

import hookscope as hs
from hookscope.cli.method_run import (
    Seed,
    check_out,
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
from hookscope.errors import SpecError

__all__ = ["effects_page", "effects_table", "patch_command"]

_PATCH_OUTPUTS = (".html", ".htm", ".csv", ".png")


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
            "--layers",
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
    progress: Annotated[
        bool | None,
        typer.Option("--progress/--no-progress", help="Show the sweep's progress (default: on a terminal)."),
    ] = None,
) -> None:
    """Activation patching: the effect of each site x position (x head) on a metric, patched on its own.

    Runs the clean and the corrupted ids, then the corrupted run once per cell with that one
    value taken from the clean run (--noise: the other way round), many cells per forward, and
    prints the cells that moved the metric most, normalised: 1 restores the clean score, 0
    changes nothing. --atp estimates the same grid from one backward pass instead.

    Example: hookscope patch 'hf-config:gpt2/causal-lm?n_layer=2' --clean 5,6,7,8 --corrupted 5,6,9,8 -m logit_diff:3,4
    """
    from hookscope.cli.parse.method_specs import (
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
        check_out(out, _PATCH_OUTPUTS)
    clean_ids, corrupted_ids = parse_ids(clean, what="--clean"), parse_ids(corrupted, what="--corrupted")
    check_pair(clean_ids, corrupted_ids)
    direction: Literal["denoise", "noise"] = "noise" if noise else "denoise"
    scorer = parse_metric(metric, clean=clean_ids, corrupted=corrupted_ids, direction=direction)
    chosen = split_selectors(sites or []) or None
    where = parse_positions(positions)
    stack = stack_prefix(stack)
    decoder_ids = parse_decoder_ids(decoder_prompt, clean_ids.shape[0], "--clean")
    net = seeded(model, dtype, seed)
    clean_in, corrupted_in = (with_decoder(net, ids, decoder_ids) for ids in (clean_ids, corrupted_ids))
    if atp:
        effects = refused(
            lambda: hs.methods.attribution_patch(
                net, clean_in, corrupted_in, metric=scorer, layers=chosen, positions=where, heads=heads,
                num_heads=num_heads, stack=stack or "", direction=direction, verify=verify,
            ), PATCH_FLAGS,
        )  # fmt: skip
    else:
        effects = refused(
            lambda: hs.methods.patch_sweep(
                net, clean_in, corrupted_in, metric=scorer, layers=chosen, positions=where, heads=heads,
                num_heads=num_heads, stack=stack or "", direction=direction, batch_rows=batch_rows,
                progress=progress,
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


def effects_table(effects: hs.methods.Effects, k: int) -> str:
    """The ``k`` cells of largest effect as a text table under a line saying what was run."""
    cells = " x ".join(str(size) for size in effects.values.shape)
    title = (
        f"{effects.method} ({effects.direction}) of {effects.metric}: {cells} cells, "
        f"clean {effects.clean:.4g}, corrupted {effects.corrupted:.4g}"
    )
    rows = [[*map(str, labels), f"{round(value, 3) + 0.0:+.3f}"] for labels, value in effects.top(k)]  # no -0.000
    return title + "\n" + text_table([*effects.dims, "effect"], rows, right={len(effects.dims)})


def _write_effects(effects: hs.methods.Effects, out: Path, settings: dict[str, str]) -> None:
    suffix = out.suffix.lower()
    if suffix == ".csv":  # one CSV writer for the package: names quoted, formula-like text marked
        effects.to_csv(out)
    elif suffix == ".png":
        write_file(out, figure_bytes(effects.plot(), "png"))
    else:
        write_file(out, effects_page(effects, settings).encode("utf-8"))


def _cells(effects: hs.methods.Effects) -> list[tuple[tuple[tuple[Any, ...], float], float]]:
    """Every cell's labels and normalised effect, with the metric itself (``raw``), in order."""
    return list(zip(effects.cells(), effects.raw.reshape(-1).tolist(), strict=True))


def effects_page(effects: hs.methods.Effects, settings: dict[str, str]) -> str:
    """One self-contained HTML page: the settings, the heatmap (an inline PNG) and every cell."""
    image = base64.b64encode(figure_bytes(effects.plot(), "png")).decode("ascii")
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

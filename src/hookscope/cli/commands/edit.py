"""``hookscope edit``: one forward with an edit, compared with the unedited output."""

from __future__ import annotations

from typing import Annotated, Any

import typer

import hookscope as hs
from hookscope.cli.parse.flags import option_default, option_flag
from hookscope.cli.parse.options import Dtype, InputShape, ModelSpec, seed_option
from hookscope.errors import SpecError

__all__ = ["edit_command"]


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
    on: Annotated[str, option_flag(hs.EditOptions, "on")] = option_default(hs.EditOptions, "on"),
    seed: Annotated[int, seed_option("Seed of the random sample input.")] = 0,
) -> None:
    """Run MODEL with and without edits and print how much the final output changed."""
    import torch

    from hookscope.cli.parse.edit_specs import parse_edit
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

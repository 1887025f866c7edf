"""``hookscope train-check``: a short training run with every monitor on, and its health report.

Where ``hookscope grads`` looks at gradient flow at initialisation, ``train-check`` trains for
``--steps`` and reports what a long run would trip over: per layer, the gradient and activation
scale at the first and last step, the worst precision loss in the chosen format, the flags, and
the first NaN/Inf (``hs.NonFiniteError``, exit 2 by the command line's table, naming the
module and step, with the batch and a trace kept in ``hookscope-trips/`` beside ``--out``).
The data is the sample input, redrawn each step (seeded); a language model (a forward that
takes ``labels``) trains on its own next-token loss, any other model on ``hookscope grads``'
synthetic loss.
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path
from typing import Annotated, Any

import torch
import typer

import hookscope as hs
from hookscope.cli.parse.flags import option_default, option_flag
from hookscope.cli.parse.options import Dtype, InputShape, ModelSpec, seed_option
from hookscope.cli.parse.specs import make_input
from hookscope.cli.training import synthetic_loss
from hookscope.io import check_output_path

__all__ = ["health_report", "train_check_command"]


def train_check_command(
    model: ModelSpec,
    input_shape: InputShape = None,
    dtype: Dtype = None,
    steps: Annotated[int, typer.Option("--steps", "-n", min=1, help="Training steps to run.")] = 50,
    lr: Annotated[float, typer.Option("--lr", min=0.0, help="AdamW learning rate.")] = 1e-3,
    # the health report always counts one format's losses: bf16 unless told, where the library counts none
    precision: Annotated[str, option_flag(hs.MonitorOptions, "precision")] = "bf16",
    flag_above: Annotated[float, option_flag(hs.MonitorOptions, "flag_above", min=0.0, max=1.0)] = option_default(
        hs.MonitorOptions, "flag_above"
    ),
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Also log every step's scalars here (.jsonl or .csv).")
    ] = None,
    seed: Annotated[int, seed_option("Seed of the weights' training data.")] = 0,
) -> None:
    """Train MODEL for a few steps with hs.monitor fully on and print its health report.

    Example: hookscope train-check 'hf-config:gpt2/causal-lm?n_layer=2' -s 4x32 --steps 50 --precision fp16
    """
    from hookscope.cli.sample import prepare

    if out is not None:
        check_output_path(out, what="--out")
    trip_dir = (out.parent if out is not None else Path(".")) / "hookscope-trips"
    options = hs.MonitorOptions(  # checked first
        precision=precision, flag_above=flag_above, sinks=(out,) if out else (), trip_dir=trip_dir
    )
    sample = prepare(model, input_shape, dtype, seed)
    typer.echo(sample.describe_input())
    net = sample.model.train()
    optimizer = torch.optim.AdamW(net.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    language_model = "labels" in inspect.signature(net.forward).parameters
    losses: list[float] = []
    with hs.monitor(net, options=options) as mon:
        for index in range(steps):
            args, kwargs = (
                (sample.args, sample.kwargs)
                if index == 0
                else make_input(net, input_shape, dtype=dtype, seed=seed + index)
            )
            loss = _loss(net, args, kwargs, language_model, generator)
            loss.backward()
            mon.step()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
    typer.echo(health_report(mon.steps, losses))


def _loss(net: Any, args: tuple[Any, ...], kwargs: dict[str, Any], language_model: bool, generator: Any) -> Any:
    ids = kwargs.get("input_ids")
    if language_model and isinstance(ids, torch.Tensor):
        output = net(*args, **kwargs, labels=ids)
        if isinstance(getattr(output, "loss", None), torch.Tensor):
            return output.loss
    return synthetic_loss(net(*args, **kwargs), generator)


def health_report(steps: list[hs.MonitorStep], losses: list[float]) -> str:
    """Per layer: gradient norm and activation scale at the first and last logged step, the
    worst precision losses over the run; then the flags, and the loss's first and last values."""
    if not steps:
        return "no step was logged"
    first, last = steps[0].scalars, steps[-1].scalars
    layers = sorted({name.split("/", 2)[2] for name in last if name.startswith("grad/norm/")}, key=_natural)
    worst: dict[str, float] = {}
    for step in steps:
        for name, value in step.scalars.items():
            if name.startswith("precision/") and math.isfinite(value):
                worst[name] = max(worst.get(name, value), value)
    lines = [f"training health over {len(losses)} steps: loss {losses[0]:.4g} -> {losses[-1]:.4g}"]
    header = (
        f"{'layer':<22} {'grad norm':>21} {'act mean|x|':>21} {'grad underflow':>15} {'act overflow':>13} "
        f"{'grad range':>10}"
    )
    lines += [header, "-" * len(header)]
    for layer in layers:
        grad = f"{first.get(f'grad/norm/{layer}', math.nan):.3g} -> {last.get(f'grad/norm/{layer}', math.nan):.3g}"
        act = f"{first.get(f'act/mean_abs/{layer}', math.nan):.3g} -> {last.get(f'act/mean_abs/{layer}', math.nan):.3g}"
        underflow = worst.get(f"precision/grad/underflow/{layer}", math.nan)
        overflow = worst.get(f"precision/act/overflow/{layer}", math.nan)
        octaves = worst.get(f"precision/grad/dynamic_range/{layer}", math.nan)
        lines.append(f"{layer:<22} {grad:>21} {act:>21} {underflow:>14.2%} {overflow:>12.2%} {octaves:>10.1f}")
    flags = [flag for step in steps for flag in step.flags]
    lines.append(f"flags: {len(flags)}" + "".join(f"\n  {flag}" for flag in flags[:20]))
    return "\n".join(lines)


def _natural(name: str) -> list[Any]:
    """``blocks.10`` after ``blocks.9``."""
    return [int(part) if part.isdigit() else part for part in name.replace("#", ".").split(".")]

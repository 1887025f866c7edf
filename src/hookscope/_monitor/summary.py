"""Flags over a gradient history: vanishing, exploding, non-finite (with its origin), dead units.

Thresholds are arguments of :meth:`GradMonitor.summary`:

=============  ==========  ==============================================================
argument       default     a layer is flagged at a step when ...
=============  ==========  ==============================================================
``vanishing``  ``1e-4``    its gradient norm is below this fraction of the largest layer's
``exploding``  ``1e3``     its gradient norm is above this value, or ...
``growth``     ``10``      ... it grew by this factor or more over ``window`` steps, from a
                           norm that was not vanishing (or to one above every other layer's)
``window``     ``5``       recorded steps for ``growth``
=============  ==========  ==============================================================

The floor on growth keeps a layer that recovers from vanishing (1e-9 to 1e-3 while the other
layers sit near 0.1) from reading as one that explodes: growth from a vanishing gradient is
recovery, unless it ends above every other layer.

Activation gradients (``grad_output``) are judged when they were recorded, else parameter
gradients. A non-finite gradient is traced to its origin by the blame rule of
:mod:`hookscope._shared.blame`, in backward order: a module call's backward takes its
``grad_output`` and makes its ``grad_input``, so the origin is the first call whose
``grad_input`` holds a NaN/Inf while its ``grad_output`` does not. Dead units are
channels of a ReLU-like output that were zero for every sample of the monitor's
``dead_window`` last recorded steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from hookscope._monitor.records import FlagKind, GradRecord, MonitorFlag, MonitorStep
from hookscope._shared.blame import blame
from hookscope.errors import SpecError

__all__ = ["GradSummary", "summarise"]


@dataclass(frozen=True)
class GradSummary:
    """Every flag of a monitor's history; ``print()`` it, or filter with :meth:`of`."""

    flags: tuple[MonitorFlag, ...]
    steps: int

    def of(self, kind: FlagKind) -> list[MonitorFlag]:
        """The flags of one kind."""
        return [flag for flag in self.flags if flag.kind == kind]

    def layers(self, kind: FlagKind) -> list[str]:
        """The layers flagged with ``kind``, in the order found."""
        return [flag.layer for flag in self.of(kind)]

    def __str__(self) -> str:
        if not self.flags:
            return f"no gradient problems found in {self.steps} recorded steps"
        head = f"{len(self.flags)} flags over {self.steps} recorded steps:"
        return "\n".join([head, *(f"  {flag}" for flag in self.flags)])


def summarise(
    steps: Sequence[MonitorStep],
    *,
    vanishing: float = 1e-4,
    exploding: float = 1e3,
    growth: float = 10.0,
    window: int = 5,
) -> GradSummary:
    """Look through recorded steps for the problems in the module doc."""
    if not 0 < vanishing < 1:
        raise SpecError(f"vanishing={vanishing!r}: expected a fraction of the largest norm, e.g. 1e-4")
    if exploding <= 0 or growth <= 1 or window < 2:
        raise SpecError("expected exploding > 0, growth > 1 and window >= 2 (steps)")
    found: dict[tuple[FlagKind, str], tuple[list[int], str]] = {}

    def flag(kind: FlagKind, layer: str, detail: str, *, step: int) -> None:
        steps_seen, _ = found.setdefault((kind, layer), ([], detail))
        steps_seen.append(step)
        found[(kind, layer)] = (steps_seen, detail)

    history: dict[str, list[tuple[int, float]]] = {}
    norms_at: dict[int, dict[str, float]] = {}  # step -> layer -> norm
    for step in steps:
        judged = step.of("grad_output") or step.of("param")
        squares: dict[str, float] = {}
        for record in judged:  # a layer with several outputs: the norm of all of them together
            if record.finite:
                squares[record.layer] = squares.get(record.layer, 0.0) + record.norm**2
        norms = {layer: math.sqrt(value) for layer, value in squares.items()}
        largest = max(norms.values(), default=0.0)
        norms_at[step.step] = norms
        for layer, norm in norms.items():
            history.setdefault(layer, []).append((step.step, norm))
            if largest == 0:
                flag("vanishing", layer, "every gradient is exactly zero", step=step.step)
            elif norm < vanishing * largest:
                flag("vanishing", layer, f"norm below {vanishing:g} of the largest layer's", step=step.step)
            if norm > exploding:
                flag("exploding", layer, f"norm above {exploding:g}", step=step.step)
        origin = _nonfinite_origin(step)
        if origin is not None:
            flag("nonfinite", *origin, step=step.step)
        for name, channels in step.dead.items():
            flag("dead", name, f"{len(channels)} channels zero for every sample: {_listing(channels)}", step=step.step)
    for layer, points in history.items():
        for (start, before), (at, now) in zip(points, points[window - 1 :], strict=False):
            if before > 0 and now / before >= growth and not _recovering(norms_at, start, at, layer, vanishing):
                flag("exploding", layer, f"norm grew {growth:g}x or more within {window} steps", step=at)
    flags = tuple(
        MonitorFlag(kind, layer, tuple(sorted(set(s))), detail) for (kind, layer), (s, detail) in found.items()
    )
    return GradSummary(flags, len(steps))


def _recovering(norms_at: dict[int, dict[str, float]], start: int, at: int, layer: str, vanishing: float) -> bool:
    """True when ``layer`` grew out of a vanishing gradient and is still not above every other layer."""
    before = norms_at[start]
    if before[layer] >= vanishing * max(before.values()):
        return False  # it was a normal gradient that grew
    others = [norm for name, norm in norms_at[at].items() if name != layer]
    return bool(others) and norms_at[at][layer] <= max(others)


def _nonfinite_origin(step: MonitorStep) -> tuple[str, str] | None:
    """``(layer, detail)`` of the step's first NaN/Inf gradient, or None when all are finite.

    The first call, in backward order, whose grad_input is non-finite while its grad_output is
    finite made it (a call without a grad_output record is not known to have had a finite one).
    Failing that (a functional op between modules, the loss, or parameters only), the earliest
    non-finite gradient in backward order is named, saying so.
    """
    if all(record.finite for record in step.records):
        return None
    outputs: dict[str, bool] = {}
    for record in step.of("grad_output"):
        outputs[record.layer] = outputs.get(record.layer, True) and record.finite
    made = sorted((r for r in step.of("grad_input") if r.order is not None), key=_order)
    origin = blame(made, output_fine=lambda r: r.finite, inputs_fine=lambda r: outputs.get(r.layer, False))
    if origin is not None:
        return origin.layer, "first NaN/Inf in backward order (grad_input, finite grad_output)"
    activations = sorted((r for r in step.records if r.what != "param" and not r.finite), key=_order)
    if activations:
        first = activations[0]
        return first.column, "first NaN/Inf in backward order; it came from outside the watched modules"
    parameters = [r for r in step.of("param") if not r.finite]
    return parameters[0].layer, f"NaN/Inf in {len(parameters)} parameter gradient(s), first in model order"


def _order(record: GradRecord) -> int:
    return record.order if record.order is not None else 1 << 30


def _listing(channels: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(str(c) for c in channels[:limit])
    return shown + (f", ... ({len(channels) - limit} more)" if len(channels) > limit else "")

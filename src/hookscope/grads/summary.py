"""Flags over a gradient history: vanishing, exploding, non-finite (with its origin), dead units.

Thresholds are arguments of :meth:`GradMonitor.summary`:

=============  ==========  ==============================================================
argument       default     a layer is flagged at a step when ...
=============  ==========  ==============================================================
``vanishing``  ``1e-4``    its gradient norm is below this fraction of the largest layer's
``exploding``  ``1e3``     its gradient norm is above this value, or ...
``growth``     ``10``      ... it grew by this factor or more over ``window`` steps
``window``     ``5``       recorded steps for ``growth``
=============  ==========  ==============================================================

Activation gradients (``grad_output``) are judged when they were recorded, else parameter
gradients. A non-finite gradient is traced to its origin in backward order: the first module
call whose ``grad_input`` holds a NaN/Inf while its ``grad_output`` does not. Dead units are
channels of a ReLU-like output that were zero for every sample of the monitor's
``dead_window`` last recorded steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from hookscope.errors import SpecError
from hookscope.grads.records import GradRecord, GradStep

__all__ = ["FlagKind", "GradFlag", "GradSummary", "summarise"]

FlagKind = Literal["vanishing", "exploding", "nonfinite", "dead"]


@dataclass(frozen=True)
class GradFlag:
    """One finding: its kind, the layer (``module#call`` or a parameter), the steps, and why."""

    kind: FlagKind
    layer: str
    steps: tuple[int, ...]
    detail: str

    def __str__(self) -> str:
        return f"{self.kind:<9} {self.layer}: {self.detail} (steps {_ranges(self.steps)})"


@dataclass(frozen=True)
class GradSummary:
    """Every flag of a monitor's history; ``print()`` it, or filter with :meth:`of`."""

    flags: tuple[GradFlag, ...]
    steps: int

    def of(self, kind: FlagKind) -> list[GradFlag]:
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
    steps: Sequence[GradStep],
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

    def flag(kind: FlagKind, layer: str, step: int, detail: str) -> None:
        steps_seen, _ = found.setdefault((kind, layer), ([], detail))
        steps_seen.append(step)
        found[(kind, layer)] = (steps_seen, detail)

    history: dict[str, list[tuple[int, float]]] = {}
    for step in steps:
        judged = step.of("grad_output") or step.of("param")
        norms = {record.layer: record.norm for record in judged if record.finite}
        largest = max(norms.values(), default=0.0)
        for layer, norm in norms.items():
            history.setdefault(layer, []).append((step.step, norm))
            if largest > 0 and norm < vanishing * largest:
                flag("vanishing", layer, step.step, f"norm below {vanishing:g} of the largest layer's")
            if norm > exploding:
                flag("exploding", layer, step.step, f"norm above {exploding:g}")
        origin = _nonfinite_origin(step)
        if origin is not None:
            flag("nonfinite", origin, step.step, "first NaN/Inf in backward order (grad_input, finite grad_output)")
        for name, channels in step.dead.items():
            flag("dead", name, step.step, f"{len(channels)} channels zero for every sample: {_listing(channels)}")
    for layer, points in history.items():
        for (_, before), (at, now) in zip(points, points[window - 1 :], strict=False):
            if before > 0 and now / before >= growth:
                flag("exploding", layer, at, f"norm grew {growth:g}x or more within {window} steps")
    flags = tuple(GradFlag(kind, layer, tuple(sorted(set(s))), detail) for (kind, layer), (s, detail) in found.items())
    return GradSummary(flags, len(steps))


def _nonfinite_origin(step: GradStep) -> str | None:
    """The first call, in backward order, whose grad_input is non-finite and grad_output finite."""
    outputs: dict[str, bool] = {}
    for record in step.of("grad_output"):
        outputs[record.layer] = outputs.get(record.layer, True) and record.finite
    inputs = sorted((r for r in step.of("grad_input") if not r.finite and r.order is not None), key=_order)
    for record in inputs:
        if outputs.get(record.layer, False):
            return record.layer
    if any(not record.finite for record in step.records):
        return "(loss)" if not outputs or not any(outputs.values()) else None
    return None


def _order(record: GradRecord) -> int:
    return record.order if record.order is not None else 1 << 30


def _ranges(steps: Sequence[int]) -> str:
    if not steps:
        return "-"
    parts, start, last = [], steps[0], steps[0]
    for step in [*steps[1:], None]:
        if step is not None and step == last + 1:
            last = step
            continue
        parts.append(str(start) if start == last else f"{start}-{last}")
        if step is not None:
            start = last = step
    return ", ".join(parts)


def _listing(channels: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(str(c) for c in channels[:limit])
    return shown + (f", ... ({len(channels) - limit} more)" if len(channels) > limit else "")

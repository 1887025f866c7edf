"""What the training monitor measures of a layer, kept on the device step by step.

:class:`Measures` names them: statistics of each gradient (per module call, every output and
input that requires grad), and of each layer's output (its first floating tensor) statistics,
a histogram, and what a low-precision format would lose of it and of its gradient. The
recorder (:mod:`~hookscope._monitor.recorder`) takes them inside its hooks: activations when a
call closes, gradients in the **one** tensor hook it puts on each tensor, whatever is measured
of it. Nothing crosses to the host until a step is read: :func:`collect` gives the step's
vectors for the caller's one transfer (one copy per device) and the function that turns them,
read, into numbers by layer. Micro-batches of one step (gradient accumulation) merge.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hookscope._core.tree import flatten_tensors
from hookscope._shared.histogram import Histogram, RawHistogram, parse_histogram, raw_histogram
from hookscope._shared.precision import Precision, merge_precision, parse_precision, raw_precision
from hookscope._shared.stats import RawStats, Stats, finalize, merge_raw, raw_stats

__all__ = ["LayerRead", "Measures", "collect", "first_floating"]


@dataclass(frozen=True)
class Measures:
    """What the monitor measures: a preset of these is ``hs.watch_grads`` (gradients only).

    ``grads``: statistics of every gradient of a watched call (``grad_output``, ``grad_input``);
    ``activations``: statistics of each layer's output; ``histograms``: a histogram of it;
    ``precision``: the low-precision format whose losses are counted, of the output and of its
    gradient (None: not counted).
    """

    grads: bool = True
    activations: bool = False
    histograms: bool = False
    precision: torch.dtype | None = None

    @property
    def of_outputs(self) -> bool:
        """Whether anything is measured of a layer's output when its call closes."""
        return self.activations or self.histograms or self.precision is not None


@dataclass
class Kept:
    """One layer's on-device values of the step so far."""

    stats: RawStats | None = None
    act_precision: torch.Tensor | None = None
    grad_slots: list[int] = field(default_factory=list)  # its outputs' gradients, by the recorder's slots
    histogram: RawHistogram | None = None  # of the step's last micro-batch (a sample, for a picture)


@dataclass
class LayerRead:
    """One layer's numbers for one step."""

    stats: Stats | None
    act_precision: Precision | None
    grad_precision: Precision | None
    histogram: Histogram | None = None


def measure_output(kept: Kept, tensor: torch.Tensor, measures: Measures) -> None:
    """Take the step's measures of a layer's output (on the device, merged into ``kept``)."""
    if measures.activations:
        raw = raw_stats(tensor)
        kept.stats = raw if kept.stats is None else merge_raw(kept.stats, raw)
    if measures.histograms:
        kept.histogram = raw_histogram(tensor)
    if measures.precision is not None:
        kept.act_precision = merge_precision(kept.act_precision, raw_precision(tensor, measures.precision))


Parse = Callable[[list[np.ndarray]], dict[str, LayerRead]]


def collect(
    kept: dict[str, Kept], grad_precision: dict[int, torch.Tensor], target: torch.dtype | None
) -> tuple[list[torch.Tensor], Parse]:
    """The step's on-device vectors by layer (its gradients' precision merged from the slots of
    its outputs), and the function that turns them, read, into numbers by layer."""
    names = list(kept)
    vectors: list[torch.Tensor] = []
    slots: dict[tuple[str, str], int] = {}
    for n in names:
        layer = kept[n]
        gradient = None
        for slot in dict.fromkeys(layer.grad_slots):
            if slot in grad_precision:
                gradient = merge_precision(gradient, grad_precision[slot])
        for kind, vector in (
            ("stats", layer.stats.vector if layer.stats is not None else None),
            ("act", layer.act_precision),
            ("grad", gradient),
            ("histogram", layer.histogram.vector if layer.histogram is not None else None),
        ):
            if vector is not None:
                slots[(n, kind)] = len(vectors)
                vectors.append(vector)

    def parse(rows: list[np.ndarray]) -> dict[str, LayerRead]:
        found = {}
        for n in names:
            layer = kept[n]
            stats = precision = gradient = histogram = None
            if (n, "stats") in slots and layer.stats is not None:
                stats = finalize([layer.stats.count], rows[slots[(n, "stats")]][None])[0]
            if (n, "act") in slots:
                precision = parse_precision(rows[slots[(n, "act")]], target)
            if (n, "grad") in slots:
                gradient = parse_precision(rows[slots[(n, "grad")]], target)
            if (n, "histogram") in slots and layer.histogram is not None:
                histogram = parse_histogram(rows[slots[(n, "histogram")]], layer.histogram.total)
            found[n] = LayerRead(stats, precision, gradient, histogram)
        return found

    return vectors, parse


def first_floating(output: Any) -> torch.Tensor | None:
    """A call's first floating tensor: what a layer's output is measured by."""
    if isinstance(output, torch.Tensor):  # the usual case: no walk of a structure
        return output if output.is_floating_point() else None
    for _, tensor in flatten_tensors(output, ""):
        if tensor.is_floating_point():
            return tensor
    return None

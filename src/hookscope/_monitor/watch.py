"""Activation statistics and precision health of chosen layers, kept on the device step by step.

One forward hook per layer: on a step that is logged it summarises the layer's output (its first
floating tensor) with :func:`~hookscope._shared.stats.raw_stats`, counts what the chosen
low-precision format would lose of it (:func:`~hookscope._shared.precision.raw_precision`),
and, when the forward runs with grad, puts a tensor hook on that output to count the same of its
gradient. Nothing crosses to the host until :meth:`LayerWatch.read`, one transfer per device
per logged step (with the monitor's own vectors);
micro-batches of one step (gradient accumulation) merge. On a step that is not logged every hook
returns after two checks (it notes that a training forward ran: a step with none is refused).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from hookscope._core.attach import HookGroup, HookSpec, WrapSpec
from hookscope._core.tree import flatten_tensors
from hookscope._shared.histogram import Histogram, RawHistogram, parse_histogram, raw_histogram
from hookscope._shared.precision import Precision, merge_precision, parse_precision, raw_precision
from hookscope._shared.stats import RawStats, Stats, finalize, merge_raw, raw_stats

__all__ = ["LayerRead", "LayerWatch"]


@dataclass
class _Kept:
    stats: RawStats | None = None
    act_precision: torch.Tensor | None = None
    grad_precision: torch.Tensor | None = None
    histogram: RawHistogram | None = None  # of the step's last micro-batch (a sample, for a picture)


@dataclass
class LayerRead:
    """One layer's numbers for one step."""

    stats: Stats | None
    act_precision: Precision | None
    grad_precision: Precision | None
    histogram: Histogram | None = None


@dataclass
class LayerWatch:
    """The hooks and the step's on-device values; :meth:`read` reads them all at once."""

    model: nn.Module
    layers: Sequence[tuple[str, nn.Module]]
    activations: bool
    precision: torch.dtype | None
    histograms: bool = False
    recording: bool = True
    ran: bool = False  # a watched layer ran with grad since the monitor's last step (set, never read, by the hooks)
    _kept: dict[str, _Kept] = field(default_factory=dict)
    _group: HookGroup | None = None

    def attach(self, *wraps: WrapSpec) -> HookGroup:
        """Attach the layer hooks (and ``wraps``, the monitor's own wrapper of the model's call)."""
        specs = [HookSpec(name, module, "forward", self._hook(name), fitted=True) for name, module in self.layers]
        self._group = HookGroup(self.model, specs, owner="monitor", restore_mode=False, wraps=wraps)
        return self._group

    def _hook(self, name: str) -> Any:
        def watch(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if not torch.is_grad_enabled():  # an evaluation's forward is not the step's
                return
            self.ran = True
            if not self.recording:
                return
            tensor = _first_floating(output)
            if tensor is None or tensor.numel() == 0:
                return
            kept = self._kept.setdefault(name, _Kept())
            if self.activations:
                raw = raw_stats(tensor)
                kept.stats = raw if kept.stats is None else merge_raw(kept.stats, raw)
            if self.histograms:
                kept.histogram = raw_histogram(tensor)
            if self.precision is not None:
                kept.act_precision = merge_precision(kept.act_precision, raw_precision(tensor, self.precision))
                if tensor.requires_grad:
                    tensor.register_hook(self._grad_hook(kept))  # type: ignore[no-untyped-call]

        return watch

    def _grad_hook(self, kept: _Kept) -> Any:
        target = self.precision

        def on_grad(grad: torch.Tensor) -> None:
            if grad.numel() == 0:
                return
            kept.grad_precision = merge_precision(kept.grad_precision, raw_precision(grad, target))

        return on_grad

    def collect(self) -> tuple[list[torch.Tensor], Callable[[list[np.ndarray]], dict[str, LayerRead]]]:
        """The step's on-device vectors, and the function that turns them, read, into numbers
        by layer; the caller reads them with its own (one transfer per device). A fresh step."""
        kept, self._kept = self._kept, {}
        names = list(kept)
        vectors: list[torch.Tensor] = []
        slots: dict[tuple[str, str], int] = {}
        for n in names:
            layer = kept[n]
            stats_vector = layer.stats.vector if layer.stats is not None else None
            histogram_vector = layer.histogram.vector if layer.histogram is not None else None
            for kind, vector in (
                ("stats", stats_vector),
                ("act", layer.act_precision),
                ("grad", layer.grad_precision),
                ("histogram", histogram_vector),
            ):
                if vector is not None:
                    slots[(n, kind)] = len(vectors)
                    vectors.append(vector)
        return vectors, lambda rows: self._parsed(kept, names, slots, rows)

    def _parsed(
        self, kept: dict[str, _Kept], names: list[str], slots: dict[tuple[str, str], int], rows: list[np.ndarray]
    ) -> dict[str, LayerRead]:
        found = {}
        for n in names:
            stats = precision = gradient = histogram = None
            if (n, "stats") in slots:
                raw = kept[n].stats
                assert raw is not None
                stats = finalize([raw.count], rows[slots[(n, "stats")]][None])[0]
            if (n, "act") in slots:
                precision = parse_precision(rows[slots[(n, "act")]], self.precision)
            if (n, "grad") in slots:
                gradient = parse_precision(rows[slots[(n, "grad")]], self.precision)
            if (n, "histogram") in slots:
                raw_histogram_ = kept[n].histogram
                assert raw_histogram_ is not None
                histogram = parse_histogram(rows[slots[(n, "histogram")]], raw_histogram_.total)
            found[n] = LayerRead(stats, precision, gradient, histogram)
        return found

    def remove(self) -> None:
        if self._group is not None:
            self._group.remove()


def _first_floating(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):  # the usual case: no walk of a structure
        return output if output.is_floating_point() else None
    for _, tensor in flatten_tensors(output, ""):
        if tensor.is_floating_point():
            return tensor
    return None

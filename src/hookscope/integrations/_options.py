"""What both callbacks share: the monitor's options (one :class:`~hookscope.MonitorOptions`),
the monitor they start with them, and the steps it logged."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from torch import nn

import hookscope as hs

__all__ = ["MonitorCallback"]


class MonitorCallback:
    """The part of a framework's ``HookscopeCallback`` that is the framework's own in nothing:
    its options, its monitor (attached afresh per training run) and the steps it logged.

    The options are :class:`~hookscope.MonitorOptions`' (keywords, or whole as ``options=``),
    validated when the callback is made; ``output_dir`` is where a trip keeps its evidence
    (default: the Trainer's), ``start`` is the Trainer's step, and ``grad_scaler`` the
    Trainer's GradScaler unless given.
    """

    def __init__(
        self,
        layers: Any = None,
        *,
        output_dir: str | os.PathLike[str] | None = None,
        options: hs.MonitorOptions | None = None,
        **opts: Any,
    ) -> None:
        super().__init__()
        self.layers = layers
        self.output_dir = output_dir
        self.options = hs.MonitorOptions.build(options, opts)
        self._own_scaler = "grad_scaler" in opts or (options is not None and options.grad_scaler is not None)
        self.monitor: hs.Monitor | None = None
        self.steps: list[hs.MonitorStep] = []

    def _attach(self, model: nn.Module, default_dir: str | os.PathLike[str], step: int, scaler: Any = None) -> None:
        """A monitor for this training run, its trips kept in ``output_dir`` (else
        ``default_dir``), numbering its steps from ``step`` (a resumed run's), its gradients
        divided by the scale of ``scaler`` (the GradScaler its loss is scaled by, found by the
        callback) unless the callback was given ``grad_scaler=`` itself; a previous run's
        monitor (a second ``train()``) is removed."""
        self._remove()
        run = dataclasses.replace(
            self.options,
            trip_dir=Path(self.output_dir or self.options.trip_dir or default_dir),
            start=step,
            grad_scaler=self.options.grad_scaler if self._own_scaler else scaler,
        )
        self.monitor = hs.monitor(model, self.layers, options=run)

    def _remove(self, during: BaseException | None = None) -> None:
        """Let go of the monitor; with ``during`` (the error training raised), a sink that fails
        to close is added to that error as a note instead of hiding it."""
        if self.monitor is not None:
            self.monitor.remove(during=during)

    def __repr__(self) -> str:
        shown = self.options
        return f"HookscopeCallback(every={shown.every}, precision={shown.precision!r}, sinks={len(shown.sinks)})"

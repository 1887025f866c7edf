"""What both callbacks share: their options, the monitor they start with them, the steps it logged."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

import hookscope as hs

__all__ = ["MonitorCallback", "MonitorSettings"]


class MonitorSettings:
    """:func:`hookscope.monitor`'s options as a callback was given them; :meth:`start` attaches one."""

    def __init__(
        self,
        layers: Any,
        output_dir: str | os.PathLike[str] | None,
        every: int,
        precision: str | torch.dtype | None,
        sinks: Sequence[Any],
        options: dict[str, Any],
    ) -> None:
        self.layers = layers
        self.output_dir = output_dir
        self.every = every
        self.precision = precision
        self.sinks = list(sinks)
        self.options = options

    def start(self, model: nn.Module, default_dir: str | os.PathLike[str], step: int, scaler: Any = None) -> hs.Monitor:
        """A monitor on ``model``, its trips kept in ``output_dir`` (else ``default_dir``),
        numbering its steps from ``step`` (a resumed run's), its gradients divided by the
        scale of ``scaler`` (the Trainer's GradScaler, found by the callback) unless the
        callback was given ``grad_scaler=`` itself."""
        options = {"grad_scaler": scaler} | self.options
        return hs.monitor(
            model,
            self.layers,
            every=self.every,
            precision=self.precision,
            sinks=self.sinks,
            trip_dir=Path(self.output_dir or default_dir),
            start=step,
            **options,
        )

    def __repr__(self) -> str:
        return f"every={self.every}, precision={self.precision!r}, sinks={len(self.sinks)}"


class MonitorCallback:
    """The part of a framework's ``HookscopeCallback`` that is the framework's own in nothing:
    its settings, its monitor (attached afresh per training run) and the steps it logged."""

    def __init__(
        self,
        layers: Any = None,
        *,
        output_dir: str | os.PathLike[str] | None = None,
        every: int = 1,
        precision: str | torch.dtype | None = None,
        sinks: Sequence[Any] = (),
        **options: Any,
    ) -> None:
        super().__init__()
        self.settings = MonitorSettings(layers, output_dir, every, precision, sinks, options)
        self.monitor: hs.Monitor | None = None
        self.steps: list[hs.MonitorStep] = []

    def _attach(self, model: nn.Module, default_dir: str | os.PathLike[str], step: int, scaler: Any = None) -> None:
        """A monitor for this training run (``scaler``: the GradScaler its loss is scaled by, if
        any); a previous run's (a second ``train()``) is removed."""
        self._remove()
        self.monitor = self.settings.start(model, default_dir, step, scaler)

    def _remove(self, during: BaseException | None = None) -> None:
        """Let go of the monitor; with ``during`` (the error training raised), a sink that fails
        to close is added to that error as a note instead of hiding it."""
        if self.monitor is not None:
            self.monitor.remove(during=during)

    def __repr__(self) -> str:
        return f"HookscopeCallback({self.settings!r})"

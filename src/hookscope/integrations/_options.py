"""What both callbacks keep of their options, and how they start a monitor with them."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

import hookscope as hs

__all__ = ["MonitorSettings"]


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

    def start(self, model: nn.Module, default_dir: str | os.PathLike[str], step: int) -> hs.Monitor:
        """A monitor on ``model``, its trips kept in ``output_dir`` (else ``default_dir``),
        numbering its steps from ``step`` (a resumed run's)."""
        return hs.monitor(
            model,
            self.layers,
            every=self.every,
            precision=self.precision,
            sinks=self.sinks,
            trip_dir=Path(self.output_dir or default_dir),
            start=step,
            **self.options,
        )

    def __repr__(self) -> str:
        return f"every={self.every}, precision={self.precision!r}, sinks={len(self.sinks)}"

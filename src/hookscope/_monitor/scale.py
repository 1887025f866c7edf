"""The loss scale a step's gradients carry, taken out of every gradient statistic the monitor logs.

Under a GradScaler (fp16) the backward runs on ``loss * scale``: every gradient, the activations'
and the parameters', is ``scale`` times the loss's own, and the scale moves during a run (halved
at an overflow, doubled after a while without one). A record that mixed them, or logged them
scaled, would jump with the scale and disagree with the loop's own ``grad_norm`` (taken after
``unscale_``). So one convention: where the scaler is known, every gradient statistic of a step
is divided by the scale at the point it is finalised, once per logged step (one host read of
``get_scale()``, nothing per hook). Counts (NaN, Inf, zeros) and the precision fractions stay
as the backward held them: what the format kept is of the scaled values.

Where the model runs under float16 autocast and no scaler is known, the monitor says so once.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
import torch
from torch import nn

from hookscope._shared.stats import RAW_FIELDS
from hookscope.errors import SpecError

__all__ = ["LossScale", "unscaled"]

#: The raw fields that are values of the tensor (a loss scale multiplies them); the others count.
_VALUED = [RAW_FIELDS.index(name) for name in ("min", "max", "mean", "spread", "abs_mean")]


class LossScale:
    """The scaler of a monitored run (or none), read once per logged step."""

    def __init__(self, scaler: Any, model: nn.Module) -> None:
        if scaler is not None and not callable(getattr(scaler, "get_scale", None)):
            raise SpecError(
                f"grad_scaler={type(scaler).__name__}: expected the torch.amp.GradScaler that scales this run's "
                "loss (anything with get_scale()), or None where no loss is scaled"
            )
        self.scaler = scaler
        self._devices = sorted({p.device.type for p in model.parameters()} or {"cpu"})
        self._told = scaler is not None  # the fp16 warning: said once, never with a scaler

    def factor(self) -> float:
        """The scale this step's gradients carry (1 with no scaler, or one not a positive number)."""
        if self.scaler is None:
            return 1.0
        scale = float(self.scaler.get_scale())
        return scale if math.isfinite(scale) and scale > 0 else 1.0

    def check_forward(self) -> None:
        """Once, at a training forward under float16 autocast with no scaler known: its gradients
        most likely carry a loss scale (that is what a GradScaler is for), logged scaled."""
        if self._told:
            return
        for device in self._devices:
            if _fp16_autocast(device):
                self._told = True
                warnings.warn(
                    f"hs.monitor: the model runs under float16 autocast ({device}) and no grad_scaler= was given: if a "
                    "GradScaler scales the loss, every gradient this monitor logs carries its scale; pass "
                    "hs.monitor(..., grad_scaler=scaler) (the callbacks find the Trainer's own)",
                    UserWarning,
                    stacklevel=6,  # the line that called the model
                )
                return


def unscaled(table: np.ndarray, scale: float) -> np.ndarray:
    """Rows of :data:`~hookscope._shared.stats.RAW_FIELDS` of gradients of a loss scaled by
    ``scale`` as those of the loss itself: every value divided by it (exact for a power of two,
    as a GradScaler's is); counts as they are."""
    if scale == 1.0:
        return table
    table = table.copy()
    table[:, _VALUED] /= scale
    return table


def _fp16_autocast(device: str) -> bool:
    """True inside ``torch.autocast(device, dtype=torch.float16)``."""
    try:
        return bool(torch.is_autocast_enabled(device)) and torch.get_autocast_dtype(device) == torch.float16
    except (TypeError, RuntimeError, AttributeError):  # a torch before 2.4, or a device without autocast
        return False

"""Send recorded gradient statistics elsewhere: TensorBoard (``pip install 'hookscope[tensorboard]'``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from hookscope._grads.records import GradRecord, GradStep

__all__ = ["write_tensorboard"]


def _tag(record: GradRecord) -> str:
    return f"grads/{record.what}/{record.column}"


def write_tensorboard(steps: Sequence[GradStep], writer: Any, *, after: int) -> int:
    """Write the steps recorded after step ``after`` as scalars; returns the last step written.

    ``writer`` is a ``torch.utils.tensorboard.SummaryWriter`` (or anything with its
    ``add_scalar(tag, value, global_step)``). Per record: ``norm``, ``mean_abs``, ``max_abs``,
    and ``ratio`` for parameters; NaN/Inf counts when there are any.
    """
    last = after
    for step in steps:
        if step.step <= after:
            continue
        for record in step.records:
            tag = _tag(record)
            values = {"norm": record.norm, "mean_abs": record.mean_abs, "max_abs": record.max_abs}
            if record.ratio is not None:
                values["ratio"] = record.ratio
            if not record.finite:
                values |= {"nan": float(record.nan), "inf": float(record.inf)}
            for name, value in values.items():
                if math.isfinite(value):
                    writer.add_scalar(f"{tag}/{name}", value, global_step=step.step)
        last = step.step
    return last

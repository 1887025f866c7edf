"""What a trip keeps: the offending batch and a trace of the model on it, named by step.

Saved before the error leaves (:meth:`~hookscope._monitor.monitor.Monitor._trip`), from the batch
the monitor's wrapper of the model's call last saw; a trace that fails is added to the error as
a note, and the batch stays.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from hookscope._core.tree import map_tensors
from hookscope._trace import trace
from hookscope.errors import NonFiniteError

__all__ = ["note", "save_evidence"]


def save_evidence(
    model: nn.Module, folder: Path, error: NonFiniteError, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[Path]:
    """The offending batch (``nonfinite_step{N}_batch.pt``) and a trace of the model on it
    (``..._trace.csv``: every call's shapes and value ranges, the first NaN/Inf marked)."""
    folder.mkdir(parents=True, exist_ok=True)
    stem = folder / f"nonfinite_step{error.step if error.step is not None else 'unknown'}"
    batch = stem.with_name(stem.name + "_batch.pt")
    detached = map_tensors(lambda t: t.detach().cpu(), {"args": list(args), "kwargs": kwargs})
    torch.save(detached, batch)
    saved = [batch]
    try:
        with torch.no_grad():
            found = trace(model, *args, model_kwargs=kwargs)
        table = stem.with_name(stem.name + "_trace.csv")
        found.to_csv(table)
        saved.append(table)
    except Exception as failure:
        note(error, f"the trace of the offending batch failed too: {failure}")
    return saved


def note(error: BaseException, text: str) -> None:
    """``error.add_note(text)`` where Python has it (3.11 on)."""
    add_note = getattr(error, "add_note", None)
    if callable(add_note):
        add_note(text)

"""What an edit function is told about the value it edits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

from hookscope._core.names import call_label, leaf_label

__all__ = ["EditContext", "EditSide"]

EditSide = Literal["output", "input"]


@dataclass(frozen=True)
class EditContext:
    """The site an edit runs at: module name, call index, which value, and the call's inputs.

    ``path`` is the edited tensor's place relative to the value on ``side``, as in a
    :class:`~hookscope.Site`: ``""`` for the value itself, ``"[0]"``, ``"['mask']"``,
    ``".logits"``; :attr:`label` joins the two (``output[0]``, ``input['mask']``), and ``site``
    reads ``name#call:label`` (the form error messages and caches use).
    """

    name: str
    call: int
    module: nn.Module
    side: EditSide
    path: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    @property
    def label(self) -> str:
        """The edited leaf as shown: ``output``, ``output[0]``, ``input['mask']``."""
        return leaf_label(self.side, self.path)

    @property
    def site(self) -> str:
        """``name#call:label``, e.g. ``h.0#0:output[0]``."""
        return f"{call_label(self.name, self.call)}:{self.label}"

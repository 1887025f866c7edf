"""What an edit function is told about the value it edits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

from hookscope._core.names import call_label

__all__ = ["EditContext", "EditSide"]

EditSide = Literal["output", "input"]


@dataclass(frozen=True)
class EditContext:
    """The site an edit runs at: module name, call index, which value, and the call's inputs.

    ``path`` is the edited tensor's place (``output``, ``output[0]``, ``[0]``, ``['mask']``);
    ``site`` reads ``name#call:path`` (the form error messages and caches use).
    """

    name: str
    call: int
    module: nn.Module
    side: EditSide
    path: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    @property
    def site(self) -> str:
        """``name#call:path``, e.g. ``h.0#0:output[0]``."""
        where = self.path if self.side == "output" else f"input{self.path}"
        return f"{call_label(self.name, self.call)}:{where}"

"""What an edit function is told about the value it edits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

from hookscope._core.names import call_label, leaf_label, split_leaf
from hookscope._core.op_sites import op_leaf_label
from hookscope._core.tree import call_leaves
from hookscope._shared.dtypes import dtype_name
from hookscope._shared.shapes import format_shape, shape_of
from hookscope.errors import SpecError

__all__ = ["EditContext", "EditSide", "checked_path"]

EditSide = Literal["output", "input"]


_SHOWN_INPUTS = 2


@dataclass(frozen=True, repr=False)
class EditContext:
    """The site an edit runs at: module name, call index, which value, and the call's inputs.

    ``path`` is the edited tensor's place relative to the value on ``side``, as in a
    :class:`~hookscope.Site`: ``""`` for the value itself, ``"[0]"``, ``"['mask']"``,
    ``".logits"``; :attr:`label` joins the two (``output[0]``, ``input['mask']``), and ``site``
    reads ``name#call:label`` (the form error messages and caches use). It prints as one line,
    the site, the module's class and the inputs' shapes and dtypes, not the module and its
    input values.

    At an op site (``"h.0.attn:op[softmax#0]"``) ``op`` is the op's name and index within the
    module call (``"softmax#0"``; an attention sub-site's is ``"attn.pattern#0"``), ``args`` and
    ``kwargs`` are what the op was called with, and the label reads as a capture's key does:

    >>> ctx = EditContext("h.0.attn", 0, nn.Identity(), "output", "", (), {}, op="softmax#0")
    >>> ctx.site, EditContext("h.0.attn", 1, nn.Identity(), "output", "", (), {}, op="attn.z#0").label
    ('h.0.attn#0:op[softmax#0]', 'attn.z')
    """

    name: str
    call: int
    module: nn.Module
    side: EditSide
    path: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    #: The op within the module call whose output is edited (``"softmax#0"``), or ``""`` for
    #: the module's own output or input.
    op: str = ""

    @property
    def label(self) -> str:
        """The edited leaf as shown: ``output``, ``output[0]``, ``input['mask']``; at an op site
        ``op[softmax#0]``, ``op[split#0][1]``, ``attn.pattern``."""
        if self.op:
            return op_leaf_label(self.op, self.side, self.path)
        return leaf_label(self.side, self.path)

    @property
    def site(self) -> str:
        """``name#call:label``, e.g. ``h.0#0:output[0]``, ``h.0.attn#0:op[softmax#0]``."""
        return f"{call_label(self.name, self.call)}:{self.label}"

    def __repr__(self) -> str:
        """``<EditContext h.1.mlp#0:output (GPT2MLP): input[0] [2, 8, 32] float32>``."""
        leaves = call_leaves(self.args, self.kwargs)
        shown = [
            f"{leaf_label('input', path)} {format_shape(shape_of(t))} {dtype_name(t.dtype)}"
            for path, t in leaves[:_SHOWN_INPUTS]
        ]
        more = len(leaves) - _SHOWN_INPUTS
        inputs = (", ".join(shown) or "no tensor input") + (f" +{more} more" if more > 0 else "")
        return f"<EditContext {self.site} ({type(self.module).__name__}): {inputs}>"


def checked_path(path: object) -> str | None:
    """``path=`` of an edit (``"output[0]"``, ``".logits"``) checked in form now; which side of the
    call it names is checked when the edit is attached."""
    if path is None:
        return None
    if not isinstance(path, str):
        raise SpecError(f"path={path!r}: expected a tree path such as 'output[0]' or 'output.logits'")
    split_leaf(path, shown=f"path={path!r}")
    return path

"""Match the calls a reentrant checkpoint re-runs in backward to the forward calls they repeat.

``torch.utils.checkpoint(..., use_reentrant=True)`` runs its block under ``no_grad`` in the
forward, so nothing there can be hooked, and runs it again with grad inside the backward. The
call counter cannot number those re-runs (each starts a pass of its own), so the forward's
calls are remembered per checkpoint and claimed back in the same order when it re-runs. A
checkpoint is recognised by the autograd context object of PyTorch's ``CheckpointFunction``,
found on the stack: the same object is there in its forward and in its backward. The stack is
looked at only on this rare path (a watched module called without grad, or inside a backward).
"""

from __future__ import annotations

import sys
from types import FrameType

__all__ = ["Replay", "checkpoint_context"]

_CHECKPOINT_FILE = "checkpoint.py"


def checkpoint_context() -> int | None:
    """The identity of the innermost reentrant checkpoint running on this thread, or None."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name in ("forward", "backward") and code.co_filename.endswith(_CHECKPOINT_FILE):
            context = frame.f_locals.get("ctx")
            if context is not None:
                return id(context)
        frame = frame.f_back
    return None


class Replay:
    """The calls one step's reentrant checkpoints ran without grad, claimed back in backward."""

    __slots__ = ("_skipped",)

    def __init__(self) -> None:
        # (checkpoint, module id) -> [(forward sequence number, call index), ...] not yet claimed;
        # any id unique per watched module serves (the monitor passes its record of the module's)
        self._skipped: dict[tuple[int, int], list[tuple[int, int]]] = {}

    def skip(self, context: int, module_id: int, sequence: int, call: int) -> None:
        """Checkpoint ``context`` ran this call without grad in the forward."""
        self._skipped.setdefault((context, module_id), []).append((sequence, call))

    @property
    def waiting(self) -> bool:
        """True while some call skipped in the forward has not been claimed back."""
        return any(self._skipped.values())

    def claim(self, context: int, module_id: int) -> tuple[int, int] | None:
        """The ``(sequence, call)`` a re-run in backward repeats, in the forward's order; or None."""
        waiting = self._skipped.get((context, module_id))
        return waiting.pop(0) if waiting else None

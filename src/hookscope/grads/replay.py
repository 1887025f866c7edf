"""Match the calls a reentrant checkpoint re-runs in backward to the forward calls they repeat.

``torch.utils.checkpoint(..., use_reentrant=True)`` runs its block under ``no_grad`` in the
forward, so nothing there can be hooked, and runs it again with grad inside the backward. The
call counter cannot number those re-runs (each starts a pass of its own), so the forward's
skipped calls are remembered in order and handed out again: a re-run region (from a watched
module entered with nothing open until it closes) takes the *last* unclaimed call of the module
that opens it -- backward visits checkpointed regions last first -- and the calls inside it take
the next unclaimed calls of their modules, in forward order.
"""

from __future__ import annotations

__all__ = ["Replay"]


class Replay:
    """The calls skipped without grad in one step's forward, claimed back during its backward."""

    __slots__ = ("_claimed", "_cursor", "_depth", "_skipped")

    def __init__(self) -> None:
        self._skipped: list[tuple[int, int]] = []  # (module id, call index), forward order
        self._claimed: list[bool] = []
        self._cursor = 0
        self._depth = 0

    def skip(self, module_id: int, call: int) -> None:
        """The forward ran this call without grad (inside a reentrant checkpoint)."""
        self._skipped.append((module_id, call))
        self._claimed.append(False)

    def enter(self, module_id: int) -> int | None:
        """A call re-run in backward begins: the forward call index it repeats, or None."""
        if self._depth == 0:
            found = next(
                (i for i in range(len(self._skipped) - 1, -1, -1) if self._free(i, module_id)),
                None,
            )
        else:
            found = next((i for i in range(self._cursor, len(self._skipped)) if self._free(i, module_id)), None)
        self._depth += 1
        if found is None:
            return None
        self._claimed[found] = True
        self._cursor = found
        return self._skipped[found][1]

    def exit(self) -> None:
        """A call re-run in backward ends."""
        self._depth = max(self._depth - 1, 0)

    def _free(self, index: int, module_id: int) -> bool:
        return not self._claimed[index] and self._skipped[index][0] == module_id

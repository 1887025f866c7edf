"""``EditOptions``: which side of a module and which of its calls an edit changes, checked once.

``hs.edit``, ``hs.run_with_edits`` and ``hookscope edit`` build one, so a bad value is refused
before any hook is attached.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hookscope._core.sites import Calls, call_filter, canonical_calls
from hookscope._edit.context import EditSide
from hookscope._shared.options import Options
from hookscope.errors import SpecError

__all__ = ["EditOptions"]


@dataclass(frozen=True)
class EditOptions(Options):
    """Where an edit acts.

    >>> EditOptions(calls=[0, 2]).wants(2), EditOptions(calls="first").wants(1)
    (True, False)
    >>> EditOptions(on="grad")
    Traceback (most recent call last):
    ...
    hookscope.errors.SpecError: on='grad' is not 'output' (default) or 'input'
    """

    feature = "edit"

    on: EditSide = "output"
    """``"output"`` (default) edits what the module returns, ``"input"`` what it takes (a forward
    pre-hook).
    """
    calls: Calls = "all"
    """Which calls of a module called several times: ``"all"``, ``"first"``, an index or a list of
    indices (``"last"`` is known only when the forward ends, too late to edit).
    """

    def __post_init__(self) -> None:
        if self.on not in ("output", "input"):
            raise SpecError(f"on={self.on!r} is not 'output' (default) or 'input'")
        object.__setattr__(self, "calls", canonical_calls(self.calls))

    @property
    def wants(self) -> Callable[[int], bool]:
        """The call filter ``calls`` asks for."""
        return call_filter(self.calls)

"""Sites: the address of one value seen by a hook, and the per-pass call numbering behind it.

A module can run several times in one forward pass (weights shared between two places, a block
applied in a loop). Each of those calls is its own site, numbered 0, 1, 2, ... in the order the
calls start; the numbering starts again at every top-level forward pass.

A :class:`Site` is written ``name#call:what`` followed by the tree path of the leaf, e.g.
``transformer.h.0.attn#0:output[0]``. ``what`` is one of ``input``, ``output``, ``grad_input``
and ``grad_output``.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from types import FrameType
from typing import Literal, get_args

from torch import nn

from hookscope.errors import SpecError

__all__ = ["CallTracker", "Site", "SiteKind", "is_reentered"]

SiteKind = Literal["input", "output", "grad_input", "grad_output"]
_SITE_KINDS: tuple[str, ...] = get_args(SiteKind)
_SITE_TEXT = re.compile(r"^(?P<module>[^#:]*)(?:#(?P<call>\d+))?:(?P<what>[a-z_]+)(?P<path>.*)$")


@dataclass(frozen=True, order=True)
class Site:
    """Where a value was seen: module name, call index within the pass, which value, leaf path.

    >>> site = Site("layer1.conv2", 1, "output", "[0]")
    >>> str(site)
    'layer1.conv2#1:output[0]'
    >>> Site.parse(str(site)) == site
    True
    """

    module: str
    call: int = 0
    what: SiteKind = "output"
    path: str = ""

    def __post_init__(self) -> None:
        if self.what not in _SITE_KINDS:
            raise SpecError(f"site kind {self.what!r} is unknown; expected one of {', '.join(_SITE_KINDS)}")
        if self.call < 0:
            raise SpecError(f"call index {self.call} is negative; calls are numbered from 0 in each pass")

    def __str__(self) -> str:
        return f"{self.module}#{self.call}:{self.what}{self.path}"

    @classmethod
    def parse(cls, text: str) -> Site:
        """Read a site written as ``name[#call]:what[path]``; the call defaults to 0."""
        match = _SITE_TEXT.match(text)
        if match is None:
            raise SpecError(f"site {text!r} is not of the form 'name#call:what[path]', e.g. 'layer1.conv2#0:output[0]'")
        what = match["what"]
        if what not in _SITE_KINDS:
            raise SpecError(f"site {text!r} names {what!r}; expected one of {', '.join(_SITE_KINDS)}")
        return cls(match["module"], int(match["call"] or 0), what, match["path"])  # type: ignore[arg-type]


def is_reentered(module: nn.Module) -> bool:
    """True when an outer call of ``module`` is still running on this thread (recursion).

    Bookkeeping that says "a call of the root is open" when the root is entered again means
    either recursion or a call that was interrupted (``KeyboardInterrupt`` skips PyTorch's
    ``always_call`` hooks, so it is never closed). Only the stack can tell them apart; this
    walk runs on that rare path alone, never per call.
    """
    frame: FrameType | None = sys._getframe(1)
    calls = 0
    while frame is not None:
        if frame.f_code.co_name == "_call_impl" and frame.f_locals.get("self") is module:
            calls += 1  # the call being entered is one; an outer one makes two
            if calls == 2:
                return True
        frame = frame.f_back
    return False


class CallTracker:
    """Numbers the calls of watched modules within each top-level forward pass.

    ``enter`` runs in a forward pre-hook and returns the call's index; ``exit`` runs in a forward
    hook registered with ``always_call=True``, so a forward that raises still closes its call.
    A pass starts when a watched module is entered while no watched call is open: with the
    model's root watched, that is each call of the model, and a submodule called on its own is
    a pass of its own. Modules are keyed by identity, so a module reachable under two names has
    one counter.

    The hot path is two dict operations and a list append/pop: no introspection per call.
    """

    __slots__ = ("_counts", "_names", "_open", "_open_calls", "_root")

    def __init__(self) -> None:
        self._counts: dict[int, int] = {}
        self._open: dict[int, list[int]] = {}
        self._open_calls = 0
        self._names: dict[int, str] = {}
        self._root = 0

    def watch(self, name: str, module: nn.Module) -> None:
        """Start counting ``module``'s calls, reported under ``name`` (``""`` marks the root)."""
        self._names.setdefault(id(module), name)
        if name == "":
            self._root = id(module)

    def enter(self, module: nn.Module) -> int:
        """Open a call of ``module`` and return its index in the current pass."""
        key = id(module)
        if key == self._root and self._open.get(key) and not is_reentered(module):
            self.reset()  # the previous pass was interrupted before its hooks could close it
        if self._open_calls == 0:
            self._counts.clear()
        index = self._counts.get(key, 0)
        self._counts[key] = index + 1
        self._open.setdefault(key, []).append(index)
        self._open_calls += 1
        return index

    def exit(self, module: nn.Module) -> None:
        """Close the innermost open call of ``module``; a close without an open is ignored."""
        stack = self._open.get(id(module))
        if stack:
            stack.pop()
            self._open_calls -= 1

    def current(self, module: nn.Module) -> int:
        """Index of ``module``'s innermost open call (valid inside its hooks)."""
        stack = self._open.get(id(module))
        if not stack:
            raise RuntimeError("no call of this module is open; current() is only valid inside its hooks")
        return stack[-1]

    def counts(self) -> dict[str, int]:
        """``{name: calls}`` for the latest pass, in the order the modules were watched."""
        return {name: self._counts.get(key, 0) for key, name in self._names.items()}

    def reset(self) -> None:
        """Forget open calls and counts (used when hooks are removed)."""
        self._counts.clear()
        self._open.clear()
        self._open_calls = 0

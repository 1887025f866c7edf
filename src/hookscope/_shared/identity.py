"""Recognise a tensor seen earlier in the pass, so its statistics are computed once.

A container's output is usually its last child's output, and a module's input usually some
earlier module's output: the same tensor object, unchanged. Keyed by identity and checked
against the tensor's version counter (bumped by every in-place op), the earlier result is
reused instead of reading the values again; a tensor changed in place since is measured anew.
Tensors are held by weak reference, so remembering them keeps no activation alive.

Writes through ``tensor.data`` bypass the version counter (that is what ``.data`` is for), so
a change made that way after a module returned is not seen: the earlier statistics are reused.
Under ``torch.compile`` nothing is remembered (Dynamo cannot trace identities or versions).
"""

from __future__ import annotations

import weakref
from typing import Generic, TypeVar

import torch

from hookscope._core.compat.compiled import is_compiling
from hookscope._core.compat.internals import version_counter

__all__ = ["SeenTensors"]

T = TypeVar("T")


class SeenTensors(Generic[T]):
    """``{tensor: value}`` for one pass, by identity and version; forgets on :meth:`clear`."""

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ReferenceType[torch.Tensor], int, T]] = {}

    def get(self, tensor: torch.Tensor) -> T | None:
        """The value stored for this very tensor, if it has not been changed in place since."""
        if is_compiling():  # no identities or version counters under torch.compile: measure anew
            return None
        entry = self._entries.get(id(tensor))
        if entry is None:
            return None
        ref, version, value = entry
        if ref() is not tensor or version_counter(tensor) != version:
            return None  # another tensor at a recycled id, an untracked one, or changed in place
        return value

    def put(self, tensor: torch.Tensor, value: T) -> None:
        """Remember ``value`` for ``tensor`` as it is now."""
        version = None if is_compiling() else version_counter(tensor)
        if version is None:
            return  # inference tensors have no version counter: an in-place change would go unseen
        self._entries[id(tensor)] = (weakref.ref(tensor), version, value)

    def clear(self) -> None:
        """Forget everything (at the start of a pass)."""
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

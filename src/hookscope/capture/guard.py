"""Copy-on-write for captured values: keep references, copy only what is about to be overwritten.

A forward hook sees a module's output before the rest of the model runs, and the rest may
change that very tensor in place: ``ReLU(inplace=True)`` after a convolution, ``out += identity``
in a residual block, ``x[mask] = 0``. Keeping a reference is then silently wrong, and copying
every value costs a pass over every activation. Instead, while a forward runs, this torch
function mode watches the storages of kept values and, just before an operation writes into
one of them, lets the recorder replace its kept reference with a copy. Only values that are
really overwritten are copied, and each at most once.

What counts as a write: functions whose name ends in a single ``_`` (``add_``, ``relu_``,
``copy_``), in-place operators and ``__setitem__`` (first argument), ``inplace=True`` (first
argument), and ``out=`` (the output tensors). Anything this misses is still caught afterwards:
each kept value's version counter is compared when it is read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["CopyOnWrite", "storage_key"]

_INPLACE_OPERATORS = frozenset(
    {
        "__setitem__",
        "__iadd__",
        "__isub__",
        "__imul__",
        "__imatmul__",
        "__itruediv__",
        "__ifloordiv__",
        "__imod__",
        "__ipow__",
        "__iand__",
        "__ior__",
        "__ixor__",
        "__ilshift__",
        "__irshift__",
    }
)


def storage_key(tensor: torch.Tensor) -> int:
    """The address of the memory behind ``tensor`` (0 when it has none, e.g. sparse or meta)."""
    try:
        return int(tensor.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return 0


def _writes_first_argument(func: Callable[..., Any]) -> bool:
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name in _INPLACE_OPERATORS


class CopyOnWrite(TorchFunctionMode):
    """Calls ``before_write(storage key)`` before any operation writes into a watched storage.

    ``watched`` is the recorder's own mapping of storage keys to the sites kept there; it is
    read, never changed, here. The check costs a dict lookup per torch call while anything is
    watched, and nothing otherwise.
    """

    def __init__(self, watched: Mapping[int, object], before_write: Callable[[int], None]) -> None:
        super().__init__()
        self._watched = watched
        self._before_write = before_write
        self._writes: dict[Any, bool] = {}

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if self._watched:
            self._protect_targets(func, args, kwargs)
        return func(*args, **kwargs)

    def _protect_targets(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        writes = self._writes.get(func)
        if writes is None:
            writes = self._writes[func] = _writes_first_argument(func)
        if (writes or kwargs.get("inplace") is True) and args and isinstance(args[0], torch.Tensor):
            self._protect(args[0])
        out = kwargs.get("out")
        if isinstance(out, torch.Tensor):
            self._protect(out)
        elif isinstance(out, (tuple, list)):
            for tensor in out:
                if isinstance(tensor, torch.Tensor):
                    self._protect(tensor)

    def _protect(self, tensor: torch.Tensor) -> None:
        key = storage_key(tensor)
        if key and key in self._watched:
            self._before_write(key)

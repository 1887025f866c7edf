"""Copy-on-write for captured values: keep references, copy only what is about to be overwritten.

A forward hook sees a module's output before the rest of the model runs, and the rest may
change that very tensor in place: ``ReLU(inplace=True)`` after a convolution, ``out += identity``
in a residual block, ``x[mask] = 0``. Keeping a reference is then silently wrong, and copying
every value costs a pass over every activation. Instead, while a forward runs, this torch
function mode watches the storages of kept values and, just before an operation writes into
one of them, lets the recorder replace its kept reference with a copy. Only values that are
really overwritten are copied, and each at most once.

What counts as a write: the arguments an op overload's schema marks as written
(``torch.ops.aten.relu_.default``, custom ops); functions whose name ends in a single ``_``
(``add_``, ``relu_``, ``copy_``, ``_foreach_mul_``), in-place operators and ``__setitem__``
(first argument, or each tensor of a list); ``inplace=True`` (first argument); and ``out=``.
Writes through ``.data`` are seen too, as the op on the ``.data`` tensor writes into the
watched storage. Handing the memory itself out -- ``untyped_storage()``, ``storage()``,
``numpy()``, ``__array__``, ``__dlpack__`` -- counts as a write, since what is done with it
afterwards (``storage.fill_()``, a numpy assignment) is out of sight: the value is copied first.

What stays outside: writes inside a function the mode passes through whole, writes through a
raw ``data_ptr()``, and memory handed out before the value was captured (a numpy array or
DLPack capsule made earlier). Those are caught afterwards by each kept value's version counter,
compared when it is read, when they bump it (the in-place ops do; ``.data``, storage, numpy
and DLPack writes do not), except under ``torch.inference_mode()``, where tensors carry no
version counter. With ``copy=False`` there is no mode: only the version counter is checked.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from hookscope._core.compat.function_modes import on_stack, put_on, take_off
from hookscope._core.compat.private import op_overload_types, torch_functions_off

__all__ = ["CopyOnWrite", "storage_bytes", "storage_key", "unwatch_writes", "watch_writes"]

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


_OP_OVERLOAD, _OP_PACKET = op_overload_types()

# Functions that hand out a tensor's memory: whatever is written through it later goes unseen.
_HANDS_OUT_MEMORY = frozenset({"untyped_storage", "storage", "_typed_storage", "numpy", "__array__", "__dlpack__"})


def storage_key(tensor: torch.Tensor) -> int:
    """The address of the memory behind ``tensor`` (0 when it has none, e.g. sparse or meta).

    Asked with torch functions off: hookscope reading a storage's address is no write.
    """
    with torch_functions_off():
        try:
            return int(tensor.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):
            return 0


def storage_bytes(tensor: torch.Tensor) -> int:
    """The size of the whole storage behind ``tensor``, asked with torch functions off."""
    with torch_functions_off():
        return int(tensor.untyped_storage().nbytes())


def _written_arguments(func: Callable[..., Any]) -> tuple[tuple[int, str], ...]:
    """``(position, name)`` of the arguments ``func`` writes into, worked out once per function.

    An op overload (``torch.ops.aten.relu_.default``, custom ops) says so in its schema; for
    everything else the name tells: ``add_``, ``__iadd__``, ``__setitem__`` write into their
    first argument.
    """
    if isinstance(func, _OP_OVERLOAD):
        return _schema_writes([func._schema])
    if isinstance(func, _OP_PACKET):  # torch.ops.ns.op(...): any overload may be chosen
        overloads = func.overloads()  # type: ignore[no-untyped-call]
        return _schema_writes([getattr(func, overload)._schema for overload in overloads])
    name = getattr(func, "__name__", "")
    if (name.endswith("_") and not name.endswith("__")) or name in _INPLACE_OPERATORS or name in _HANDS_OUT_MEMORY:
        return ((0, "self"),)
    return ()


def _schema_writes(schemas: list[Any]) -> tuple[tuple[int, str], ...]:
    written = {
        (index, argument.name)
        for schema in schemas
        for index, argument in enumerate(schema.arguments)
        if argument.alias_info is not None and argument.alias_info.is_write
    }
    return tuple(sorted(written))


def _tensors_in(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):  # _foreach_*_ ops write into lists of tensors
        return [item for item in value if isinstance(item, torch.Tensor)]
    return []


class CopyOnWrite(TorchFunctionMode):
    """Calls a watcher's ``before_write(storage key)`` before any operation writes into a storage
    it watches.

    One mode per thread serves every keeper watching at once (:func:`watch_writes`): two
    captures, a capture inside ``hs.diff`` or ``hs.extract``, never stack two modes, so the last
    one to finish can always take the mode off again. Each watcher's ``watched`` is that
    keeper's own mapping of storage keys to the sites kept there; it is read, never changed,
    here. While the mode is on, every torch call pays a Python dispatch and a dict lookup,
    which is why a keeper turns it on only once a value is watched and copies small values
    outright instead of watching them.
    """

    def __init__(self) -> None:
        super().__init__()
        self.watchers: list[tuple[Mapping[int, object], Callable[[int], None]]] = []
        self._writes: dict[Any, tuple[tuple[int, str], ...]] = {}

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        for watched, _ in self.watchers:  # one watcher almost always: no generator per torch op
            if watched:
                self._protect_targets(func, args, kwargs)
                break
        return func(*args, **kwargs)

    def _protect_targets(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            written = self._writes[func]
        except KeyError:
            written = self._writes[func] = _written_arguments(func)
        except TypeError:  # an unhashable callable: work it out each time
            written = _written_arguments(func)
        if not written and kwargs.get("inplace") is True:
            written = ((0, "input"),)
        for position, name in written:
            target = args[position] if position < len(args) else kwargs.get(name)
            for tensor in _tensors_in(target):
                self._protect(tensor)
        for tensor in _tensors_in(kwargs.get("out")):
            self._protect(tensor)

    def _protect(self, tensor: torch.Tensor) -> None:
        key = storage_key(tensor)
        if not key:
            return
        for watched, before_write in list(self.watchers):  # a callback may end its own watch
            if key in watched:
                with torch_functions_off():  # its copy is hookscope's work: no mode below sees it
                    before_write(key)


class _ThreadGuard(threading.local):
    """This thread's one :class:`CopyOnWrite` (torch's mode stack is per thread, too)."""

    def __init__(self) -> None:
        self.mode = CopyOnWrite()


_GUARD = _ThreadGuard()


def watch_writes(watched: Mapping[int, object], before_write: Callable[[int], None]) -> None:
    """Start calling ``before_write`` for writes into the storages in ``watched`` (on this
    thread), pushing the shared mode if it is not on torch's mode stack already."""
    mode = _GUARD.mode
    mode.watchers.append((watched, before_write))
    if not on_stack(mode):
        put_on(mode)


def unwatch_writes(watched: Mapping[int, object]) -> None:
    """Stop watching ``watched``; the last watcher to stop takes the mode off torch's stack,
    wherever it stands there (modes pushed above it since stay, in their order), so no mode
    outlives the captures that needed it."""
    mode = _GUARD.mode
    mode.watchers[:] = [entry for entry in mode.watchers if entry[0] is not watched]
    if not mode.watchers:
        take_off(mode)

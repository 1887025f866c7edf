"""The function mode of an op watch: run each torch call, then report it while a selected call runs.

Why a module of its own: the mode is the one piece that sits on torch's function-mode stack and
sees every torch call; what it reports to is decided elsewhere, by :class:`~hookscope._core.ops.OpWatcher`
setting :attr:`_OpMode.frame` as selected modules' forwards open and close. Here are the mode, the
listener it calls (:class:`OpListener`) and the watcher's stack entries it reads.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.overrides import TorchFunctionMode

from hookscope._core.compat.function_modes import depth as _mode_depth
from hookscope._core.compat.private import mode_at
from hookscope._core.op_sites import op_name

__all__ = ["Frames", "OpListener", "hookscope_work", "open_frames", "report_value"]


class OpListener(Protocol):
    """Told of each op call inside a watched module; returns a value to use instead of
    ``output`` for the rest of the forward, or None to keep it.

    Called as ``listener(module, call, op, index, args, kwargs, output)``: the selected module's
    name and call index in the pass, the op's name (:func:`op_name`) and its index among that
    module call's ops of that name, and what the op was called with and returned. Torch ops it
    calls are reported to no watcher on this thread: they are hookscope's work (a pattern
    recomputed, a reduction, an edit), not the module's, so another capture's or edit's watch
    of the same module neither keeps them nor counts them in its op indices. For an in-place op
    (``add_``, ``x += y``) ``output`` is the written tensor itself, and a replacement changes only
    what the call returns (``out += y`` rebinds ``out`` to it; a bare ``out.add_(y)`` ignores it).
    """

    def __call__(
        self, module: str, call: int, op: str, index: int, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any: ...


class _Frame:
    """A selected module's forward running its own code: its name, call index and op counts so far."""

    __slots__ = ("call", "counts", "key", "module")

    def __init__(self, module: str, call: int, key: int) -> None:
        self.module = module
        self.call = call
        self.key = key  # id() of the module object
        self.counts: dict[str, int] = {}


class _Off:
    """Nothing is reported while this is the innermost entry: the call of a module inside the
    watch (its hooks, anyone's), and a submodule's forward with ``children=False``."""

    __slots__ = ()


class _Inherit:
    """A submodule's forward with ``children=True``: its ops are the innermost selected call's."""

    __slots__ = ()


_OFF = _Off()
_INHERIT = _Inherit()


# Results that never hold a tensor, answered without a look inside (x.shape, x.size(), x.dim(), ...).
_NO_TENSOR = frozenset({int, float, bool, complex, str, type(None), torch.Size, torch.dtype, torch.device})


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if type(value) in _NO_TENSOR:
        return False
    if isinstance(value, (tuple, list)):
        if not value or (isinstance(value, list) and type(value[0]) in _NO_TENSOR):
            return False  # empty, or tolist()'s numbers: not read one by one
        return any(_holds_tensor(item) for item in value)
    return False


_WATCHER_NUMBERS = itertools.count()


class _Listening(threading.local):
    """How many op listeners are running on this thread: while one is, no mode reports."""

    depth = 0


_LISTENING = _Listening()


class _OpMode(TorchFunctionMode):
    """Runs each torch function, then reports it to the listener when it returned a tensor and
    a selected module's own code is running (``frame``)."""

    def __init__(self, listener: OpListener) -> None:
        super().__init__()
        #: The innermost selected call running, set by the watcher; None: report nothing.
        self.frame: _Frame | None = None
        #: Attach order among watchers: a later watcher's mode sits above an earlier one's.
        self.order = next(_WATCHER_NUMBERS)
        self._listener = listener
        self._names: dict[Any, str] = {}

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if kwargs is None:
            kwargs = {}
        output = func(*args, **kwargs)  # torch took this mode off the stack while it runs
        frame = self.frame
        if frame is None or _LISTENING.depth or not _holds_tensor(output):
            return output
        try:
            name = self._names[func]
        except KeyError:
            name = self._names[func] = op_name(func)
        except TypeError:  # an unhashable callable
            name = op_name(func)
        counts = frame.counts
        index = counts.get(name, 0)
        counts[name] = index + 1
        _LISTENING.depth += 1
        try:
            replacement = self._listener(frame.module, frame.call, name, index, args, kwargs, output)
        finally:
            _LISTENING.depth -= 1
        return output if replacement is None else replacement


#: The op watches reporting one module call's own code: ``(mode, frame)`` pairs, lowest first.
Frames = list[tuple[_OpMode, _Frame]]


def open_frames(module: Any) -> Frames:
    """The op watches on this thread whose innermost selected call is ``module``'s, in the
    order they were attached (the order an op's value reaches them); empty where none is. Read
    once per call of a tapped module and handed to :func:`report_value` for each of its values."""
    key = id(module)
    found = []
    for at in range(_mode_depth()):
        mode = mode_at(at)
        if type(mode) is _OpMode and mode.frame is not None and mode.frame.key == key:
            found.append((mode, mode.frame))
    found.sort(key=lambda pair: pair[0].order)
    return found


def report_value(frames: Frames, op: str, index: int, value: Any) -> Any:
    """Hand a value computed inside a module's forward by hookscope's own code (an expert's
    rows, read by a tap on a fused kernel) to that call's op watches (``frames``, from
    :func:`open_frames`), as if an op named ``op`` with that ``index`` had returned it; return
    what the module goes on with (a watch's replacement, else ``value``). Watches see it in the
    order they were attached, each the previous one's replacement, as stacked modes see a real
    op's output."""
    for mode, frame in frames:
        counts = frame.counts
        if counts.get(op, 0) <= index:
            counts[op] = index + 1  # what hs.layers lists: as many as the highest index reported
        _LISTENING.depth += 1
        try:
            replacement = mode._listener(frame.module, frame.call, op, index, (), {}, value)
        finally:
            _LISTENING.depth -= 1
        if replacement is not None:
            value = replacement
    return value


class hookscope_work:  # noqa: N801 - used as a context manager, like torch.no_grad
    """Inside: torch calls on this thread are reported to no op watch (hookscope's own
    computation standing in for a fused kernel, whose values :func:`report_value` hands on)."""

    def __enter__(self) -> None:
        _LISTENING.depth += 1

    def __exit__(self, *exc: object) -> None:
        _LISTENING.depth -= 1

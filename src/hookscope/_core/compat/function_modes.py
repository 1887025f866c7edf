"""Put a torch function mode on this thread's mode stack and take it off again, wherever it stands.

hookscope pushes modes of its own while a forward runs (the capture's copy-on-write guard, the
op watcher of :mod:`~hookscope._core.ops`), each when it needs to and not in ``with`` blocks, so
two of them interleave: one may be pushed above the other and taken off first or last. Popping
blindly would take the other's mode off; :func:`take_off` removes exactly the mode asked for and
leaves every other mode where it was, in its order. Torch keeps one stack per thread: these
functions act on the calling thread's.

>>> from torch.overrides import TorchFunctionMode
>>> class Quiet(TorchFunctionMode):
...     def __torch_function__(self, func, types, args=(), kwargs=None):
...         return func(*args, **(kwargs or {}))
>>> first, second = Quiet(), Quiet()
>>> put_on(first); put_on(second)
>>> take_off(first), on_stack(second), on_stack(first)
(True, True, False)
>>> take_off(second), take_off(second), depth()
(True, False, 0)
"""

from __future__ import annotations

from typing import Any

from hookscope._core.compat.private import mode_at as _at
from hookscope._core.compat.private import mode_stack_depth as _length
from hookscope._core.compat.private import pop_mode as _pop
from hookscope._core.compat.private import push_mode as _push

__all__ = ["depth", "on_stack", "put_on", "put_under", "take_off"]


def depth() -> int:
    """How many torch function modes are on this thread's stack."""
    return int(_length())


def on_stack(mode: Any) -> bool:
    """True when ``mode`` is on this thread's stack (at any height)."""
    return any(_at(index) is mode for index in range(_length()))


def put_on(mode: Any) -> None:
    """Push ``mode`` on top of this thread's stack (as ``with mode:`` does on entry)."""
    _push(mode)


def put_under(mode: Any, above: Any) -> None:
    """Push ``mode`` below every mode on this thread's stack for which ``above(other)`` is True;
    the modes lifted to make room (those and any pushed after the lowest of them) go back on in
    their order. For modes that must run in an order of their own whoever pushed first."""
    size = _length()
    lowest = next((index for index in range(size) if above(_at(index))), None)
    if lowest is None:
        _push(mode)
        return
    lifted: list[Any] = []
    while _length() > lowest:
        lifted.append(_pop())
    _push(mode)
    for other in reversed(lifted):
        _push(other)


def take_off(mode: Any) -> bool:
    """Remove ``mode`` from this thread's stack wherever it stands; the modes pushed above it
    stay, in their order. False when it was not on the stack (nothing changes then)."""
    size = _length()
    if size and _at(size - 1) is mode:  # the usual case: it is on top
        _pop()
        return True
    if not on_stack(mode):
        return False
    above: list[Any] = []  # pushed after it and still on: lift them off, drop it, put them back
    while _at(_length() - 1) is not mode:
        above.append(_pop())
    _pop()
    for other in reversed(above):
        _push(other)
    return True

"""The call tracker: each call of a watched module numbered within its forward pass, passes told apart.

A module can run several times in one forward pass (weights shared between two places, a block
applied in a loop). Each of those calls is its own site (:class:`~hookscope._core.sites.Site`),
numbered 0, 1, 2, ... in the order the calls start; the numbering starts again at every
top-level forward pass. :class:`CallTracker` keeps that numbering, tells a
:class:`PassListener` where passes start and end, and follows the thread rule (only the thread
that attached opens passes).
"""

from __future__ import annotations

import sys
import threading
from types import FrameType
from typing import Any, Protocol

from torch import nn

from hookscope._core.compat.compiled import EAGER, is_compiling
from hookscope._core.compat.internals import CALL_IMPL, hook_dicts_key
from hookscope._core.compat.private import graph_task_id
from hookscope._core.names import module_label
from hookscope.errors import ConcurrentPassError, SpecError, UnsupportedModelError

_get_ident = threading.get_ident

__all__ = [
    "PASSED_BY",
    "REPLICAS_HINT",
    "CallTracker",
    "PassListener",
    "backward_id",
    "in_backward",
    "is_reentered",
]

#: Ends the refusal of a DataParallel replica: what works instead.
REPLICAS_HINT = (
    "nn.DataParallel's replicas run in threads: hs.capture keeps them per device and hs.edit edits each, "
    "or use the bare model (parallel.module) on one device"
)


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
        if frame.f_code.co_name == CALL_IMPL and frame.f_locals.get("self") is module:
            calls += 1  # the call being entered is one; an outer one makes two
            if calls == 2:
                return True
        frame = frame.f_back
    return False


def backward_id() -> int:
    """The id of the backward pass running on this thread (each ``backward()`` its own, a
    reentrant checkpoint's inner one too), -1 outside one: state kept per backward is keyed by
    it, so a backward that raised before its end leaves nothing that the next one inherits."""
    return graph_task_id()


def in_backward() -> bool:
    """True while autograd runs a backward pass on this thread: a module called now is a
    checkpointed block (``torch.utils.checkpoint``) recomputing its forward."""
    return graph_task_id() != -1


def _on_autograd_thread() -> bool:
    """True on a thread that Python's ``threading`` did not start, such as autograd's device
    threads (on CUDA a backward, and a checkpoint's recomputation, run on one); asked on the
    rare path only."""
    return isinstance(threading.current_thread(), threading._DummyThread)


class PassListener(Protocol):
    """Told by a :class:`CallTracker` when a forward pass starts, ends, or was cut short.

    A listener that keeps ``nn.DataParallel`` replicas apart (the capture) or acts on them as on
    the model (edits) also sets ``accepts_replicas = True``; for any other listener a replica
    entering the pass is refused by the tracker itself, with one
    :class:`~hookscope.errors.ConcurrentPassError` for every feature.
    """

    def pass_started(self, module: nn.Module) -> None: ...

    def pass_ended(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None: ...

    def pass_abandoned(self) -> None: ...


def _replica_opener(name: str) -> Exception:
    return UnsupportedModelError(
        f"a replica of {name or 'the hooked model'!r} (nn.DataParallel copies it per device and runs the "
        "copies in threads) started a forward pass: attach to the DataParallel wrapper itself, whose call "
        "opens the pass, so that each replica is numbered on its own and captured per device"
    )


class _ReplicaCalls:
    """The call numbering of one thread's ``nn.DataParallel`` replicas, keyed by the originals."""

    __slots__ = ("counts", "open")

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.open: dict[int, list[int]] = {}


#: What :meth:`CallTracker.enter` returns for a call it leaves alone: one on another thread.
PASSED_BY = -1


class CallTracker:
    """Numbers the calls of watched modules within each forward pass, and says when passes start and end.

    ``enter`` runs in a forward pre-hook and returns the call's index; ``exit`` runs in a forward
    hook registered with ``always_call=True``, so a forward that raises still closes its call.
    A pass starts when a watched module is entered while no watched call is open: with the
    model's root watched, that is each call of the model, and a submodule called on its own is
    a pass of its own. A pass whose opening module is entered again with no outer call of it on
    the stack was cut short (``KeyboardInterrupt`` skips ``always_call`` hooks) and is dropped.
    Modules are keyed by identity, so a module reachable under two names has one counter.

    **Threads.** A tracker follows the thread that made it, which is the thread that attached
    the feature (``hs.capture(model)``, ``hs.tracing(model)``, ``hs.edit(...)``; the one-shot
    forms attach and run on the calling thread): only that thread opens passes. A forward of the
    same model on any other thread passes by: ``enter`` returns :data:`PASSED_BY` and touches
    nothing, so the owner's numbering, passes and listener are undisturbed, and the feature's
    hooks return at once where :attr:`shared` and :meth:`foreign` say the call is another
    thread's (one attribute read per hook until another thread has run the model). A feature
    attached on one thread and run only on another therefore records nothing. Two exceptions:

    - a call made while autograd runs a backward (:func:`in_backward`) on a thread Python did
      not start (autograd's device threads, where CUDA runs a backward) is the owner's: a
      checkpointed block recomputing its forward, which edits must change as they changed the
      forward. A backward on a Python thread runs on that thread and follows its rule;
    - ``nn.DataParallel`` replicas (shallow copies sharing the watched modules' hook dicts) run
      in threads during the owner's pass: where the listener says ``accepts_replicas`` each such
      thread numbers its calls on its own, else the replica is refused with a
      :class:`~hookscope.errors.ConcurrentPassError` naming ``feature`` (the ``hs.`` verb) and
      the way out; a replica opening a pass (the wrapper not watched) is refused as well.

    Autograd's thread entering while the owner's pass is open (or the reverse) is refused the
    same way: the calls of the two would mix.

    The hot path is one thread comparison, a few dict operations and a list append/pop. Inside
    compiled code the thread cannot be read (Dynamo cannot trace ``get_ident``): a pass opens
    and ends eagerly (one graph break where that happens inside compiled code), and once
    another thread has run the model every hook checks eagerly (a graph break per hook).
    """

    __slots__ = (
        "_counts",
        "_feature",
        "_listener",
        "_lock",
        "_names",
        "_open",
        "_open_calls",
        "_opener",
        "_originals",
        "_owner",
        "_replicas",
        "_thread",
        "replaying",
        "shared",
    )

    def __init__(self, listener: PassListener | None = None, *, feature: str = "hooks") -> None:
        self._feature = feature
        self._counts: dict[int, int] = {}
        self._open: dict[int, list[int]] = {}
        self._open_calls = 0
        self._names: dict[int, str] = {}
        self._listener = listener
        self._opener = 0
        self._owner = threading.get_ident()  # the thread that attaches: the only one that opens passes
        self._thread = 0  # the thread of the open pass: the owner, or autograd's during its backward
        self._lock = threading.RLock()  # re-entrant: a listener may run the model again
        self._originals: dict[int, int] = {}  # id of a watched module's hook dict -> id of the module
        # Thread -> its replicas' calls, in this pass. Keyed by the thread object, which the
        # dict keeps alive: a finished thread's ident is reused by the next one Python starts,
        # so two replicas run one after the other would otherwise share one numbering.
        self._replicas: dict[threading.Thread, _ReplicaCalls] = {}
        #: True during a pass that autograd runs inside a backward pass: a checkpointed block
        #: (``torch.utils.checkpoint``) recomputing its forward. Features that record the forward
        #: (capture, trace) ignore such a pass, so the recomputation neither adds a second
        #: capture nor replaces the real one; edits still apply, or the recomputation would differ.
        self.replaying = False
        #: True once a thread other than the owner's has entered a watched module (for good:
        #: compiled code guards on it). Until then every call is the owner's and hooks skip
        #: :meth:`foreign`; from then on they ask it.
        self.shared = False

    def watch(self, name: str, module: nn.Module) -> None:
        """Start counting ``module``'s calls, reported under ``name``."""
        self._names.setdefault(id(module), name)
        self._open.setdefault(id(module), [])  # every key from the start: compiled code guards on the dict's size
        # nn.DataParallel's replicas are shallow copies: they share the original's hook dicts
        self._originals.setdefault(hook_dicts_key(module), id(module))

    def enter(self, module: nn.Module, *, eager: bool = False) -> int:
        """Open a call of ``module`` and return its index in the current pass, or
        :data:`PASSED_BY` for a call on another thread, which is left alone. ``eager=True``:
        called from compiled code through :data:`EAGER`, so certainly not being traced."""
        if not eager and is_compiling():
            if self.shared or self._open_calls == 0 or id(module) == self._opener:
                # Opening a pass (and entering its opener again: recursion, or a call on another
                # thread) needs the thread, the lock and autograd's state, none of which Dynamo
                # traces: run it eagerly, one graph break where the pass opens in compiled code;
                # once another thread has run the model, every call is checked so.
                index: int = EAGER(_enter_eagerly)(self, module)
                return index
            return self._count(id(module))
        key, ident = id(module), _get_ident()
        if ident == self._thread and self._open_calls and key != self._opener:
            return self._count(key)  # the hot path: a call inside this thread's open pass
        if ident != self._owner:
            return self._enter_elsewhere(module, key, ident)
        return self._enter_owned(module, key, ident)

    def _enter_owned(self, module: nn.Module, key: int, ident: int) -> int:
        """A call that opens a pass, or enters the pass's opener again, on the pass's own thread."""
        if self._open_calls:
            if ident != self._thread:
                raise self._refusal(module, replica=False)  # autograd's thread and the owner's: never mixed
            if key != self._opener or is_reentered(module):
                return self._count(key)  # recursion
            self._abandon()
        with self._lock:  # the owner and autograd's thread entering at once: one opens the pass
            if self._open_calls:
                raise self._refusal(module, replica=False)
            if self._originals.get(hook_dicts_key(module), key) != key:
                raise _replica_opener(self._names.get(self._originals[hook_dicts_key(module)], ""))
            self._open_pass(module, key, ident)
            return self._count(key)

    def _enter_elsewhere(self, module: nn.Module, key: int, ident: int) -> int:
        """A call on a thread other than the owner's (the rare path): a DataParallel replica,
        autograd recomputing a checkpointed block for the owner, or another thread's forward."""
        original = self._originals.get(hook_dicts_key(module))
        if original is not None and original != key:
            self.shared = True
            return self._enter_replica(module, original)
        if in_backward() and _on_autograd_thread():
            return self._enter_owned(module, key, ident)
        self.shared = True
        return PASSED_BY

    def _open_pass(self, module: nn.Module, key: int, thread: int) -> None:
        self._counts.clear()
        self._replicas = {}
        self._opener = key
        self._thread = thread
        self.replaying = in_backward()
        if self._listener is not None:
            self._listener.pass_started(module)

    def _count(self, key: int) -> int:
        index = self._counts.get(key, 0)
        self._counts[key] = index + 1
        self._open.setdefault(key, []).append(index)
        self._open_calls += 1
        return index

    def exit(
        self,
        module: nn.Module,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        output: Any = None,
        *,
        eager: bool = False,
    ) -> None:
        """Close the innermost open call of ``module``; a close without an open is ignored, and
        so is one on a thread other than the pass's (it opened nothing)."""
        if not self._open_calls:
            return  # nothing open
        if not eager and is_compiling():
            if self._open_calls == 1 or id(module) == self._opener or self.shared:
                # The pass ends, or its opener closes (maybe on another thread, which only an
                # eager check tells): eagerly, as the pass opened.
                EAGER(_exit_eagerly)(self, module, args, kwargs, output)
                return
        elif _get_ident() != self._thread:
            replica_stack = self._replica_stack(module)  # None: a call on another thread, never opened
            if replica_stack:
                replica_stack.pop()
            return
        stack = self._open.get(id(module))
        if not stack:
            return
        stack.pop()
        if self._open_calls > 1:
            self._open_calls -= 1
            return
        with self._lock:  # the pass ends: no other thread opens the next one before its listener is done
            self._open_calls = 0
            if self._listener is not None:
                self._listener.pass_ended(module, args, kwargs or {}, output)

    def foreign(self, *, eager: bool = False) -> bool:
        """True for a call that is another thread's, which hooks leave alone: not on the thread of
        the open pass, and no ``nn.DataParallel`` replica of it. Hooks ask it only once
        :attr:`shared` is set: ``if tracker.shared and tracker.foreign(): return``."""
        if not eager and is_compiling():
            foreign: bool = EAGER(_foreign_eagerly)(self)
            return foreign
        ident = _get_ident()
        if self._open_calls:
            return ident != self._thread and not self.in_replica()
        return ident != self._owner

    def owns(self) -> bool:
        """True on the thread whose pass is open: a closing hook running for a call on another
        thread (``always_call`` hooks run for refused calls too) must leave the pass alone."""
        return self._open_calls > 0 and not (self.shared and self.foreign())

    def current(self, module: nn.Module) -> int:
        """Index of ``module``'s innermost open call (valid inside its hooks, on the pass's thread)."""
        stack = self._open.get(id(module))
        if not stack and self._replicas:  # a DataParallel replica, on its own thread
            stack = self._replica_stack(module)
        if not stack:
            raise SpecError(
                "no call of this module is open; current() is valid only inside its hooks, while the call runs"
            )
        return stack[-1]

    def in_replica(self) -> bool:
        """True on a thread running ``nn.DataParallel`` replicas of the watched modules in this pass."""
        return bool(self._replicas) and threading.current_thread() in self._replicas

    def _enter_replica(self, module: nn.Module, original: int) -> int:
        """A replica's call (``nn.DataParallel`` runs one per device in threads): numbered on its
        own if the listener keeps replicas apart, during the pass the wrapper's call opened."""
        if not self._open_calls:
            raise _replica_opener(self._names.get(original, ""))
        accepts = self._listener is None or getattr(self._listener, "accepts_replicas", False)
        if not accepts:
            raise self._refusal(module, replica=True)
        replica = self._replica_calls()
        if replica is None:
            with self._lock:
                replica = self._replicas.setdefault(threading.current_thread(), _ReplicaCalls())
        index = replica.counts.get(original, 0)
        replica.counts[original] = index + 1
        replica.open.setdefault(original, []).append(index)
        return index

    def _replica_calls(self) -> _ReplicaCalls | None:
        return self._replicas.get(threading.current_thread())

    def _replica_stack(self, module: nn.Module) -> list[int] | None:
        """This thread's open calls of the original that ``module`` is a replica of."""
        replica = self._replica_calls()
        return replica.open.get(self._originals.get(hook_dicts_key(module), 0)) if replica else None

    def counts(self) -> dict[str, int]:
        """``{name: calls}`` for the latest pass, in the order the modules were watched."""
        return {name: self._counts.get(key, 0) for key, name in self._names.items()}

    def reset(self) -> None:
        """Forget open calls and counts (used when hooks are removed)."""
        self._replicas = {}
        self._counts.clear()
        for stack in self._open.values():
            stack.clear()
        self._open_calls = 0

    def _abandon(self) -> None:
        self.reset()
        if self._listener is not None:
            self._listener.pass_abandoned()

    def _refusal(self, module: nn.Module, *, replica: bool) -> ConcurrentPassError:
        """The one error for a call that would mix into a pass open on another thread (on that rare
        path only): a replica the listener does not keep apart, or autograd's thread and the owner's."""
        self.shared = True  # the refused call's closing hooks must leave the open pass alone
        key = self._originals.get(hook_dicts_key(module), id(module))  # a replica: its original's name
        name = self._names.get(key, "")
        where = module_label(name)
        verb = f"hs.{self._feature}"
        if replica:
            message = (
                f"{verb} records the forward pass of the thread that attached it, and an nn.DataParallel replica "
                f"of {where!r} entered it from another thread: the replicas' calls would mix into that one record; "
                f"{REPLICAS_HINT}"
            )
        else:
            message = (
                f"{verb} is recording a forward pass on one thread and autograd entered {where!r} on another "
                "meanwhile (a checkpointed block recomputing in a backward): the calls of the two would mix; "
                f"run the backward after the forward returns, on the thread that attached {verb}, or give the "
                "other thread its own copy of the model"
            )
        return ConcurrentPassError(message, feature=self._feature, module=name)


# What compiled code calls through EAGER (plain functions: EAGER makes one wrapper per function).
# They say eager=True rather than ask is_compiling() again: torch's flag is process-wide, so it
# reads True on any thread while another thread compiles, and asking again would recurse.


def _enter_eagerly(tracker: CallTracker, module: nn.Module) -> int:
    return tracker.enter(module, eager=True)


def _exit_eagerly(tracker: CallTracker, module: nn.Module, *rest: Any) -> None:
    tracker.exit(module, *rest, eager=True)


def _foreign_eagerly(tracker: CallTracker) -> bool:
    return tracker.foreign(eager=True)

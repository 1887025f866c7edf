"""Run code around one module's call or forward: what a hook cannot do.

A :class:`WrapSpec` is attached and removed by :class:`~hookscope._core.attach.HookGroup` like a
hook; this module holds the wrapper put in the module's ``__dict__`` and the handle that takes
it out again in any order. Why wrappers and not hooks is :class:`WrapSpec`'s docstring.
"""

from __future__ import annotations

import copy
import operator
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from hookscope._core.compat.compiled import never_compiled
from hookscope._core.compat.internals import CALL_IMPL, COMPILED_CALL_IMPL, calls_look_up_call_impl
from hookscope._core.names import module_label
from hookscope.errors import HookscopeError, SpecError, UnsupportedModelError

__all__ = ["WrapHandle", "WrapKind", "WrapSpec", "calls_through_module_call", "copied_error", "is_wrapper"]

#: What a :class:`WrapSpec` runs around: ``"call"`` the module's whole call (its hooks, from the
#: first pre-hook to the last forward hook, and the forward), ``"forward"`` its forward alone;
#: ``"compiled"``, the call ``model.compile()`` compiled (only the compile routes wrap it).
WrapKind = Literal["call", "forward", "compiled"]
_WRAPPED_ATTRIBUTE: dict[str, str] = {"call": CALL_IMPL, "forward": "forward", "compiled": COMPILED_CALL_IMPL}


@dataclass(frozen=True)
class WrapSpec:
    """Run ``fn`` around one module's call or forward: ``fn(inner, args, kwargs)`` must return
    ``inner(*args, **kwargs)`` (it may run code before and after, in ``try``/``finally``).

    Why not hooks: hooks run in the order attached, so no hook can run *last before* the
    forward once another pre-hook is attached after it, and ``always_call`` forward hooks are
    skipped by a ``KeyboardInterrupt``. A wrapper of ``forward`` brackets the forward itself;
    a wrapper of the call (the instance's ``_call_impl``, which ``nn.Module.__call__`` looks up)
    brackets every hook of the module too.

    Installed as an instance attribute and removed by :class:`HookGroup` like a hook; if other
    code wrapped the same attribute after it (accelerate wraps ``forward``), removal leaves a
    pass-through in place rather than undo the other wrapper (it copies and pickles as what
    it wraps, so the model can still be saved). Under ``torch.compile`` a wrapped
    module runs eagerly, everything it calls included (a graph break around it): what a wrapper
    watches then runs as written.
    """

    name: str
    module: nn.Module
    around: WrapKind
    fn: Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]

    def __post_init__(self) -> None:
        if self.around not in _WRAPPED_ATTRIBUTE:
            raise SpecError(f"wrap kind {self.around!r} is unknown; expected 'call' or 'forward'")
        if self.around == "call" and not calls_look_up_call_impl():
            raise UnsupportedModelError(
                f"this torch ({torch.__version__}) calls modules without looking up _call_impl on the instance, "
                "which op sites need; use torch 2.1 or later"
            )
        if self.around == "call" and not calls_through_module_call(self.module):
            raise UnsupportedModelError(
                f"module {module_label(self.name)!r} ({type(self.module).__name__}) overrides __call__, so its "
                "forward may run without nn.Module's call: select a module that is called as nn.Module calls"
            )


def calls_through_module_call(module: nn.Module) -> bool:
    """Whether calling ``module`` goes through ``nn.Module.__call__`` (so a ``"call"`` wrap sees
    the call): False for classes that override ``__call__`` (torch.compile's ``OptimizedModule``)."""
    return type(module).__call__ is nn.Module.__call__


def is_wrapper(attribute: object) -> bool:
    """Whether a module's ``forward`` (or ``_call_impl``) as found is one of hookscope's wrappers."""
    return isinstance(attribute, _Wrapper)


class _Wrapper:
    """The callable put in the module's ``__dict__``; a pass-through once removed while other
    code's wrapper sits above it.

    Never compiled (a graph break around it under ``torch.compile``), and never copied: a
    ``copy.deepcopy`` of a wrapped module would keep a wrapper calling the *original* module,
    silently, so copying one is refused with the fix (as the hooks' anchors refuse it).
    ``had`` and ``previous`` are what the attribute held before it (``inner`` is that, or the
    class's method, bound), so a stack of wrappers can be taken apart in any order.
    """

    __slots__ = ("active", "fn", "had", "inner", "owner", "previous")

    def __init__(self, fn: Callable[..., Any], module: nn.Module, attribute: str, owner: str) -> None:
        self.fn = fn
        self.owner = owner
        self.had = attribute in module.__dict__
        self.previous = module.__dict__.get(attribute)
        self.inner: Callable[..., Any] = getattr(module, attribute)
        self.active = True

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        if self.active:
            return self.fn(self.inner, args, kwargs)
        return self.inner(*args, **kwargs)

    __call__ = never_compiled(_call)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        if not self.active:  # a pass-through left behind: the copy gets what it wraps, bound to the copy
            return copy.deepcopy(self.inner, memo)
        raise copied_error(self.owner, "copied", "copy")

    def __reduce__(self) -> Any:
        if not self.active:
            # A pass-through left behind under other code's wrapper: it pickles as what it wraps
            # (memoised with the rest), through a stdlib function, so loading needs no hookscope.
            return (operator.getitem, ((self.inner,), 0))
        raise copied_error(self.owner, "pickled", "save")


def _wrapped_attribute(module: nn.Module, around: WrapKind) -> str:
    """The instance attribute to wrap: ``_call_impl`` for the call; for the forward, the one
    that runs the module's own code: accelerate's ``_old_forward`` under its hook (its
    ``forward`` runs the hook's pre- and post-forward work around it, not the module's code)."""
    if around == "forward" and "_old_forward" in module.__dict__ and hasattr(module, "_hf_hook"):
        return "_old_forward"
    return _WRAPPED_ATTRIBUTE[around]


class WrapHandle:
    """Removes one :class:`_Wrapper`, whatever the order: on top, it restores what the attribute
    held (and unwinds pass-throughs below it); under another hookscope wrapper, it is spliced
    out of the chain; under other code's wrapper, it stays as a pass-through."""

    def __init__(self, module: nn.Module, owner: str, around: WrapKind, fn: Callable[..., Any]) -> None:
        self._module = weakref.ref(module)
        self._attribute = _wrapped_attribute(module, around)
        self._wrapper = _Wrapper(fn, module, self._attribute, owner)
        module.__dict__[self._attribute] = self._wrapper

    def remove(self) -> None:
        wrapper = self._wrapper
        if not wrapper.active:
            return
        wrapper.active = False
        module = self._module()
        if module is None:
            return
        held = module.__dict__
        attribute = self._attribute
        if held.get(attribute) is wrapper:
            _unwind(held, attribute, wrapper)
            return
        above = held.get(attribute)
        while isinstance(above, _Wrapper):  # hookscope's own wrappers above it: splice it out
            if above.inner is wrapper:
                above.inner, above.had, above.previous = wrapper.inner, wrapper.had, wrapper.previous
                return
            above = above.inner
        if self._attribute == "forward" and held.get("_old_forward") is wrapper:
            held["_old_forward"] = wrapper.inner  # accelerate wrapped it since: give it what we wrapped
            return
        # under other code's wrapper: left as a pass-through


def _unwind(held: dict[str, Any], attribute: str, wrapper: _Wrapper) -> None:
    """Put back what ``wrapper`` replaced, and what each pass-through under it replaced."""
    while True:
        if wrapper.had:
            held[attribute] = wrapper.previous
        else:
            held.pop(attribute, None)
        below = held.get(attribute)
        if not (isinstance(below, _Wrapper) and not below.active):
            return
        wrapper = below


def copied_error(owner: str, how: str, fix: str) -> HookscopeError:
    """The refusal to copy or pickle a module while hookscope is attached to it: the copy would
    carry the hooks (or op-site wrappers) and report into, or run, the original."""
    return HookscopeError(
        f"a module is being {how} while hookscope.{owner} is attached to it: the copy would carry its hooks "
        f"and report into (or run) the original; {fix} the model before "
        "attaching, or after removal (leave the with-block, or call .remove())"
    )

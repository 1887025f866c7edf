"""Hooks on models run through ``torch.compile``.

Dynamo traces a module's hooks into the graph it compiles, and guards on the hook dicts it saw
non-empty, so hooks attached *before* the first compiled call fire on every call and their
removal makes it recompile. But it does not guard on hook dicts it saw empty
(``torch._dynamo.config.skip_nnmodule_hook_guards``): hooks attached to a model whose compiled
code was made without them would never be called. That silent loss is what this module
prevents:

- :func:`eager_routes` runs before hooks are attached. When Dynamo holds code compiled without
  them that this model could run, this model, and only it, leaves compiled code while hooked: its
  ``torch.compile`` wrappers call the eager module. No ``torch._dynamo.reset()``: other models
  keep their compiled code, and this one finds its own again once the hooks are removed.
- :func:`guard_hook_dicts` has Dynamo guard on empty hook dicts while hooks are attached, so code
  compiled meanwhile for one block is not reused for another block whose hooks it never saw.
- :func:`sentinels` are two hooks per compile wrapper inside the model: one on the module it
  wraps (inside the compiled code) marks the call, one on the wrapper (outside it) checks the
  mark. A call whose compiled code skipped the hooks raises instead of returning a result the
  hooks never saw.
"""

from __future__ import annotations

import gc
import inspect
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from types import CodeType
from typing import Any

import torch
from torch import nn

from hookscope._core.compat.private import (
    compiled_code_objects,
    dynamo_config,
    has_compiled_code,
    optimized_module_class,
    wrapper_code,
)
from hookscope._core.names import module_label, named_modules
from hookscope.errors import StaleCompiledCodeWarning, UnsupportedModelError

__all__ = [
    "EAGER",
    "Route",
    "compile_wrappers",
    "eager_routes",
    "guard_hook_dicts",
    "is_compiling",
    "never_compiled",
    "note_registration",
    "reassert_hook_guards",
    "sentinels",
    "watching_wrappers",
]

_COMPILER = getattr(torch, "compiler", None)
_DISABLE: Callable[..., Any] | None = getattr(_COMPILER, "disable", None)
_IS_COMPILING: Callable[[], bool] | None = getattr(_COMPILER, "is_compiling", None)

#: True while Dynamo traces the code calling it: hook bodies then take paths it can trace
#: without a graph break (no reads to the host, no storage addresses, no version counters),
#: and run what it cannot trace through :data:`EAGER`. Always False in a torch lacking
#: ``torch.compiler.is_compiling`` or ``disable``: there Dynamo breaks the graph around hooks.
is_compiling: Callable[[], bool] = (
    _IS_COMPILING if _IS_COMPILING is not None and _DISABLE is not None else (lambda: False)
)

_ESCAPES: dict[Callable[..., Any], Callable[..., Any]] = {}


def EAGER(function: Callable[..., Any]) -> Callable[..., Any]:  # noqa: N802 (reads as a marker at call sites)
    """``function`` made callable eagerly from compiled code (``torch.compiler.disable``, one
    graph break), for hook work Dynamo cannot trace: threads, locks, autograd's state, reads to
    the host. Only called where :func:`is_compiling` is True; pass plain functions, not bound
    methods: one wrapper is made per function."""
    escape = _ESCAPES.get(function)
    if escape is None:
        assert _DISABLE is not None, "is_compiling() is False where torch.compiler.disable is missing"
        escape = _ESCAPES[function] = _DISABLE(function)
    return escape


def never_compiled(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` as Dynamo must leave it: called from compiled code, it and everything it calls
    run eagerly (``torch.compiler.disable``: a graph break around it). For wrappers whose work is
    to see a module's torch calls one by one, which compiled code would never make. Unchanged
    in a torch without ``torch.compiler.disable``."""
    return _DISABLE(function) if _DISABLE is not None else function


def compile_wrappers(model: nn.Module, hooked: Sequence[nn.Module] = ()) -> list[tuple[str, nn.Module]]:
    """``(name, wrapper)`` for every ``torch.compile`` wrapper (``OptimizedModule``) in ``model``;
    with ``hooked``, only the wrappers whose compiled code would have to call one of those modules."""
    cls = optimized_module_class()
    if cls is None:
        return []
    wrappers = [(name, module) for name, module in named_modules(model) if isinstance(module, cls)]
    if not hooked:
        return wrappers
    ids = {id(module) for module in hooked}
    return [(name, w) for name, w in wrappers if any(id(m) in ids for m in _inner(w).modules())]


Route = tuple[str, nn.Module, str, Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]]


def eager_routes(model: nn.Module, hooked: Sequence[nn.Module]) -> list[Route]:
    """``(name, module, around, fn)`` wraps (``around``: ``"forward"`` or ``"compiled"``, the
    in-place ``_compiled_call_impl``) that keep compiled code made without the hooks about to be
    attached to ``hooked`` from running while they are attached; none when there is no such code.

    Dynamo keeps its code per code object, shared by every model of a class (and the code of
    every ``torch.compile`` wrapper is one code object), so no compiled code can be dropped for
    one model alone: ``torch._dynamo.reset()`` would make every compiled model in the process
    compile again, and a method attaching hooks per cell would compile once per cell. Instead,
    only this model leaves its compiled code while hooked:

    - a ``torch.compile`` wrapper holding a hooked module, or around the model, calls the eager
      module it wraps; ``model.compile()`` (in place) calls the module's own ``_call_impl``;
    - found neither, but code of the model's classes is compiled (a function compiled around a
      call of this model, or another model of its class compiled: Dynamo's guards do not tell
      them apart): each hooked module gets a pass-through ``forward`` that is never compiled.
      Dynamo guards that a module it inlined has no ``forward`` of its own, so code that inlined
      *these* modules compiles again around them (a graph break at each) and runs them eagerly;
      other models' code is untouched, and an eager call costs next to nothing more. Without a
      compiled caller of this model found, nothing is said: most often there is none.

    Only the first case warns (the model loses its compiled speed while hooked). Removing the
    hooks takes the routes off, and the compiled code, still valid, runs again.
    """
    if not hooked or "torch._dynamo" not in sys.modules:
        return []
    stale = _stale_frames(model)
    if not stale:
        return []
    routes = [(name, wrapper, "forward", _run_inner(wrapper)) for name, wrapper in compile_wrappers(model, hooked)]
    ids = {id(module) for module in hooked}
    for name, module in named_modules(model):
        if module.__dict__.get("_compiled_call_impl") is not None and any(id(m) in ids for m in module.modules()):
            routes.append((name, module, "compiled", _run_call_impl(module)))
    if not routes:
        routes = _routes_around(model)
    if not routes:
        own = {id(module): module for module in hooked}.values()
        return [("", module, "forward", _pass_through) for module in own]
    warnings.warn(
        f"torch.compile holds code compiled for {stale} before these hooks were attached, and that code would "
        "never call them (torch.compile does not notice hooks added later); while they are attached, this model "
        "runs eagerly (its compiled code is kept, and used again after); other compiled code is "
        "untouched (to run them compiled, attach them before the first compiled call, or call "
        "torch._dynamo.reset() first)",
        StaleCompiledCodeWarning,
        stacklevel=_caller_level(),
    )
    return routes


def _run_inner(wrapper: nn.Module) -> Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]:
    """In place of a wrapper's compiled ``forward``: the eager module it wraps, called (its hooks too)."""
    ref = weakref.ref(wrapper)  # the route sits in the wrapper's own __dict__: no cycle through it

    def eager(_compiled: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        owner = ref()
        assert owner is not None, "a route is only called through the module that holds it"
        return _inner(owner)(*args, **kwargs)

    return eager


def _run_call_impl(module: nn.Module) -> Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]:
    """In place of ``model.compile()``'s compiled call: the module's own call, eagerly."""
    ref = weakref.ref(module)

    def eager(_compiled: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        owner = ref()
        assert owner is not None, "a route is only called through the module that holds it"
        call: Callable[..., Any] = owner._call_impl
        return call(*args, **kwargs)

    return eager


def _pass_through(inner: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return inner(*args, **kwargs)


def _routes_around(model: nn.Module) -> list[Route]:
    """Routes for the ``torch.compile`` wrappers elsewhere in the process that hold ``model``
    (the eager module was hooked, the wrapper is what gets called). A module ``model.compile()``'d
    around it is not found without a heap walk: the pass-through routes cover it."""
    return [(type(w).__name__, w, "forward", _run_inner(w)) for w in _wrappers_around(model)]


# While hookscope hooks are attached, Dynamo guards on every hook dict it reads, empty or not.
_GUARDS_LOCK = threading.Lock()
_guard_holders = 0
_guard_saved = True
# Dynamo's config is per thread (a context variable): the thread that switched the guard on.
_guard_thread: int | None = None


def guard_hook_dicts() -> Callable[[], None]:
    """Have Dynamo guard on empty hook dicts until the returned function is called (once).

    Dynamo skips guards on hook dicts it saw empty (``torch._dynamo.config.skip_nnmodule_hook_guards``).
    A graph break inside a block (an op watcher's eager module, a model's own break) makes
    Dynamo compile the rest of the block as a frame of its own, shared by every block of that
    class: compiled for block 0, whose MLP had no hooks, it ran for block 1 too and skipped
    block 1's hooks. With the guard, block 1 fails it and gets code with its hooks. Code
    compiled meanwhile keeps these guards (it recompiles when its hooks change, as it does for
    hooks it saw); the setting is put back when the last hookscope group is removed. Found
    switched back on while groups are attached (the user's ``config.patch`` around a capture's
    creation, an assignment), it is switched off again at each attach and before each call of a
    ``torch.compile`` wrapper holding hooks (:func:`reassert_hook_guards`), with one warning.
    """
    config: Any = dynamo_config()
    if config is None:
        return _nothing
    global _guard_holders, _guard_saved, _guard_thread
    with _GUARDS_LOCK:
        if not _guard_holders:
            _guard_saved = config.skip_nnmodule_hook_guards
            config.skip_nnmodule_hook_guards = False
            _guard_thread = threading.get_ident()
        else:
            reassert_hook_guards()
        _guard_holders += 1
    released: list[bool] = []

    def release() -> None:
        global _guard_holders
        with _GUARDS_LOCK:
            if released:
                return
            released.append(True)
            _guard_holders -= 1
            if not _guard_holders and config.skip_nnmodule_hook_guards is False:
                config.skip_nnmodule_hook_guards = _guard_saved

    return release


_SWITCHED_ON_SAID: list[bool] = []


def reassert_hook_guards() -> None:
    """While hookscope groups are attached, switch Dynamo's guards on empty hook dicts back on if
    something turned them off (one config read when nothing did); warn the first time. Only on
    the thread that switched them on: Dynamo's config is per thread, and another thread's is
    its own."""
    config: Any = dynamo_config()
    if not _guard_holders or config is None or threading.get_ident() != _guard_thread:
        return
    if config.skip_nnmodule_hook_guards is not True:
        return
    config.skip_nnmodule_hook_guards = False
    if not _SWITCHED_ON_SAID:
        _SWITCHED_ON_SAID.append(True)
        warnings.warn(
            "torch._dynamo.config.skip_nnmodule_hook_guards was switched on while hookscope hooks are attached "
            "(a config.patch around a capture's creation, or an assignment); code compiled so could skip the hooks "
            "of later blocks, so hookscope switched it off again until its hooks are removed (set it after "
            "removing them)",
            StaleCompiledCodeWarning,
            stacklevel=_caller_level(),
        )


def _nothing() -> None:
    return None


def sentinels(model: nn.Module, hooked: Sequence[nn.Module]) -> list[tuple[str, nn.Module, str, Callable[..., Any]]]:
    """``(name, module, kind, fn)`` of the hooks that catch a compiled call that skipped the hooks:
    per wrapper, a pre-hook on it clears a mark, a pre-hook on the module it wraps (inside the
    compiled code) sets it, and a forward hook on the wrapper checks it."""
    found: list[tuple[str, nn.Module, str, Callable[..., Any]]] = []
    for name, wrapper in compile_wrappers(model, hooked):
        inner = _inner(wrapper)
        mark: list[bool] = [False]

        def calling(_module: nn.Module, _args: Any, mark: list[bool] = mark) -> None:
            mark[0] = False
            reassert_hook_guards()  # before the wrapper's compiled call compiles anything

        def entered(_module: nn.Module, _args: Any, mark: list[bool] = mark) -> None:
            mark[0] = True

        def returned(_module: nn.Module, _args: Any, _output: Any, mark: list[bool] = mark, name: str = name) -> None:
            if not mark[0]:
                raise UnsupportedModelError(
                    f"the torch.compile'd code of {module_label(name)!r} ran without calling the hooks attached "
                    "inside it (it was compiled before they were attached); call torch._dynamo.reset() and "
                    "run again, or attach the hooks before the first compiled call"
                )

        found.append((name, wrapper, "forward_pre", calling))
        found.append((f"{name}._orig_mod" if name else "_orig_mod", inner, "forward_pre", entered))
        found.append((name, wrapper, "forward", returned))
    return found


def _inner(wrapper: nn.Module) -> nn.Module:
    inner = wrapper._modules["_orig_mod"]
    assert inner is not None, "an OptimizedModule always holds the module it compiles"
    return inner


def _stale_frames(model: nn.Module) -> str:
    """What compiled code hooks on ``model`` could run inside, described; ``""`` when none.

    Only this model's own compiled callers count: a ``torch.compile`` wrapper in it or around it
    or a ``model.compile()`` in it whose code ran, or code compiled from its classes' own
    ``forward`` (a function compiled around this model, or around another model of its class:
    Dynamo's guards do not tell the two apart). A model merely of a class whose other instances
    were compiled, through their wrappers, attaches as if nothing were compiled: Dynamo only
    runs that code inside a compiled caller, and this model has none.
    """
    codes = compiled_code_objects()
    if codes is not None and not codes:
        return ""  # nothing is compiled in the process
    compiled = _compiled_check(codes)
    inside = [name for name, wrapper in compile_wrappers(model) if _ran_compiled(_inner(wrapper), compiled)]
    if inside:
        return f"the torch.compile wrapper {inside[0]!r}" if inside[0] else "this torch.compile'd model"
    for module in model.modules():
        if module.__dict__.get("_compiled_call_impl") is not None and _ran_compiled(module, compiled):
            return f"the model.compile()'d {type(module).__name__}"
    if any(_ran_compiled(_inner(wrapper), compiled) for wrapper in _wrappers_around(model)):
        return f"a torch.compile wrapper of this {type(model).__name__}"
    for module_class in dict.fromkeys(type(module) for module in model.modules()):
        forward = getattr(module_class, "forward", None)
        own = inspect.unwrap(forward) if callable(forward) else None
        if compiled(getattr(own, "__code__", None)):  # its own code, not that of a shared decorator
            return f"{module_class.__qualname__}.forward"
    return ""


def _compiled_check(codes: list[CodeType] | None) -> Callable[[CodeType | None], bool]:
    """Whether a code object has compiled code: by ``codes``, else by asking Dynamo."""
    if codes is not None:
        held = {id(code) for code in codes}
        return lambda code: code is not None and id(code) in held
    return lambda code: code is not None and bool(has_compiled_code(code))


def _ran_compiled(module: nn.Module, compiled: Callable[[CodeType | None], bool]) -> bool:
    """Whether a wrapper's or a ``model.compile()``'d module's compiled code may have run: the
    code every wrapper shares, or code of its classes' ``forward`` (decorators' too), is compiled."""
    shared = wrapper_code()
    if shared is None:
        return False
    if compiled(shared):  # one code for every wrapper
        return True
    for module_class in dict.fromkeys(type(inner) for inner in module.modules()):
        forward = getattr(module_class, "forward", None)
        while forward is not None:
            if compiled(getattr(forward, "__code__", None)):
                return True
            forward = getattr(forward, "__wrapped__", None)
    return False


# torch.compile wrappers (OptimizedModule) made in this process, weakly: a global module
# registration hook (attached by attach.py) notes each as it takes the module it wraps, and one
# heap walk, the first time one is looked for, finds those made before it was attached. Without
# it, each attach would walk the heap to find the wrappers around a model.
_WRAPPERS: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_REGISTRY = {"watching": False, "seeded": False}
#: Whether Dynamo was imported before hookscope (which imports it for ``torch.compiler.disable``):
#: only then can a wrapper predate the registration hook.
_DYNAMO_BEFORE = "torch._dynamo.eval_frame" in sys.modules


def note_registration(module: nn.Module, name: str, submodule: object) -> None:
    """The global module-registration hook: keeps each ``torch.compile`` wrapper as it
    registers the module it wraps (one string compare for every other registration)."""
    if name == "_orig_mod":
        cls = optimized_module_class()
        if cls is not None and issubclass(type(module), cls):
            _WRAPPERS.add(module)


def watching_wrappers(watching: bool) -> None:
    """Told by attach.py once the registration hook is attached (``watching``), or that this
    torch has none; no wrapper can predate Dynamo's import, so none needs finding then."""
    _REGISTRY["watching"] = watching
    _REGISTRY["seeded"] = watching and not _DYNAMO_BEFORE


def _wrappers_around(model: nn.Module) -> list[nn.Module]:
    """Compile wrappers elsewhere in the process whose model holds ``model`` (the eager
    module was hooked, the wrapper is what gets called)."""
    cls = optimized_module_class()
    if cls is None:
        return []
    if not (_REGISTRY["watching"] and _REGISTRY["seeded"]):
        for obj in gc.get_objects():  # once: wrappers made before the registration hook
            if issubclass(type(obj), cls):  # type(), not isinstance: no __class__ of proxies is read
                _WRAPPERS.add(obj)
        _REGISTRY["seeded"] = True
    found = []
    for wrapper in list(_WRAPPERS):
        inner = wrapper._modules.get("_orig_mod")
        if wrapper is not model and inner is not None and any(module is model for module in inner.modules()):
            found.append(wrapper)
    return found


def _caller_level() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside hookscope."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("hookscope."):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level

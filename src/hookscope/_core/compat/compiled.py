"""Hooks on models run through ``torch.compile``.

Dynamo traces a module's hooks into the graph it compiles, and guards on the hook dicts it saw
non-empty, so hooks attached *before* the first compiled call fire on every call and their
removal makes it recompile. But it does not guard on hook dicts it saw empty
(``torch._dynamo.config.skip_nnmodule_hook_guards``): hooks attached to a model whose compiled
code was made without them would never be called. That silent loss is what this module
prevents:

- :func:`recompile_if_stale` runs before hooks are attached. When the model is, holds, or is
  held by a ``torch.compile`` wrapper and Dynamo holds compiled code of such wrappers, the code
  is dropped (``torch._dynamo.reset()``), so the next call compiles again, with the hooks.
- :func:`sentinels` are two hooks per compile wrapper inside the model: one on the module it
  wraps (inside the compiled code) marks the call, one on the wrapper (outside it) checks the
  mark. A call whose compiled code skipped the hooks raises instead of returning a result the
  hooks never saw.

``model.compile()`` (in place) compiles ``_call_impl`` with the hooks read at run time, and
needs neither.
"""

from __future__ import annotations

import gc
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from hookscope._core.names import module_label, named_modules
from hookscope.errors import StaleCompiledCodeWarning, UnsupportedModelError

__all__ = ["EAGER", "compile_wrappers", "is_compiling", "never_compiled", "recompile_if_stale", "sentinels"]

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

_EVAL_FRAME = "torch._dynamo.eval_frame"
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
    cls = _optimized_module()
    if cls is None:
        return []
    wrappers = [(name, module) for name, module in named_modules(model) if isinstance(module, cls)]
    if not hooked:
        return wrappers
    ids = {id(module) for module in hooked}
    return [(name, w) for name, w in wrappers if any(id(m) in ids for m in _inner(w).modules())]


def recompile_if_stale(model: nn.Module, hooked: Sequence[nn.Module]) -> None:
    """Drop compiled code that was made without the hooks about to be attached to ``hooked``.

    Any frame a hook would run in may have been compiled: the wrapper's own, or the ``forward``
    of any module class of the model (where a graph break split the model into several compiled
    frames). Dynamo keeps its code per code object,
    so this asks it about each of those code objects, once per class: a few lookups, and none at
    all in a process that never imported Dynamo. ``torch._dynamo.reset()`` is process-wide:
    other compiled functions compile again on their next call, the price of hooks that fire.
    """
    if not hooked or "torch._dynamo" not in sys.modules:
        return
    stale = _stale_frames(model)
    if not stale:
        return
    import torch._dynamo

    warnings.warn(
        f"torch.compile holds code compiled for {stale} before these hooks were attached, and that code "
        "would never call them (torch.compile does not notice hooks added later); hookscope called "
        "torch._dynamo.reset(), so the next call compiles again, with the hooks (attach hooks before the "
        "first compiled call to avoid the recompilation)",
        StaleCompiledCodeWarning,
        stacklevel=_caller_level(),
    )
    torch._dynamo.reset()


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


def _optimized_module() -> type[nn.Module] | None:
    """``OptimizedModule``, if Dynamo has been imported (no wrapper can exist otherwise)."""
    eval_frame = sys.modules.get(_EVAL_FRAME)
    return getattr(eval_frame, "OptimizedModule", None) if eval_frame is not None else None


def _stale_frames(model: nn.Module) -> str:
    """What compiled code hooks on ``model`` could run inside, described; ``""`` when none."""
    try:
        from torch._dynamo import external_utils
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:
        return ""

    def compiled(function: object) -> bool:
        code = getattr(function, "__code__", None)
        try:
            return code is not None and bool(_debug_get_cache_entry_list(code))
        except (TypeError, RuntimeError):
            return True  # an unknown code object: assume the worst

    cls = _optimized_module()
    if cls is not None and compiled(external_utils.wrap_inline(lambda: None)):  # one code for every wrapper
        inside = [name for name, _ in compile_wrappers(model)]
        if inside:
            return f"the torch.compile wrapper {inside[0]!r}" if inside[0] else "this torch.compile'd model"
        if _wrappers_around(model, cls):
            return f"a torch.compile wrapper of this {type(model).__name__}"
    for module_class in dict.fromkeys(type(module) for module in model.modules()):
        forward = getattr(module_class, "forward", None)
        if compiled(forward):
            return f"{module_class.__qualname__}.forward"
    return ""


def _wrappers_around(model: nn.Module, cls: type[nn.Module]) -> list[nn.Module]:
    """Compile wrappers elsewhere in the process whose model holds ``model`` (the eager
    module was hooked, the wrapper is what gets called). One heap walk, only once a wrapper ran."""
    found = []
    for obj in gc.get_objects():
        if issubclass(type(obj), cls):  # type(), not isinstance: no __class__ of proxies is read
            inner = obj._modules.get("_orig_mod")
            if inner is not None and any(module is model for module in inner.modules()):
                found.append(obj)
    return found


def _caller_level() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside hookscope."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("hookscope."):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level

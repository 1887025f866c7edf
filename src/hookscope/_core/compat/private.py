"""Every private torch API hookscope calls, each behind one version guard.

Torch's private names move between releases without notice. Reading each of them here, once,
with what to do where it is missing, means a torch that renamed one fails in one place with a
message naming it (or falls back where a fallback is exact), not deep inside a hook. Nothing
else in the package touches ``torch._C``, ``torch._ops`` or ``torch._dynamo`` (a test reads the
source for it); ``tests/core/test_compat.py`` checks each accessor against the behaviour it stands for.

The calls, by what they are for:

- the torch function mode stack (:func:`mode_stack_depth`, :func:`mode_at`, :func:`push_mode`,
  :func:`pop_mode`, :func:`torch_functions_off`): hookscope's modes come and go mid-forward;
- autograd's graph task id (:func:`graph_task_id`): which backward runs on this thread;
- op overloads (:func:`op_overload_types`): which arguments an op writes, from its schema;
- zero tensors (:func:`is_zero_tensor`): tensors with no memory behind ``data_ptr()``;
- :func:`foreach_norm`: every gradient's norm in one kernel per device and dtype;
- Dynamo (:func:`optimized_module_class`, :func:`dynamo_config`, :func:`compiled_code_objects`,
  :func:`has_compiled_code`, :func:`wrapper_code`, :func:`dynamo_errors`): what is compiled,
  and how compiling failed.

The private attributes of torch's objects (a tensor's version counter, a module's hook dicts,
``_modules``, ``_call_impl``) are read in :mod:`~hookscope._core.compat.internals`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from types import CodeType
from typing import Any

import torch

from hookscope.errors import UnsupportedModelError

__all__ = [
    "compiled_code_objects",
    "dynamo_config",
    "dynamo_errors",
    "foreach_norm",
    "graph_task_id",
    "has_compiled_code",
    "is_zero_tensor",
    "mode_at",
    "mode_stack_depth",
    "op_overload_types",
    "optimized_module_class",
    "pop_mode",
    "push_mode",
    "torch_functions_off",
    "wrapper_code",
]

#: The oldest torch hookscope supports (pyproject's ``torch>=2.1``): every name read below
#: exists there, unless its guard says otherwise.
MINIMUM_TORCH = (2, 1)


def _needed(owner: object, name: str, path: str) -> Any:
    """``owner.name``, or an error naming the private API this torch lacks (read at import:
    a torch without it cannot run hookscope's op sites or in-place guard at all)."""
    found = getattr(owner, name, None)
    if found is None:
        raise UnsupportedModelError(
            f"this torch ({torch.__version__}) has no {path}, which hookscope needs; "
            f"use torch {'.'.join(map(str, MINIMUM_TORCH))} or later (hookscope's tests name the versions it runs on)"
        )
    return found


# -- the torch function mode stack (torch._C, since torch 2.0) ------------------------------------

_LENGTH: Callable[[], int] = _needed(torch._C, "_len_torch_function_stack", "torch._C._len_torch_function_stack")
_AT: Callable[[int], Any] = _needed(torch._C, "_get_function_stack_at", "torch._C._get_function_stack_at")
_PUSH: Callable[[Any], None] = _needed(
    torch._C, "_push_on_torch_function_stack", "torch._C._push_on_torch_function_stack"
)
_POP: Callable[[], Any] = _needed(torch._C, "_pop_torch_function_stack", "torch._C._pop_torch_function_stack")
_FUNCTIONS_OFF: Callable[[], AbstractContextManager[None]] = _needed(
    torch._C, "DisableTorchFunction", "torch._C.DisableTorchFunction"
)


def mode_stack_depth() -> int:
    """How many torch function modes are on this thread's stack."""
    return int(_LENGTH())


def mode_at(index: int) -> Any:
    """The mode at ``index`` of this thread's stack (0: the lowest)."""
    return _AT(index)


def push_mode(mode: Any) -> None:
    """Push ``mode`` on this thread's stack, without calling its ``__enter__``."""
    _PUSH(mode)


def pop_mode() -> Any:
    """Take the top mode off this thread's stack and return it."""
    return _POP()


def torch_functions_off() -> AbstractContextManager[None]:
    """A ``with`` block in which no torch function mode sees torch calls (hookscope's own work)."""
    return _FUNCTIONS_OFF()


# -- autograd -------------------------------------------------------------------------------------

# torch._C._current_graph_task_id: since torch 2.0; where missing, no backward is ever seen, the
# behaviour of torch before it (checkpointed recomputations then count as forwards).
_GRAPH_TASK: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", lambda: -1)


def graph_task_id() -> int:
    """The id of the backward pass running on this thread, -1 outside one."""
    return int(_GRAPH_TASK())


def foreach_norm(tensors: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """The 2-norm of each tensor, in one kernel per device and dtype (``torch._foreach_norm``),
    computed in ``dtype`` where given. A torch before 2.3 takes no ``dtype=``: the tensors are
    cast first (the same values); one without the function gets one norm per tensor."""
    fused = getattr(torch, "_foreach_norm", None)
    if fused is None:
        return [torch.linalg.vector_norm(t, 2, dtype=dtype) for t in tensors]
    if dtype is None:
        return list(fused(list(tensors)))
    try:
        return list(fused(list(tensors), 2, dtype=dtype))
    except TypeError:  # a torch without dtype= (before 2.3)
        return list(fused([t.to(dtype) for t in tensors]))


def is_zero_tensor(tensor: torch.Tensor) -> bool:
    """True for one of autograd's zero tensors, which have no memory behind ``data_ptr()``."""
    check = getattr(tensor, "_is_zerotensor", None)
    return bool(check()) if check is not None else False


def op_overload_types() -> tuple[type[torch._ops.OpOverload], type[torch._ops.OpOverloadPacket]]:
    """``(OpOverload, OpOverloadPacket)``: the types of ``torch.ops.ns.op.overload`` and
    ``torch.ops.ns.op``, whose schema says which arguments they write."""
    ops = torch._ops
    return _needed(ops, "OpOverload", "torch._ops.OpOverload"), _needed(
        ops, "OpOverloadPacket", "torch._ops.OpOverloadPacket"
    )


# -- Dynamo (read only once imported: hookscope never imports it for a model that is not compiled) --

_EVAL_FRAME = "torch._dynamo.eval_frame"


def optimized_module_class() -> type[torch.nn.Module] | None:
    """``OptimizedModule``, the class of ``torch.compile``'s wrappers, once Dynamo is imported
    (no wrapper can exist before); None before, or in a torch without it."""
    eval_frame = sys.modules.get(_EVAL_FRAME)
    found = getattr(eval_frame, "OptimizedModule", None) if eval_frame is not None else None
    return found if isinstance(found, type) else None


def dynamo_config() -> Any:
    """Dynamo's config module once imported and holding ``skip_nnmodule_hook_guards`` (the one
    setting hookscope switches), else None."""
    config = sys.modules.get("torch._dynamo.config")
    return config if config is not None and hasattr(config, "skip_nnmodule_hook_guards") else None


def _cache_entries() -> Callable[[CodeType], Any] | None:
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:
        return None
    entries: Callable[[CodeType], Any] = _debug_get_cache_entry_list
    return entries


def compiled_code_objects() -> list[CodeType] | None:
    """The code objects Dynamo holds compiled code for (Dynamo tracks what it compiled, so the
    list is short); None where this torch does not say, and each code must be asked instead
    (:func:`has_compiled_code`)."""
    entries = _cache_entries()
    if entries is None:
        return None
    try:
        from torch._dynamo import convert_frame
    except ImportError:
        return None
    seen = getattr(getattr(convert_frame, "input_codes", None), "seen", None)
    if not isinstance(seen, list):
        return None
    found = []
    for ref in list(seen):
        code = ref()
        try:
            if code is not None and entries(code):
                found.append(code)
        except (TypeError, RuntimeError):
            return None
    return found


def has_compiled_code(code: CodeType) -> bool | None:
    """Whether Dynamo holds compiled code for ``code``: True also for a code object it cannot
    ask about (assume the worst); None where this torch cannot say at all."""
    entries = _cache_entries()
    if entries is None:
        return None
    try:
        return bool(entries(code))
    except (TypeError, RuntimeError):
        return True


def wrapper_code() -> CodeType | None:
    """The one code object every ``torch.compile`` wrapper's compiled call runs through
    (``torch._dynamo.external_utils.wrap_inline``), or None in a torch without it."""
    try:
        from torch._dynamo import external_utils
    except ImportError:
        return None
    wrap_inline = getattr(external_utils, "wrap_inline", None)
    if wrap_inline is None:
        return None
    code: CodeType | None = getattr(wrap_inline(lambda: None), "__code__", None)
    return code


def dynamo_errors() -> tuple[type[BaseException], type[BaseException]]:
    """``(recompile limit hit, any Dynamo failure)``: the exceptions a compiled function raises
    when Dynamo gives up on it (imports Dynamo: called where something is being compiled)."""
    from torch._dynamo import exc

    limit: type[BaseException] = getattr(exc, "FailOnRecompileLimitHit", None) or _NeverRaisedError
    failure: type[BaseException] = _needed(exc, "TorchDynamoException", "torch._dynamo.exc.TorchDynamoException")
    return limit, failure


class _NeverRaisedError(Exception):
    """Stands for an exception type a torch does not have: never raised, so never caught."""

"""The private attributes of ``nn.Module`` and ``Tensor`` that hookscope reads, each in one place.

:mod:`~hookscope._core.compat.private` holds torch's private *functions*; this module holds the
private *attributes* of its objects that hooks alone cannot replace:

- :func:`version_counter`: ``tensor._version``, bumped by every in-place write, which tells a
  kept value that was written into after it was read from one that was not;
- :func:`hook_dicts_key`: the identity of ``module._forward_pre_hooks``, which
  ``nn.DataParallel``'s replicas share with the module they copy (``replicate`` copies
  ``__dict__`` shallowly): the one way to tell a replica's call from its original's;
- :func:`module_hooks`: the hook functions in ``module._forward_hooks``, ``_forward_pre_hooks``,
  ``_backward_hooks`` and ``_backward_pre_hooks``, which ``hs.verify`` counts to prove a check
  left none behind (a ``RemovableHandle`` does not say whether it is still attached);
- :func:`child_slots`: ``module._modules``, every child under every attribute, a module held
  twice included (``named_children`` lists it once);
- :data:`CALL_IMPL`, :data:`COMPILED_CALL_IMPL` and :func:`calls_look_up_call_impl`: the instance
  attributes ``nn.Module.__call__`` runs, which a wrapper of a module's whole call replaces;
- :data:`COMPILED_MODEL_ATTRIBUTE`: where ``torch.compile``'s wrapper keeps the model.

A test (``tests/core/test_compat_internals.py``) checks each against the behaviour it stands for on the
installed torch, and that no module outside ``compat/`` reads these names.
"""

from __future__ import annotations

from collections.abc import ItemsView

import torch
from torch import nn

__all__ = [
    "CALL_IMPL",
    "COMPILED_CALL_IMPL",
    "COMPILED_MODEL_ATTRIBUTE",
    "calls_look_up_call_impl",
    "child_slots",
    "hook_dicts_key",
    "module_hooks",
    "version_counter",
]

#: The instance attribute ``nn.Module.__call__`` looks up and runs: the hooks and the forward.
CALL_IMPL = "_call_impl"
#: What ``module.compile()`` compiles and ``nn.Module.__call__`` runs instead of :data:`CALL_IMPL`.
COMPILED_CALL_IMPL = "_compiled_call_impl"
#: The attribute of ``torch.compile``'s ``OptimizedModule`` that holds the compiled model.
COMPILED_MODEL_ATTRIBUTE = "_orig_mod"


def version_counter(tensor: torch.Tensor) -> int | None:
    """``tensor._version``, bumped by each in-place write; None for an inference tensor, which has none."""
    return None if tensor.is_inference() else int(tensor._version)


def hook_dicts_key(module: nn.Module) -> int:
    """An identity ``module`` shares with every replica ``nn.DataParallel`` made of it, and with no other module."""
    return id(module._forward_pre_hooks)


def module_hooks(module: nn.Module) -> list[object]:
    """Every module hook function attached to ``module`` now: forward, forward pre-, backward and
    backward pre-hooks, in that order."""
    tables = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks, module._backward_pre_hooks)
    return [hook for table in tables for hook in table.values()]


def child_slots(module: nn.Module) -> ItemsView[str, nn.Module | None]:
    """Every child slot of ``module`` as ``(attribute, child)``: a child held under two attributes
    twice, None for an empty slot."""
    return module._modules.items()


def calls_look_up_call_impl() -> bool:
    """True when ``nn.Module.__call__`` runs the instance's :data:`CALL_IMPL` (torch 2.0 and later),
    so an instance attribute of that name is run for every call, hooks included."""
    return nn.Module.__call__ is getattr(nn.Module, "_wrapped_call_impl", None)

"""Module names as the user thinks of them: without the attribute segments of wrappers.

``DistributedDataParallel`` and ``DataParallel`` keep the model as ``.module``, and
``torch.compile`` keeps it as ``._orig_mod``, so ``named_modules()`` of a wrapped model spells
every layer ``module.encoder.layer.0`` or ``_orig_mod.encoder.layer.0``. The same layer of the
same model would then have one name on rank 0 in a notebook and another in the training job.
Here every module below a wrapper is named as in the bare model (``encoder.layer.0``); the
wrapped module itself keeps the attribute's name (``module``, ``_orig_mod``), since the root's
name ``""`` belongs to the wrapper, the object that is called. Selectors match either spelling
(:func:`~hookscope.core.select.select`), so code written against ``ddp.module`` keeps working.

Wrappers are recognised by class, looked up lazily, so that a process that never imports
``torch.distributed`` or ``torch._dynamo`` does not import them here either.

>>> import torch
>>> from torch import nn
>>> ddp_like = torch.nn.DataParallel(nn.Sequential(nn.Linear(2, 2)))
>>> [name for name, _ in named_modules(ddp_like)]
['', 'module', '0']
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

from torch import nn

__all__ = ["NamedModule", "is_wrapper", "named_modules", "named_parameters", "wrapped"]

NamedModule = tuple[str, nn.Module]

# (module that defines the class, class name, attribute holding the wrapped model)
_WRAPPERS = (
    ("torch.nn.parallel.distributed", "DistributedDataParallel", "module"),
    ("torch.nn.parallel.data_parallel", "DataParallel", "module"),
    ("torch._dynamo.eval_frame", "OptimizedModule", "_orig_mod"),
)


def wrapped(module: nn.Module) -> tuple[str, nn.Module] | None:
    """``(attribute, inner module)`` when ``module`` is a known wrapper, else None.

    Only modules whose defining package is already imported are checked: a wrapper cannot
    exist before its class does.
    """
    for module_path, class_name, attribute in _WRAPPERS:
        owner = sys.modules.get(module_path)
        cls = getattr(owner, class_name, None) if owner is not None else None
        if cls is not None and isinstance(module, cls):
            inner = module._modules.get(attribute)
            if inner is not None:
                return attribute, inner
    return None


def is_wrapper(module: nn.Module) -> bool:
    """True for a ``DistributedDataParallel``, ``DataParallel`` or ``torch.compile`` wrapper."""
    return wrapped(module) is not None


def named_modules(model: nn.Module) -> list[NamedModule]:
    """``model.named_modules()`` with wrapper segments dropped from the names below a wrapper.

    Same modules, same order, each module once (as ``named_modules()``); only the names differ.
    """
    return [(name, module) for name, _, module in _walk(model)]


def raw_and_named_modules(model: nn.Module) -> list[tuple[str, str, nn.Module]]:
    """``(name, spelling in named_modules(), module)`` for every module: what selectors match."""
    return list(_walk(model))


def named_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``model.named_parameters()`` under the names of :func:`named_modules`, each parameter once."""
    seen: set[int] = set()
    found = []
    for module_name, module in named_modules(model):
        for name, parameter in module.named_parameters(prefix=module_name, recurse=False):
            if id(parameter) not in seen:
                seen.add(id(parameter))
                found.append((name, parameter))
    return found


def _walk(model: nn.Module) -> Iterator[tuple[str, str, nn.Module]]:
    """Depth-first like ``named_modules()``: ``(name, raw name, module)``, each module once.

    Each entry carries the prefix its children are named under: a module's own name, except
    for the module a wrapper holds, whose children are named under the wrapper's prefix.
    """
    seen: set[int] = set()
    stack: list[tuple[str, str, nn.Module, str]] = [("", "", model, "")]
    while stack:
        name, raw, module, prefix = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        yield name, raw, module
        inner = wrapped(module)
        children = []
        for attribute, child in module._modules.items():
            if child is None:
                continue
            child_name = f"{prefix}.{attribute}" if prefix else attribute
            child_raw = f"{raw}.{attribute}" if raw else attribute
            child_prefix = prefix if inner is not None and child is inner[1] else child_name
            children.append((child_name, child_raw, child, child_prefix))
        stack.extend(reversed(children))

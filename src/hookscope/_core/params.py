"""Parameter counts that survive lazy modules and weights tied between modules, and where a
model's weights live."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["count", "model_device", "model_float_dtype", "own_count"]


def count(parameters: Iterable[nn.Parameter]) -> int:
    """Elements in ``parameters``, each tensor once; a lazy module's uninitialised ones count 0.

    >>> shared = nn.Linear(2, 2)
    >>> count([shared.weight, shared.weight, *nn.LazyLinear(3).parameters()])
    4
    """
    unique = {id(p): p for p in parameters}
    return sum(0 if isinstance(p, nn.parameter.UninitializedParameter) else p.numel() for p in unique.values())


def own_count(module: nn.Module) -> int:
    """Elements of the module's own parameters (not its children's)."""
    return count(module.parameters(recurse=False))


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first weight that has values (offloaded ones sit on ``meta``),
    else the CPU: where inputs made for it go.

    >>> model_device(nn.Linear(2, 2))
    device(type='cpu')
    """
    for tensor in (*model.parameters(), *model.buffers()):
        if not tensor.is_meta:
            return tensor.device
    return torch.device("cpu")


def model_float_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's first floating-point weight, else float32: what float inputs
    made for it are cast to.

    >>> model_float_dtype(nn.Linear(2, 2).to(torch.bfloat16))
    torch.bfloat16
    """
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)

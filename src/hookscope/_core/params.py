"""Parameter counts that survive lazy modules and weights tied between modules."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

__all__ = ["count", "own_count"]


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

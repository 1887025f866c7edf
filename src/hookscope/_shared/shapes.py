"""Shapes as hookscope writes them: a nested tensor's ragged sizes are -1, printed ``?``.

>>> format_shape((2, -1, 8))
'[2, ?, 8]'
"""

from __future__ import annotations

import torch

__all__ = ["format_shape", "shape_of"]


def shape_of(tensor: torch.Tensor) -> tuple[int, ...]:
    """The tensor's shape; a nested tensor's ragged sizes are -1 (shown as ``?``)."""
    if not tensor.is_nested:
        return tuple(tensor.shape)
    sizes = [component.shape for component in tensor.unbind()]
    if not sizes:
        return (0, *(-1,) * (tensor.dim() - 1))
    ragged = (len({size[d] for size in sizes}) == 1 for d in range(tensor.dim() - 1))
    return (len(sizes), *(sizes[0][d] if same else -1 for d, same in enumerate(ragged)))


def format_shape(shape: tuple[int, ...]) -> str:
    """``(2, 16, 32)`` -> ``"[2, 16, 32]"``; a scalar is ``"[]"``; a ragged size (-1) is ``?``."""
    return "[" + ", ".join("?" if size < 0 else str(size) for size in shape) + "]"

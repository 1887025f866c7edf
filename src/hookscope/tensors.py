"""Tensors inside whatever a module returns, their statistics, and dtype names.

>>> import torch
>>> from hookscope import tensors
>>> [path for path, _ in tensors.flatten_tensors({"a": torch.zeros(1), "b": (torch.ones(2), 3)})]
["output['a']", "output['b'][0]"]
>>> tensors.parse_dtype("bf16"), tensors.dtype_name(torch.float16)
(torch.bfloat16, 'float16')
"""

from __future__ import annotations

from hookscope._core.tree import flatten_tensors, map_tensors
from hookscope._shared.dtypes import dtype_name, parse_dtype
from hookscope._shared.names import own_exports, public_dir
from hookscope._shared.stats import tensor_stats

__all__ = ["dtype_name", "flatten_tensors", "map_tensors", "parse_dtype", "tensor_stats"]

own_exports(__name__)


def __dir__() -> list[str]:
    """``__all__``, the dunders and public submodules, not the imports: what tab completion offers."""
    return public_dir(__name__)

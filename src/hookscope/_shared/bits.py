"""Tensors of dtypes numpy lacks (bfloat16, float8) kept as their bit patterns, and back.

Files and stores hold numpy arrays; a bfloat16 value has no numpy dtype, but its 16 bits fit a
``uint16`` exactly, so it is stored so and viewed back as bfloat16 on reading: no rounding.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["NUMPY_LACKS", "UINT_OF_WIDTH", "bits_to_tensor", "numpy_dtype", "tensor_to_numpy"]


def _lacking() -> tuple[torch.dtype, ...]:
    """The floating dtypes of this torch that numpy has no dtype for (bfloat16, the float8 kinds, ...)."""
    found = {value for value in vars(torch).values() if isinstance(value, torch.dtype) and value.is_floating_point}
    lacking = []
    for dtype in sorted(found, key=str):
        try:
            torch.empty(0, dtype=dtype).numpy()
        except TypeError:
            lacking.append(dtype)
    return tuple(lacking)


NUMPY_LACKS = _lacking()
UINT_OF_WIDTH = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}
_SIGNED_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def numpy_dtype(dtype: torch.dtype) -> np.dtype[Any]:
    """The numpy dtype values of ``dtype`` are held in: the same, or the unsigned int of their width.

    >>> numpy_dtype(torch.float16), numpy_dtype(torch.bfloat16)
    (dtype('float16'), dtype('uint16'))
    """
    if dtype in NUMPY_LACKS:
        return np.dtype(f"uint{dtype.itemsize * 8}")
    return torch.empty(0, dtype=dtype).numpy().dtype


def tensor_to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor as numpy without a copy; dtypes numpy lacks as their bits (:func:`numpy_dtype`)."""
    if tensor.dtype not in NUMPY_LACKS:
        return tensor.numpy()
    width = tensor.element_size()  # viewed through the signed int: torch has no numpy bridge for uint16 before 2.3
    return tensor.view(_SIGNED_OF_WIDTH[width]).numpy().view(numpy_dtype(tensor.dtype))


def bits_to_tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Values of ``dtype`` from the bits :func:`tensor_to_numpy` gave (``array`` is copied if not contiguous).

    >>> x = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    >>> torch.equal(bits_to_tensor(tensor_to_numpy(x), torch.bfloat16), x)
    True
    """
    contiguous = np.ascontiguousarray(array)
    if dtype not in NUMPY_LACKS:
        return torch.from_numpy(contiguous)
    signed = np.dtype(f"int{contiguous.dtype.itemsize * 8}")
    return torch.from_numpy(contiguous.view(signed)).view(dtype)

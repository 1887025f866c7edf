"""Dtypes and devices by the names people write: ``"bf16"``, ``"fp16"``, ``torch.float16``, ``"cuda:1"``.

Shared by the command line (``--dtype``) and the features that take a dtype option, so that
``dtype="bf16"`` means the same in ``hs.extract`` as ``--dtype bf16`` does on a shell line.
"""

from __future__ import annotations

import torch

from hookscope.errors import SpecError

__all__ = ["dtype_name", "floating_dtype", "parse_device", "parse_dtype"]

_DTYPES: dict[str, torch.dtype] = {
    **dict.fromkeys(("float32", "fp32", "f32", "float"), torch.float32),
    **dict.fromkeys(("float16", "fp16", "f16", "half"), torch.float16),
    **dict.fromkeys(("bfloat16", "bf16"), torch.bfloat16),
    **dict.fromkeys(("float64", "fp64", "f64", "double"), torch.float64),
}


def dtype_name(dtype: torch.dtype) -> str:
    """``"bfloat16"`` for ``torch.bfloat16``: the name files, stores and messages use.

    >>> dtype_name(torch.float16)
    'float16'
    """
    return str(dtype).removeprefix("torch.")


def parse_dtype(text: str) -> torch.dtype:
    """Read a floating dtype name: ``float32``/``fp32``/``f32``, ``fp16``/``half``, ``bf16``, ``float64``.

    >>> parse_dtype("bf16"), parse_dtype("torch.float16")
    (torch.bfloat16, torch.float16)
    >>> parse_dtype("int8")
    Traceback (most recent call last):
    ...
    hookscope.errors.SpecError: dtype 'int8' is not understood; ...
    """
    key = text.strip().lower().removeprefix("torch.")
    if key in _DTYPES:
        return _DTYPES[key]
    raise SpecError(f"dtype {text!r} is not understood; expected one of {', '.join(_DTYPES)}")


def floating_dtype(dtype: torch.dtype | str | None, option: str = "dtype") -> torch.dtype | None:
    """``None``, a floating ``torch.dtype`` or a name :func:`parse_dtype` reads; else ``SpecError``.

    >>> floating_dtype("bf16"), floating_dtype(None)
    (torch.bfloat16, None)
    """
    if dtype is None:
        return None
    if isinstance(dtype, torch.dtype):
        if dtype.is_floating_point:
            return dtype
        raise SpecError(f"{option}={dtype} is not a floating dtype; expected e.g. torch.float16 or 'bf16'")
    if isinstance(dtype, str):
        return parse_dtype(dtype)
    raise SpecError(f"{option}={dtype!r} is not a dtype; expected e.g. torch.float16 or 'bf16'")


def parse_device(device: str | torch.device | None, option: str = "device") -> torch.device | None:
    """``None``, or the ``torch.device`` that ``device`` names; else ``SpecError``.

    >>> parse_device("cpu"), parse_device(None)
    (device(type='cpu'), None)
    """
    if device is None or isinstance(device, torch.device):
        return device
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise SpecError(
            f"{option}={device!r} is not a torch device; expected e.g. 'cpu', 'cuda' or 'cuda:1'"
        ) from error

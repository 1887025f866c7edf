"""Dtypes and devices by the names people write: ``"bf16"``, ``"fp16"``, ``torch.float16``, ``"cuda:1"``.

Shared by the command line (``--dtype``) and the features that take a dtype option, so that
``dtype="bf16"`` means the same in ``hs.extract`` as ``--dtype bf16`` does on a shell line.
"""

from __future__ import annotations

from typing import Literal

import torch

from hookscope.errors import SpecError

__all__ = [
    "OVERFLOW_CHOICES",
    "Overflow",
    "cast_checked",
    "dtype_name",
    "floating_dtype",
    "overflow_choice",
    "overflow_message",
    "parse_device",
    "parse_dtype",
]

#: What a cast that turns finite values into +-inf does: tell once per pass, refuse, or say nothing.
Overflow = Literal["warn", "error", "ignore"]
OVERFLOW_CHOICES: tuple[Overflow, ...] = ("warn", "error", "ignore")

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


def cast_checked(value: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``value`` cast to ``dtype``, and how many finite values the cast turned into +-inf.

    The count is a 0-dim tensor on ``value``'s device (read it when convenient: reading it at
    once would wait for the device), or None when ``dtype`` holds every value of
    ``value``'s dtype (a widening cast, bfloat16 from float32, or not floating at all).
    float16 stops at 65504: a float32 activation of 1e5 becomes inf there.

    >>> cast, overflowed = cast_checked(torch.tensor([1.0, 7e4, float("inf")]), torch.float16)
    >>> cast.tolist(), int(overflowed)
    ([1.0, inf, inf], 1)
    """
    cast = value.to(dtype)
    if not (value.is_floating_point() and dtype.is_floating_point):
        return cast, None
    if torch.finfo(dtype).max >= torch.finfo(value.dtype).max:
        return cast, None
    return cast, (torch.isinf(cast) & torch.isfinite(value)).sum()


def overflow_choice(value: object) -> str:
    """``overflow=`` checked: one of :data:`OVERFLOW_CHOICES`; else ``SpecError``."""
    if value not in OVERFLOW_CHOICES:
        raise SpecError(
            f"overflow={value!r} is not one of 'warn' (default: say which sites a dtype cast turned finite "
            "values into +-inf at), 'error' (refuse them), 'ignore'"
        )
    return str(value)


def overflow_message(counts: dict[str, int], dtype: torch.dtype, feature: str) -> str:
    """The one sentence a warning or an error says about values a cast turned into +-inf."""
    total = sum(counts.values())
    named = ", ".join(f"{site} ({count:,})" for site, count in list(counts.items())[:5])
    more = f" and {len(counts) - 5} more sites" if len(counts) > 5 else ""
    return (
        f"{feature}: dtype={dtype_name(dtype)} turned {total:,} finite values past its largest "
        f"({torch.finfo(dtype).max:g}) into +-inf, at {named}{more}; keep them in bfloat16 or float32 "
        "(dtype='bf16'), or pass overflow='error' to refuse such values, 'ignore' to keep them as inf"
    )

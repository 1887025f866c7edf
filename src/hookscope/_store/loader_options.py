"""The options of a :class:`~hookscope.StoreLoader`, checked: counts, flags, dtype, device, ranks."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from hookscope.errors import SpecError

__all__ = ["count_option", "device_option", "dtype_option", "flag_option", "ranks_option"]


def count_option(name: str, value: Any, *, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
        raise SpecError(f"{name} must be an int >= {least}, got {value!r}")
    return int(value)


def flag_option(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise SpecError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def dtype_option(value: Any) -> torch.dtype | None:
    """A floating dtype from a ``torch.dtype`` or its name (``"bfloat16"``); None keeps the stored one."""
    if value is None:
        return None
    found = getattr(torch, value.removeprefix("torch."), None) if isinstance(value, str) else value
    if not isinstance(found, torch.dtype) or not found.is_floating_point:
        raise SpecError(f"dtype must be a floating torch dtype (torch.float16, 'bfloat16'), got {value!r}")
    return found


def device_option(value: Any) -> torch.device | None:
    if value is None:
        return None
    try:
        return torch.device(value)
    except (RuntimeError, TypeError) as error:
        raise SpecError(f"device {value!r} is not a device ('cpu', 'cuda:0', torch.device): {error}") from None


def ranks_option(rank: Any, world_size: Any) -> tuple[int, int]:
    """This process's rank and the number of ranks: given, else torch.distributed's, else the environment's."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        default = torch.distributed.get_rank(), torch.distributed.get_world_size()
    else:
        default = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    rank = count_option("rank", default[0] if rank is None else rank, least=0)
    world_size = count_option("world_size", default[1] if world_size is None else world_size, least=1)
    if rank >= world_size:
        raise SpecError(
            f"rank {rank} is not below world_size {world_size}; ranks are 0..{world_size - 1}: pass both rank= and "
            "world_size= or neither"
        )
    return rank, world_size

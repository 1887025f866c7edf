"""The accelerator path as one compiled kernel per tensor (``torch.compile``; Triton on CUDA)."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from hookscope._core.compat.compiled import is_compiling
from hookscope._core.compat.private import dynamo_errors
from hookscope._shared.stats.fields import _ALL, _Wanted
from hookscope._shared.stats.torch_path import _unconditional_of

__all__ = ["COMPILED_DEVICES"]

#: Devices whose statistics run as one compiled kernel per tensor (Triton on CUDA); elsewhere,
#: and while the model itself is being compiled, the same function runs op by op.
COMPILED_DEVICES = {"cuda"}
_COMPILED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_compiled: Any = None  # the compiled _unconditional_of, made on first use
_compile_failed: str | None = None  # why compiling failed, once: from then on op by op
_COMPILING = os.environ.get("HOOKSCOPE_COMPILED_STATS", "1") != "0"


def _device_path(source: torch.Tensor) -> Any:
    """``_unconditional_of``, compiled for floating tensors on the devices of :data:`COMPILED_DEVICES`.

    ``torch.compile`` fuses the upcast and every reduction into one kernel that reads the
    tensor once (instead of about twelve kernels, each a pass); ``dynamic=True`` makes one
    compiled version serve every size, and inductor's cache keeps it across processes. Nothing
    in it reads a value back, so the forward stays free of host syncs. It always computes every
    field (one read either way) and under ``no_grad``, so that one graph per dtype serves every
    call; a single value, integers and booleans (token ids, masks) go op by op.
    """
    global _compiled
    if (
        source.device.type not in COMPILED_DEVICES
        or source.dtype not in _COMPILED_DTYPES
        or source.numel() < 2
        or _compile_failed is not None
        or is_compiling()
        or not _COMPILING
    ):
        return _unconditional_of
    if _compiled is None:
        _compiled = torch.compile(_unconditional_of, dynamic=True, fullgraph=True)
    return _guarded


def _guarded(source: torch.Tensor, wanted: _Wanted) -> torch.Tensor:
    """The compiled statistics (every field: those not ``wanted`` are blanked when read).

    Where the compiler stack fails (no Triton, no C compiler), the same ops run one by one from
    then on, with one warning that says why; past dynamo's recompile limit, this call alone does.
    Errors of the values or the device (out of memory, an asynchronous CUDA error) are raised.
    """
    global _compile_failed
    limit_hit, dynamo_failed = dynamo_errors()
    try:
        with torch.no_grad():
            vector: torch.Tensor = _compiled(source, _ALL)
    except limit_hit:
        return _unconditional_of(source, wanted)
    except (dynamo_failed, ImportError) as error:
        _compile_failed = f"{type(error).__name__}: {error}"
        warnings.warn(
            f"hookscope: statistics on {source.device.type} could not be compiled ({_compile_failed}); "
            "computing them op by op (slower, same values). Set HOOKSCOPE_COMPILED_STATS=0 to skip compiling.",
            RuntimeWarning,
            stacklevel=2,
        )
        return _unconditional_of(source, wanted)
    return vector

"""Default tolerances of a comparison, from the precision of what is compared.

One table for every way in (``hs.diff``, ``hs.diff.dtypes``, ``hookscope diff --dtype``, and the
methods that check a model against itself: ``decompose_resid``'s sum, the logit lens's fit of
what follows the final norm), so the same question gets the same answer: two float32 models are
held to float32's rounding, a bf16 or fp16 copy to what those formats can keep. A site is within tolerance when
``max|a - b| <= atol + rtol * max|a|``.

>>> tolerances(torch.float32), tolerances(torch.float32, torch.bfloat16)
((1e-05, 1e-08), (0.01, 0.001))
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["HALF_TOLERANCES", "SINGLE_TOLERANCES", "model_dtypes", "tolerances"]

#: float32 and float64: what float32 rounding along a forward leaves.
SINGLE_TOLERANCES = (1e-5, 1e-8)
#: bfloat16, float16 and narrower: 8 or 11 bits of mantissa.
HALF_TOLERANCES = (1e-2, 1e-3)


def tolerances(*dtypes: torch.dtype | None) -> tuple[float, float]:
    """``(rtol, atol)`` for values of these dtypes: those of the least precise floating one."""
    floating = [dtype for dtype in dtypes if dtype is not None and dtype.is_floating_point]
    if any(torch.finfo(dtype).bits <= 16 for dtype in floating):
        return HALF_TOLERANCES
    return SINGLE_TOLERANCES


def model_dtypes(*models: nn.Module) -> list[torch.dtype]:
    """The floating dtypes of the models' parameters and buffers."""
    found: list[torch.dtype] = []
    for model in models:
        tensors: Iterable[torch.Tensor] = (*model.parameters(), *model.buffers())
        found.extend({t.dtype for t in tensors if t.is_floating_point()})
    return found

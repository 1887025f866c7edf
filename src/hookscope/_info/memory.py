"""How hookscope allocates and keeps memory in this process: the facts ``hookscope info`` lists.

Each line is read from the module that owns the policy, so it cannot drift from what runs: the
malloc policy (:mod:`hookscope._shared.malloc`), a capture's copy rule (the keeper's eager-copy
size), the pinned-memory path from a GPU, and the threads the statistics kernel reads with.

>>> sorted(memory_policy())
['CUDA to host', 'captured values', 'malloc', 'statistics threads']
"""

from __future__ import annotations

import torch

from hookscope._capture.keeper import EAGER_COPY_BYTES
from hookscope._shared import malloc
from hookscope._shared.stats import kernel
from hookscope._shared.units import format_bytes

__all__ = ["memory_policy"]


def memory_policy() -> dict[str, str]:
    """One line per policy: ``malloc``, ``captured values``, ``CUDA to host``, ``statistics threads``."""
    return {
        "malloc": malloc.describe(),
        "captured values": (
            f"a value that shares memory with the model is copied at once up to {format_bytes(EAGER_COPY_BYTES)}; "
            "a larger one is watched and copied only before an in-place write would change it "
            "(CaptureOptions.copy='auto'; copy=True copies every value at once)"
        ),
        "CUDA to host": _to_host(),
        "statistics threads": _statistics_threads(),
    }


def _to_host() -> str:
    path = (
        "through pinned memory with non-blocking copies: a capture with device='cpu' waits once per "
        "forward, hs.extract reuses a pool of pinned buffers across batches"
    )
    if torch.cuda.is_available():
        return f"values leave the GPU {path}"
    return f"no CUDA device here (values from one would go {path})"


def _statistics_threads() -> str:
    if not kernel.enabled():
        return f"torch reductions, on torch's {torch.get_num_threads()} intra-op threads"
    team = kernel.team_threads()
    if team:
        return (
            f"the fused kernel reads tensors below {kernel.TEAM_MIN_VALUES:,} values in the calling thread, longer "
            f"ones alone or with torch's OpenMP team of {team} threads, whichever has been reading faster"
        )
    why = "torch runs on one thread" if torch.get_num_threads() < 2 else "torch does not run on GNU OpenMP"
    return f"the fused kernel reads every tensor in the calling thread ({why})"

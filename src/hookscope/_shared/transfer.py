"""Many small on-device vectors to the host in one transfer per device.

A step's statistics, precision counts, histograms and norms are each a few numbers on the device;
reading them one kind at a time costs one device-to-host copy (on an accelerator, one sync) per
kind. :func:`fetch` flattens every vector of a device into one, copies it once, and hands each
caller its own slice back, in order.

>>> import torch
>>> [part.tolist() for part in fetch([torch.tensor([1.0, 2.0]), torch.tensor([3], dtype=torch.int64)])]
[[1.0, 2.0], [3.0]]
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["fetch"]


def fetch(vectors: Sequence[torch.Tensor]) -> list[np.ndarray]:
    """Each vector as a float64 numpy array (flattened), with one copy per device."""
    by_device: dict[torch.device, list[int]] = {}
    for index, vector in enumerate(vectors):
        by_device.setdefault(vector.device, []).append(index)
    found: list[np.ndarray] = [np.empty(0)] * len(vectors)
    for indices in by_device.values():
        wide = torch.float32 if vectors[indices[0]].device.type == "mps" else torch.float64
        parts = [vectors[i].detach().reshape(-1).to(wide) for i in indices]
        joined = torch.cat(parts).cpu().to(torch.float64).numpy()
        start = 0
        for i, part in zip(indices, parts, strict=True):
            found[i] = joined[start : start + part.numel()]
            start += part.numel()
    return found

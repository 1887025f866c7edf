"""What a store was made with, so that a resumed run can refuse to mix two configurations.

A resumed run appends rows to arrays written earlier. If the model, the layers, a reduction,
the dtype or the rows changed in between, the store would hold rows of two extractions and
look whole. So the configuration is recorded when the store is made and compared, key by key,
before anything is written again; every difference is named.

The model is identified by its class, its parameter count and a fingerprint: a hash of each
parameter's and buffer's name, shape, dtype and the bytes of up to 4,096 evenly spaced values.
It tells another checkpoint or a fine-tuned copy from the model that made the store, without
reading every weight of a large model (one changed weight among millions can slip through).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
import torch
from torch import nn

from hookscope._core.compat.offload import named_real_tensors
from hookscope._core.params import count
from hookscope._core.tree import flatten_tensors
from hookscope._extract.data import Batch, Source
from hookscope._shared.bits import tensor_to_numpy

__all__ = ["SAMPLED_VALUES", "data_identity", "differences", "model_identity"]

SAMPLED_VALUES = 4096


def model_identity(model: nn.Module, spec: str | None) -> dict[str, Any]:
    """``{"spec", "class", "parameters", "fingerprint"}`` of ``model``; ``spec`` defaults to the class."""
    cls = type(model)
    qualified = f"{cls.__module__}.{cls.__qualname__}"
    return {
        "spec": spec or qualified,
        "class": qualified,
        "parameters": count(model.parameters()),
        "fingerprint": fingerprint(model),
    }


def fingerprint(model: nn.Module) -> str:
    """A hash of names, shapes, dtypes and sampled values of every parameter and buffer.

    >>> a, b = nn.Linear(3, 2), nn.Linear(3, 2)
    >>> fingerprint(a) == fingerprint(a), fingerprint(a) == fingerprint(b)
    (True, False)
    """
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in named_real_tensors(model):  # accelerate-offloaded weights: their real values
        if isinstance(tensor, nn.parameter.UninitializedParameter):  # a lazy module before its first forward
            digest.update(f"{name}:uninitialised;".encode())
            continue
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        digest.update(_sample_bytes(tensor.detach()))
    return digest.hexdigest()


def data_identity(first: Batch, source: Source) -> dict[str, Any]:
    """A hash of the first row's inputs (sampled like the weights) and of the row order, if one was chosen.

    Another data set, another seed of random rows or another ``indices=`` with the same number
    of rows would otherwise resume as if nothing changed. Only row 0 is hashed, so that a new
    batch size is reported as that, not as other data; the same rows in the data's own order
    (no ``indices``, ``range(n)``, a list of 0..n-1) hash alike.
    """
    digest = hashlib.blake2b(digest_size=16)
    for path, tensor in flatten_tensors((first.args, first.kwargs)):
        row = tensor[:1] if tensor.dim() > 0 and not tensor.is_sparse else tensor
        digest.update(f"{path}:{tuple(row.shape)}:{row.dtype};".encode())
        digest.update(_sample_bytes(row.detach()))
    return {"first_row": digest.hexdigest(), "order": _order(getattr(source, "indices", None), source.rows)}


def _order(indices: Any, rows: int | None) -> str | None:
    """A hash of the chosen row order; None for the data's own order."""
    if indices is None:
        return None
    order = np.asarray(indices, dtype=np.int64)
    if rows is not None and np.array_equal(order, np.arange(len(order))):
        return None  # 0, 1, 2, ...: the data's own order, however it was written
    return hashlib.blake2b(order.tobytes(), digest_size=16).hexdigest()


def _sample_bytes(tensor: torch.Tensor) -> bytes:
    """The bytes of up to ``SAMPLED_VALUES`` evenly spaced values; nothing for what has none to read."""
    if tensor.is_meta or tensor.numel() == 0:
        return b""  # weights not loaded yet (offloaded models): structure only
    if tensor.is_sparse:
        return _sample_bytes(tensor.coalesce().values())
    try:
        return _strided_sample(tensor)
    except (RuntimeError, TypeError):  # a layout or dtype without a flat numpy view (nested, complex32, ...)
        return b"unsampled"


def _strided_sample(tensor: torch.Tensor) -> bytes:
    flat = tensor.reshape(-1)
    if flat.numel() > SAMPLED_VALUES:
        steps = torch.arange(SAMPLED_VALUES, device=flat.device)  # integer steps: float32 would round past the end
        picks = steps * (flat.numel() - 1) // (SAMPLED_VALUES - 1)
        flat = flat[picks]
    return tensor_to_numpy(flat.cpu()).tobytes()


def differences(stored: dict[str, Any], wanted: dict[str, Any], prefix: str = "") -> list[str]:
    """Each key whose value differs, as ``"key: stored A, now B"``, nested keys dotted.

    >>> differences({"dtype": "float32", "model": {"class": "A"}}, {"dtype": "bfloat16", "model": {"class": "A"}})
    ["dtype: stored 'float32', now 'bfloat16'"]
    """
    found: list[str] = []
    for key in sorted(set(stored) | set(wanted), key=str):
        a, b = stored.get(key, _ABSENT), wanted.get(key, _ABSENT)
        label = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            found.extend(differences(a, b, prefix=f"{label}."))
        elif _canonical(a) != _canonical(b):
            found.append(f"{label}: stored {_short(a)}, now {_short(b)}")
    return found


class _Absent:
    def __repr__(self) -> str:
        return "absent"


_ABSENT = _Absent()


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)  # tuples and lists compare alike, as JSON stores them


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."

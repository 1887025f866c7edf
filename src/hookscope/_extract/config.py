"""What a store was made with, so that a resumed run can refuse to mix two configurations.

A resumed run appends rows to arrays written earlier. If the model, the layers, a reduction,
the dtype or the rows changed in between, the store would hold rows of two extractions and
look whole. So the configuration is recorded when the store is made and compared, key by key,
before anything is written again; every difference is named.

The model is identified by its class, its parameter count and a fingerprint: a hash of each
parameter's and buffer's name, shape, dtype and a CRC32C of all its bytes. Every weight is
read, so one changed weight among millions changes it; CRC32C runs at over 10 GB/s, so that
costs about a tenth of a forward of the same bytes (GPU weights are copied to the host first).

The data is identified by a hash of its first row here, and by a checksum of each chunk's
input rows in the manifest (:mod:`hookscope._extract.inputs`), which a resumed run checks.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from hookscope._core.compat.offload import named_real_tensors
from hookscope._core.params import count
from hookscope._core.tree import flatten_tensors
from hookscope._extract.data import Batch, Source
from hookscope._shared.bits import tensor_to_numpy
from hookscope._shared.reduce import parse_reduction
from hookscope._store import crc32c
from hookscope.errors import SpecError

__all__ = ["data_identity", "differences", "fingerprint", "model_identity", "store_options"]


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
    """A hash of the names, shapes, dtypes and every value of every parameter and buffer.

    >>> a, b = nn.Linear(3, 2), nn.Linear(3, 2)
    >>> fingerprint(a) == fingerprint(a), fingerprint(a) == fingerprint(b)
    (True, False)
    """
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in named_real_tensors(model):  # accelerate-offloaded weights: their real values
        if isinstance(tensor, nn.parameter.UninitializedParameter):  # a lazy module before its first forward
            digest.update(f"{name}:uninitialised;".encode())
            continue
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}:{_content_checksum(tensor.detach())};".encode())
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
        digest.update(f"{path}:{tuple(row.shape)}:{row.dtype}:{_content_checksum(row.detach())};".encode())
    return {"first_row": digest.hexdigest(), "order": _order(getattr(source, "indices", None), source.rows)}


def _order(indices: Any, rows: int | None) -> str | None:
    """A hash of the chosen row order; None for the data's own order."""
    if indices is None:
        return None
    order = np.asarray(indices, dtype=np.int64)
    if rows is not None and np.array_equal(order, np.arange(len(order))):
        return None  # 0, 1, 2, ...: the data's own order, however it was written
    return hashlib.blake2b(order.tobytes(), digest_size=16).hexdigest()


def _content_checksum(tensor: torch.Tensor) -> str:
    """The CRC32C of all of ``tensor``'s bytes; a word for what has none to read."""
    if tensor.is_meta or tensor.numel() == 0:
        return "empty"  # weights not loaded yet (offloaded models): structure only
    if tensor.is_sparse:
        return _content_checksum(tensor.coalesce().values())
    try:
        values = tensor_to_numpy(tensor.cpu().contiguous())
    except (RuntimeError, TypeError):  # a layout or dtype without a flat numpy view (nested, complex32, ...)
        return "unread"
    return f"{crc32c(values):08x}"


#: The options a store records under their own names (``ExtractConfig.recorded`` and the run's own).
_RECORDED_OPTIONS = ("keep", "calls", "dtype", "eval_mode", "compression_level", "tokens", "batch_size", "chunk_rows")


def store_options(config: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`~hookscope.ExtractConfig` keywords a store's recorded configuration holds
    (``store.meta["config"]``): what a run that resumes it is given, besides the model, the layers
    and the data. A reduction recorded for a function (its name and a hash) cannot be made again.

    >>> store_options({"model": {"spec": "gpt2"}, "keep": "output", "mask": "attention_mask",
    ...                "reduce": {"h.0": "mean:1", "h.1": None}, "rows": 8})
    {'keep': 'output', 'mask': 'auto', 'reduce': {'h.0': 'mean:1'}, 'model_spec': 'gpt2'}
    """
    found = {key: config[key] for key in _RECORDED_OPTIONS if key in config}
    if "mask" in config:  # recorded as the key read: "auto" reads attention_mask
        found["mask"] = "auto" if config["mask"] == "attention_mask" else config["mask"]
    reduce = {layer: spec for layer, spec in (config.get("reduce") or {}).items() if spec is not None}
    for layer, spec in reduce.items():
        try:
            parse_reduction(spec)
        except SpecError:
            raise SpecError(
                f"the store reduced {layer!r} with {spec!r}, a function that a record cannot hold; give reduce= again"
            ) from None
    if reduce:
        found["reduce"] = reduce
    model = config.get("model")
    if isinstance(model, Mapping) and isinstance(model.get("spec"), str):
        found["model_spec"] = model["spec"]
    return found


def differences(stored: dict[str, Any], wanted: dict[str, Any], prefix: str = "") -> list[str]:
    """Each key whose value differs, as ``"key: stored A, now B"``, nested keys dotted.

    A key absent on one side and None on the other is no difference: both say "not set" (the
    reduction of a layer no longer selected is None, which its absence from the other side
    repeats beside the real difference, the layers).

    >>> differences({"dtype": "float32", "model": {"class": "A"}}, {"dtype": "bfloat16", "model": {"class": "A"}})
    ["dtype: stored 'float32', now 'bfloat16'"]
    >>> differences({"layers": ["0"], "reduce": {"0": None}}, {"layers": ["1"], "reduce": {"1": None}})
    ["layers: stored ['0'], now ['1']"]
    """
    found: list[str] = []
    for key in sorted(set(stored) | set(wanted), key=str):
        a, b = stored.get(key, _ABSENT), wanted.get(key, _ABSENT)
        label = f"{prefix}{key}"
        if {type(a), type(b)} <= {_Absent, type(None)}:
            continue
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

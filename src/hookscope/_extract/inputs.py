"""The input rows of a store's chunks: their checksum parts, and the check that a resumed run's data is the same.

The manifest records, per chunk, the CRC32C of the input rows that made it (see
``hookscope._store.checksums``). Here the parts are taken off the batches as they pass, and a
resumed run's batches of done chunks are checked against the recorded checksums; input rows
that differ are refused.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from hookscope._core.tree import flatten_tensors
from hookscope._extract.data import Batch
from hookscope._shared.bits import tensor_to_numpy
from hookscope._store import InputDigests, Layout, Manifest, crc32c, regions, text_crc
from hookscope.errors import DataError

__all__ = ["InputCheck", "check_input_rows", "data_changed", "input_parts"]


def input_parts(batch: Batch, chunks: Iterable[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """``(chunk, part checksum, rows)`` for each ``(chunk, low, high)`` region of ``batch``'s rows."""
    tensors = [(path, tensor.detach()) for path, tensor in flatten_tensors((batch.args, batch.kwargs), root="batch")]
    found = []
    for chunk, low, high in chunks:
        seed = 0
        for path, tensor in tensors:
            rows = tensor[low - batch.start : high - batch.start] if _batch_first(tensor, batch.rows) else tensor
            seed = text_crc(f"{path}:{rows.dtype}:{tuple(rows.shape[1:])};", seed)
            seed = crc32c(_host_bytes(rows), seed)
        found.append((chunk, seed, high - low))
    return found


def _batch_first(tensor: torch.Tensor, rows: int) -> bool:
    return tensor.dim() > 0 and tensor.shape[0] == rows and not tensor.is_sparse


def _host_bytes(tensor: torch.Tensor) -> np.ndarray:
    if tensor.is_sparse:
        tensor = tensor.to_dense()
    if tensor.is_meta or tensor.is_nested:
        return np.zeros(0, dtype=np.uint8)
    try:
        return tensor_to_numpy(tensor.cpu().contiguous())
    except (RuntimeError, TypeError):  # a dtype without a numpy view (complex32, ...): its text
        return np.frombuffer(repr(tensor.tolist()).encode(), dtype=np.uint8)


def data_changed(layout: Layout, chunk: int) -> DataError:
    first, last = layout.span(chunk)
    return DataError(
        f"rows {first}..{last - 1} of the data are not the rows the store was made from (their checksum differs "
        f"from the one recorded with chunk {chunk}): the data changed since the store was begun; pass the same data "
        "to resume, or overwrite=True (--overwrite) to start again",
        rows=range(first, last),
    )


def check_input_rows(layout: Layout, manifest: Manifest, batches: Iterable[Batch]) -> None:
    """Read ``batches`` (the rows of done chunks) and raise ``DataError`` at the first chunk whose
    input rows differ from those recorded."""
    check = InputCheck(layout, manifest)
    for batch in batches:
        check.see(batch)


class InputCheck:
    """Compares each done chunk's input rows with the checksum recorded for it, batch by batch:
    the batches of done chunks read again (indexed data), or those a resumed stream skips."""

    def __init__(self, layout: Layout, manifest: Manifest) -> None:
        self.layout = layout
        self.manifest = manifest
        self._digests = InputDigests(layout)

    def see(self, batch: Batch) -> None:
        """Take ``batch``; ``DataError`` once a chunk it completes differs from the one recorded."""
        whole = self._digests.add(input_parts(batch, regions(self.layout, batch.start, batch.stop)))
        for chunk, digest in whole.items():
            recorded, _ = self.manifest.digests_of(chunk)
            if recorded is not None and recorded != digest:
                raise data_changed(self.layout, chunk)

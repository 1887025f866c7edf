"""Checksums of a store's chunks and of the input rows that made them.

Each chunk of each site gets the CRC32C of its stored bytes, and each chunk the CRC32C of its
input rows; both go into the manifest (``_hookscope/digests``) before the chunk is marked done.
A resumed run checks every done chunk against them before it writes anything: a chunk whose
bytes changed (a flipped bit, a deleted file) is written again; input rows that changed (other
data behind the same first row) are refused, since the store would mix two data sets.

CRC32C runs at over 10 GB/s on this kind of machine (``google-crc32c``, which zarr itself
needs), so a chunk's checksum costs far less than writing it.

The input checksum of a chunk is the CRC32C of the CRC32Cs of its parts, one part per batch
that reaches into it: the rows of each of the batch's tensors that fall in the chunk (a
tensor that is not batch-first, whole), each preceded by its path, dtype and row shape.
Batches are cut the same way in every run of one configuration (the batch size is part of
it), so the parts, and the checksum, are the same. The parts are taken off the batches by the
extraction (``hookscope._extract.inputs``); this module keeps the arithmetic.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from hookscope._shared.optional import require
from hookscope._store.layout import Layout

__all__ = ["InputDigests", "combine", "crc32c", "regions", "text_crc"]


def crc32c(values: np.ndarray, seed: int = 0) -> int:
    """The CRC32C of an array's bytes (made contiguous if it is not), continuing from ``seed``.

    >>> crc32c(np.zeros(3, dtype=np.uint8)) == crc32c(np.zeros(3, dtype=np.uint8))
    True
    """
    flat = np.ascontiguousarray(values).reshape(-1).view(np.uint8)
    return int(_crc32c_module().extend(seed, flat)) if flat.size else seed


def text_crc(text: str, seed: int) -> int:
    """The CRC32C of ``text``'s UTF-8 bytes, continuing from ``seed``."""
    return int(_crc32c_module().extend(seed, text.encode("utf-8", "surrogatepass")))


def _crc32c_module() -> Any:
    """``google_crc32c``, which zarr needs too (imported on use: ``import hookscope`` stays light)."""
    return require("google_crc32c", purpose="a feature store's checksums", package="google-crc32c")


def combine(parts: Iterable[int]) -> int:
    """One checksum from the checksums of a chunk's parts, in order."""
    return crc32c(np.asarray(list(parts), dtype=np.uint32))


def regions(layout: Layout, start: int, stop: int) -> list[tuple[int, int, int]]:
    """``(chunk, low, high)``: the rows ``[start, stop)`` cut at chunk boundaries."""
    found = []
    for chunk in layout.chunks_of(start, stop):
        first, last = layout.span(chunk)
        found.append((chunk, max(start, first), min(stop, last)))
    return found


class InputDigests:
    """Collects the parts of each chunk's input checksum as batches pass; says when a chunk is whole."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self._parts: dict[int, list[int]] = {}
        self._rows: dict[int, int] = {}

    def add(self, parts: Iterable[tuple[int, int, int]]) -> dict[int, int]:
        """Take ``(chunk, part, rows)``; return ``{chunk: checksum}`` for each chunk now whole."""
        whole = {}
        for chunk, part, rows in parts:
            self._parts.setdefault(chunk, []).append(part)
            self._rows[chunk] = self._rows.get(chunk, 0) + rows
            if self._rows[chunk] == self.layout.rows_in(chunk):
                whole[chunk] = self.pop(chunk)
        return whole

    def pop(self, chunk: int) -> int:
        """The checksum of ``chunk`` from the parts seen so far (the last, shorter chunk of a stream)."""
        self._rows.pop(chunk, None)
        return combine(self._parts.pop(chunk, []))

    def pending(self) -> dict[int, Any]:
        """The chunks begun and not whole, with their rows so far."""
        return dict(self._rows)

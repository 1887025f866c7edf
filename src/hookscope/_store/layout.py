"""The shape of a store: one array per site, rows cut into chunks along dimension 0.

Learned from the first batch: which sites the capture saw, each row's shape and dtype. Every
later batch must agree (``check`` names the site that does not). Chunks are whole multiples of
the batch, so a chunk is complete after a fixed number of batches, chunk boundaries do not
depend on how many processes run, and each process owns whole chunks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from hookscope._core.sites import Site, short_names
from hookscope._shared.bits import NUMPY_LACKS, numpy_dtype
from hookscope._shared.dtypes import dtype_name
from hookscope.errors import DataError, SpecError

__all__ = [
    "CHUNK_BYTES",
    "MAX_CHUNK_ROWS",
    "Layout",
    "SiteLayout",
    "array_names",
    "choose_chunk_rows",
]

#: Default chunk size: at most this many bytes of the widest site, uncompressed ...
CHUNK_BYTES = 8 * 2**20
#: ... and at most this many rows, so that a crash loses little and processes share the work.
MAX_CHUNK_ROWS = 1024
_RESERVED = ("_hookscope", "_rows")  # the groups of the manifest and of the rows' provenance


@dataclass(frozen=True)
class SiteLayout:
    """One array of the store: which site fills it, and the shape and dtype of one row."""

    name: str
    site: str
    layer: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name of the values, e.g. "bfloat16"
    reduce: str | None
    #: ``{"k": k, "width": w}`` for sparse latents packed as ``(..., 2k)`` (values, then indices)
    sparse: dict[str, int] | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        found = getattr(torch, self.dtype)
        assert isinstance(found, torch.dtype)
        return found

    @property
    def stored(self) -> np.dtype[Any]:
        """The numpy dtype the store holds the values in: bfloat16 and float8 as their bits."""
        return numpy_dtype(self.torch_dtype)

    @property
    def as_bits(self) -> bool:
        """True when the store holds the values' bit patterns (bfloat16, float8)."""
        return self.torch_dtype in NUMPY_LACKS

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape) * self.stored.itemsize

    def to_json(self) -> dict[str, Any]:
        record = asdict(self)
        if self.sparse is None:
            del record["sparse"]  # the records of dense sites stay as they were
        record["shape"] = list(self.shape)
        record["stored_dtype"] = str(self.stored)
        return record

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> SiteLayout:
        return cls(
            name=record["name"],
            site=record["site"],
            layer=record["layer"],
            shape=tuple(record["shape"]),
            dtype=record["dtype"],
            reduce=record["reduce"],
            sparse=record.get("sparse"),
        )

    def check(self, value: torch.Tensor, rows: int, start: int) -> None:
        """Raise ``DataError`` unless ``value`` holds ``rows`` rows of this site's shape and dtype."""
        shape = tuple(value.shape)
        if shape[:1] == (rows,) and shape[1:] == self.shape and dtype_name(value.dtype) == self.dtype:
            return
        first = f"rows {start}..{start + rows - 1}"
        expected = f"({rows}, {', '.join(map(str, self.shape))}) {self.dtype}".replace(", )", ")")
        found = f"{shape} {dtype_name(value.dtype)}"
        hint = (
            "reduce the varying dimension (e.g. reduce='mean:1' over tokens) or pad every batch to one length"
            if shape[:1] == (rows,)
            else "the first dimension must be the batch: pick a module whose output is batch-first"
        )
        raise DataError(
            f"site {self.site!r} gave {found} for {first}; the store holds {expected} per batch; {hint}",
            rows=range(start, start + rows),
        )


@dataclass(frozen=True)
class Layout:
    """Sites, rows and chunking of a store."""

    sites: tuple[SiteLayout, ...]
    rows: int | None  # None: a stream whose end tells the number
    batch_size: int
    chunk_rows: int
    #: Arrays written beside the sites, row for row (see ``hookscope._store.provenance``).
    extras: tuple[SiteLayout, ...] = ()

    @property
    def arrays(self) -> tuple[SiteLayout, ...]:
        """Every array the writer fills: the sites', then the extras."""
        return self.sites + self.extras

    @property
    def chunks(self) -> int | None:
        return None if self.rows is None else math.ceil(self.rows / self.chunk_rows)

    def span(self, chunk: int) -> tuple[int, int]:
        """Rows ``[start, stop)`` of ``chunk``; the last chunk stops at the last row."""
        start = chunk * self.chunk_rows
        stop = start + self.chunk_rows
        return start, stop if self.rows is None else min(stop, self.rows)

    def rows_in(self, chunk: int) -> int:
        """Rows of ``chunk`` (of a stream: the full chunk size, its end not being known)."""
        start, stop = self.span(chunk)
        return stop - start

    def chunks_of(self, start: int, stop: int) -> range:
        """The chunks that rows ``[start, stop)`` touch."""
        return range(start // self.chunk_rows, (stop - 1) // self.chunk_rows + 1)


def choose_chunk_rows(batch_size: int, row_bytes: int, rows: int | None, requested: int | None) -> int:
    """Rows per chunk: ``requested`` (checked), else as many whole batches as fit the defaults.

    >>> choose_chunk_rows(32, 3072, 2048, None), choose_chunk_rows(8, 4 * 2**20, None, None)
    (1024, 8)
    """
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise SpecError(f"chunk_rows={requested!r} must be a positive int, a multiple of the batch size")
        if requested % batch_size:
            low = max(batch_size, requested - requested % batch_size)
            raise SpecError(
                f"chunk_rows={requested} is not a multiple of the batch size {batch_size}: a chunk must be whole "
                f"batches, so that processes and resumed runs never share one; use e.g. {low}"
            )
        return requested
    per_batch = max(1, batch_size * row_bytes)
    batches = max(1, min(CHUNK_BYTES // per_batch, MAX_CHUNK_ROWS // batch_size))
    if rows is not None:
        batches = min(batches, math.ceil(rows / batch_size))
    return batches * batch_size


def array_names(sites: Sequence[Site]) -> dict[Site, str]:
    """The array name of each site: the module's name when it is the module's only site, else the site text.

    >>> array_names([Site("fc"), Site("h.0", 0), Site("h.0", 1)])
    {Site(module='fc', call=0, what='output', path=''): 'fc', Site(module='h.0', call=0, what='output', path=''): \
'h.0#0:output', Site(module='h.0', call=1, what='output', path=''): 'h.0#1:output'}
    """
    names = short_names(sites)
    for site, name in names.items():
        if "/" in name or name.startswith("__") or name in _RESERVED:
            raise SpecError(
                f"site {str(site)!r} cannot name an array ({name!r}): zarr names may not hold '/', start with "
                f"'__' or be one of {', '.join(map(repr, _RESERVED))}; rename the module"
            )
    return names

"""One array of a feature store, read lazily: :class:`StoreArray`.

Indexing reads only the chunks it touches, checks them (their CRC32C as zarr decodes them, and
that a done chunk's file is there), shows rows a partial store has not written as NaN, and
refuses a read larger than the machine's memory before anything is allocated.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from hookscope._shared.bits import bits_to_tensor
from hookscope._shared.credentials import scrub
from hookscope._shared.units import format_bytes
from hookscope._store.layout import SiteLayout
from hookscope._store.verify import damaged_error, missing_chunk, present_chunks, read_fault, unreadable_error
from hookscope.errors import StoreError, StoreIndexError, StoreReadError

__all__ = ["StoreArray", "Unwritten"]


@dataclass(frozen=True)
class Unwritten:
    """The chunks of a partial store recorded as done, and their rows."""

    done: np.ndarray  # one bool per chunk
    chunk_rows: int


class StoreArray:
    """One site's rows, read lazily: indexing reads only the chunks it touches.

    ``array[10:20]`` is a numpy array (bfloat16 and float8 values as float32, exactly);
    ``array.torch(slice(10, 20))`` a tensor in the values' own dtype; ``array.zarr`` the zarr array.
    In a partial store, rows of chunks not recorded as done read as NaN, never as the zeros
    the file holds there; integer and boolean rows, which have no NaN, are refused. A chunk that
    fails its CRC32C, or whose file is gone, is a :class:`~hookscope.errors.StoreError` naming it;
    one whose bytes could not be fetched (the network) a :class:`~hookscope.errors.StoreReadError`.
    Usable in processes forked or unpickled from the one that opened it (``DataLoader`` workers):
    a store at a URL makes its connections anew there (see ``hookscope._store.fsspec_store``).
    """

    def __init__(
        self,
        zarr_array: Any,
        layout: SiteLayout,
        unwritten: Unwritten | None = None,
        *,
        checks_files: bool = True,
        present: set[int] | None = None,
        secrets: tuple[str, ...] = (),
    ) -> None:
        self.zarr = zarr_array
        self.layout = layout
        self.secrets = secrets  # what messages about the store must not show (its credentials)
        self._unwritten = unwritten
        self._checks_files = checks_files  # format 2 writes every chunk's file; format 1 skipped all-zero ones
        self._present = set() if present is None else present  # chunks whose file was seen: the store's, shared

    @property
    def name(self) -> str:
        return self.layout.name

    @property
    def site(self) -> str:
        return self.layout.site

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.zarr.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self) -> np.dtype[Any]:
        """The numpy dtype indexing returns (float32 for values stored as bits)."""
        return np.dtype(np.float32) if self.layout.as_bits else self.layout.stored

    @property
    def torch_dtype(self) -> torch.dtype:
        return self.layout.torch_dtype

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index: Any) -> np.ndarray:
        rows = self._rows_read(index)
        raw = self._read(index, rows)
        values = bits_to_tensor(raw, self.layout.torch_dtype).float().numpy() if self.layout.as_bits else raw
        missing = self._missing(rows)
        if missing is None:
            return values
        values = np.array(values, copy=True)
        values[missing] = np.nan
        return values

    def torch(self, index: Any = slice(None)) -> Tensor:
        """Rows ``index`` as a tensor of the dtype the values had (``torch.bfloat16`` included)."""
        rows = self._rows_read(index, as_float=False)
        values = bits_to_tensor(self._read(index, rows), self.layout.torch_dtype)
        missing = self._missing(rows)
        if missing is None:
            return values
        values = values.clone()
        values[torch.from_numpy(np.asarray(missing))] = torch.nan
        return values

    def dense(self, index: Any = slice(None)) -> Tensor:
        """Rows ``index`` of sparse latents (``hs.edits.SparseTopk``) as dense float32 ``(rows, ..., width)``:
        zeros but for each vector's ``k`` kept latents."""
        k, width = self._sparse_form()
        packed = self._packed(index)
        dense = torch.zeros((*packed.shape[:-1], width), dtype=torch.float32)
        return dense.scatter_(-1, packed[..., k:].long(), packed[..., :k])

    def sparse(self, index: Any = slice(None)) -> Tensor:
        """Rows ``index`` of sparse latents as a ``torch.sparse_coo_tensor`` of shape ``(rows, ..., width)``
        (coalesced: each vector's ``k`` latents)."""
        k, width = self._sparse_form()
        packed = self._packed(index)
        lead = packed.shape[:-1]
        grid = torch.stack(torch.meshgrid(*[torch.arange(n) for n in lead], indexing="ij"), dim=0) if lead else None
        latents = packed[..., k:].long().reshape(-1)
        if grid is None:
            indices = latents.unsqueeze(0)
        else:
            where = grid.reshape(len(lead), -1).repeat_interleave(k, dim=1)
            indices = torch.cat([where, latents.unsqueeze(0)], dim=0)
        values = packed[..., :k].reshape(-1)
        return torch.sparse_coo_tensor(indices, values, (*lead, width), check_invariants=True).coalesce()

    def _packed(self, index: Any) -> Tensor:
        """The packed rows; rows never written (a partial store: NaN) are refused, having no indices."""
        packed = self.torch(index)
        k, _ = self._sparse_form()
        if packed[..., k:].isnan().any():  # NaN indices: rows never written (NaN values are values)
            raise StoreIndexError(
                f"rows {index!r} of {self.name!r} include rows never written (their chunks are not done), which "
                "have no latents to unpack; read rows of done chunks (store.done_chunks())",
                array=self.name,
            )
        return packed

    def _sparse_form(self) -> tuple[int, int]:
        sparse = self.layout.sparse
        if sparse is None:
            raise StoreError(
                f"{self.name!r} holds dense values, not sparse latents; read it with store[{self.name!r}][rows] "
                "(dense() and sparse() read sites stored with reduce=hs.edits.SparseTopk(...) or splice.topk(k))",
                array=self.name,
            )
        return int(sparse["k"]), int(sparse["width"])

    def __iter__(self) -> Iterator[np.ndarray]:
        """Row by row, reading one chunk at a time."""
        step = self.zarr.chunks[0]
        for start in range(0, len(self), step):
            yield from self[start : start + step]

    def _rows_read(self, index: Any, *, as_float: bool = True) -> range | np.ndarray:
        """The rows ``index`` reads, checked against the array's length and the memory they need.

        A row index the checks cannot follow (a tuple whose first part is not the rows) is
        refused rather than guessed. A read that would need more memory than the machine has is
        refused before anything is allocated.
        """
        rows_index = index[0] if isinstance(index, tuple) and index else index
        if (isinstance(index, tuple) and not index) or rows_index is Ellipsis:
            rows_index = slice(None)
        length = self.shape[0]
        try:
            if isinstance(rows_index, slice):
                rows: range | np.ndarray = range(length)[rows_index]
            elif isinstance(rows_index, (int, np.integer)) and not isinstance(rows_index, bool):
                rows = np.asarray(range(length)[int(rows_index)])  # 0-d: the read drops the rows axis
            else:
                picked = np.asarray(rows_index)
                if picked.dtype == bool:
                    if picked.shape != (length,):
                        raise IndexError(f"a boolean row mask of shape {picked.shape} for {length} rows")
                    rows = np.flatnonzero(picked)
                else:
                    rows = np.asarray(picked, dtype=np.int64).reshape(-1)
                    rows = np.where(rows < 0, rows + length, rows)
                    if rows.size and (rows.min() < 0 or rows.max() >= length):
                        raise IndexError(f"a row index is out of bounds for {length} rows")
        except (IndexError, TypeError, ValueError) as error:
            span = f"rows 0..{length - 1} (or -{length}..-1)" if length else "no rows"
            raise StoreIndexError(
                f"rows {index!r} of {self.name!r}: {error}; the array has {span}", array=self.name
            ) from None
        count = len(rows) if isinstance(rows, range) else rows.size
        needed = count * self.layout.row_bytes * (2 if self.layout.as_bits and as_float else 1)
        if _whole_rows(index) and needed > _memory_bytes():  # a read of some columns: zarr knows its size
            raise StoreError(
                f"reading {count:,} rows of {self.name!r} needs {format_bytes(needed)}, more than this machine's "
                f"memory ({format_bytes(_memory_bytes())}); read fewer rows at a time (store[{self.name!r}][i:j])",
                array=self.name,
            )
        return rows

    def _read(self, index: Any, rows: range | np.ndarray) -> np.ndarray:
        """The stored values at ``index``; a lost or damaged chunk is a ``StoreError`` naming it.

        zarr checks each chunk's CRC32C as it decodes it. A chunk recorded as done whose file is
        gone would read as zeros, so the files of the done chunks a read touches are looked for
        first (once per array and chunk; stores of format 2, which write every chunk's file).
        """
        chunks = self._chunks_of(rows)
        try:
            self._look_for_files(chunks)
        except StoreError:
            raise
        except Exception as error:  # the look itself failed: the network, not the store
            reason = f"{type(error).__name__}: {error}"
            raise unreadable_error(self.name, chunks[0], self.chunk_span(chunks[0]), reason, self.secrets) from error
        try:
            return np.asarray(self.zarr[index])
        except MemoryError as error:
            raise StoreError(f"reading {self.name!r} at {index!r}: {error}; read fewer rows", array=self.name) from None
        except Exception as error:
            if isinstance(error, (IndexError, TypeError)) and not isinstance(error, StoreError):
                raise StoreError(f"{self.name!r}[{index!r}]: {error}", array=self.name) from None
            raise self._culprit(chunks, error) from error

    def _look_for_files(self, chunks: list[int]) -> None:
        """Refuse a read of done ``chunks`` whose file is gone (zarr would give zeros)."""
        unseen = [chunk for chunk in chunks if chunk not in self._present and self._written(chunk)]
        if len(unseen) > _LIST_AFTER:  # one listing of the array's chunk files instead of a look per chunk
            self._present.update(present_chunks(self.zarr))
            unseen = [chunk for chunk in unseen if chunk not in self._present]
            if unseen:
                raise self._damaged(unseen[0], "its file is gone (the chunk is recorded as written)")
        for chunk in unseen:
            if missing_chunk(self.zarr, chunk):
                raise self._damaged(chunk, "its file is gone (the chunk is recorded as written)")
            self._present.add(chunk)

    def _chunks_of(self, rows: range | np.ndarray) -> list[int]:
        step = self.zarr.chunks[0]
        if isinstance(rows, range):
            if not len(rows):
                return []
            if abs(rows.step) == 1:
                low, high = min(rows[0], rows[-1]), max(rows[0], rows[-1])
                return list(range(low // step, high // step + 1))
            rows = np.asarray(rows)
        return [int(c) for c in np.unique(np.asarray(rows) // step)]

    def _written(self, chunk: int) -> bool:
        """True where the store says the chunk's file must exist."""
        if not self._checks_files:
            return False
        return self._unwritten is None or bool(chunk < len(self._unwritten.done) and self._unwritten.done[chunk])

    def _culprit(self, chunks: list[int], error: Exception) -> StoreError:
        """The chunk a failed read broke on, damaged or not fetched (read one by one: only on this error path)."""
        step = self.zarr.chunks[0]
        for chunk in chunks:
            try:
                self.zarr[chunk * step : (chunk + 1) * step]
            except Exception as found:
                return self.fault(chunk, found)
        return StoreReadError(
            f"reading {self.name!r} failed on the way ({scrub(f'{type(error).__name__}: {error}', self.secrets)}), "
            "and each of its chunks read at a second try; the store is not known to be damaged: read again",
            array=self.name,
        )

    def fault(self, chunk: int, error: BaseException) -> StoreError:
        """The error for ``chunk`` having failed to read with ``error``: damaged, or not fetched."""
        damaged, reason = read_fault(self.zarr, chunk, error)
        if damaged:
            return self._damaged(chunk, scrub(reason, self.secrets))
        return unreadable_error(self.name, chunk, self.chunk_span(chunk), reason, self.secrets)

    def chunk_span(self, chunk: int) -> range:
        """The rows of row-chunk ``chunk``."""
        step = self.zarr.chunks[0]
        return range(chunk * step, min((chunk + 1) * step, self.shape[0]))

    def _damaged(self, chunk: int, reason: str) -> StoreError:
        return damaged_error(self.name, chunk, self.chunk_span(chunk), reason)

    def _missing(self, rows: range | np.ndarray) -> np.ndarray | None:
        """Which of ``rows`` were never written (a mask over them), or None when all were."""
        if self._unwritten is None:
            return None
        picked = np.asarray(rows)
        missing: np.ndarray = ~self._unwritten.done[picked // self._unwritten.chunk_rows]
        if not missing.any():
            return None
        if not self.torch_dtype.is_floating_point:
            first = int(picked[missing].flat[0])
            raise StoreError(
                f"row {first} of {self.name!r} was never written (its chunk is not done) and {self.layout.dtype} "
                "values have no NaN to show it; read rows of done chunks (store.done_chunks()), or run the "
                "extraction again to finish the store",
                array=self.name,
                chunk=first // self._unwritten.chunk_rows,
            )
        return missing

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        values = self[:]
        return values if dtype is None else values.astype(dtype)

    def __repr__(self) -> str:
        return f"<StoreArray {self.name!r} {self.shape} {self.layout.dtype}>"


#: Past this many chunk files to look for, a read lists the array's chunk files once instead.
_LIST_AFTER = 8


def _whole_rows(index: Any) -> bool:
    """True when ``index`` reads whole rows (no selection along the other axes)."""
    if not isinstance(index, tuple):
        return True
    return all(part is Ellipsis or part == slice(None) for part in index[1:])


def _memory_bytes() -> int:
    """Physical memory of this machine; a very large number where it cannot be read."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 2**62

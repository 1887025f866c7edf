"""Reading a feature store: ``hs.open_store(path)``.

A store is a plain zarr v3 group, so ``zarr.open_group(path)``, ``xarray.open_zarr(path)`` and
``dask.array.from_zarr(path, component=name)`` read it too. This module adds what they do not
know: site names, the original dtype of values kept as bits (bfloat16 comes back as bfloat16
in ``store.torch``, as float32 in numpy), the configuration the store was made with, and
whether it is complete.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import IterableDataset

from hookscope._core.sites import Site
from hookscope._core.std_names import is_std_selector, std_pattern
from hookscope._extract.layout import SiteLayout
from hookscope._extract.provenance import INDEX, MASK, TOKENS
from hookscope._extract.running_stats import SiteStats
from hookscope._extract.store_meta import checked_layout, merged_stats, stored_layout
from hookscope._extract.verify import (
    damaged_chunks,
    damaged_error,
    describe,
    missing_chunk,
    present_chunks,
    reaching,
    read_fault,
    unreadable_error,
)
from hookscope._extract.zarr_io import Manifest, Target, open_group, read_meta, target_of
from hookscope._shared.bits import bits_to_tensor
from hookscope._shared.credentials import scrub
from hookscope._shared.optional import require
from hookscope._shared.tables import Column, Table
from hookscope._shared.units import counted, format_bytes
from hookscope.errors import SiteNotFoundError, StoreError, StoreIndexError, StoreReadError

__all__ = ["Store", "StoreArray", "open_store"]


@dataclass(frozen=True)
class _Unwritten:
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
    a store at a URL makes its connections anew there (see ``hookscope._extract.fsspec_store``).
    """

    def __init__(
        self,
        zarr_array: Any,
        layout: SiteLayout,
        unwritten: _Unwritten | None = None,
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


class Store:
    """A feature store made by :func:`hookscope.extract`.

    ``store["h.0"]`` is a :class:`StoreArray` (by array name or site text), ``store.torch("h.0",
    slice(0, 32))`` a tensor, ``store.sites`` the array names, ``len(store)`` the number of rows
    and ``store.meta`` the configuration it was made with. What each row is: ``store.row_index``,
    ``store.tokens``, ``store.attention_mask``; each site's statistics: ``store.stats``; batches
    for training: ``store.loader(...)``.

    Example::

        store = hs.open_store("feats.zarr")           # or "s3://bucket/feats.zarr", storage_options={...}
        x = store["h.5"][:1000]                     # numpy, (1000, 768)
        t = store.torch("h.5", slice(0, 1000))      # torch, the stored dtype (bfloat16 too)
        store.stats["h.5"].norm_rms                  # kept while writing: no pass over the data
        store.tokens[store.row_index[:] == 42]       # the tokens of data set row 42

    >>> import tempfile, torch
    >>> from torch import nn
    >>> import hookscope as hs
    >>> ids = torch.tensor([[3, 1, 4, 1], [5, 9, 2, 6]])
    >>> model = nn.Sequential(nn.Embedding(10, 3), nn.Linear(3, 2))
    >>> store = hs.extract(model, ids, "1", tempfile.mkdtemp() + "/f.zarr", progress=False, indices=[1, 0])
    >>> store.row_index[:].tolist(), store.tokens[:].tolist(), store.stats["1"].count
    ([1, 0], [[5, 9, 2, 6], [3, 1, 4, 1]], 8)
    """

    def __init__(self, target: Target, group: Any, meta: dict[str, Any]) -> None:
        self.target = target
        self.group = group
        self.meta = meta
        checked = checked_layout(target.label, group, meta, target.secrets)
        self._layouts = list(checked.sites)
        self._extras = {extra.name: extra for extra in checked.extras}
        self._stats: dict[str, SiteStats] | None = None
        self._by_key: dict[str, SiteLayout] = {}
        self._present: dict[str, set[int]] = {}  # per array, the chunks whose file a read has seen
        #: Rows the ``hs.extract`` call that returned this store wrote, on all ranks (0: the store was
        #: complete and only checked); None for a store opened by ``hs.open_store``.
        self.written_rows: int | None = None
        for layout in self._layouts:
            self._by_key[layout.name] = layout
            self._by_key.setdefault(layout.site, layout)

    @property
    def path(self) -> str:
        return self.target.label

    @property
    def sites(self) -> list[str]:
        """The array names, in model order."""
        return [layout.name for layout in self._layouts]

    @property
    def complete(self) -> bool:
        return self.meta.get("state") == "complete"

    @property
    def rows(self) -> int:
        """Rows in every array (for a stream still being written: the rows written so far)."""
        rows = self.meta.get("rows")
        if rows is None:
            first = self.sites[0] if self.sites else None
            return int(self.group[first].shape[0]) if first is not None else 0
        return int(rows)

    @property
    def chunk_rows(self) -> int:
        return int(self.meta["config"]["chunk_rows"])

    def done_chunks(self) -> set[int]:
        """The chunks recorded as written; every chunk of a complete store."""
        with reaching(self.path, "reading its manifest", self.target.secrets):
            return Manifest(self.group).done()

    # -- what each row is ---------------------------------------------------------------------

    @property
    def row_index(self) -> StoreArray:
        """Each row's index in the data set it came from (``(N,)`` int64): the index picked with
        ``indices=``, a stream's row number. ``store.tokens[i]`` and the data set's
        ``dataset[store.row_index[i]]`` say what made row ``i``."""
        found = self._extra(INDEX)
        if found is None:
            raise StoreError(
                f"store {self.path!r} keeps no row index: it was made by an older hookscope; extract it again "
                "(overwrite=True) to keep each row's provenance"
            )
        return found

    @property
    def tokens(self) -> StoreArray | None:
        """The token ids each row was made from (``(N, seq)`` int64, ``-1`` past a shorter batch's
        end); None when the data carried none (see ``tokens=`` of ``hs.extract``)."""
        return self._extra(TOKENS)

    @property
    def attention_mask(self) -> StoreArray | None:
        """Each row's padding mask (``(N, seq)`` bool, True for real tokens); None when the batches had none."""
        return self._extra(MASK)

    def _extra(self, name: str) -> StoreArray | None:
        layout = self._extras.get(name)
        return None if layout is None else self._array(layout)

    @property
    def stats(self) -> Mapping[str, SiteStats]:
        """Each floating site's statistics, by array name: count, mean, std, min, max, norms, and per
        feature (:class:`~hookscope.SiteStats`), over every stored vector with padding left out.

        Kept while the store was written, so nothing of the data is read: they are merged from
        the manifest's per-chunk parts (one small read); a complete store's scalars are in its
        attributes too (``store.meta["stats"]``, for readers without hookscope). A partial
        store's cover its done chunks.
        """
        if self._stats is None:
            layout = stored_layout(self.meta, self.path)
            chunks = self.meta.get("chunks") if self.complete else sorted(self.done_chunks())
            with reaching(self.path, "reading its statistics", self.target.secrets):
                self._stats = merged_stats(Manifest(self.group), layout, chunks if chunks is not None else [])
        return self._stats

    def __len__(self) -> int:
        return self.rows

    def __iter__(self) -> Iterator[str]:
        return iter(self.sites)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in self._by_key

    def __getitem__(self, key: str) -> StoreArray:
        std = self.meta.get("config", {}).get("std")
        if is_std_selector(key) and isinstance(std, dict) and std_pattern(key) in std:
            key = str(Site.parse(std[std_pattern(key)]))  # a canonical name the extraction was given: its site
        layout = self._by_key.get(key)
        if layout is None:
            raise self._not_found(key)
        return self._array(layout)

    def _array(self, layout: SiteLayout) -> StoreArray:
        """The :class:`StoreArray` of a site or provenance array."""
        with reaching(self.path, f"opening array {layout.name!r}", self.target.secrets):
            found = self.group[layout.name]
        return StoreArray(
            found,
            layout,
            self._unwritten_rows(),
            checks_files=self.meta.get("format") != 1,
            present=self._present.setdefault(layout.name, set()),
            secrets=self.target.secrets,
        )

    def _unwritten_rows(self) -> _Unwritten | None:
        """Which chunks a partial store has not written, for its arrays to show as NaN; None when complete."""
        if self.complete:
            return None
        rows = int(self.group[self.sites[0]].shape[0]) if self.sites else 0
        chunk_rows = self.chunk_rows
        done = np.zeros(max(math.ceil(rows / chunk_rows), 1), dtype=bool)
        for chunk in self.done_chunks():
            if chunk < len(done):
                done[chunk] = True
        return _Unwritten(done, chunk_rows)

    def verify(self) -> None:
        """Read every done chunk of every array and compare it with the checksums recorded when it
        was written; ``StoreError`` listing the damaged ones (``.array`` and ``.chunk``: the first).

        Reading a store already checks each chunk it touches (its CRC32C, and that its file is
        there); this checks them all at once, e.g. after copying a store. Cost: one read of the
        whole store. Running the same extraction again writes damaged chunks anew.
        """
        stored = stored_layout(self.meta)
        current = self.meta.get("format") != 1
        with reaching(self.path, "checking its chunks", self.target.secrets):
            damage = damaged_chunks(
                self.group,
                stored.arrays,
                Manifest(self.group),
                sorted(self.done_chunks()),
                stored.chunk_rows,
                checks_files=current,
                secrets=self.target.secrets,
            )
        if damage:
            fix = (
                "run the same extraction again, which writes them anew"
                if current
                else "this store of format 1 cannot be repaired: overwrite=True makes it anew"
            )
            raise StoreError(
                f"store {self.path!r} has {len(damage)} damaged chunk(s): {describe(damage, 5)}; {fix}",
                array=damage[0].array,
                chunk=damage[0].chunk,
            )

    def torch(self, key: str, index: Any = slice(None)) -> Tensor:
        """Rows ``index`` of site ``key`` as a tensor of the values' own dtype."""
        return self[key].torch(index)

    def loader(self, sites: str | Sequence[str], batch_size: int, **options: Any) -> IterableDataset[Any]:
        """Batches of ``sites`` for training, shuffled across the whole store: a
        :class:`~hookscope.StoreLoader` (see it for the options).

        Example::

            for batch in store.loader("h.5", 4096, tokens=True, seed=0):   # (4096, d) token rows
                sae_step(batch)
        """
        from hookscope._extract.loader import StoreLoader

        return StoreLoader(self, sites, batch_size, **options)

    def _not_found(self, key: str) -> SiteNotFoundError:
        """The error for a key that names no array: the arrays it may have meant, in the message and as fields."""
        same_module = [layout.name for layout in self._layouts if layout.layer == key]
        if same_module:
            message = f"{key!r} has several sites in {self.path}; name one of {', '.join(map(repr, same_module))}"
            return SiteNotFoundError(message, key=key, candidates=tuple(same_module))
        close = difflib.get_close_matches(key, list(self._by_key), n=3, cutoff=0.5)
        hint = f"did you mean {' or '.join(map(repr, close))}?" if close else f"sites: {', '.join(self.sites[:8])}"
        message = f"no site {key!r} in {self.path}; {hint}"
        return SiteNotFoundError(message, key=key, candidates=tuple(close or self.sites))

    def to_hf_dataset(
        self, sites: list[str] | None = None, *, provenance: bool = True, cache_dir: str | None = None
    ) -> Any:
        """The rows as a Hugging Face ``datasets.Dataset``, one column per site (``pip install datasets``),
        and what each row is: ``row_index``, and ``tokens`` and ``attention_mask`` where the store
        keeps them (``provenance=False`` leaves them out).

        Rows are read chunk by chunk and written to the datasets cache (``cache_dir``, default the
        datasets library's), so the store never has to fit in memory. Values kept as bits
        (bfloat16, float8) become float32.
        """
        datasets = require("datasets", purpose="to_hf_dataset()", extra="datasets")
        if self.target.path is None:
            raise StoreError("to_hf_dataset reads a store by path; this store is not on a local path")
        columns = {self[key].name: self[key].name for key in (sites or self.sites)}
        if provenance:
            kept = {column: name for column, name in _HF_PROVENANCE.items() if name in self._extras}
            taken = sorted(set(kept) & set(columns))
            if taken:
                raise StoreError(
                    f"site(s) {', '.join(map(repr, taken))} have the name of a provenance column; pass "
                    "provenance=False (and read store.row_index, store.tokens yourself), or leave those sites out"
                )
            columns.update(kept)
        features = datasets.Features(
            {column: _hf_feature(datasets, self._column(name)) for column, name in columns.items()}
        )
        return datasets.Dataset.from_generator(  # a tuple: datasets would shard a list between workers
            _hf_rows,
            features=features,
            gen_kwargs={"path": str(self.target.path), "columns": tuple(columns.items())},
            cache_dir=cache_dir,
        )

    def _column(self, name: str) -> StoreArray:
        """A site's array, or a provenance array (``_rows/index``) by its name."""
        extra = self._extras.get(name)
        return self._array(extra) if extra is not None else self[name]

    def _table(self) -> Table:
        """One row per array: its name, the site that fills it, one row's shape, its dtype and its
        size uncompressed, under the store's path, rows and state."""
        title = (
            f"<Store {self.path}: {counted(self.rows, 'row')}, {counted(len(self.sites), 'site')}, "
            f"{self.meta.get('state', '?')}>"
        )
        reduced = any(layout.reduce for layout in self._layouts)
        columns = [*map(Column, ("array", "site", "shape", "dtype")), Column("size", "right")]
        table = Table(columns + ([Column("reduce")] if reduced else []), title=title)
        for layout in self._layouts:
            shape = str(("N", *layout.shape)).replace("'", "")  # (N, 16, 30, 30)
            size = format_bytes(self.rows * layout.row_bytes)
            table.add(
                layout.name, layout.site, shape, layout.dtype, size, *([_shown_reduce(layout)] if reduced else [])
            )
        return table

    def __repr__(self) -> str:
        return self._table().text()

    def _repr_html_(self) -> str:
        return self._table().html()


#: The longest reduction a store's table shows whole (the record keeps it all: ``store.meta``).
_REDUCE_SHOWN = 40


def _shown_reduce(layout: SiteLayout) -> str:
    """A site's reduction as the store's table shows it: sparse latents by their ``k`` and width
    (the record names the encoder, a long text), anything else on one line, cut past 40 characters.

    >>> _shown_reduce(SiteLayout("h.1", "h.1", "h.1", (10, 8), "float32", "sparse_topk(k=4, encode=...)",
    ...                          {"k": 4, "width": 96}))
    'sparse_topk(k=4, width=96)'
    """
    if layout.sparse is not None:
        return f"sparse_topk(k={layout.sparse['k']}, width={layout.sparse['width']})"
    text = " ".join(str(layout.reduce or "").split())
    return text if len(text) <= _REDUCE_SHOWN else text[: _REDUCE_SHOWN - 3] + "..."


def _hf_feature(datasets: Any, array: StoreArray) -> Any:
    value = str(array.dtype)
    shape = array.shape[1:]
    if not shape:
        return datasets.Value(value)
    if len(shape) == 1:
        return datasets.List(datasets.Value(value), length=shape[0])
    if len(shape) > 5:
        raise StoreError(f"site {array.name!r} has {len(shape)}-D rows; datasets takes at most 5-D arrays")
    kind = getattr(datasets, f"Array{len(shape)}D")
    return kind(shape=shape, dtype=value)


#: The provenance columns of ``to_hf_dataset``, and the arrays that fill them.
_HF_PROVENANCE = {"row_index": INDEX, "tokens": TOKENS, "attention_mask": MASK}


def _hf_rows(path: str, columns: tuple[tuple[str, str], ...]) -> Iterator[dict[str, Any]]:
    store = open_store(path)
    step = store.chunk_rows
    arrays = {column: store._column(name) for column, name in columns}
    for start in range(0, len(store), step):
        block = {column: array[start : start + step] for column, array in arrays.items()}
        for offset in range(len(next(iter(block.values())))):
            yield {column: values[offset] for column, values in block.items()}


def open_store(
    path: str | os.PathLike[str] | Any,
    *,
    partial: bool = False,
    verify: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> Store:
    """Open a store made by :func:`hookscope.extract` for reading.

    An incomplete store (a run that stopped part-way) raises ``StoreError`` naming how much is
    done; ``partial=True`` opens it anyway (rows of chunks not done read as NaN, and integer
    rows there are refused; ``store.done_chunks()`` says which are done).

    The metadata is checked against the arrays before anything is read (rows, shapes, dtypes,
    chunking): a store that contradicts itself is a ``StoreError`` naming the array. Every read
    checks the chunks it touches; ``verify=True`` checks every chunk now (:meth:`Store.verify`:
    one read of the whole store).

    ``path`` may be an fsspec URL (``"s3://bucket/feats.zarr"``, ``"gs://..."``) with
    ``storage_options`` for its file system (endpoint, credentials), or a zarr store object.

    >>> import tempfile, torch
    >>> from torch import nn
    >>> import hookscope as hs
    >>> out = tempfile.mkdtemp() + "/feats.zarr"
    >>> _ = hs.extract(nn.Sequential(nn.Linear(4, 3)), torch.randn(10, 4), layers="0", out=out, progress=False)
    >>> store = hs.open_store(out)
    >>> len(store), store.sites, store["0"][:2].shape
    (10, ['0'], (2, 3))
    """
    target = path if isinstance(path, Target) else target_of(path, storage_options)
    meta = read_meta(target)
    if not meta:
        what = "nothing" if meta is None else "a zarr store hookscope did not make"
        raise StoreError(f"{target.label!r} holds {what}; expected a store written by hookscope.extract")
    try:
        group = open_group(target, writable=False)
    except Exception as error:
        raise StoreError(f"store {target.label!r} cannot be opened: {target.said(error)}") from error
    if meta.get("state") == "creating":
        raise StoreError(
            f"store {target.label!r} was cut short while it was being made and holds no data; run the extraction "
            "again, which makes it anew"
        )
    store = Store(target, group, meta)
    if not store.complete and not partial:
        chunks = meta.get("chunks")
        done = len(store.done_chunks())
        of = f" of {chunks}" if chunks is not None else ""
        raise StoreError(
            f"store {target.label!r} is incomplete: {done}{of} chunks written (state {meta.get('state')!r}); run the "
            "same extraction again to finish it (it resumes), or open_store(path, partial=True) to read what is done"
        )
    if verify:
        store.verify()
    return store


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

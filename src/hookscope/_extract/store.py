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
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import IterableDataset

from hookscope._core.sites import Site
from hookscope._core.std.stdmap import is_std_selector, std_pattern
from hookscope._extract.layout import Layout, SiteLayout
from hookscope._extract.provenance import INDEX, MASK, TOKENS
from hookscope._extract.running_stats import SiteStats, chunk_part, features, merge, summary
from hookscope._extract.verify import damaged_chunks, describe, missing_chunk, present_chunks
from hookscope._extract.zarr_io import MANIFEST_GROUP, Manifest, Target, open_group, read_meta, target_of
from hookscope._shared.bits import bits_to_tensor
from hookscope._shared.optional import require
from hookscope._shared.tables import Column, Table
from hookscope._shared.units import counted, format_bytes
from hookscope.errors import SiteNotFoundError, StoreError, StoreIndexError

__all__ = ["Store", "StoreArray", "merged_stats", "open_store"]


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
    fails its CRC32C, or whose file is gone, is a :class:`~hookscope.errors.StoreError` naming it.
    """

    def __init__(
        self,
        zarr_array: Any,
        layout: SiteLayout,
        unwritten: _Unwritten | None = None,
        *,
        checks_files: bool = True,
        present: set[int] | None = None,
    ) -> None:
        self.zarr = zarr_array
        self.layout = layout
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
        try:
            return np.asarray(self.zarr[index])
        except MemoryError as error:
            raise StoreError(f"reading {self.name!r} at {index!r}: {error}; read fewer rows", array=self.name) from None
        except Exception as error:
            if isinstance(error, (IndexError, TypeError)) and not isinstance(error, StoreError):
                raise StoreError(f"{self.name!r}[{index!r}]: {error}", array=self.name) from None
            raise self._culprit(chunks, error) from error

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
        """The chunk a failed read broke on (read one by one: only on this error path)."""
        step = self.zarr.chunks[0]
        for chunk in chunks:
            try:
                self.zarr[chunk * step : (chunk + 1) * step]
            except Exception as found:
                return self._damaged(chunk, f"it cannot be read ({type(found).__name__}: {found})")
        return StoreError(f"reading {self.name!r} failed: {type(error).__name__}: {error}", array=self.name)

    def _damaged(self, chunk: int, reason: str) -> StoreError:
        step = self.zarr.chunks[0]
        first = chunk * step
        last = min(first + step, self.shape[0]) - 1
        return StoreError(
            f"chunk {chunk} (rows {first}..{last}) of {self.name!r} is damaged: {reason}; run the same extraction "
            "again, which checks every chunk and writes the damaged ones again (hs.open_store(path, verify=True) "
            "lists them all)",
            array=self.name,
            chunk=chunk,
        )

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
        checked = checked_layout(target.label, group, meta)
        self._layouts = list(checked.sites)
        self._extras = {extra.name: extra for extra in checked.extras}
        self._stats: dict[str, SiteStats] | None = None
        self._by_key: dict[str, SiteLayout] = {}
        self._present: dict[str, set[int]] = {}  # per array, the chunks whose file a read has seen
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
        return StoreArray(
            self.group[layout.name],
            layout,
            self._unwritten_rows(),
            checks_files=self.meta.get("format") != 1,
            present=self._present.setdefault(layout.name, set()),
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
        damage = damaged_chunks(
            self.group,
            stored.arrays,
            Manifest(self.group),
            sorted(self.done_chunks()),
            stored.chunk_rows,
            checks_files=current,
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

    def to_hf_dataset(self, sites: list[str] | None = None, *, cache_dir: str | None = None) -> Any:
        """The rows as a Hugging Face ``datasets.Dataset``, one column per site (``pip install datasets``).

        Rows are read chunk by chunk and written to the datasets cache (``cache_dir``, default the
        datasets library's), so the store never has to fit in memory. Values kept as bits
        (bfloat16, float8) become float32.
        """
        datasets = require("datasets", purpose="to_hf_dataset()", extra="datasets")
        if self.target.path is None:
            raise StoreError("to_hf_dataset reads a store by path; this store is not on a local path")
        names = [self[key].name for key in (sites or self.sites)]
        features = datasets.Features({name: _hf_feature(datasets, self[name]) for name in names})
        return datasets.Dataset.from_generator(  # a tuple: datasets would shard a list between workers
            _hf_rows,
            features=features,
            gen_kwargs={"path": str(self.target.path), "names": tuple(names)},
            cache_dir=cache_dir,
        )

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
            table.add(layout.name, layout.site, shape, layout.dtype, size, *([layout.reduce or ""] if reduced else []))
        return table

    def __repr__(self) -> str:
        return self._table().text()

    def _repr_html_(self) -> str:
        return self._table().html()


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


def _hf_rows(path: str, names: tuple[str, ...]) -> Iterator[dict[str, Any]]:
    store = open_store(path)
    step = store.chunk_rows
    for start in range(0, len(store), step):
        block = {name: store[name][start : start + step] for name in names}
        for offset in range(len(next(iter(block.values())))):
            yield {name: values[offset] for name, values in block.items()}


def open_store(
    path: str | os.PathLike[str] | Any,
    *,
    partial: bool = False,
    verify: bool = False,
    storage_options: dict[str, Any] | None = None,
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
        raise StoreError(f"store {target.label!r} cannot be opened: {type(error).__name__}: {error}") from error
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


def merged_stats(manifest: Manifest, layout: Layout, chunks: int | Iterable[int]) -> dict[str, SiteStats]:
    """Each site's statistics over ``chunks`` (a count: the first ones; or which), merged in chunk order.

    A site some of whose chunks have no part recorded (written by a hookscope that kept none) has
    no statistics rather than those of the chunks that have one.
    """
    wanted = sorted(range(chunks) if isinstance(chunks, int) else chunks)
    found = {}
    for site in layout.sites:
        array = manifest.stats_array(site.name)
        if array is None:
            continue
        merged: np.ndarray | None = chunk_part(np.zeros((0, features(site.shape))))
        for start in range(0, len(wanted), _STATS_BLOCK):  # a block of chunks' parts in memory at a time
            block = [c for c in wanted[start : start + _STATS_BLOCK] if c < array.shape[0]]
            parts = np.asarray(array[block[0] : block[-1] + 1])[[c - block[0] for c in block]] if block else None
            if len(block) < len(wanted[start : start + _STATS_BLOCK]) or (
                parts is not None and not np.isfinite(parts[:, 0]).all()
            ):
                merged = None  # a chunk without its part (the fill value, NaN): no statistics for the site
                break
            if parts is not None and merged is not None:
                merged = merge([merged, *parts])
        if merged is not None:
            found[site.name] = summary(merged)
    return found


#: Chunks whose statistics are merged at a time (a part is 4 + 4 * features floats).
_STATS_BLOCK = 256


def stored_layout(meta: dict[str, Any], label: str = "") -> Layout:
    """The :class:`Layout` a store's hookscope attributes describe (checked: ``StoreError`` if they lie)."""

    def damaged(what: str) -> StoreError:
        where = f"store {label!r}" if label else "the store"
        return StoreError(
            f"{where}: {what}; its attributes are damaged: make it anew with the same extraction and "
            "overwrite=True (--overwrite)"
        )

    config = meta.get("config")
    sites = meta.get("sites")
    if not isinstance(config, dict) or not isinstance(sites, list):
        raise damaged("the hookscope attributes lack 'config' or 'sites'")
    chunk_rows = config.get("chunk_rows")
    batch_size = config.get("batch_size", chunk_rows)
    rows = meta.get("rows")
    if not isinstance(chunk_rows, int) or not isinstance(batch_size, int) or min(chunk_rows, batch_size) < 1:
        raise damaged(f"chunk_rows {chunk_rows!r} is not a positive int")
    if rows is not None and not _whole(rows, least=0):
        raise damaged(f"rows {rows!r} is not an int >= 0")
    layouts = []
    for record in sites:
        try:
            layout = SiteLayout.from_json(record)
            layout.stored  # noqa: B018  (a dtype name torch does not know raises here)
        except (KeyError, TypeError, ValueError, AttributeError, AssertionError) as error:
            raise damaged(
                f"the record of a site ({str(record)[:80]}) is damaged: {type(error).__name__}: {error}"
            ) from None
        if not isinstance(layout.name, str) or not all(_whole(n, least=0) for n in layout.shape):
            raise damaged(f"the record of site {layout.name!r} is damaged: shape {list(layout.shape)}")
        layouts.append(layout)
    extras = []
    for record in meta.get("provenance") or []:
        try:
            extras.append(SiteLayout.from_json(record))
        except (KeyError, TypeError, ValueError) as error:
            raise damaged(f"the record of a provenance array ({str(record)[:80]}) is damaged: {error}") from None
    return Layout(tuple(layouts), rows, batch_size, chunk_rows, tuple(extras))


def checked_layout(label: str, group: Any, meta: dict[str, Any]) -> Layout:
    """:func:`stored_layout`, with each array checked against it: present, its dtype, its row
    shape, its chunking and (a store that knows it) its number of rows."""
    layout = stored_layout(meta, label)
    complete = meta.get("state") == "complete"
    if complete and layout.rows is None:
        raise StoreError(f"store {label!r} says it is complete but not how many rows it holds; it is damaged")
    for site in layout.arrays:
        try:
            array = group[site.name]
            shape, chunks, dtype = tuple(array.shape), tuple(array.chunks), np.dtype(array.dtype)
        except Exception as error:
            raise StoreError(
                f"array {site.name!r} of store {label!r} cannot be opened ({type(error).__name__}: {error}); the "
                "store is damaged: run the extraction again with overwrite=True",
                array=site.name,
            ) from None
        wanted = (site.stored, site.shape, (layout.chunk_rows, *site.shape))
        if (dtype, shape[1:], chunks) != wanted or (layout.rows is not None and shape[0] != layout.rows):
            rows = "N" if layout.rows is None else layout.rows
            raise StoreError(
                f"array {site.name!r} of store {label!r} is {shape} {dtype} in chunks of {chunks}, but the store's "
                f"record says ({rows}, {', '.join(map(str, site.shape))}) {site.stored} in chunks of {wanted[2]}; "
                "the store is damaged: run the extraction again with overwrite=True",
                array=site.name,
            )
    if complete and layout.chunks is not None:
        manifest = Manifest(group).array
        if manifest is None or tuple(manifest.shape) != (layout.chunks,):
            found = "none" if manifest is None else f"{tuple(manifest.shape)}"
            raise StoreError(
                f"store {label!r} says it holds {layout.rows:,} rows in {layout.chunks:,} chunks, but its manifest "
                f"has {found} entries; the store is damaged: run the extraction again with overwrite=True",
                array=f"{MANIFEST_GROUP}/done",
            )
    return layout


#: Past this many chunk files to look for, a read lists the array's chunk files once instead.
_LIST_AFTER = 8


def _whole_rows(index: Any) -> bool:
    """True when ``index`` reads whole rows (no selection along the other axes)."""
    if not isinstance(index, tuple):
        return True
    return all(part is Ellipsis or part == slice(None) for part in index[1:])


def _whole(value: object, *, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _memory_bytes() -> int:
    """Physical memory of this machine; a very large number where it cannot be read."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 2**62

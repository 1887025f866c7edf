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
from typing import Any

import numpy as np
from torch import Tensor
from torch.utils.data import IterableDataset

from hookscope._core.sites import Site
from hookscope._core.std_names import is_std_selector, std_pattern
from hookscope._shared.tables import Column, Table
from hookscope._shared.units import counted, format_bytes
from hookscope._store.array import StoreArray, Unwritten
from hookscope._store.attributes import checked_layout, stored_layout
from hookscope._store.export import to_hf_dataset
from hookscope._store.layout import SiteLayout
from hookscope._store.manifest import Manifest
from hookscope._store.provenance import INDEX, MASK, TOKENS
from hookscope._store.running_stats import SiteStats
from hookscope._store.statistics import merged_stats
from hookscope._store.verify import damaged_chunks, describe, reaching
from hookscope._store.zarr_io import Target, open_group, read_meta, target_of
from hookscope.errors import SiteNotFoundError, StoreError

__all__ = ["Store", "open_store"]


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
    >>> store = hs.extract(model, ids, tempfile.mkdtemp() + "/f.zarr", layers="1", progress=False, indices=[1, 0])
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

    def _unwritten_rows(self) -> Unwritten | None:
        """Which chunks a partial store has not written, for its arrays to show as NaN; None when complete."""
        if self.complete:
            return None
        rows = int(self.group[self.sites[0]].shape[0]) if self.sites else 0
        chunk_rows = self.chunk_rows
        done = np.zeros(max(math.ceil(rows / chunk_rows), 1), dtype=bool)
        for chunk in self.done_chunks():
            if chunk < len(done):
                done[chunk] = True
        return Unwritten(done, chunk_rows)

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
        from hookscope._store.loader import StoreLoader  # the loader reads a Store: imported on use

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
        return to_hf_dataset(self, _hf_rows, sites, provenance=provenance, cache_dir=cache_dir)

    def keeps(self, name: str) -> bool:
        """True when the store keeps provenance array ``name`` (``_rows/tokens``, ...)."""
        return name in self._extras

    def column(self, name: str) -> StoreArray:
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


def _hf_rows(  # the datasets library runs it, maybe in another process: it opens the store anew
    path: str, columns: tuple[tuple[str, str], ...]
) -> Iterator[dict[str, Any]]:
    store = open_store(path)
    step = store.chunk_rows
    arrays = {column: store.column(name) for column, name in columns}
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

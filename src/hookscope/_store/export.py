"""A store as a Hugging Face ``datasets.Dataset``: ``store.to_hf_dataset()``.

Rows are read chunk by chunk and written to the datasets cache, so the store never has to fit in
memory; each row keeps what it is (``row_index``, and ``tokens`` and ``attention_mask`` where the
store keeps them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from hookscope._shared.optional import require
from hookscope._store.array import StoreArray
from hookscope._store.provenance import INDEX, MASK, TOKENS
from hookscope._store.zarr_io import Target
from hookscope.errors import StoreError

__all__ = ["Rows", "to_hf_dataset"]

#: The generator of a data set's rows: ``(path, ((column, array name), ...))`` -> one dict per row.
#: The store's own (``hookscope._store.store``), which opens the store anew where datasets runs it.
Rows = Callable[[str, tuple[tuple[str, str], ...]], Iterator[dict[str, Any]]]


class _Exported(Protocol):
    """What the export reads of a :class:`~hookscope.Store`."""

    target: Target

    @property
    def sites(self) -> list[str]: ...

    def __getitem__(self, key: str) -> StoreArray: ...

    def keeps(self, name: str) -> bool: ...

    def column(self, name: str) -> StoreArray: ...


def to_hf_dataset(
    store: _Exported,
    rows: Rows,
    sites: Sequence[str] | None = None,
    *,
    provenance: bool = True,
    cache_dir: str | None = None,
) -> Any:
    """``store``'s rows as a ``datasets.Dataset`` (see :meth:`Store.to_hf_dataset`), made by ``rows``."""
    datasets = require("datasets", purpose="to_hf_dataset()", extra="datasets")
    if store.target.path is None:
        raise StoreError("to_hf_dataset reads a store by path; this store is not on a local path")
    columns = {store[key].name: store[key].name for key in (sites or store.sites)}
    if provenance:
        kept = {column: name for column, name in _HF_PROVENANCE.items() if store.keeps(name)}
        taken = sorted(set(kept) & set(columns))
        if taken:
            raise StoreError(
                f"site(s) {', '.join(map(repr, taken))} have the name of a provenance column; pass "
                "provenance=False (and read store.row_index, store.tokens yourself), or leave those sites out"
            )
        columns.update(kept)
    features = datasets.Features(
        {column: _hf_feature(datasets, store.column(name)) for column, name in columns.items()}
    )
    return datasets.Dataset.from_generator(  # a tuple: datasets would shard a list between workers
        rows,
        features=features,
        gen_kwargs={"path": str(store.target.path), "columns": tuple(columns.items())},
        cache_dir=cache_dir,
    )


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

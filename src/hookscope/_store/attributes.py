"""What a store's hookscope attributes say, checked against its arrays.

Read by :func:`~hookscope._store.store.open_store` before anything else, and by a resumed
extraction: a store whose attributes contradict its arrays is refused before a read allocates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hookscope._shared.credentials import scrub
from hookscope._store.layout import Layout, SiteLayout
from hookscope._store.manifest import MANIFEST_GROUP, Manifest
from hookscope.errors import StoreError

__all__ = ["checked_layout", "stored_layout"]


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


def checked_layout(label: str, group: Any, meta: dict[str, Any], secrets: Sequence[str] = ()) -> Layout:
    """:func:`stored_layout`, with each array checked against it: present, its dtype, its row
    shape, its chunking and (a store that knows it) its number of rows. ``secrets`` are the
    store's, left out of the file system's error a message quotes."""
    layout = stored_layout(meta, label)
    complete = meta.get("state") == "complete"
    if complete and layout.rows is None:
        raise StoreError(f"store {label!r} says it is complete but not how many rows it holds; it is damaged")
    for site in layout.arrays:
        try:
            array = group[site.name]
            shape, chunks, dtype = tuple(array.shape), tuple(array.chunks), np.dtype(array.dtype)
        except Exception as error:
            said = scrub(f"{type(error).__name__}: {error}", secrets)
            raise StoreError(
                f"array {site.name!r} of store {label!r} cannot be opened ({said}); the "
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


def _whole(value: object, *, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least

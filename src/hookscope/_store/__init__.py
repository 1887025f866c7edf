"""The feature store: an on-disk format and its readers, which never touch a model.

A store is one zarr v3 group (``zarr_io`` makes it and reads its attributes, ``fsspec_store``
reaches one at a URL): one array per site laid out by ``layout``, the provenance arrays named by
``provenance``, and a ``manifest`` of finished chunks with their ``checksums`` and their part of
each site's ``running_stats``; ``writer_record`` (with ``object_record`` on object storage) says
who writes it now. Readers: ``store`` (``open_store``, ``Store``), ``array`` (``StoreArray``),
``attributes`` (the attributes checked against the arrays), ``statistics`` (merged from the
manifest), ``verify`` (chunks against their checksums), ``loader`` (``StoreLoader``, shuffled
batches for training) and ``export`` (a Hugging Face data set).

The writing side (``zarr_io``, ``manifest``, ``checksums``, ``running_stats``,
``writer_record``) imports none of the readers. ``hookscope._extract`` runs a model over data and
writes through what this package root exports.
"""

from hookscope._store.array import StoreArray
from hookscope._store.attributes import stored_layout
from hookscope._store.checksums import InputDigests, combine, crc32c, regions, text_crc
from hookscope._store.layout import Layout, SiteLayout, array_names, choose_chunk_rows
from hookscope._store.loader import StoreLoader
from hookscope._store.manifest import Manifest, stats_widths
from hookscope._store.provenance import INDEX, MASK, TOKENS, provenance_array
from hookscope._store.running_stats import SiteStats, chunk_part, vectors_of
from hookscope._store.statistics import merged_stats
from hookscope._store.store import Store, open_store
from hookscope._store.verify import damaged_chunks, describe
from hookscope._store.writer_record import StoreHold
from hookscope._store.zarr_io import (
    FORMAT,
    Target,
    check_only_ours,
    clear,
    create_store,
    open_group,
    read_meta,
    remove_partial_files,
    target_of,
    write_meta,
    zarr_module,
)

__all__ = [
    "FORMAT",
    "INDEX",
    "MASK",
    "TOKENS",
    "InputDigests",
    "Layout",
    "Manifest",
    "SiteLayout",
    "SiteStats",
    "Store",
    "StoreArray",
    "StoreHold",
    "StoreLoader",
    "Target",
    "array_names",
    "check_only_ours",
    "choose_chunk_rows",
    "chunk_part",
    "clear",
    "combine",
    "crc32c",
    "create_store",
    "damaged_chunks",
    "describe",
    "merged_stats",
    "open_group",
    "open_store",
    "provenance_array",
    "read_meta",
    "regions",
    "remove_partial_files",
    "stats_widths",
    "stored_layout",
    "target_of",
    "text_crc",
    "vectors_of",
    "write_meta",
    "zarr_module",
]

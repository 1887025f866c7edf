"""Checking what a store holds against its manifest's checksums.

Two questions, asked before a resumed run writes anything and by ``open_store(verify=True)``:

- are the chunks recorded as done still what was written? Each site's chunk is read (zarr
  checks the CRC32C of the compressed bytes as it reads) and its values' CRC32C compared with the
  manifest's; a chunk file that is gone counts as damaged too, since zarr would read it as zeros;
- is the data the same? The input rows of each done chunk are read again (the model does not
  run) and their checksum compared with the one recorded when the chunk was written.

Damaged chunks are written again by a resumed run; input rows that differ are refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hookscope._extract.checksums import InputDigests, crc32c, input_parts, regions
from hookscope._extract.data import Batch
from hookscope._extract.layout import Layout, SiteLayout
from hookscope._extract.zarr_io import Manifest, zarr_module
from hookscope.errors import DataError

__all__ = [
    "Damage",
    "InputCheck",
    "check_input_rows",
    "damaged_chunks",
    "data_changed",
    "describe",
    "missing_chunk",
    "present_chunks",
]


@dataclass(frozen=True)
class Damage:
    """One site's chunk that is not what was written, and why."""

    array: str
    chunk: int
    rows: range
    reason: str

    def __str__(self) -> str:
        return f"chunk {self.chunk} (rows {self.rows.start}..{self.rows.stop - 1}) of {self.array!r}: {self.reason}"


def describe(damage: Sequence[Damage], limit: int = 3) -> str:
    """The first ``limit`` damaged chunks, one clause each, and how many more."""
    shown = "; ".join(str(found) for found in damage[:limit])
    return shown + (f"; and {len(damage) - limit} more" if len(damage) > limit else "")


def missing_chunk(array: Any, chunk: int) -> bool:
    """True when the file (or object) of row-chunk ``chunk`` of ``array`` is not there."""
    key = array.metadata.encode_chunk_key((chunk, *([0] * (array.ndim - 1))))
    return not zarr_module().core.sync.sync(array.store_path.store.exists(f"{array.store_path.path}/{key}"))


def present_chunks(array: Any) -> set[int]:
    """The row-chunks of ``array`` that have a file (or object): one listing of the array."""
    zarr = zarr_module()
    prefix = f"{array.store_path.path}/c/"

    async def listed() -> list[str]:
        return [key async for key in array.store_path.store.list_prefix(prefix)]

    found = set()
    for key in zarr.core.sync.sync(listed()):
        first = key[len(prefix) :].split("/", 1)[0]
        if first.isdigit():
            found.add(int(first))
    return found


def damaged_chunks(
    group: Any,
    sites: Sequence[SiteLayout],
    manifest: Manifest,
    chunks: Iterable[int],
    chunk_rows: int,
    *,
    checks_files: bool = True,
) -> list[Damage]:
    """The site chunks among ``chunks`` that are not what the manifest says was written.

    ``checks_files=False`` for a store of format 1, which wrote no file for an all-zero chunk:
    there only what reads can be checked.
    """
    found = []
    arrays = [(site, group[site.name]) for site in sites]
    for chunk in chunks:
        _, digests = manifest.digests_of(chunk)
        for index, (site, array) in enumerate(arrays):
            first = chunk * chunk_rows
            rows = range(first, min(first + chunk_rows, array.shape[0]))
            digest = digests[index] if index < len(digests) else None
            reason = _check_one(array, chunk, rows, digest, checks_files=checks_files)
            if reason is not None:
                found.append(Damage(site.name, chunk, rows, reason))
    return found


def _check_one(array: Any, chunk: int, rows: range, digest: int | None, *, checks_files: bool) -> str | None:
    if len(rows) == 0:
        return "the array holds none of its rows"
    if checks_files and missing_chunk(array, chunk):
        return "its file is gone"
    try:
        values = np.asarray(array[rows.start : rows.stop])
    except Exception as error:  # the CRC32C zarr checks, or a codec that cannot decode
        return f"it cannot be read ({type(error).__name__}: {error})"
    if digest is not None and crc32c(values) != digest:
        return "its values differ from those written (checksum)"
    return None


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

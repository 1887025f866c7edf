"""Checking what a store holds against its manifest's checksums.

Two questions, asked before a resumed run writes anything and by ``open_store(verify=True)``:

- are the chunks recorded as done still what was written? Each site's chunk is read (zarr
  checks the CRC32C of the compressed bytes as it reads) and its values' CRC32C compared with the
  manifest's; a chunk file that is gone counts as damaged too, since zarr would read it as zeros;
- is the data the same? The input rows of each done chunk are read again (the model does not
  run) and their checksum compared with the one recorded when the chunk was written (the
  extraction asks that one: ``hookscope._extract.inputs``).

Damaged chunks are written again by a resumed run; input rows that differ are refused.

A chunk that fails to read is damaged only when its bytes were fetched and zarr cannot decode
them (:func:`read_fault`). A failure to fetch them (the network, credentials, a timeout, a forked
process's stale connection) says nothing of the chunk: it is a ``StoreReadError``, and a check
stops there rather than mark healthy chunks for writing again.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from hookscope._shared.credentials import scrub
from hookscope._store.checksums import crc32c
from hookscope._store.layout import SiteLayout
from hookscope._store.manifest import Manifest
from hookscope._store.zarr_io import zarr_module
from hookscope.errors import HookscopeError, StoreError, StoreReadError

__all__ = [
    "Damage",
    "damaged_chunks",
    "damaged_error",
    "describe",
    "missing_chunk",
    "present_chunks",
    "reaching",
    "read_fault",
    "unreadable_error",
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


def _chunk_key(array: Any, chunk: int) -> str:
    """The store key of row-chunk ``chunk`` of ``array``."""
    key = array.metadata.encode_chunk_key((chunk, *([0] * (array.ndim - 1))))
    return f"{array.store_path.path}/{key}"


def missing_chunk(array: Any, chunk: int) -> bool:
    """True when the file (or object) of row-chunk ``chunk`` of ``array`` is not there."""
    return not zarr_module().core.sync.sync(array.store_path.store.exists(_chunk_key(array, chunk)))


def read_fault(array: Any, chunk: int, error: BaseException) -> tuple[bool, str]:
    """Why row-chunk ``chunk`` of ``array`` failed to read with ``error``: ``(damaged, reason)``.

    Told apart by fetching the chunk's stored bytes apart from decoding them: bytes that cannot
    be fetched are a failure on the way (``damaged`` False: the network, credentials, a timeout,
    the disk); bytes fetched that zarr then cannot decode (its CRC32C, the codec) are damage. A
    chunk that reads at the second try failed on the way too. Only on an error path.
    """
    zarr = zarr_module()
    try:
        zarr.core.sync.sync(
            array.store_path.store.get(_chunk_key(array, chunk), prototype=zarr.core.buffer.default_buffer_prototype())
        )
    except Exception as fetched:
        return False, f"{type(fetched).__name__}: {fetched}"
    step = array.chunks[0]
    try:
        array[chunk * step : (chunk + 1) * step]
    except Exception as decoded:
        if _on_the_way(decoded):
            return False, f"{type(decoded).__name__}: {decoded}"
        return True, f"it cannot be read ({type(decoded).__name__}: {decoded})"
    return False, f"{type(error).__name__}: {error} (it read at a second try)"


#: Packages whose errors are about reaching a store, never about what it holds.
_TRANSPORT_PACKAGES = frozenset(
    {"botocore", "aiobotocore", "aiohttp", "urllib3", "requests", "httpx", "google", "azure"}
)


def _on_the_way(error: BaseException) -> bool:
    """True for an error of reaching the store: a system or network error, or one it was raised from.

    Only causes count (``raise ... from``), not an error being handled meanwhile, which may be
    hookscope's own (a ``StoreError`` is an ``OSError`` too).
    """
    seen: BaseException | None = error
    for _ in range(8):  # a cause's cause, not round a loop
        if seen is None or isinstance(seen, HookscopeError):
            return False
        if isinstance(seen, OSError) or type(seen).__module__.split(".")[0] in _TRANSPORT_PACKAGES:
            return True
        seen = seen.__cause__
    return False


@contextmanager
def reaching(label: str, what: str, secrets: Sequence[str] = ()) -> Iterator[None]:
    """Turn a failure to reach the store at ``label`` while ``what`` into a ``StoreReadError``
    (other errors pass as they are): opening an array or the manifest reads their metadata."""
    try:
        yield
    except HookscopeError:
        raise
    except Exception as error:
        if not _on_the_way(error):
            raise
        said = scrub(f"{type(error).__name__}: {error}", secrets)
        raise StoreReadError(
            f"store {label!r} could not be reached while {what} ({said}); the store is not known to be damaged: "
            "check that it can be reached (the endpoint, the credentials, the network) and try again"
        ) from error


def _rows_text(rows: range) -> str:
    return f"rows {rows.start}..{rows.stop - 1}"


def damaged_error(name: str, chunk: int, rows: range, reason: str) -> StoreError:
    """The error for a chunk whose stored bytes are not what was written."""
    return StoreError(
        f"chunk {chunk} ({_rows_text(rows)}) of {name!r} is damaged: {reason}; run the same extraction again, which "
        "checks every chunk and writes the damaged ones again (hs.open_store(path, verify=True) lists them all)",
        array=name,
        chunk=chunk,
    )


def unreadable_error(name: str, chunk: int, rows: range, reason: str, secrets: Sequence[str] = ()) -> StoreReadError:
    """The error for a chunk whose bytes could not be fetched: nothing is known to be wrong with it."""
    return StoreReadError(
        f"chunk {chunk} ({_rows_text(rows)}) of {name!r} could not be fetched ({scrub(reason, secrets)}); the store "
        "is not known to be damaged: check that it can be reached (the endpoint, the credentials, the network) and "
        "read again",
        array=name,
        chunk=chunk,
    )


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
    secrets: Sequence[str] = (),
) -> list[Damage]:
    """The site chunks among ``chunks`` that are not what the manifest says was written.

    ``checks_files=False`` for a store of format 1, which wrote no file for an all-zero chunk:
    there only what reads can be checked. A ``StoreReadError`` (and nothing marked) where a chunk
    cannot be fetched, ``secrets`` left out of its message.
    """
    found = []
    arrays = [(site, group[site.name]) for site in sites]
    for chunk in chunks:
        _, digests = manifest.digests_of(chunk)
        for index, (site, array) in enumerate(arrays):
            first = chunk * chunk_rows
            rows = range(first, min(first + chunk_rows, array.shape[0]))
            digest = digests[index] if index < len(digests) else None
            reason = _check_one(site.name, array, chunk, rows, digest, checks_files=checks_files, secrets=secrets)
            if reason is not None:
                found.append(Damage(site.name, chunk, rows, scrub(reason, secrets)))
    return found


def _check_one(
    name: str, array: Any, chunk: int, rows: range, digest: int | None, *, checks_files: bool, secrets: Sequence[str]
) -> str | None:
    if len(rows) == 0:
        return "the array holds none of its rows"
    if checks_files and missing_chunk(array, chunk):
        return "its file is gone"
    try:
        values = np.asarray(array[rows.start : rows.stop])
    except Exception as error:  # the CRC32C zarr checks, a codec that cannot decode, or the way there
        damaged, reason = read_fault(array, chunk, error)
        if not damaged:
            raise unreadable_error(name, chunk, rows, reason, secrets) from error
        return reason
    if digest is not None and crc32c(values) != digest:
        return "its values differ from those written (checksum)"
    return None

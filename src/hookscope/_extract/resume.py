"""What a store was made with, read back by a run that resumes, repeats or replaces it.

Before anything is written, a run reads what ``out`` holds (a new store, one to resume, or a
refusal), compares the configuration key by key (every difference named) and checks its
share of the done chunks against their checksums, marking damaged ones to be written again.
"""

from __future__ import annotations

import platform
import shlex
import sys
import warnings
from typing import Any

import numpy as np
import torch

from hookscope._capture import CaptureOptions
from hookscope._extract.config import differences
from hookscope._extract.data import IndexedSource, Source
from hookscope._extract.inputs import check_input_rows
from hookscope._extract.ranks import Ranks
from hookscope._shared.credentials import redacted_command
from hookscope._store import (
    FORMAT,
    Layout,
    Manifest,
    Target,
    check_only_ours,
    damaged_chunks,
    describe,
    open_group,
    read_meta,
    stored_layout,
    write_meta,
)
from hookscope._version import __version__
from hookscope.errors import SpecError, StoreError, StoreRepairWarning

__all__ = ["check_stored", "existing_meta", "reopen_if_repaired", "reusable_chunk_rows", "same_config", "store_meta"]


def existing_meta(target: Target, *, resume: bool, overwrite: bool) -> dict[str, Any] | None:
    """The stored hookscope attributes to resume, or None for a new store (after checks)."""
    meta = read_meta(target)
    if meta is None:
        return None
    if overwrite:
        check_only_ours(target, meta)  # refused before anything runs, and before anything is deleted
    if meta == {}:
        if overwrite:
            return None
        raise StoreError(
            f"out {target.label!r} is a zarr store that hookscope did not make; choose another path, or "
            "overwrite=True (--overwrite) to replace it"
        )
    if overwrite or meta.get("state") == "creating":  # 'creating': cut short before any data
        return None
    if not resume:
        raise StoreError(
            f"out {target.label!r} already holds a feature store ({meta.get('state')}); resume=True continues "
            "it, overwrite=True (--overwrite) replaces it, or choose another path"
        )
    if meta.get("format") != FORMAT and meta.get("state") == "complete":
        raise StoreError(
            f"out {target.label!r} is a complete store of format {meta.get('format')!r}, made by an older "
            f"hookscope: read it with hs.open_store(path); this hookscope (format {FORMAT}) can neither check nor "
            "continue it: overwrite=True (--overwrite) makes it anew"
        )
    if meta.get("format") != FORMAT:  # a format-1 store has no checksums to resume against
        raise StoreError(
            f"out {target.label!r} is a store of format {meta.get('format')!r}; this hookscope writes format "
            f"{FORMAT}: overwrite=True replaces it"
        )
    return meta


def check_stored(target: Target, source: Source, ranks: Ranks, meta: dict[str, Any], *, repair: bool) -> None:
    """Check this rank's share of the done chunks against their checksums (see ``hookscope._store.verify``).

    Damaged chunks are marked not done, with a :class:`~hookscope.errors.StoreRepairWarning`,
    so that this run writes them again (rank 0 then reopens a complete store); where the
    store cannot be written (``repair=False``: a complete store on a read-only mount) they
    are a ``StoreError``. Input rows that differ from those recorded raise
    :class:`~hookscope.errors.DataError`.
    """
    group = open_group(target, writable=True)
    manifest = Manifest(group)
    done = manifest.done()
    stored = stored_layout(meta)
    mine = sorted(done)[ranks.rank :: ranks.world_size]
    damage = damaged_chunks(group, stored.arrays, manifest, mine, stored.chunk_rows, secrets=target.secrets)
    broken = sorted({found.chunk for found in damage})
    if isinstance(source, IndexedSource):
        intact = [chunk for chunk in mine if chunk not in broken]
        check_input_rows(stored, manifest, source.batches([stored.span(chunk) for chunk in intact]))
    if not broken:
        return
    if not repair:
        raise StoreError(
            f"{target.label}: {len(broken)} stored chunk(s) are damaged: {describe(damage)}; the store cannot "
            "be written here (read-only), so they cannot be written again: run where it is writable",
            array=damage[0].array,
            chunk=damage[0].chunk,
        )
    manifest.unmark(broken)
    warnings.warn(
        f"{target.label}: {len(broken)} stored chunk(s) are damaged and are written again: {describe(damage)}",
        StoreRepairWarning,
        stacklevel=2,
    )


def reopen_if_repaired(target: Target, meta: dict[str, Any]) -> None:
    """A complete store some of whose chunks the check unmarked becomes a store being written
    (rank 0 alone writes attributes)."""
    group = open_group(target, writable=True)
    chunks = meta.get("chunks")
    if isinstance(chunks, int) and len(Manifest(group).done()) < chunks:
        write_meta(group, {**meta, "state": "writing"})


def reusable_chunk_rows(existing: dict[str, Any] | None, batch_size: int) -> int | None:
    """The stored chunking, to resume with, when it still fits the batch (else the default, and a difference)."""
    stored = existing["config"].get("chunk_rows") if existing else None
    return stored if isinstance(stored, int) and stored % batch_size == 0 else None


def store_meta(config: dict[str, Any], layout: Layout, command: str | None) -> dict[str, Any]:
    import zarr

    return {
        "format": FORMAT,
        "state": "writing",
        "rows": layout.rows,
        "chunks": layout.chunks,
        "config": config,
        "sites": [site.to_json() for site in layout.sites],
        "provenance": [array.to_json() for array in layout.extras],
        "versions": {
            "hookscope": __version__,
            "torch": torch.__version__,
            "zarr": zarr.__version__,
            "numpy": np.__version__,
            "python": platform.python_version(),
        },
        "command": redacted_command(command if command is not None else shlex.join(sys.argv)),
    }


def same_config(target: Target, stored: dict[str, Any], wanted: dict[str, Any]) -> None:
    """Raise ``StoreError`` naming every difference between the stored and the wanted configuration."""

    def comparable(meta: dict[str, Any]) -> dict[str, Any]:
        sites = {site["name"]: _site_text(site) for site in meta.get("sites", [])}
        # a store made before provenance kept no tokens: resumed with the default, it keeps none still
        return _capture_spelled({"tokens": "auto", **meta.get("config", {}), "sites": sites})

    found = differences(comparable(stored), comparable(wanted))
    if found:
        raise StoreError(
            f"out {target.label!r} was made with another configuration, so its rows cannot be continued: "
            + "; ".join(found)
            + "; run with the stored configuration to resume, overwrite=True (--overwrite) to start again, "
            "or choose another path"
        )


def _capture_spelled(config: dict[str, Any]) -> dict[str, Any]:
    """``keep`` and ``calls`` in the one spelling a capture gives them: a store written before the
    extraction held its capture's options recorded them as given (``[2, 0]``, not ``[0, 2]``)."""
    try:
        spelled = CaptureOptions(keep=config.get("keep", "output"), calls=config.get("calls", "all")).to_dict()
    except SpecError:
        return config  # a value no capture takes: compared as it is
    return {**config, **{key: spelled[key] for key in ("keep", "calls") if key in config}}


def _site_text(site: dict[str, Any]) -> str:
    """``"h.0#0:output (N, 768) float32 reduce=mean:1"``: one stored site, as a difference shows it."""
    shape = "".join(f", {n}" for n in site.get("shape", []))
    reduce = f" reduce={site['reduce']}" if site.get("reduce") else ""
    sparse = f" sparse={site['sparse']}" if site.get("sparse") else ""  # before the long reduce text
    return f"{site.get('site')} (N{shape}) {site.get('dtype')}{sparse}{reduce}"

"""The manifest of a store: which chunks have landed, their checksums and their statistics.

A subgroup ``_hookscope`` of the store's group holds it: ``done`` (one element per chunk, 1 once
every array's chunk has landed), ``digests`` (the CRC32Cs of each chunk's input rows and stored
bytes) and ``stats/<array>`` (each chunk's part of a site's running statistics). One element
file per chunk in each, so each process writes only its own. It is not inferred from the
presence of chunk files: zarr writes no file for a chunk that holds only its fill value.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hookscope._store.layout import Layout
from hookscope._store.running_stats import part_width

__all__ = ["MANIFEST_GROUP", "STATS_GROUP", "WRITER_RECORD", "Manifest", "stats_widths"]

MANIFEST_GROUP = "_hookscope"
WRITER_RECORD = "writer.json"  # in MANIFEST_GROUP: who writes the store now (see hookscope._store.writer_record)
STATS_GROUP = "stats"  # in MANIFEST_GROUP: each site's statistics per chunk (see hookscope._store.running_stats)


def stats_widths(layout: Layout) -> dict[str, int]:
    """The sites whose running statistics a store keeps (floating values), and the width of a chunk's part."""
    return {
        site.name: part_width(site.shape)
        for site in layout.sites
        if site.torch_dtype.is_floating_point and site.sparse is None
    }


class Manifest:
    """Which chunks have landed, their checksums, and their statistics.

    ``done[c] == 1`` once every array's chunk ``c`` is written. ``digests[c]`` holds, for that
    chunk, the CRC32C of the input rows that made it (column 0) and of each array's stored bytes
    (columns 1..: the sites', then the provenance arrays'), written just before ``done[c]``; -1
    where none was recorded (a store of format 1). ``stats/<array>[c]`` holds the chunk's part of
    a site's running statistics (see ``running_stats``). One element file per chunk in each, so
    each process writes only its own.
    """

    def __init__(self, group: Any) -> None:
        self.group = group
        self.array = group.get(f"{MANIFEST_GROUP}/done")  # None in a store cut short while being made
        self.digests = group.get(f"{MANIFEST_GROUP}/digests")  # None in a store of format 1
        self._stats: dict[str, Any] = {}

    @staticmethod
    def create(group: Any, chunks: int, arrays: int, stats: dict[str, int] | None = None) -> None:
        holder = group.require_group(MANIFEST_GROUP)  # its folder may exist already: it holds the writer record
        holder.create_array("done", shape=(chunks,), chunks=(1,), dtype="uint8", fill_value=0, compressors=None)
        holder.create_array(
            "digests",
            shape=(chunks, arrays + 1),
            chunks=(1, arrays + 1),
            dtype="int64",
            fill_value=-1,
            compressors=None,
        )
        for name, width in (stats or {}).items():
            holder.create_array(
                f"{STATS_GROUP}/{name}",
                shape=(chunks, width),
                chunks=(1, width),
                dtype="float64",
                fill_value=float("nan"),
                compressors=None,
            )

    def stats_array(self, name: str) -> Any:
        """The per-chunk statistics of array ``name``; None where the store keeps none."""
        if name not in self._stats:
            self._stats[name] = self.group.get(f"{MANIFEST_GROUP}/{STATS_GROUP}/{name}")
        return self._stats[name]

    def done(self) -> set[int]:
        """The chunks recorded as done; an element that cannot be read counts as not done."""
        if self.array is None:
            return set()
        try:
            flags = np.asarray(self.array[:])
        except Exception:  # a torn element file: read one by one, and trust only what reads back as 1
            return {c for c in range(self.array.shape[0]) if self._readable_flag(c)}
        return {int(c) for c in np.flatnonzero(flags == 1)}

    def _readable_flag(self, chunk: int) -> bool:
        try:
            return bool(self.array[chunk] == 1)
        except Exception:
            return False

    def digests_of(self, chunk: int) -> tuple[int | None, list[int | None]]:
        """``(inputs, [site, ...])`` recorded for ``chunk``; None for each one not recorded."""
        if self.digests is None or chunk >= self.digests.shape[0]:
            return None, []
        try:
            row = [int(v) for v in np.asarray(self.digests[chunk])]
        except Exception:
            return None, []
        known = [v if v >= 0 else None for v in row]
        return known[0], known[1:]

    def mark(
        self, chunk: int, digests: tuple[int, list[int]] | None = None, stats: dict[str, np.ndarray] | None = None
    ) -> None:
        """Record ``chunk`` as done, after its ``(inputs, [array, ...])`` checksums and its sites'
        statistics; grows the manifest for a stream whose length is not known."""
        assert self.array is not None, "the manifest is made with the store"
        for name, part in (stats or {}).items():
            found = self.stats_array(name)
            if found is None:
                continue
            if chunk >= found.shape[0]:
                found.resize((chunk + 1, found.shape[1]))
            found[chunk] = part
        if chunk >= self.array.shape[0]:
            self.array.resize((chunk + 1,))
        if digests is not None and self.digests is not None:
            if chunk >= self.digests.shape[0]:
                self.digests.resize((chunk + 1, self.digests.shape[1]))
            inputs, values = digests
            self.digests[chunk] = np.array([inputs, *values], dtype=np.int64)
        self.array[chunk] = 1

    def unmark(self, chunks: list[int]) -> None:
        """Record ``chunks`` as not done (found damaged): the next run writes them again."""
        assert self.array is not None, "the manifest is made with the store"
        for chunk in chunks:
            self.array[chunk] = 0

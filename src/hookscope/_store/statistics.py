"""A store's statistics over its chunks, merged from the manifest's per-chunk parts.

The parts are written with each chunk (``hookscope._store.running_stats``), so statistics over
any set of chunks cost one small read of the manifest, never a pass over the data.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from hookscope._store.layout import Layout
from hookscope._store.manifest import Manifest
from hookscope._store.running_stats import SiteStats, chunk_part, features, merge, summary

__all__ = ["merged_stats"]


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

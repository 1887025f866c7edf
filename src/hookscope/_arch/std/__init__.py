"""Canonical names: one set of site names across transformer architectures (``"std:..."``).

:func:`~hookscope._arch.std.registry.std_map` resolves them on a model from a family table
(:mod:`~hookscope._arch.std.families`) or the structural detector
(:mod:`~hookscope._arch.std.detect`), checked on one forward
(:mod:`~hookscope._arch.std.resolve`); :func:`~hookscope._arch.std.registry.expand_std` turns
``"std:"`` selectors into the site selectors every feature already takes.
"""

from hookscope._arch.std.registry import (
    CanonicalSource,
    canonical_source,
    expand_std,
    kept_std_map,
    known_std_map,
    select_std,
    std_map,
    stream_modules,
)
from hookscope._core.std_names import STD_PREFIX, StdMap, StdSite, is_std_selector

__all__ = [
    "STD_PREFIX",
    "CanonicalSource",
    "StdMap",
    "StdSite",
    "canonical_source",
    "expand_std",
    "is_std_selector",
    "kept_std_map",
    "known_std_map",
    "select_std",
    "std_map",
    "stream_modules",
]

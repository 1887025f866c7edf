"""Thinning a long list of sites to a few, evenly spread: what plots and the report draw of a deep model.

>>> spread(list(range(10)), 4)
[0, 3, 6, 9]
"""

from __future__ import annotations

from typing import Any

from hookscope.errors import SpecError

__all__ = ["DEFAULT_MAX_SITES", "spread"]

#: How many sites a histogram grid or a feature-map section draws unless told otherwise.
DEFAULT_MAX_SITES = 16


def spread(items: list[Any], limit: int) -> list[Any]:
    """At most ``limit`` of ``items``, evenly spread from the first to the last (both kept)."""
    if limit < 1:
        raise SpecError(f"max_sites={limit}; expected at least 1")
    if len(items) <= limit:
        return items
    if limit == 1:
        return items[:1]
    picks = sorted({round(i * (len(items) - 1) / (limit - 1)) for i in range(limit)})
    return [items[i] for i in picks]

"""``Cache.stack``: the values of many sites as one tensor with a labelled first axis.

A study reads "every layer's residual stream" as one tensor; stacking by pattern saves the loop
and keeps the labels beside the values, so index ``i`` of the tensor always says which site it is.
"""

from __future__ import annotations

import fnmatch
from typing import Any, NamedTuple, Protocol

import torch

from hookscope._core.sites import Site
from hookscope._core.std_names import STD_PREFIX, is_std_selector, std_pattern
from hookscope.errors import SiteNotFoundError, SpecError

__all__ = ["Stacked", "stack"]


class Stacked(NamedTuple):
    """One tensor with a labelled first axis: ``tensor[i]`` is the value of ``labels[i]``.

    >>> values, labels = Stacked(torch.zeros(2, 3), ["a", "b"])
    >>> values.shape, labels
    (torch.Size([2, 3]), ['a', 'b'])
    """

    tensor: torch.Tensor
    labels: list[str]


class _Values(Protocol):
    """What stacking reads of a cache."""

    meta: dict[str, Any]

    def __getitem__(self, key: str | Site) -> torch.Tensor: ...

    def short_names(self) -> dict[Site, str]: ...

    def std_names(self, pattern: str) -> list[str]: ...


def stack(cache: _Values, pattern: str) -> Stacked:
    """The values whose names match ``pattern``, stacked in capture order (canonical names: map order).

    ``pattern`` is a canonical pattern (``"std:blocks.*.resid_post"``, labels are canonical
    names) or a glob over the cache's short names (``"transformer.h.*"``, ``"h.*#1:output"``).
    """
    if not isinstance(pattern, str):
        raise SpecError(f"stack({pattern!r}): expected a pattern such as 'std:blocks.*.resid_post' or 'h.*'")
    if is_std_selector(pattern):
        labels = cache.std_names(std_pattern(pattern))
        values = [cache[STD_PREFIX + name] for name in labels]
    else:
        named = [(name, site) for site, name in cache.short_names().items() if fnmatch.fnmatchcase(name, pattern)]
        labels = [name for name, _ in named]
        values = [cache[site] for _, site in named]
    if not values:
        shown = ", ".join(list(cache.short_names().values())[:8]) or "nothing"
        raise SiteNotFoundError(f"stack({pattern!r}) matched no captured value; the cache holds {shown}", key=pattern)
    shapes = sorted({tuple(value.shape) for value in values})
    if len(shapes) > 1:
        raise SpecError(
            f"stack({pattern!r}): the values have different shapes {shapes}; stack sites of one shape "
            "(a narrower pattern, or reduce them when capturing)"
        )
    return Stacked(torch.stack(values), labels)

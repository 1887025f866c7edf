"""Metric names that never merge: one spelling per thing named, the same at every step.

Two different things can ask for one spelling: a module named ``fc#1`` and the second call of
``fc`` (both ``fc#1``), or ``x+1`` and ``x_1`` once a sink that refuses ``+`` (MLflow) has
cleaned them. A sink or dashboard given the same name twice keeps one value and drops the other
without a word. :class:`UniqueLabels` gives each key (a module call, a metric name) the spelling
it asks for unless another key holds it, then the first free ``spelling<mark>2``,
``spelling<mark>3``, ...; a key keeps its spelling for the life of the object, so a metric is
named alike at every step.

>>> labels = UniqueLabels(mark="~")
>>> labels.claim("module fc#1", "fc#1")
'fc#1'
>>> labels.claim("call 1 of fc", "fc#1"), labels.claim("call 1 of fc", "fc#1")
('fc#1~2', 'fc#1~2')
>>> labels.renamed
{'call 1 of fc': 'fc#1~2'}
"""

from __future__ import annotations

from collections.abc import Hashable

__all__ = ["UniqueLabels"]


class UniqueLabels:
    """Keys to spellings, injective and stable; ``mark`` joins a taken spelling and its number."""

    def __init__(self, *, mark: str) -> None:
        self._mark = mark
        self._given: dict[Hashable, str] = {}
        self._taken: set[str] = set()
        self._renamed: dict[Hashable, str] = {}

    def claim(self, key: Hashable, spelling: str) -> str:
        """The spelling of ``key``: the one asked for when free (or already its own), else numbered."""
        known = self._given.get(key)
        if known is not None:
            return known
        chosen, number = spelling, 2
        while chosen in self._taken:
            chosen = f"{spelling}{self._mark}{number}"
            number += 1
        self._given[key] = chosen
        self._taken.add(chosen)
        if chosen != spelling:
            self._renamed[key] = chosen
        return chosen

    @property
    def renamed(self) -> dict[Hashable, str]:
        """The keys that did not get the spelling they asked for, and the spelling they got."""
        return dict(self._renamed)

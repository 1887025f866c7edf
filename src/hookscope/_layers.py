"""``layers()``: every module a selector can name, with its class, parameters and calls.

The table answers the first question before hooking anything: what is this model called
inside? Given a sample input it also runs one forward pass and counts how often each module
ran, which shows shared modules (called twice), loops, and modules that never run at all.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from typing import Any, NamedTuple, overload

import torch
from torch import nn

from hookscope._core.attach import HookGroup
from hookscope._core.compat.offload import ensure_loaded
from hookscope._core.names import ROOT_LABEL, module_label, named_modules
from hookscope._core.params import count, own_count
from hookscope._core.select import ensure_module
from hookscope._core.sites import CallTracker
from hookscope._shared.tables import Column, Table
from hookscope.errors import SiteNotFoundError

__all__ = ["Layer", "LayerTable", "layers"]


class Layer(NamedTuple):
    """One module: its dotted name (``""`` for the root), class, own parameters, calls."""

    name: str
    class_name: str
    params: int
    calls: int | None
    depth: int


class LayerTable:
    """The modules of a model, in ``named_modules()`` order; prints as an aligned table.

    Iterating yields :class:`Layer` rows; ``table["layer1.conv1"]`` looks one up by name.
    ``params`` counts a module's own parameters (not its children's); the footer's total counts
    each parameter tensor once, so weights tied between two modules are not counted twice.
    """

    def __init__(self, rows: list[Layer], total_params: int, trainable_params: int) -> None:
        self.rows = rows
        self.total_params = total_params
        self.trainable_params = trainable_params
        self._by_name = {row.name: row for row in rows}

    @property
    def names(self) -> list[str]:
        """Every module name, in model order (the root's name is ``""``)."""
        return [row.name for row in self.rows]

    @property
    def has_calls(self) -> bool:
        """True when a sample input was run and the ``calls`` column is filled."""
        return bool(self.rows) and self.rows[0].calls is not None

    def __iter__(self) -> Iterator[Layer]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    @overload
    def __getitem__(self, key: int) -> Layer: ...
    @overload
    def __getitem__(self, key: str) -> Layer: ...
    def __getitem__(self, key: int | str) -> Layer:
        if isinstance(key, int):
            return self.rows[key]
        found = self._by_name.get("" if key == ROOT_LABEL else key)
        if found is None:
            close = difflib.get_close_matches(key, list(self._by_name), n=3, cutoff=0.6)
            hint = (
                f"did you mean {' or '.join(map(repr, close))}?" if close else "the names are the table's first column"
            )
            raise SiteNotFoundError(f"no module {key!r} in this table; {hint}", key=key, candidates=tuple(close))
        return found

    def _table(self) -> Table:
        """The rows as a :class:`~hookscope._shared.tables.Table`, the totals as its note."""
        own_sum = sum(row.params for row in self.rows)
        shared = (
            f" ({own_sum - self.total_params:,} counted under two names above)" if own_sum != self.total_params else ""
        )
        footer = (
            f"{len(self.rows)} modules · {self.total_params:,} parameters ({self.trainable_params:,} trainable){shared}"
        )
        if self.has_calls:
            unused = sum(1 for row in self.rows if row.calls == 0)
            footer += f" · {unused} modules not called" if unused else ""
        columns = [Column("name"), Column("class"), Column("params", "right")]
        table = Table(columns + ([Column("calls", "right")] if self.has_calls else []), notes=[footer])
        for row in self.rows:
            calls = [str(row.calls)] if self.has_calls else []
            table.add(module_label(row.name), row.class_name, f"{row.params:,}", *calls)
        return table

    def __str__(self) -> str:
        return self._table().text()

    def __repr__(self) -> str:
        return str(self)

    def _repr_html_(self) -> str:
        return self._table().html()


def layers(model: nn.Module, *example_args: Any, **example_kwargs: Any) -> LayerTable:
    """List every module of ``model``: dotted name, class, own parameter count, and calls.

    With a sample input (``layers(model, x)``, keyword inputs too) one forward pass runs in eval
    mode under ``torch.no_grad()`` -- so batch-norm statistics are not touched -- and the
    ``calls`` column shows how often each module ran in it. The model's modes are restored.

    Example::

        >>> import hookscope as hs
        >>> print(hs.layers(nn.Sequential(nn.Linear(4, 8), nn.ReLU())))
        name     class        params
        ────────────────────────────
        (root)   Sequential        0
        0        Linear           40
        1        ReLU              0
        3 modules · 40 parameters (40 trainable)
    """
    ensure_module(model)
    named = named_modules(model)
    calls = _count_calls(model, named, example_args, example_kwargs) if example_args or example_kwargs else None
    rows = [
        Layer(
            name,
            type(module).__name__,
            own_count(module),
            None if calls is None else calls.get(name, 0),
            name.count(".") + 1 if name else 0,
        )
        for name, module in named
    ]
    unique = list(model.parameters())
    return LayerTable(rows, count(unique), count(p for p in unique if p.requires_grad))


def _count_calls(
    model: nn.Module, named: list[tuple[str, nn.Module]], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, int]:
    ensure_loaded(model, (args, kwargs))  # a meta model: one line, not torch's device mismatch
    tracker = CallTracker()
    with HookGroup(model, [], owner="layers", tracker=tracker, count=named), torch.no_grad():
        model.eval()
        model(*args, **kwargs)
        return tracker.counts()

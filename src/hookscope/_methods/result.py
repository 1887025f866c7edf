"""``Effects``: a labelled grid of effects (site × position [× head]) that sweeps and attribution share.

One result type for the exact sweep and its linear estimate, so the two are compared cell by cell
(:meth:`Effects.compare`), drawn the same way (:meth:`Effects.plot`) and handed to pandas
(:meth:`Effects.to_pandas`) or xarray (:meth:`Effects.to_xarray`) with their labels.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from hookscope._shared.csv_text import csv_text
from hookscope._shared.files import write_text
from hookscope._shared.optional import require
from hookscope._shared.tables import Column, Table
from hookscope.errors import SpecError

__all__ = ["Disagreement", "Effects", "disagree"]


@dataclass(frozen=True)
class Disagreement:
    """A cell where an estimate and the exact patch part: opposite signs, or the estimate far off."""

    cell: tuple[str | int, ...]
    estimate: float
    exact: float

    def __str__(self) -> str:
        return f"{'/'.join(map(str, self.cell))}: estimate {self.estimate:+.3f}, patched {self.exact:+.3f}"


def disagree(estimate: float, patched: float, min_effect: float) -> bool:
    """An estimate and the exact patch of one cell part: opposite signs, and either moves the
    metric by at least ``min_effect``."""
    return max(abs(estimate), abs(patched)) >= min_effect and estimate * patched < 0


@dataclass
class Effects:
    """Effects of patching, labelled: ``effects.values[i, j]`` is site ``coords["site"][i]`` at
    position ``coords["position"][j]`` (and head ``coords["head"][k]`` when by head).

    ``values`` are normalised: ``(patched - corrupted) / (clean - corrupted)``, where ``clean``
    and ``corrupted`` are the metric on the unpatched runs (mean over rows), so 1 means the patch
    restores the clean behaviour and 0 means it changes nothing (when denoising: patching clean
    values into the corrupted run; when noising, 1 means nothing changed and 0 that the patch
    broke it entirely). ``raw`` is the metric itself (for an estimate: the estimated metric).

    >>> grid = Effects(torch.tensor([[0.0, 1.0]]), torch.tensor([[1.0, 3.0]]), ("site", "position"),
    ...                {"site": ["h.0"], "position": [0, 1]}, clean=3.0, corrupted=1.0, method="sweep")
    >>> grid.at("h.0", 1), grid.top(1)
    (1.0, [(('h.0', 1), 1.0)])
    """

    values: torch.Tensor
    raw: torch.Tensor
    dims: tuple[str, ...]
    coords: dict[str, list[Any]]
    clean: float
    corrupted: float
    method: str
    metric: str = "metric"
    direction: str = "denoise"
    sites: dict[str, str] = field(default_factory=dict)  # each row's label -> the site it was on this model
    #: An estimate's cells checked by an exact patch (``verify=``): labels -> normalised effect.
    verified: dict[tuple[Any, ...], float] = field(default_factory=dict)
    #: The checked cells where the estimate and the exact patch disagree in sign.
    flags: list[Disagreement] = field(default_factory=list)
    #: Patched forwards the result took (cells whose patch writes the value already there take none).
    forwards: int = 0

    # -- reading --------------------------------------------------------------------------------

    def at(self, *cell: Any) -> float:
        """The normalised effect of one cell, by labels: ``effects.at("blocks.3.resid_pre", 5)``
        (a canonical name may keep its ``std:``; positions are the ones swept, 0-based)."""
        return float(self.values[self._index(cell)])

    def _index(self, cell: tuple[Any, ...]) -> tuple[int, ...]:
        if len(cell) != len(self.dims):
            raise SpecError(f"a cell has {len(self.dims)} labels ({', '.join(self.dims)}), got {len(cell)}: {cell!r}")
        index = []
        for dim, label in zip(self.dims, cell, strict=True):
            labels = self.coords[dim]
            if dim == "site" and isinstance(label, str) and label.startswith("std:"):
                label = label[len("std:") :]
            if label not in labels:
                raise SpecError(f"{dim} {label!r} is not in this result; its {dim}s: {labels[:12]}")
            index.append(labels.index(label))
        return tuple(index)

    def cells(self) -> Iterator[tuple[tuple[Any, ...], float]]:
        """Every cell's labels and normalised effect, in order."""
        for flat, value in enumerate(self.values.reshape(-1).tolist()):
            yield self._labels(flat), value

    def _labels(self, flat: int) -> tuple[Any, ...]:
        index = []
        for size in reversed(self.values.shape):
            index.append(flat % size)
            flat //= size
        return tuple(self.coords[dim][i] for dim, i in zip(self.dims, reversed(index), strict=True))

    def top(self, k: int = 10) -> list[tuple[tuple[Any, ...], float]]:
        """The ``k`` cells of largest absolute effect, largest first (NaN cells last)."""
        flat = self.values.reshape(-1)
        order = flat.abs().nan_to_num(-1.0).argsort(descending=True)[:k].tolist()  # NaN last, and shown
        return [(self._labels(i), float(flat[i])) for i in order]

    def correlation(self, other: Effects) -> float:
        """Pearson correlation of two results' values over the same cells (an estimate against the sweep)."""
        a, b = self._same_cells(other)
        a, b = a - a.mean(), b - b.mean()
        denominator = float(a.norm() * b.norm())
        return float((a * b).sum()) / denominator if denominator else math.nan

    def compare(self, exact: Effects, *, min_effect: float = 0.05) -> list[Disagreement]:
        """The cells where this result (an estimate) and ``exact`` (the sweep) disagree in sign,
        among those where either moves the metric by at least ``min_effect`` (normalised)."""
        a, b = self._same_cells(exact)
        return [
            Disagreement(self._labels(flat), estimate, patched)
            for flat, (estimate, patched) in enumerate(zip(a.tolist(), b.tolist(), strict=True))
            if disagree(estimate, patched, min_effect)
        ]

    def _same_cells(self, other: Effects) -> tuple[torch.Tensor, torch.Tensor]:
        if self.dims != other.dims or self.coords != other.coords:
            raise SpecError(
                f"the two results cover different cells ({self.method}: {self._extent()}, {other.method}: "
                f"{other._extent()}); run both on the same sites, positions and heads"
            )
        return self.values.reshape(-1).double().nan_to_num(0.0), other.values.reshape(-1).double().nan_to_num(0.0)

    def _extent(self) -> str:
        return ", ".join(f"{len(self.coords[dim])} {dim}s" for dim in self.dims)

    # -- other libraries --------------------------------------------------------------------------

    def to_pandas(self) -> Any:
        """A ``DataFrame``: sites down, positions across (2-D), or one row per cell with a column per label."""
        pandas = require("pandas", purpose="Effects.to_pandas()", extra="pandas")
        if len(self.dims) == 2:
            return pandas.DataFrame(
                self.values.numpy(),
                index=pandas.Index(self.coords[self.dims[0]], name=self.dims[0]),
                columns=pandas.Index(self.coords[self.dims[1]], name=self.dims[1]),
            )
        rows = [(*labels, value) for labels, value in self.cells()]
        return pandas.DataFrame(rows, columns=[*self.dims, "effect"])

    def records(self) -> list[dict[str, Any]]:
        """One dict per cell, in order: its labels by dim, ``effect`` (normalised) and ``metric`` (raw)."""
        raws = self.raw.reshape(-1).tolist()
        return [
            {**dict(zip(self.dims, labels, strict=True)), "effect": value, "metric": raw}
            for (labels, value), raw in zip(self.cells(), raws, strict=True)
        ]

    def to_csv(self, path: str | os.PathLike[str] | None = None) -> str:
        """The :meth:`records` as CSV, one row per cell; written to ``path`` (atomically) when given.

        Site names are quoted and formula-like text is marked with ``'`` as in ``Trace.to_csv``
        (:mod:`hookscope._shared.csv_text`). Returns the text.

        >>> grid = Effects(torch.tensor([[0.5]]), torch.tensor([[2.0]]), ("site", "position"),
        ...                {"site": ["=h.0"], "position": [3]}, clean=3.0, corrupted=1.0, method="sweep")
        >>> grid.to_csv().splitlines()
        ['site,position,effect,metric', "'=h.0,3,0.5,2.0"]
        """
        text = csv_text(self.records(), empty_header=[*self.dims, "effect", "metric"])
        if path is not None:
            write_text(path, text)
        return text

    def to_xarray(self) -> Any:
        """An ``xarray.DataArray`` with the labels as coordinates (needs xarray)."""
        xarray = require("xarray", purpose="Effects.to_xarray()")
        attrs = {"clean": self.clean, "corrupted": self.corrupted, "method": self.method, "metric": self.metric}
        return xarray.DataArray(self.values.numpy(), dims=self.dims, coords=self.coords, attrs=attrs)

    def plot(self, **options: Any) -> Any:
        """The heatmap (:func:`hookscope.plots.effects`); returns the matplotlib ``Figure``."""
        from hookscope.plots import effects

        return effects(self, **options)

    # -- display ----------------------------------------------------------------------------------

    def _table(self, k: int = 10) -> Table:
        title = (
            f"{self.method} ({self.direction}) of {self.metric}: {' × '.join(map(str, self.values.shape))} cells, "
            f"clean {self.clean:.4g}, corrupted {self.corrupted:.4g}"
        )
        if self.clean == self.corrupted:
            title += " (the two runs score alike: every effect is undefined, NaN)"
        table = Table([*map(Column, self.dims), Column("effect", "right")], title=title)
        for labels, value in self.top(k):
            table.add(*map(str, labels), f"{value:+.3f}")
        return table

    def __repr__(self) -> str:
        return self._table().text()

    def _repr_html_(self) -> str:
        return self._table().html()

"""The grid of a patching study: where each site holds its positions and heads, and the cells.

A site's layout comes from what the site is, never from the ``heads=`` option, which only asks
for a head dim in the grid:

- an attention sub-site (``:attn.z``, ``:attn.pattern``, ``:attn.q``, ..., and the canonical
  ``attn.*``/``cross_attn.*`` names, eager attention's softmax among them) holds
  ``(batch, heads, seq, ...)``: positions on dim 2, heads on dim 1. Patched without ``heads=``,
  a cell is one position of every head.
- an op site the model's canonical map reads one of those names at (eager attention's
  ``:op[softmax#0]`` is ``attn.pattern``) is laid out as that name.
- a value of 4 or more dims that is none of these is refused: dim 1 may be heads or positions,
  and nothing in the value says which.
- any other value is ``(batch, seq, ...)``. By head, a merged value ``(batch, seq, hidden)``
  (the input of attention's output projection) is read as ``num_heads`` blocks of its last dim,
  as ``hs.edits.zero(heads=, num_heads=)`` reads it. Nothing in the value says how many heads it
  merges, so without ``num_heads=`` it is refused rather than guessed.

Reading the layout from the option instead made a 10-token sweep over 4 heads report its 10
positions as heads (a merged site by head) and its heads as positions (``attn.z`` without
``heads=``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from hookscope._capture import Cache
from hookscope._methods.runs import PatchSite
from hookscope.errors import SpecError

__all__ = ["Cell", "Grid", "Heads", "Positions", "SiteLayout", "check_num_heads", "lay_out"]

Positions = Literal["each", "all", "image", "text"] | Sequence[int]
Heads = bool | Sequence[int]


@dataclass(frozen=True)
class Cell:
    """One patch: a site (its index in the plan), a position (None: every position) and a head (None: all)."""

    site: int
    position: int | None
    head: int | None


@dataclass(frozen=True)
class SiteLayout:
    """Where one site's value holds its positions and heads.

    ``per_head``: ``(batch, heads, seq, ...)``, an attention sub-site; else ``(batch, seq, ...)``.
    ``split``: by head on a merged value, how many heads its last dim holds.
    """

    per_head: bool
    split: int | None = None

    @property
    def position_dim(self) -> int:
        return 2 if self.per_head else 1

    def by_head(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` as ``(batch, heads, seq, ...)``, a view (writes through it reach ``value``)."""
        if self.per_head:
            return value
        assert self.split is not None
        split = value.view(*value.shape[:-1], self.split, value.shape[-1] // self.split)  # splitting a dim: a view
        return split.movedim(-2, 1)

    def part(self, value: torch.Tensor, head: int | None, position: int | None) -> torch.Tensor:
        """What one cell patches of ``value`` (every row), a view: its head (None: all) at its
        position (None: every position)."""
        dim = self.position_dim
        if head is not None:
            value, dim = self.by_head(value)[:, head], 1
        return value if position is None else value.select(dim, position)

    def per_position(self, value: torch.Tensor, head: int | None) -> torch.Tensor:
        """``value`` (of ``head``; None: all) as ``(seq, everything else)``."""
        dim = self.position_dim
        if head is not None:
            value, dim = self.by_head(value)[:, head], 1
        return value.movedim(dim, 0).reshape(value.shape[dim], -1)

    def summed(self, value: torch.Tensor, by_head: bool) -> torch.Tensor:
        """``value`` summed over all but its cells' dims: ``(batch, heads, seq)`` by head, else ``(batch, seq)``."""
        if by_head:
            heads = self.by_head(value)
            return heads.reshape(*heads.shape[:3], -1).sum(-1)
        moved = value.movedim(self.position_dim, 1)
        return moved.reshape(*moved.shape[:2], -1).sum(-1)


@dataclass(frozen=True)
class Grid:
    """The cells of a study, in site-major order, with the dims and labels of its result."""

    cells: list[Cell]
    dims: tuple[str, ...]
    coords: dict[str, list[Any]]
    shape: tuple[int, ...]
    layouts: list[SiteLayout]


def lay_out(
    model: nn.Module,
    found: list[PatchSite],
    source: Cache,
    target: Cache,
    positions: Positions,
    heads: Heads,
    num_heads: int | None,
    rows: int,
) -> Grid:
    """Each site's layout, checked against the others (one length, one head count), and the cells."""
    seq: int | None = None
    head_count: int | None = None
    layouts = []
    for site in found:
        value, other = source[site.read], target[site.read]
        if value.shape != other.shape:
            raise SpecError(
                f"{site.label}: the clean and corrupted runs' values have shapes {tuple(value.shape)} and "
                f"{tuple(other.shape)}; patch between inputs of one shape (pad the prompts to one length)"
            )
        layout = _site_layout(model, site, value, heads, num_heads)
        if value.dim() <= layout.position_dim or value.shape[0] != rows:
            form = "(batch, heads, seq, ...), an attention sub-site" if layout.per_head else "(batch, seq, ...)"
            raise SpecError(f"{site.label} has shape {tuple(value.shape)}: patching by position needs {form}")
        length = int(value.shape[layout.position_dim])
        if seq is not None and length != seq:
            raise SpecError(f"{site.label} has {length} positions and an earlier site {seq}: sweep sites of one length")
        seq = length
        if heads is not False:
            count = int(value.shape[1]) if layout.per_head else layout.split
            if head_count is not None and count != head_count:
                raise SpecError(
                    f"{site.label} has {count} heads and an earlier site {head_count}: sweep by head over sites "
                    "of one head count (key and value sub-sites may have fewer heads than the queries)"
                )
            head_count = count
        layouts.append(layout)
    assert seq is not None
    if num_heads is not None and all(layout.per_head for layout in layouts):  # an option nothing reads
        raise SpecError(
            f"num_heads={num_heads}, and every site holds its heads apart on dim 1 ({found[0].label}: "
            f"{head_count} heads): num_heads= is for a value whose heads are merged in its last dim; drop it"
        )
    position_labels = _positions(positions, seq)
    dims: tuple[str, ...] = ("site", "position")
    coords: dict[str, list[Any]] = {"site": [site.label for site in found], "position": position_labels}
    head_labels: list[int | None] = [None]
    if heads is not False:
        assert head_count is not None
        head_labels = list(range(head_count)) if heads is True else [_head(h, head_count) for h in heads]
        dims = ("site", "head", "position")
        coords = {"site": coords["site"], "head": list(head_labels), "position": position_labels}
    cells = [
        Cell(index, None if position == "all" else position, head)
        for index in range(len(found))
        for head in head_labels
        for position in position_labels
    ]
    return Grid(cells, dims, coords, tuple(len(coords[dim]) for dim in dims), layouts)


def check_num_heads(num_heads: Any, heads: Heads) -> None:
    """Refuse a ``num_heads=`` that is not a count, or that nothing reads (no ``heads=``), before any run."""
    if num_heads is None:
        return
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise SpecError(f"num_heads={num_heads!r}: expected how many heads a merged value's last dim holds, e.g. 12")
    if heads is False:
        raise SpecError(
            f"num_heads={num_heads} reads a merged value's last dim as heads, which only heads= uses; add heads=True "
            "or drop num_heads="
        )


def _site_layout(
    model: nn.Module, site: PatchSite, value: torch.Tensor, heads: Heads, num_heads: int | None
) -> SiteLayout:
    if site.per_head:
        if value.dim() < 3:
            raise SpecError(f"{site.label} has shape {tuple(value.shape)}: expected (batch, heads, seq, ...)")
        return SiteLayout(per_head=True)
    shape = tuple(value.shape)
    if value.dim() >= 4:
        raise SpecError(
            f"{site.label} has shape {shape}: a value of 4 or more dims may hold heads on dim 1 (attention's "
            "(batch, heads, seq, ...)) or positions, and nothing says which for this site, so it is not guessed: "
            "patch attention's values by their canonical names, which are held per head (std:blocks.*.attn.pattern, "
            "std:blocks.*.attn.z, std:blocks.*.attn.scores), or a value (batch, seq, ...) such as the input of the "
            "attention's output projection (by head: heads=True with num_heads=)"
        )
    if heads is False:
        return SiteLayout(per_head=False)
    if num_heads is None:
        config = getattr(getattr(model, "config", None), "num_attention_heads", None)
        said = f" (this model's config says num_attention_heads={config})" if isinstance(config, int) else ""
        raise SpecError(
            f"{site.label} has shape {shape}, (batch, seq, hidden) with its heads merged in the last dim, and the "
            f"value does not say how many: give num_heads={said}, or patch a sub-site held per head "
            "(std:blocks.*.attn.z)"
        )
    if value.dim() < 3 or shape[-1] % num_heads:
        raise SpecError(
            f"{site.label} has shape {shape}: by head with num_heads={num_heads} needs (batch, seq, hidden) with "
            "hidden a multiple of num_heads"
        )
    return SiteLayout(per_head=False, split=num_heads)


def _positions(positions: Positions, seq: int) -> list[Any]:
    if positions == "each":
        return list(range(seq))
    if positions == "all":
        return ["all"]
    if isinstance(positions, Sequence) and not isinstance(positions, str) and positions:
        return [_position(p, seq) for p in positions]
    raise SpecError(f"positions={positions!r}: expected 'each' (default), 'all' (every position at once) or a list")


def _position(position: Any, seq: int) -> int:
    if isinstance(position, bool) or not isinstance(position, int) or not -seq <= position < seq:
        raise SpecError(f"position {position!r} is not one of the {seq} positions (0 to {seq - 1}, or negative)")
    return position % seq


def _head(head: Any, count: int) -> int:
    if isinstance(head, bool) or not isinstance(head, int) or not 0 <= head < count:
        raise SpecError(f"head {head!r} is not one of the {count} heads (0 to {count - 1})")
    return head

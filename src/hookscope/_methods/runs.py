"""The runs a method makes: its inputs (a tensor or a dict of keyword inputs), copied along the
batch for batched patches, and the sites it reads and writes, resolved once per study.

A method reads a site in one run and writes it in another; for most sites that is one place, but a
canonical ``resid_mid`` is read at a norm's input and written at the residual ``add`` (an op site),
so the two are kept apart here: :class:`PatchSite` holds both, and whether the value is held per
head (an attention sub-site), which decides where the value keeps its positions.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hookscope._arch.std import expand_std, known_std_map
from hookscope._capture import Cache
from hookscope._core.names import escape_name, leaf_label
from hookscope._core.op_sites import ATTN_KINDS, op_leaf_label
from hookscope._core.sites import Site
from hookscope._core.std_names import STD_PREFIX
from hookscope.errors import HookscopeError, SiteNotFoundError, SpecError

__all__ = ["Inputs", "PatchSite", "patch_sites"]

# A canonical attention sub-site (eager attention's pattern is a softmax op site, not an attn. one).
_HEAD_NAME = re.compile(rf"(?:^|\.)(?:cross_)?attn\.(?:{'|'.join(ATTN_KINDS)})$")


@dataclass(frozen=True)
class Inputs:
    """A model's input for one run: positional tensors and keyword inputs, ``rows`` along dim 0."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rows: int

    @classmethod
    def of(cls, given: Any, what: str, extra: dict[str, Any] | None = None) -> Inputs:
        """``given``: a tensor (``model(tensor)``), a dict (``model(**dict)``) or a tuple of tensors."""
        if isinstance(given, torch.Tensor):
            args: tuple[Any, ...] = (given,)
            kwargs: dict[str, Any] = {}
        elif isinstance(given, dict):
            args, kwargs = (), dict(given)
        elif isinstance(given, tuple):
            args, kwargs = given, {}
        else:
            raise SpecError(
                f"{what}={type(given).__name__}: expected the model's input as a tensor (token ids), a dict of "
                "keyword inputs (a tokenizer's batch) or a tuple of positional inputs"
            )
        kwargs.update(extra or {})
        batched = [v for v in [*args, *kwargs.values()] if isinstance(v, torch.Tensor) and v.dim() > 0]
        if not batched:
            raise SpecError(f"{what} holds no tensor with a batch dimension")
        # The rows: of the token ids where given, else the largest leading dim (a (1, seq)
        # position_ids broadcasts over the batch, it is not one).
        main = kwargs.get("input_ids")
        rows = main.shape[0] if isinstance(main, torch.Tensor) and main.dim() > 0 else max(v.shape[0] for v in batched)
        return cls(args, kwargs, int(rows))

    def repeated(self, times: int) -> Inputs:
        """The batch ``times`` over, one copy after another (copy ``j`` is rows ``j*rows ...``)."""
        if times == 1:
            return self

        def copy(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == self.rows:
                return value.repeat(times, *([1] * (value.dim() - 1)))
            return value

        return Inputs(
            tuple(copy(v) for v in self.args), {k: copy(v) for k, v in self.kwargs.items()}, self.rows * times
        )

    def stacked(self, other: Inputs) -> Inputs | None:
        """This batch, then ``other``'s, in one batch; None when they do not stack (another
        structure, or a non-batch value that differs)."""
        if len(self.args) != len(other.args) or self.kwargs.keys() != other.kwargs.keys():
            return None
        pairs = [*zip(self.args, other.args, strict=True), *((self.kwargs[k], other.kwargs[k]) for k in self.kwargs)]
        joined = []
        for mine, theirs in pairs:
            if isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor):
                batched = mine.dim() > 0 and mine.shape[0] == self.rows and theirs.shape[0] == other.rows
                if batched and mine.shape[1:] == theirs.shape[1:] and mine.dtype == theirs.dtype:
                    joined.append(torch.cat([mine, theirs]))
                    continue
                if mine.shape == theirs.shape and torch.equal(mine, theirs):
                    joined.append(mine)
                    continue
                return None
            if mine is not theirs and not _same_plain_value(mine, theirs):
                return None
            joined.append(mine)
        count = len(self.args)
        return Inputs(
            tuple(joined[:count]), dict(zip(self.kwargs, joined[count:], strict=True)), self.rows + other.rows
        )

    def run(self, model: nn.Module) -> Any:
        return model(*self.args, **self.kwargs)


def _same_plain_value(mine: Any, theirs: Any) -> bool:
    """Equal non-tensor inputs (flags, numbers, strings); a container of tensors is never
    taken as equal (its comparison is ambiguous), so such inputs run apart."""
    try:
        return bool(mine == theirs)
    except (RuntimeError, TypeError, ValueError):
        return False


@dataclass(frozen=True)
class PatchSite:
    """One site of a study: its label (a canonical name where given one), where a capture reads
    its value, the selector an edit writes it with, and whether the value is held per head
    (``(batch, heads, seq, ...)``: an attention sub-site, or an op site the canonical map reads
    one at, as eager attention's softmax) rather than ``(batch, seq, ...)``."""

    label: str
    read: Site
    write: str
    per_head: bool = False


def patch_sites(model: nn.Module, selectors: str | Sequence[str], cache: Cache) -> list[PatchSite]:
    """The sites ``selectors`` name on ``model``, in the order ``cache`` (a capture of them) holds
    them: one per captured site, a ``std:`` pattern once per canonical name it covers."""
    given = [selectors] if isinstance(selectors, str) else list(selectors)
    _, writes = expand_std(model, given, "write")
    std = cache.meta.get("std") or {}
    by_site: dict[Site, str] = {}
    for name in std:
        try:
            by_site.setdefault(cache.resolve(STD_PREFIX + name), name)
        except SiteNotFoundError:  # selected, but never ran in this run: no row for it
            continue
    found = []
    shown = cache.short_names()  # "shared" for a module's only site; "shared#1:output" where it has several
    per_head_reads: set[str] | None = None
    for site in cache.sites():
        name = by_site.get(site)
        sub_site = site.op.startswith("attn.")
        if name is not None:
            found.append(PatchSite(name, site, writes[name], sub_site or bool(_HEAD_NAME.search(name))))
            continue
        label = op_leaf_label(site.op, site.what, site.path) if site.op else leaf_label(site.what, site.path)
        per_head = sub_site
        if not per_head and cache[site].dim() >= 4:  # heads or positions on dim 1: ask the map, never guess
            per_head_reads = _per_head_reads(model) if per_head_reads is None else per_head_reads
            per_head = f"{escape_name(site.module or '')}:{label}" in per_head_reads
        found.append(PatchSite(shown[site], site, f"{site.module or '(root)'}:{label}", per_head))
    if not found:
        raise SpecError(f"layers={selectors!r} selected nothing that ran in the clean run")
    return found


def _per_head_reads(model: nn.Module) -> set[str]:
    """The selectors the model's canonical map reads per-head values at (``attn.*``), so an op site
    named by hand (eager attention's ``:op[softmax#0]``, ``std:blocks.N.attn.pattern``) is laid
    out as its canonical name is; none for a model without a map."""
    try:
        std = known_std_map(model)
    except HookscopeError:
        return set()
    return {site.read for site in std.sites.values() if _HEAD_NAME.search(site.name)}

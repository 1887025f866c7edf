"""The two runs of a model diff: keep the reference's values, then compare the other's as they come.

Run a records every call of the chosen modules (order, class, shapes) while ``hs.capture``
keeps their values (on ``keep_on``, the CPU by default; safe against later in-place ops, and
a tensor seen twice is kept once). Run b compares each value the moment its module produces
it, queueing the metrics on b's device, and lets go of a's value once compared: the peak is
a's values plus b's own forward, never both activation sets held at once. Both runs are
:class:`~hookscope._shared.call_recorder.CallRecorder` s whose hooks run eagerly under
``torch.compile``: comparing reads values back.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch
from torch import nn

from hookscope._capture import Cache
from hookscope._core.compat.internals import version_counter
from hookscope._core.tree import call_leaves, flatten_tensors
from hookscope._diff.metrics import raw_metrics
from hookscope._shared.call_recorder import Args, CallRecorder, Handled, Kwargs, OpenCall, Watched
from hookscope._shared.dtypes import dtype_name
from hookscope._shared.shapes import shape_of
from hookscope._shared.stats import is_measurable
from hookscope.errors import HookscopeError

__all__ = ["Comparer", "Kept", "LeafDraft", "Reference"]

Leaves = list[tuple[str, torch.Tensor]]
#: (what, relative path) of each leaf of a call -> its shape and dtype
Shapes = dict[tuple[str, str], tuple[tuple[int, ...], str]]


@dataclass
class Kept:
    """One call of a module in run a: what went in and came out (copies), in the order calls began."""

    name: str
    call: int
    class_name: str
    leaf: bool = True
    inputs: dict[str, torch.Tensor | None] = field(default_factory=dict)
    outputs: dict[str, torch.Tensor | None] = field(default_factory=dict)
    shapes: Shapes = field(default_factory=dict)


@dataclass
class LeafDraft:
    """One compared leaf of run b, its metrics still on the device."""

    what: str
    path: str
    shape_a: tuple[int, ...] | None
    shape_b: tuple[int, ...] | None
    dtype_a: str | None
    dtype_b: str | None
    raw: tuple[int, torch.Tensor] | None = None
    note: str | None = None


@dataclass
class CallDraft:
    """One call of run b and the call of a it stands against."""

    name_b: str
    call: int
    class_b: str
    leaf: bool
    reference: Kept | None
    leaves: list[LeafDraft] = field(default_factory=list)
    finished: int | None = None


def _dtype(tensor: torch.Tensor) -> str:
    return dtype_name(tensor.dtype)


@dataclass(eq=False)
class _Module(Watched):
    leaf: bool  # has no children: a container passes a child's values on


R = TypeVar("R", Kept, CallDraft)


@dataclass(eq=False)
class _Open(OpenCall[_Module], Generic[R]):
    record: R  # what the run keeps of the call


class _Run(CallRecorder[_Module, _Open[R]]):
    """Hooks on every chosen module of one model, run once; removed by the caller."""

    feature = "diff"

    def __init__(self, model: nn.Module, modules: Sequence[tuple[str, nn.Module]]) -> None:
        self.passes = 0
        super().__init__(model, modules, escape_compiled=True)

    def watch(self, name: str, module: nn.Module) -> _Module:
        return _Module(name, type(module).__name__, next(module.children(), None) is None)

    def start_pass(self, module: nn.Module) -> None:
        self.passes += 1
        if self.passes > 1:
            raise HookscopeError("a diff runs each model once; this model was called a second time in one run")


class Reference(_Run[Kept]):
    """Run a: every call, in the order calls began, with its shapes; :meth:`fill` adds the values."""

    def __init__(self, model: nn.Module, modules: list[tuple[str, nn.Module]]) -> None:
        self.calls: list[Kept] = []
        super().__init__(model, modules)

    def open_call(self, site: _Module, call: int, handled: Handled, args: Args, kwargs: Kwargs) -> _Open[Kept]:
        kept = Kept(site.name, call, site.class_name, site.leaf)
        for path, tensor in call_leaves(args, kwargs):
            kept.shapes[("input", path)] = (shape_of(tensor), _dtype(tensor))
        self.calls.append(kept)
        return _Open(site, call, handled, kept)

    def close_call(self, draft: _Open[Kept], output: Any) -> None:
        for path, tensor in flatten_tensors(output, ""):
            draft.record.shapes[("output", path)] = (shape_of(tensor), _dtype(tensor))

    def fill(self, cache: Cache) -> None:
        """Take the values of every recorded call from ``cache`` (a capture of the same forward)."""
        by_site = {(kept.name, kept.call): kept for kept in self.calls}
        for site in cache.sites():
            kept = by_site.get((site.module, site.call))
            if kept is not None:
                (kept.inputs if site.what == "input" else kept.outputs)[site.path] = cache[site]


class Comparer(_Run[CallDraft]):
    """Run b: each value measured against run a's as it is produced; a's copy is let go after."""

    def __init__(
        self,
        model: nn.Module,
        modules: list[tuple[str, nn.Module]],
        reference: list[Kept],
        pairs: dict[str, str] | None,
    ) -> None:
        self.drafts: list[CallDraft] = []
        self._by_site = {(kept.name, kept.call): kept for kept in reference}
        self._in_order = list(reference)
        self._pairs = pairs  # None: match by order
        self._started = 0
        self._finished = 0
        self.matched: set[tuple[str, int]] = set()
        self._measured: Measured = {}
        super().__init__(model, modules)

    def _reference(self, name: str, call: int) -> Kept | None:
        if self._pairs is None:
            index = self._started
            return self._in_order[index] if index < len(self._in_order) else None
        name_a = self._pairs.get(name)
        return None if name_a is None else self._by_site.get((name_a, call))

    def open_call(self, site: _Module, call: int, handled: Handled, args: Args, kwargs: Kwargs) -> _Open[CallDraft]:
        kept = self._reference(site.name, call)
        self._started += 1
        draft = CallDraft(site.name, call, site.class_name, site.leaf, kept)
        if kept is not None:
            self.matched.add((kept.name, kept.call))
            draft.leaves = compare_leaves("input", kept.inputs, kept.shapes, call_leaves(args, kwargs), self._measured)
            kept.inputs.clear()  # compared: a's copies of them can go
        self.drafts.append(draft)
        return _Open(site, call, handled, draft)

    def close_call(self, draft: _Open[CallDraft], output: Any) -> None:
        compared = draft.record
        compared.finished = self._finished
        self._finished += 1
        if compared.reference is not None:
            reference = compared.reference
            leaves = flatten_tensors(output, "")
            compared.leaves += compare_leaves("output", reference.outputs, reference.shapes, leaves, self._measured)
            reference.outputs.clear()


Measured = dict[tuple[int, int], tuple["weakref.ref[torch.Tensor]", int, tuple[int, torch.Tensor]]]


def compare_leaves(
    what: str,
    kept: dict[str, torch.Tensor | None],
    shapes: Shapes,
    leaves: Leaves,
    measured: Measured | None = None,
) -> list[LeafDraft]:
    """Each of b's leaves against a's value at the same path, with a note where they cannot be
    compared. ``measured`` remembers the pairs measured already in this pass: a layer's input
    is the previous layer's output and a container's output its last child's, measured once."""
    compared = []
    seen = set()
    for path, tensor in leaves:
        seen.add(path)
        shape_b, dtype_b = shape_of(tensor), _dtype(tensor)
        known = shapes.get((what, path))
        if known is None:
            compared.append(LeafDraft(what, path, None, shape_b, None, dtype_b, note="only in b"))
            continue
        shape_a, dtype_a = known
        leaf = LeafDraft(what, path, shape_a, shape_b, dtype_a, dtype_b)
        reference = kept.get(path)
        if shape_a != shape_b:
            leaf.note = "shapes differ"
        elif reference is None or not is_measurable(tensor):
            leaf.note = "not comparable (sparse, complex or meta)"
        else:
            leaf.raw = _measure(reference, tensor, measured)
        compared.append(leaf)
    for (side, path), (shape_a, dtype_a) in shapes.items():
        if side == what and path not in seen:
            compared.append(LeafDraft(what, path, shape_a, None, dtype_a, None, note="only in a"))
    return compared


def _measure(reference: torch.Tensor, tensor: torch.Tensor, measured: Measured | None) -> tuple[int, torch.Tensor]:
    if measured is None:
        return raw_metrics(reference, tensor)
    version = version_counter(tensor)  # inference tensors have no counter
    if version is None:
        return raw_metrics(reference, tensor)
    key = (id(reference), id(tensor))
    known = measured.get(key)
    if known is not None and known[0]() is tensor and known[1] == version:
        return known[2]
    raw = raw_metrics(reference, tensor)
    measured[key] = (weakref.ref(tensor), version, raw)  # a weak reference: b's values still go
    return raw

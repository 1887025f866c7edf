"""The two runs of a model diff: keep the reference's values, then compare the other's as they come.

Run a records every call of the chosen modules (order, class, shapes) while ``hs.capture``
keeps their values (on ``keep_on``, the CPU by default; safe against later in-place ops, and
a tensor seen twice is kept once). Run b compares each value the moment its module produces
it, queueing the metrics on b's device, and lets go of a's value once compared: the peak is
a's values plus b's own forward, never both activation sets held at once.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hookscope._capture import Cache
from hookscope._core.attach import HookGroup, HookSpec, Scoped
from hookscope._core.compat.compiled import EAGER, is_compiling
from hookscope._core.sites import CallTracker
from hookscope._core.tree import call_leaves, flatten_tensors
from hookscope._diff.metrics import raw_metrics
from hookscope._shared.shapes import shape_of
from hookscope._shared.stats import is_measurable
from hookscope.errors import HookscopeError

__all__ = ["Comparer", "Kept", "LeafDraft", "Reference"]

Leaves = list[tuple[str, torch.Tensor]]


@dataclass
class Kept:
    """One call of a module in run a: what went in and came out (copies), in the order calls began."""

    name: str
    call: int
    class_name: str
    leaf: bool = True
    inputs: dict[str, torch.Tensor | None] = field(default_factory=dict)
    outputs: dict[str, torch.Tensor | None] = field(default_factory=dict)
    shapes: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)  # "what path" -> shape, dtype


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
    return str(tensor.dtype).removeprefix("torch.")


class _Run(Scoped):
    """Hooks on every chosen module of one model, numbered by a call tracker, removed by the caller."""

    def __init__(self, model: nn.Module, modules: list[tuple[str, nn.Module]], owner: str) -> None:
        self._tracker = CallTracker(listener=self)
        specs = []
        for name, module in modules:
            specs.append(
                HookSpec(name, module, "forward_pre", self._enter(name, module), with_kwargs=True, fitted=True)
            )
            specs.append(HookSpec(name, module, "forward", self._leave(name), with_kwargs=True, fitted=True))
        self.passes = 0
        self._group = HookGroup(model, specs, owner=owner, tracker=self._tracker, restore_mode=False)

    def _enter(self, name: str, module: nn.Module) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None]:
        current, class_name = self._tracker.current, type(module).__name__
        leaf = next(module.children(), None) is None

        def enter(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if is_compiling():  # the comparison reads values back: run it eagerly
                EAGER(type(self).opened)(self, name, current(module), class_name, leaf, call_leaves(args, kwargs))
                return
            self.opened(name, current(module), class_name, leaf, call_leaves(args, kwargs))

        return enter

    def _leave(self, name: str) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any], Any], None]:
        current = self._tracker.current

        def leave(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if is_compiling():
                EAGER(type(self).closed)(self, name, current(module), flatten_tensors(output, ""))
                return
            self.closed(name, current(module), flatten_tensors(output, ""))

        return leave

    def opened(self, name: str, call: int, class_name: str, leaf: bool, leaves: Leaves) -> None:
        raise NotImplementedError

    def closed(self, name: str, call: int, leaves: Leaves) -> None:
        raise NotImplementedError

    # -- told by the call tracker ---------------------------------------------------------------

    def pass_started(self, module: nn.Module) -> None:
        self.passes += 1
        if self.passes > 1:
            raise HookscopeError("a diff runs each model once; this model was called a second time in one run")

    def pass_ended(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        pass

    def pass_abandoned(self) -> None:
        pass

    def refuse_thread(self) -> Exception:
        return HookscopeError("a diff follows one thread; this model was entered from another thread meanwhile")


class Reference(_Run):
    """Run a: every call, in the order calls began, with its shapes; :meth:`fill` adds the values."""

    def __init__(self, model: nn.Module, modules: list[tuple[str, nn.Module]]) -> None:
        self.calls: list[Kept] = []
        self._open: dict[tuple[str, int], Kept] = {}
        super().__init__(model, modules, owner="diff")

    def opened(self, name: str, call: int, class_name: str, leaf: bool, leaves: Leaves) -> None:
        kept = Kept(name, call, class_name, leaf)
        for path, tensor in leaves:
            kept.shapes["input" + path] = (shape_of(tensor), _dtype(tensor))
        self.calls.append(kept)
        self._open[(name, call)] = kept

    def closed(self, name: str, call: int, leaves: Leaves) -> None:
        kept = self._open.pop((name, call), None)  # no always_call: this runs only after a call returned
        if kept is None:
            return
        for path, tensor in leaves:
            kept.shapes["output" + path] = (shape_of(tensor), _dtype(tensor))

    def fill(self, cache: Cache) -> None:
        """Take the values of every recorded call from ``cache`` (a capture of the same forward)."""
        by_site = {(kept.name, kept.call): kept for kept in self.calls}
        for site in cache.sites():
            kept = by_site.get((site.module, site.call))
            if kept is not None:
                (kept.inputs if site.what == "input" else kept.outputs)[site.path] = cache[site]


class Comparer(_Run):
    """Run b: each value measured against run a's as it is produced; a's copy is let go after."""

    def __init__(
        self,
        model: nn.Module,
        modules: list[tuple[str, nn.Module]],
        reference: list[Kept],
        pairs: dict[str, str] | None,
    ) -> None:
        self.drafts: list[CallDraft] = []
        self._open: dict[tuple[str, int], CallDraft] = {}
        self._by_site = {(kept.name, kept.call): kept for kept in reference}
        self._in_order = list(reference)
        self._pairs = pairs  # None: match by order
        self._started = 0
        self._finished = 0
        self.matched: set[tuple[str, int]] = set()
        self._measured: Measured = {}
        super().__init__(model, modules, owner="diff")

    def _reference(self, name: str, call: int) -> Kept | None:
        if self._pairs is None:
            index = self._started
            return self._in_order[index] if index < len(self._in_order) else None
        name_a = self._pairs.get(name)
        return None if name_a is None else self._by_site.get((name_a, call))

    def opened(self, name: str, call: int, class_name: str, leaf: bool, leaves: Leaves) -> None:
        kept = self._reference(name, call)
        self._started += 1
        draft = CallDraft(name, call, class_name, leaf, kept)
        if kept is not None:
            self.matched.add((kept.name, kept.call))
            draft.leaves = compare_leaves("input", kept.inputs, kept.shapes, leaves, self._measured)
            kept.inputs.clear()  # compared: a's copies of them can go
        self.drafts.append(draft)
        self._open[(name, call)] = draft

    def closed(self, name: str, call: int, leaves: Leaves) -> None:
        draft = self._open.pop((name, call), None)
        if draft is None:
            return
        draft.finished = self._finished
        self._finished += 1
        if draft.reference is not None:
            draft.leaves += compare_leaves(
                "output", draft.reference.outputs, draft.reference.shapes, leaves, self._measured
            )
            draft.reference.outputs.clear()


Measured = dict[tuple[int, int], tuple["weakref.ref[torch.Tensor]", int, tuple[int, torch.Tensor]]]


def compare_leaves(
    what: str,
    kept: dict[str, torch.Tensor | None],
    shapes: dict[str, tuple[tuple[int, ...], str]],
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
        known = shapes.get(what + path)
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
    for key, (shape_a, dtype_a) in shapes.items():
        if key.startswith(what) and key[len(what) :] not in seen:
            compared.append(LeafDraft(what, key[len(what) :], shape_a, None, dtype_a, None, note="only in a"))
    return compared


def _measure(reference: torch.Tensor, tensor: torch.Tensor, measured: Measured | None) -> tuple[int, torch.Tensor]:
    if measured is None:
        return raw_metrics(reference, tensor)
    version = None if tensor.is_inference() else tensor._version  # inference tensors have no counter
    if version is None:
        return raw_metrics(reference, tensor)
    key = (id(reference), id(tensor))
    known = measured.get(key)
    if known is not None and known[0]() is tensor and known[1] == version:
        return known[2]
    raw = raw_metrics(reference, tensor)
    measured[key] = (weakref.ref(tensor), version, raw)  # a weak reference: b's values still go
    return raw

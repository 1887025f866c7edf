"""The comparison itself: two models run (a kept, b compared as it runs) or two captures paired,
and the compared calls read into a :class:`Diff`'s rows.

``hs.diff`` and its built-ins (``api``) check arguments and prepare the two sides (a cast copy,
an autocast or compiled wrapper, a copy on another device); every one of them ends here. Kept
apart so the one path that runs the models, pairs the sites and reads the metrics reads whole.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from hookscope._arch.std import known_std_map, select_std
from hookscope._capture import Cache, capture
from hookscope._core.compat.offload import ensure_loaded
from hookscope._core.names import call_label, unwrapped_modules
from hookscope._core.select import Selector, ensure_module
from hookscope._diff.matching import Match, name_pairs
from hookscope._diff.metrics import read_metrics
from hookscope._diff.recorder import CallDraft, Comparer, Kept, LeafDraft, Reference, compare_leaves
from hookscope._diff.result import Diff, DiffRow, LeafDiff
from hookscope._shared.dtypes import dtype_name
from hookscope._shared.units import counted
from hookscope.errors import PairingWarning, SpecError

__all__ = ["Inputs", "compare_caches", "compare_models", "std_pairs"]
Inputs = tuple[tuple[Any, ...], dict[str, Any]]


def compare_models(
    a: nn.Module,
    b: nn.Module,
    inputs_a: Inputs,
    inputs_b: Inputs,
    *,
    match: Match,
    layers: Selector | Sequence[Selector] | None,
    rtol: float,
    atol: float,
    keep_on: str | torch.device,
    paired_b_only: bool = False,
) -> Diff:
    """Run a, keeping its values; run b, comparing each value as b makes it (see ``recorder``).

    ``paired_b_only`` hooks only b's modules that pair with one of a's: for a wrapper around a
    (autocast, compile), whose own root is no counterpart of anything.
    """
    ensure_loaded(a)  # a meta model: one line, not torch's error
    ensure_loaded(b)
    _check_tolerances(rtol, atol)
    if match == "std":  # pair the modules carrying the same canonical name (two architectures)
        match, std_layers = std_pairs(ensure_module(a), ensure_module(b))
        layers = std_layers if layers is None else layers
    modules_a = _modules(ensure_module(a), layers)
    modules_b = unwrapped_modules(ensure_module(b))  # a wrapper's held module: its calls are the wrapper's
    pairs = None if match == "order" else name_pairs([n for n, _ in modules_a], [n for n, _ in modules_b], match)
    if pairs is not None:
        if not pairs or (set(pairs) == {""} and len(modules_a) > 1 and layers is None):
            raise SpecError(_no_pairs(modules_a, modules_b, match))
        if layers is not None or paired_b_only:  # b's other modules were left out on purpose, not missing
            modules_b = [(name, module) for name, module in modules_b if name in pairs]
    elif layers is not None:
        raise SpecError("layers= picks a's modules by name, which match='order' cannot pair; leave layers out")
    wanted = {name for name, _ in modules_a}
    keeping = capture(a, lambda name, _: name in wanted, keep="both", device=keep_on)
    with Reference(a, modules_a) as reference, keeping, torch.no_grad(), _blame("a"):
        a(*inputs_a[0], **inputs_a[1])
    reference.fill(keeping.cache)
    del keeping
    gc.collect()  # a capture and its call tracker refer to each other: free its cache now, so that
    # the calls hold the only references to a's values and each goes once it is compared
    with Comparer(b, modules_b, reference.calls, pairs) as comparer, torch.no_grad(), _blame("b"):
        b(*inputs_b[0], **inputs_b[1])
    meta = {"a": type(a).__name__, "b": type(b).__name__, "inputs": True}
    return _diff(comparer, reference.calls, rtol, atol, meta, check_classes=pairs is None)


def compare_caches(a: Cache, b: Cache, *, match: Match, rtol: float, atol: float) -> Diff:
    """Two captures already taken: their sites paired by module (and call), compared directly."""
    _check_tolerances(rtol, atol)
    calls_a, calls_b = _calls_of(a), _calls_of(b)
    if match == "order":
        paired = list(zip(calls_a, calls_b, strict=False))
    else:
        pairs = name_pairs(list(dict.fromkeys(k.name for k in calls_a)), [k.name for k in calls_b], match)
        by_site = {(kept.name, kept.call): kept for kept in calls_a}
        paired = [(by_site[(pairs[k.name], k.call)], k) for k in calls_b if (pairs.get(k.name), k.call) in by_site]
    drafts = []
    for order, (kept_a, kept_b) in enumerate(paired):
        draft = CallDraft(kept_b.name, kept_b.call, kept_b.class_name, True, kept_a, finished=order)
        for what, values_b in (("input", kept_b.inputs), ("output", kept_b.outputs)):
            values_a = kept_a.inputs if what == "input" else kept_a.outputs
            leaves = [(path, tensor) for path, tensor in values_b.items() if tensor is not None]
            draft.leaves += compare_leaves(what, values_a, kept_a.shapes, leaves)
        drafts.append(draft)
    matched = {(kept.name, kept.call) for kept, _ in paired}
    paired_b = {id(kb) for _, kb in paired}
    only_b = [f"{call_label(k.name, k.call)}" for k in calls_b if id(k) not in paired_b]
    with_inputs = any(kept.inputs for kept in calls_a) and any(kept.inputs for kept in calls_b)
    return _rows(drafts, calls_a, matched, only_b, rtol, atol, {"a": "Cache", "b": "Cache", "inputs": with_inputs})


def _calls_of(cache: Cache) -> list[Kept]:
    """A cache's values grouped by call, in the order their outputs were kept (the order outputs
    were made, as for two models; a call with inputs only goes where its inputs were)."""
    calls: dict[tuple[str, int], Kept] = {}
    first_seen: dict[tuple[str, int], int] = {}
    first_output: dict[tuple[str, int], int] = {}
    for position, site in enumerate(cache.sites()):
        key = (site.module, site.call)
        kept = calls.setdefault(key, Kept(site.module, site.call, ""))
        tensor = cache[site]
        (kept.inputs if site.what == "input" else kept.outputs)[site.path] = tensor
        kept.shapes[(site.what, site.path)] = (tuple(tensor.shape), dtype_name(tensor.dtype))
        first_seen.setdefault(key, position)
        if site.what == "output":
            first_output.setdefault(key, position)
    return sorted(calls.values(), key=lambda k: first_output.get((k.name, k.call), first_seen[(k.name, k.call)]))


def _diff(
    comparer: Comparer, reference: list[Kept], rtol: float, atol: float, meta: dict[str, Any], *, check_classes: bool
) -> Diff:
    only_b = [f"{call_label(d.name_b, d.call)}" for d in comparer.drafts if d.reference is None]
    finished = sorted((d for d in comparer.drafts if d.finished is not None), key=lambda d: d.finished or 0)
    return _rows(finished, reference, comparer.matched, only_b, rtol, atol, meta, check_classes=check_classes)


def _rows(
    drafts: list[CallDraft],
    reference: list[Kept],
    matched: set[tuple[str, int]],
    only_b: list[str],
    rtol: float,
    atol: float,
    meta: dict[str, Any],
    *,
    check_classes: bool = False,
) -> Diff:
    leaves = [leaf for draft in drafts if draft.reference is not None for leaf in draft.leaves]
    measured = read_metrics([leaf.raw for leaf in leaves if leaf.raw is not None])
    metrics = iter(measured)
    read = {id(leaf): next(metrics) for leaf in leaves if leaf.raw is not None}
    rows: list[DiffRow] = []
    off_track: list[str] = []
    for draft in drafts:
        kept = draft.reference
        if kept is None:
            continue
        inputs = tuple(
            LeafDiff(leaf.path, leaf.shape_a, leaf.shape_b, read.get(id(leaf)), leaf.note)
            for leaf in draft.leaves
            if leaf.what == "input"
        )
        unlike = check_classes and _unlike(kept, draft)
        if unlike:
            off_track.append(f"a's {call_label(kept.name, kept.call)} ({kept.class_name}) with b's {draft.name_b}")
        for leaf in (leaf for leaf in draft.leaves if leaf.what == "output"):
            note = leaf.note
            if unlike and note is None:  # paired by order, a layer against another kind
                note = f"classes differ ({kept.class_name} vs {draft.class_b})"
            rows.append(_row(len(rows), kept, draft, leaf, read.get(id(leaf)), note, inputs))
    if off_track:
        warnings.warn(PairingWarning(_off_track_message(off_track)), stacklevel=5)  # the user's hs.diff call
    only_a = [f"{call_label(k.name, k.call)}" for k in reference if (k.name, k.call) not in matched]
    return Diff(rows, rtol=rtol, atol=atol, only_a=only_a, only_b=only_b, meta=meta)


def _unlike(kept: Kept, draft: CallDraft) -> bool:
    """Whether a pair made by call order joins modules of different kinds: a layer with another
    layer's class, or a layer with a container. Two containers may differ in class (two
    implementations of one block), and so may the roots."""
    if kept.leaf != draft.leaf:
        return kept.name != "" or draft.name_b != ""
    return kept.leaf and kept.class_name != draft.class_b


def _off_track_message(pairs: list[str]) -> str:
    shown = "; ".join(pairs[:3]) + (f"; and {len(pairs) - 3} more" if len(pairs) > 3 else "")
    return (
        f"match='order' paired {counted(len(pairs), 'call')} with a module of another kind ({shown}): "
        "the models' call orders differ there, so those rows compare unrelated values (marked "
        "'classes differ'); pair by name or by a mapping (match={'a.pattern.*': 'b.pattern.*'}) instead"
    )


def _row(
    order: int, kept: Kept, draft: CallDraft, leaf: LeafDraft, metrics: Any, note: str | None, inputs: Any
) -> DiffRow:
    return DiffRow(
        order=order,
        name=kept.name,
        name_b=draft.name_b,
        call=kept.call,
        class_name=kept.class_name or draft.class_b,
        class_b=draft.class_b,
        path=leaf.path,
        shape=leaf.shape_a,
        shape_b=leaf.shape_b,
        dtype=leaf.dtype_a,
        dtype_b=leaf.dtype_b,
        metrics=metrics,
        note=note,
        inputs=inputs,
    )


@contextlib.contextmanager
def _blame(which: str) -> Iterator[None]:
    """Say which model's forward an exception came from."""
    try:
        yield
    except Exception as error:
        if hasattr(error, "add_note"):
            error.add_note(f"hookscope.diff: raised in model {which}'s forward")
        raise


def _modules(model: nn.Module, layers: Selector | Sequence[Selector] | None) -> list[tuple[str, nn.Module]]:
    if layers is None:
        return unwrapped_modules(model)
    kept = {
        id(module) for _, module in unwrapped_modules(model)
    }  # a wrapper's held module: its calls are the wrapper's
    return [(name, module) for name, module in select_std(model, layers) if id(module) in kept]


def std_pairs(a: nn.Module, b: nn.Module) -> tuple[Callable[[str], str | None], list[Selector]]:
    """``match="std"``: a's module for each canonical name that a module carries in both models,
    paired with b's (``{a's name: b's name}``), and a's modules to compare."""
    std_a, std_b = known_std_map(a), known_std_map(b)
    pairs: dict[str, str] = {}
    for name, site in std_a.items():
        other = std_b.sites.get(name)
        if site.module is not None and other is not None and other.module is not None:
            pairs.setdefault(site.module, other.module)
    if not pairs:
        raise SpecError(
            f"match='std' found no canonical name a module carries in both models ({std_a.family} and {std_b.family})"
        )
    return pairs.get, list(pairs)


def _check_tolerances(rtol: float, atol: float) -> None:
    for name, value in (("rtol", rtol), ("atol", atol)):
        if not isinstance(value, (int, float)) or value < 0:
            raise SpecError(f"{name}={value!r}; expected a tolerance of 0 or more")


def _no_pairs(modules_a: list[tuple[str, nn.Module]], modules_b: list[tuple[str, nn.Module]], match: Match) -> str:
    sample_a = ", ".join(repr(n) for n, _ in modules_a[1:4])
    sample_b = ", ".join(repr(n) for n, _ in modules_b[1:4])
    return (
        f"no module of b matches one of a by {'name' if match == 'name' else 'the given map'} "
        f"(a has {sample_a} ..., b has {sample_b} ...); pass match={{'a.pattern.*': 'b.pattern.*'}} "
        "or match='order' for models that differ only in their names"
    )

"""One site plan and one transactional attach, for every feature that hooks selected sites.

A capture, an edit and a trace each turn selectors into sites the same way: canonical names
expanded, op selectors (``"h.0.attn:op[softmax#0]"``, attention sub-sites) split from module
selectors, the op selectors' modules found; then attach the same way: the feature's
:class:`~hookscope._core.attach.HookGroup`, then its op watcher, all or nothing, both taken off
by the feature's own ``remove()`` (also from ``hs.remove_all``). :class:`SitePlan` is what the
first step gives and :func:`attach_plan` is the second.

Why the plan's making is not here: expanding ``std:`` names and laying out attention sub-sites
are model knowledge (the ``_arch`` layer, above this one), so
:func:`hookscope._arch.plan.plan_sites` makes the plan with them and hands it down here; the
core keeps what holds for any ``nn.Module``: the split of op selectors and the attach.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Protocol, TypeVar

from torch import nn

from hookscope._core.attach import HookGroup
from hookscope._core.live_hooks import remove_through
from hookscope._core.op_sites import OpPattern, op_pattern
from hookscope._core.ops import OpWatcher
from hookscope._core.select import Selector, compile_selector

__all__ = ["OpPart", "SitePlan", "Use", "attach_plan", "split_op_selectors"]

#: What a feature does at a site, which decides what a canonical name stands for: ``"read"``
#: (capture, extract), ``"write"`` (edit) or ``"module"`` (trace, gradients: the module whose
#: output it is).
Use = Literal["read", "write", "module"]


class OpPart(Protocol):
    """The op selectors of a plan, as the attach needs them: the modules they watch."""

    @property
    def modules(self) -> list[tuple[str, nn.Module]]: ...


OpsT = TypeVar("OpsT", bound=OpPart)


@dataclass(frozen=True)
class SitePlan(Generic[OpsT]):
    """What a feature's selectors pick on one model, before anything is attached.

    Attributes:
        selectors: the module selectors, canonical names expanded, op selectors taken out, lists
            opened up, in the order given.
        patterns: the op selectors (and attention sub-sites), parsed.
        std: ``{canonical name: site text}`` for the canonical names selected.
        ops: the op selectors' watch plan (their modules found), or None without op selectors.
    """

    selectors: list[Any]
    patterns: list[OpPattern]
    std: dict[str, str] = field(default_factory=dict)
    ops: OpsT | None = None

    @property
    def op_modules(self) -> list[tuple[str, nn.Module]]:
        """The modules the op selectors watch: the feature's call tracker counts them, so a
        watched module called on its own opens a pass."""
        return self.ops.modules if self.ops is not None else []


def split_op_selectors(selectors: Sequence[Any]) -> tuple[list[OpPattern], list[Selector]]:
    """The op selectors (``"h.0.attn:op[softmax#0]"``, parsed: a malformed one is a ``SpecError``
    now) and the module selectors, lists opened up."""
    patterns: list[OpPattern] = []
    others: list[Selector] = []
    for selector in selectors:
        if isinstance(selector, (list, tuple)):
            if not selector:
                compile_selector(selector)  # an empty list selects nothing: the selector rules' SpecError
            inner_patterns, inner_others = split_op_selectors(selector)
            patterns.extend(inner_patterns)
            others.extend(inner_others)
            continue
        pattern = op_pattern(selector)
        if pattern is None:
            others.append(selector)
        else:
            patterns.append(pattern)
    return patterns, others


def attach_plan(
    plan: SitePlan[OpsT],
    group: Callable[[list[tuple[str, nn.Module]]], HookGroup],
    watch: Callable[[OpsT], OpWatcher],
    remove: Callable[[], None],
) -> tuple[HookGroup, OpWatcher | None]:
    """Attach a feature's hooks for ``plan``, all or nothing: ``group(op_modules)`` attaches its
    hook group (counting the op selectors' modules too), then ``watch(plan.ops)`` its op watcher;
    if the watcher fails, the group comes off again before the error leaves. ``remove`` (the
    feature's own ``remove()``) is how ``hs.remove_all`` takes both off, so the feature reads as
    removed and lets go of what it holds beside its hooks.
    """
    attached = group(plan.op_modules)
    remove_through(attached, remove)
    if plan.ops is None:
        return attached, None
    try:
        watcher = watch(plan.ops)
    except BaseException:
        attached.remove()
        raise
    remove_through(watcher._group, remove)  # the watcher's own group: remove_all finds it on its modules
    return attached, watcher

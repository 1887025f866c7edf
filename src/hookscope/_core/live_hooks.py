"""The hookscope hooks on a model right now: list them, and remove them without their owners.

Why a module of its own: :mod:`~hookscope._core.attach` attaches and removes one group through
the object that made it; these read the registry of live groups after the fact, for a user (or a
notebook) that lost that object: :func:`attached` lists the hooks, :func:`remove_all` removes
their groups, through each feature's own ``remove()`` registered by :func:`remove_through`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

from torch import nn

from hookscope._core.attach import AttachedHook, HookGroup, live_groups
from hookscope._core.names import named_modules
from hookscope._core.select import ensure_module

__all__ = ["attached", "remove_all", "remove_through"]


def attached(model: nn.Module) -> list[AttachedHook]:
    """List the hookscope hooks attached to ``model`` and its submodules right now, in model order.

    Each entry names the module (relative to ``model``), the hook kind, the owner label and the
    :class:`HookGroup` that will remove it. Hooks registered by other code are not listed.

    >>> model = nn.Sequential(nn.Linear(2, 2))
    >>> attached(model)
    []
    """
    ensure_module(model)
    order = {id(module): (index, name) for index, (name, module) in enumerate(named_modules(model))}
    found: list[tuple[int, AttachedHook]] = []
    for group in live_groups():
        for record in group._records:
            module = record.module()
            if module is not None and id(module) in order:
                index, name = order[id(module)]
                found.append((index, AttachedHook(name, record.kind, group.owner, group, record.purpose)))
    found.sort(key=lambda pair: pair[0])
    return [hook for _, hook in found]


# A feature's own remove() for its group (weakly: a forgotten feature falls back to the group's),
# so that remove_all also lets go of what the feature holds beside its hooks.
_REMOVERS: weakref.WeakKeyDictionary[HookGroup, weakref.WeakMethod[Callable[[], None]]] = weakref.WeakKeyDictionary()


def remove_through(group: HookGroup, remove: Callable[[], None]) -> None:
    """Have :func:`remove_all` take ``group`` off by calling ``remove``, the bound ``remove``
    method of the feature that owns it (a capture's also takes a write guard off that a cut-short
    forward left on). Held weakly: it keeps neither the feature nor the group alive."""
    _REMOVERS[group] = weakref.WeakMethod(remove)


def remove_all(model: nn.Module) -> int:
    """Remove every hook hookscope attached to ``model`` or its submodules; return how many.

    For a notebook where a capture, a detector or an edit was left attached and the object
    that would remove it is gone: each :class:`HookGroup` with a hook on one of the modules is
    removed whole, through its feature's own ``remove()`` where it has one, so the feature's
    object then reads as removed (``live`` is False; its ``remove()`` does nothing more). Hooks
    registered by other code (``module.register_forward_hook``) stay. The count is of the
    hooks :func:`attached` listed on the removed groups: the features' own and their call counters.

    >>> from hookscope._core.attach import HookSpec
    >>> model = nn.Sequential(nn.Linear(2, 2))
    >>> group = HookGroup(model, [HookSpec("0", model[0], "forward", lambda m, args, out: None)])
    >>> remove_all(model), group.live, remove_all(model)
    (1, False, 0)
    """
    ensure_module(model)
    inside = {id(module) for _, module in named_modules(model)}
    removed = 0
    for group in live_groups():
        modules = [record.module() for record in group._records]
        if not any(module is not None and id(module) in inside for module in [group.model, *modules]):
            continue
        removed += len(modules)
        remover = _REMOVERS.get(group)
        feature_remove = remover() if remover is not None else None
        try:
            (feature_remove or group.remove)()
        finally:
            group.remove()  # idempotent: a no-op after the feature's own remove()
    return removed

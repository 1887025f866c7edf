"""``hooks()``: plain PyTorch hook functions, attached by selector and always removed.

Code written for PyTorch's ``register_forward_hook`` works here unchanged; what hookscope adds is
picking modules by name, glob, regex, type or predicate, attaching all-or-nothing, and removing
every hook on exit, also when the forward raises. ``attached()`` lists what is attached now,
printed one row per group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeAlias

from torch import nn

from hookscope._core.attach import AttachedHook, HookGroup, HookSpec, check_kind
from hookscope._core.live_hooks import attached as attached_hooks
from hookscope._core.select import Selector, ensure_module, select
from hookscope._core.tracker import CallTracker
from hookscope._shared.tables import Column, Table
from hookscope._shared.units import counted
from hookscope.errors import SpecError

__all__ = ["AttachedHooks", "HookMap", "attached", "hooks"]

HookFn = Callable[..., Any]
# Mapping keys are Any because Mapping is invariant in its key type: a dict[str, fn] must fit.
HookMap: TypeAlias = Mapping[Any, HookFn | Iterable[HookFn]] | Iterable[tuple[Selector, HookFn | Iterable[HookFn]]]


def hooks(
    model: nn.Module,
    hook_map: HookMap,
    *,
    kind: str = "forward",
    with_kwargs: bool = False,
    prepend: bool = False,
    always_call: bool = False,
    track_calls: bool = False,
    restore_mode: bool = True,
    owner: str = "hooks",
) -> HookGroup:
    """Attach plain PyTorch hook functions to the modules each selector picks.

    ``hook_map`` maps selectors to a function (or a list of functions); pairs
    ``[(selector, fn), ...]`` work too, for selectors that cannot be dict keys. Each function is
    registered exactly as PyTorch's own method for ``kind`` would register it, so it is called
    the PyTorch way and may return a replacement:

    ==================  =========================================  =======================
    ``kind``            called as                                  may return
    ==================  =========================================  =======================
    ``"forward_pre"``   ``fn(module, args)``                       new args
    (``with_kwargs``)   ``fn(module, args, kwargs)``               ``(args, kwargs)``
    ``"forward"``       ``fn(module, args, output)``               new output
    (``with_kwargs``)   ``fn(module, args, kwargs, output)``       new output
    ``"backward_pre"``  ``fn(module, grad_output)``                new grad_output
    ``"backward"``      ``fn(module, grad_input, grad_output)``    new grad_input
    ==================  =========================================  =======================

    Every selector is resolved and every function checked before anything is attached; then all
    hooks attach or none stays. The returned :class:`HookGroup` is a context manager; on exit (or
    ``remove()``) only its own hooks are removed and each module's train/eval mode is restored
    (``restore_mode=False`` keeps changes made meanwhile). With ``track_calls=True`` the group
    numbers repeated calls of a module within a pass: ``group.call_index(module)`` inside a hook,
    ``group.calls`` afterwards. The hooks run on every thread, as PyTorch's do; the numbering
    follows the thread that attached them, and a forward on another thread is not numbered.

    Example::

        def show(module, args, output):
            print(type(module).__name__, tuple(args[0].shape), "->", tuple(output.shape))

        with hs.hooks(model, {"layer*.conv2": show, nn.Linear: show}):
            model(x)
        # every hook is gone here, also if model(x) raised
    """
    ensure_module(model)
    checked_kind = check_kind(kind)
    specs = [
        HookSpec(name, module, checked_kind, fn, with_kwargs, prepend, always_call)
        for selector, fns in _entries(hook_map)
        for name, module in select(model, selector)
        for fn in fns
    ]
    tracker = CallTracker() if track_calls else None
    return HookGroup(model, specs, owner=owner, tracker=tracker, restore_mode=restore_mode)


def _entries(hook_map: HookMap) -> list[tuple[Selector, list[HookFn]]]:
    if isinstance(hook_map, Mapping):
        pairs: Iterable[Any] = hook_map.items()
    elif isinstance(hook_map, Iterable) and not isinstance(hook_map, (str, nn.Module)):
        pairs = hook_map
    else:
        raise SpecError(
            f"hooks expects a mapping {{selector: fn}} or pairs [(selector, fn)], got {type(hook_map).__name__}; "
            "e.g. hs.hooks(model, {'fc': my_hook})"
        )
    entries = []
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise SpecError(f"hooks expects (selector, fn) pairs, got {pair!r}; e.g. [('fc', my_hook)]")
        selector, fns = pair
        fn_list = list(fns) if isinstance(fns, (list, tuple)) else [fns]
        if not fn_list:
            raise SpecError(f"no hook function given for selector {selector!r}; give a function or a list of them")
        entries.append((selector, fn_list))
    if not entries:
        raise SpecError("hooks was given no (selector, fn) entries; e.g. hs.hooks(model, {'fc': my_hook})")
    return entries


class AttachedHooks(list[AttachedHook]):
    """The hookscope hooks on a model, as :func:`attached` lists them: a list of
    :class:`~hookscope.AttachedHook`, one per hook, that prints as one row per group.

    A detector on a 70-module model attaches 280 hooks (its own two per module, and the call
    counters); the table says that in one line: the group, its owner, its hooks by kind, the
    modules they sit on, and the call counters and compile checks beside them.
    """

    def _table(self) -> Table:
        groups: dict[int, list[AttachedHook]] = {}
        for hook in self:
            groups.setdefault(hook.group.number, []).append(hook)
        title = f"{counted(len(self), 'hookscope hook')} in {counted(len(groups), 'group')}"
        if not groups:
            title = "no hookscope hooks attached"
        columns = [Column("group"), Column("owner"), Column("hooks"), Column("modules", "right"), Column("also")]
        notes = ["each group goes with its object's .remove(); all of them with hs.remove_all(model)"]
        table = Table(columns, title=title, notes=notes if groups else [])
        for number, hooks in groups.items():
            own = [hook for hook in hooks if hook.purpose == "hook"]
            kinds: dict[str, int] = {}
            for hook in own:
                kinds[hook.kind] = kinds.get(hook.kind, 0) + 1
            helpers: dict[str, int] = {}
            for hook in hooks:
                if hook.purpose != "hook":
                    helpers[hook.purpose] = helpers.get(hook.purpose, 0) + 1
            modules = len({hook.module for hook in own or hooks})
            table.add(
                f"#{number}",
                hooks[0].owner,
                " ".join(f"{kind}×{count}" for kind, count in kinds.items()) or "-",
                f"{modules:,}",
                ", ".join(counted(count, purpose) for purpose, count in helpers.items()),
            )
        return table

    def __repr__(self) -> str:
        return self._table().text()

    def _repr_html_(self) -> str:
        return self._table().html()


def attached(model: nn.Module) -> AttachedHooks:
    """The hookscope hooks attached to ``model`` and its submodules right now, in model order.

    Each entry (an :class:`~hookscope.AttachedHook`) names the module (relative to ``model``),
    the hook kind, the owner label and the :class:`HookGroup` that will remove it. Hooks
    registered by other code are not listed. The list prints as one row per group.

    >>> import torch
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    >>> with hooks(model, {"0": lambda module, args, output: None}, owner="probe"):
    ...     listed = attached(model)
    ...     table = repr(listed).splitlines()
    >>> len(listed), listed[0].module, listed[0].kind, table[0], table[3].split()
    (1, '0', 'forward', '1 hookscope hook in 1 group', ['#...', 'probe', 'forward×1', '1'])
    >>> attached(model)
    no hookscope hooks attached
    """
    return AttachedHooks(attached_hooks(model))

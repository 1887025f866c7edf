"""Attach hooks to modules and always take them off again.

This is the only file that calls PyTorch's ``register_*hook`` methods, and the only one that
wraps a module's call or forward (:class:`WrapSpec`: what a hook cannot do, run code exactly
around the forward whatever other hooks are attached). Everything that attaches (``hooks``,
``capture``, ``edit``, ...) builds a list of :class:`HookSpec` (and :class:`WrapSpec`) and hands
it to :class:`HookGroup`, which follows the contract of PyTorch's ``RemovableHandle``:

- attaching is transactional: all hooks of a group are attached, or none stay;
- ``remove()`` is idempotent and removes only this group's own handles, so a user's hooks and
  other libraries' hooks survive, as do other (nested) hookscope groups;
- the group is a context manager that removes on exit, also when the forward raised;
- the train/eval mode of every module is restored on removal;
- the group holds no strong reference to the model, like ``RemovableHandle``.

Live groups are listed in a registry that :func:`~hookscope._core.live_hooks.attached` reads:
hookscope never looks into PyTorch's private hook dictionaries. The registry holds groups
weakly; what keeps a group alive is its modules: each hooked module (and the model) holds an *anchor* to it, a no-op
``load_state_dict`` post-hook that never runs in a forward. A group nobody removed therefore
lives exactly as long as a module it hooks: a model dropped with a capture still attached is
garbage-collected with the capture and every value it kept.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, TypeVar

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from hookscope._core.compat.compiled import (
    eager_routes,
    guard_hook_dicts,
    note_registration,
    sentinels,
    watching_wrappers,
)
from hookscope._core.compat.fx import refuse_uncalled
from hookscope._core.compat.offload import refuse_real_inputs, unloaded_tensor
from hookscope._core.hook_spec import HOOK_KINDS, HookKind, HookSpec, check_kind
from hookscope._core.names import module_label, named_modules
from hookscope._core.select import ensure_module
from hookscope._core.tracker import CallTracker
from hookscope._core.wrap import WrapHandle, WrapSpec, copied_error
from hookscope.errors import SpecError

__all__ = [
    "HOOK_KINDS",
    "AttachedHook",
    "AttachedKind",
    "HookGroup",
    "HookKind",
    "HookSpec",
    "Scoped",
    "WrapSpec",
    "check_kind",
    "live_groups",
]

#: What a listed hook is: a module hook of a kind above, a wrapper, or a parameter's
#: post-accumulate-grad hook (:meth:`HookGroup.add_grad_accumulated`).
AttachedKind = HookKind | Literal["call wrapper", "forward wrapper", "grad accumulated"]

# Groups with hooks attached, weakly, by group number (ascending: insertion order). Strong
# references would keep every forgotten group's model and captured values alive for good.
_LIVE_GROUPS: weakref.WeakValueDictionary[int, HookGroup] = weakref.WeakValueDictionary()
_group_numbers = itertools.count(1)


@dataclass(frozen=True)
class AttachedHook:
    """One live hookscope hook, as listed by :func:`~hookscope._core.live_hooks.attached`."""

    module: str
    kind: AttachedKind
    owner: str
    group: HookGroup
    purpose: str  # "hook": the caller's function; "call counter": per-call numbering; "compile check"; "eager route"


@dataclass(frozen=True)
class _Record:
    name: str
    module: weakref.ReferenceType[nn.Module]
    kind: AttachedKind
    purpose: str
    handle: RemovableHandle | WrapHandle


class HookGroup:
    """Hooks attached together and removed together.

    Built from a list of :class:`HookSpec`; every hook is attached in the constructor or, if
    one fails, none stays attached. Use it as a context manager, or call :meth:`remove`
    (idempotent) when done::

        with HookGroup(model, [HookSpec("fc", model.fc, "forward", print_shapes)]) as group:
            model(x)
        assert not group.live

    With a :class:`~hookscope._core.tracker.CallTracker`, the group also numbers each call of the
    hooked modules, the root, and any extra modules named in ``count``, within each forward
    pass: ``group.call_index(module)`` inside a hook, ``group.calls`` after the pass.
    """

    def __init__(
        self,
        model: nn.Module,
        specs: Sequence[HookSpec],
        *,
        owner: str = "hooks",
        tracker: CallTracker | None = None,
        count: Sequence[tuple[str, nn.Module]] = (),
        restore_mode: bool = True,
        wraps: Sequence[WrapSpec] = (),
    ) -> None:
        ensure_module(model)
        self.owner = owner
        self.number = next(_group_numbers)
        self._model = weakref.ref(model)
        self._tracker = tracker
        self._records: list[_Record] = []
        self._anchors: list[RemovableHandle] = []
        self._modes = [(weakref.ref(m), m.training) for m in model.modules()] if restore_mode else []
        self._live = True
        # Called on removal, or when a group nobody removed is collected.
        self._guards = weakref.finalize(self, guard_hook_dicts())
        try:
            self._attach(model, specs, count)
            for wrap in wraps:
                handle = WrapHandle(wrap.module, self.owner, wrap.around, wrap.fn)
                kind: Literal["call wrapper", "forward wrapper"] = (
                    "call wrapper" if wrap.around == "call" else "forward wrapper"
                )
                self._records.append(_Record(wrap.name, weakref.ref(wrap.module), kind, "hook", handle))
        except BaseException:
            self._live = False
            self._detach_all()
            raise
        _LIVE_GROUPS[self.number] = self

    def _attach(self, model: nn.Module, specs: Sequence[HookSpec], count: Sequence[tuple[str, nn.Module]]) -> None:
        refuse_uncalled(model, [spec.name for spec in specs])
        hooked = [*(spec.module for spec in specs), *(module for _, module in count)]
        for name, module, around, fn in eager_routes(model, hooked):
            route = WrapHandle(module, self.owner, around, fn)  # type: ignore[arg-type]
            wrapped: Literal["call wrapper", "forward wrapper"] = (
                "forward wrapper" if around == "forward" else "call wrapper"
            )
            self._records.append(_Record(name, weakref.ref(module), wrapped, "eager route", route))
        for name, module, kind, fn in sentinels(model, hooked):
            self._add(name, module, kind, "compile check", fn)  # type: ignore[arg-type]
        meta = unloaded_tensor(model)  # found once here: a loaded model gets no hook for it
        if meta is not None:
            self._add("", model, "forward_pre", "meta check", _meta_check(meta), with_kwargs=True, prepend=True)
        tracked: dict[int, tuple[str, nn.Module]] = {}
        if self._tracker is not None:
            tracked[id(model)] = ("", model)
            for name, module in [*((spec.name, spec.module) for spec in specs), *count]:
                tracked.setdefault(id(module), (name, module))
        # With a tracker, prepended hooks go on before the call counters, which are prepended
        # after them: each call is opened before any hook of this group runs, prepended or not.
        early = [spec for spec in specs if spec.prepend] if self._tracker is not None else []
        for spec in early:
            self._add_spec(spec)
        if self._tracker is not None:
            for name, module in tracked.values():
                self._tracker.watch(name, module)
                self._add(name, module, "forward_pre", "call counter", _enter_hook(self._tracker), prepend=True)
        for spec in specs:
            if not any(spec is other for other in early):
                self._add_spec(spec)
        if self._tracker is not None:  # closes the call after every hook of this group has run
            for name, module in tracked.values():
                closer = _exit_hook(self._tracker)
                self._add(name, module, "forward", "call counter", closer, with_kwargs=True, always_call=True)
        self._anchor([model, *hooked])

    def _add_spec(self, spec: HookSpec) -> None:
        self._add(
            spec.name,
            spec.module,
            spec.kind,
            "hook",
            spec.fn,
            with_kwargs=spec.with_kwargs,
            prepend=spec.prepend,
            always_call=spec.always_call,
        )

    def _anchor(self, modules: Sequence[nn.Module]) -> None:
        """Make each module keep this group alive (the registry holds it weakly): a no-op
        ``load_state_dict`` post-hook referring to the group, which no forward ever calls."""
        anchor = _Anchor(self)
        for module in {id(module): module for module in modules}.values():
            self._anchors.append(module.register_load_state_dict_post_hook(anchor))  # type: ignore[no-untyped-call]

    def _add(
        self,
        name: str,
        module: nn.Module,
        kind: HookKind,
        purpose: str,
        fn: Callable[..., Any],
        *,
        with_kwargs: bool = False,
        prepend: bool = False,
        always_call: bool = False,
    ) -> None:
        handle: RemovableHandle
        if kind == "forward_pre":
            handle = module.register_forward_pre_hook(fn, prepend=prepend, with_kwargs=with_kwargs)
        elif kind == "forward":
            handle = module.register_forward_hook(fn, prepend=prepend, with_kwargs=with_kwargs, always_call=always_call)
        elif kind == "backward_pre":
            handle = module.register_full_backward_pre_hook(fn, prepend=prepend)
        else:
            handle = module.register_full_backward_hook(fn, prepend=prepend)
        self._records.append(_Record(name, weakref.ref(module), kind, purpose, handle))

    def add_grad_accumulated(
        self, name: str, module: nn.Module, parameter: torch.Tensor, fn: Callable[[torch.Tensor], None]
    ) -> None:
        """Call ``fn(parameter)`` each time a backward has accumulated ``parameter``'s gradient
        (PyTorch's post-accumulate-grad hook), as a hook of this group: listed under ``module``
        (the one holding the parameter) by :func:`~hookscope._core.live_hooks.attached`, and removed with the group, by
        :func:`~hookscope._core.live_hooks.remove_all` too, whoever else forgot it."""
        if not self._live:
            raise SpecError(f"hookscope.{self.owner}: its hooks were removed; attach a new one")
        handle = parameter.register_post_accumulate_grad_hook(fn)  # type: ignore[no-untyped-call]
        self._records.append(_Record(name, weakref.ref(module), "grad accumulated", "hook", handle))

    @property
    def live(self) -> bool:
        """True until :meth:`remove` has run."""
        return self._live

    @property
    def model(self) -> nn.Module | None:
        """The model the group was attached to, or None if it has been garbage-collected."""
        return self._model()

    @property
    def calls(self) -> dict[str, int]:
        """``{module name: calls}`` in the latest forward pass (the root is named ``""``)."""
        if self._tracker is None:
            raise SpecError("this group does not count calls; attach it with track_calls=True")
        return self._tracker.counts()

    def call_index(self, module: nn.Module) -> int:
        """Index (0, 1, ...) of ``module``'s current call in this pass; valid inside its hooks,
        on the thread that attached the group (calls on other threads are not numbered)."""
        tracker = self._tracker
        if tracker is None:
            raise SpecError("this group does not count calls; attach it with track_calls=True")
        if tracker.shared and tracker.foreign():
            raise SpecError(
                "call_index() numbers the calls of the thread that attached the hooks, and this call runs on "
                "another thread: its calls are not numbered; attach the hooks on the thread that runs the model"
            )
        return tracker.current(module)

    def remove(self) -> None:
        """Remove every hook of this group and restore train/eval modes. Safe to call twice."""
        if not self._live:
            return
        self._live = False
        _LIVE_GROUPS.pop(self.number, None)
        try:
            self._detach_all()
        finally:
            for module_ref, training in self._modes:
                module = module_ref()
                if module is not None:  # per module, not train(): children may have had other modes
                    module.training = training
            if self._tracker is not None:
                self._tracker.reset()

    def _detach_all(self) -> None:
        records, self._records = self._records, []
        for record in reversed(records):
            record.handle.remove()
        anchors, self._anchors = self._anchors, []
        for handle in anchors:
            handle.remove()
        self._guards()

    def hooks(self) -> Iterator[AttachedHook]:
        """The hooks this group has attached (empty once removed)."""
        for record in self._records:
            yield AttachedHook(record.name, record.kind, self.owner, self, record.purpose)

    def __len__(self) -> int:
        return sum(1 for record in self._records if record.purpose == "hook")

    def __enter__(self) -> HookGroup:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.note_failure(exc)
        self.remove()

    def note_failure(self, error: object) -> None:
        """Add a note to ``error`` naming the model's innermost module whose forward it came
        out of (read from its traceback, so any module counts, hooked or not); a note of that
        kind already there (the trace's own) is not repeated."""
        model = self.model
        if not isinstance(error, Exception) or model is None or not hasattr(error, "add_note"):
            return
        if any("the error went through" in note for note in getattr(error, "__notes__", ())):
            return
        where = raised_in(model, error)
        if where is not None:
            error.add_note(f"hookscope.{self.owner}: the error went through {where}")

    def __repr__(self) -> str:
        state = "live" if self._live else "removed"
        return f"<HookGroup #{self.number} owner={self.owner!r}: {len(self)} hooks, {state}>"


ScopedT = TypeVar("ScopedT", bound="Scoped")


class Scoped:
    """``RemovableHandle``'s contract for a feature that owns a :class:`HookGroup` (``_group``):
    ``live``, an idempotent ``remove()``, and a ``with`` block that removes on exit."""

    _group: HookGroup

    @property
    def live(self) -> bool:
        """True until the hooks have been removed."""
        return self._group.live

    def remove(self) -> None:
        """Remove every hook of this object. Safe to call twice."""
        self._group.remove()

    def __enter__(self: ScopedT) -> ScopedT:
        return self

    def __exit__(self, *exc: object) -> bool | None:
        if len(exc) > 1:
            self._group.note_failure(exc[1])
        self.remove()
        return None


def live_groups() -> list[HookGroup]:
    """Every group with hooks still attached, on any model (used by the test suite's leak check)."""
    return list(_LIVE_GROUPS.values())


class _Anchor:
    """A ``load_state_dict`` post-hook that does nothing when called: it is there to hold a
    :class:`HookGroup` alive for as long as the module whose hook dict holds it."""

    __slots__ = ("group",)

    def __init__(self, group: HookGroup) -> None:
        self.group = group

    def __call__(self, module: nn.Module, incompatible_keys: Any) -> None:
        return None

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise copied_error(self.group.owner, "copied", "copy")

    def __reduce__(self) -> Any:
        raise copied_error(self.group.owner, "pickled", "save")


def _watch_wrappers() -> None:
    """Attach, once per process (on import, before most wrappers exist), the global
    module-registration hook that notes each ``torch.compile`` wrapper as it is made, so that
    finding the wrappers around a model at each attach needs no walk of the heap
    (:mod:`hookscope._core.compat.compiled`)."""
    register = getattr(torch.nn.modules.module, "register_module_module_registration_hook", None)
    if register is not None:
        register(note_registration)
    watching_wrappers(register is not None)


_watch_wrappers()


def _meta_check(meta: str) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None]:
    """A pre-hook on the root of a model built on ``meta``: a call on inputs with values is
    refused, as ``hs.layers`` refuses it, before any hook of the group sees meta values
    (a shapes-only run, on meta inputs, passes)."""

    def check(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        refuse_real_inputs(meta, (args, kwargs))

    return check


def _enter_hook(tracker: CallTracker) -> Callable[[nn.Module, Any], None]:
    enter = tracker.enter

    def count_call(module: nn.Module, _args: Any) -> None:
        enter(module)

    return count_call


def raised_in(model: nn.Module, error: BaseException) -> str | None:
    """``"h.0.mlp (GPT2MLP)"``: the innermost of ``model``'s modules running when ``error`` was
    raised, from the frames its traceback holds; None when it came from outside them."""
    names = {id(module): name for name, module in named_modules(model)}
    found: str | None = None
    traceback = error.__traceback__
    while traceback is not None:
        owner = traceback.tb_frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            found = f"{module_label(names[id(owner)])} ({type(owner).__name__})"
        traceback = traceback.tb_next
    return found


def _exit_hook(tracker: CallTracker) -> Callable[[nn.Module, Any, Any, Any], None]:
    exit_call = tracker.exit

    def close_call(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        exit_call(module, args, kwargs, output)

    return close_call

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

Live groups are listed in a registry that :func:`attached` reads: hookscope never looks into
PyTorch's private hook dictionaries. The registry holds groups weakly; what keeps a group alive
is its modules: each hooked module (and the model) holds an *anchor* to it, a no-op
``load_state_dict`` post-hook that never runs in a forward. A group nobody removed therefore
lives exactly as long as a module it hooks: a model dropped with a capture still attached is
garbage-collected with the capture and every value it kept.
"""

from __future__ import annotations

import copy
import difflib
import inspect
import itertools
import operator
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, TypeVar, get_args

import torch
import torch.fx
from torch import nn
from torch.utils.hooks import RemovableHandle

from hookscope._core.compat.compiled import (
    eager_routes,
    guard_hook_dicts,
    never_compiled,
    note_registration,
    sentinels,
    watching_wrappers,
)
from hookscope._core.compat.offload import refuse_real_inputs, unloaded_tensor
from hookscope._core.names import module_label, named_modules
from hookscope._core.select import ensure_module
from hookscope._core.sites import CallTracker
from hookscope.errors import HookscopeError, SpecError, UnsupportedModelError

__all__ = [
    "HOOK_KINDS",
    "AttachedHook",
    "AttachedKind",
    "HookGroup",
    "HookKind",
    "HookSpec",
    "Scoped",
    "WrapKind",
    "WrapSpec",
    "attached",
    "calls_through_call_impl",
    "check_kind",
    "live_groups",
    "refuse_uncalled",
]

HookKind = Literal["forward_pre", "forward", "backward_pre", "backward"]
HOOK_KINDS: tuple[str, ...] = get_args(HookKind)
#: What a listed hook is: a module hook of a kind above, a wrapper, or a parameter's
#: post-accumulate-grad hook (:meth:`HookGroup.add_grad_accumulated`).
AttachedKind = HookKind | Literal["call wrapper", "forward wrapper", "grad accumulated"]
#: What a :class:`WrapSpec` runs around: ``"call"`` the module's whole call (its hooks, from the
#: first pre-hook to the last forward hook, and the forward), ``"forward"`` its forward alone;
#: ``"compiled"``, the call ``model.compile()`` compiled (only the compile routes wrap it).
WrapKind = Literal["call", "forward", "compiled"]
_WRAPPED_ATTRIBUTE: dict[str, str] = {"call": "_call_impl", "forward": "forward", "compiled": "_compiled_call_impl"}

# How PyTorch calls each kind of hook, for the arity check made once at attach time.
_SIGNATURES: dict[tuple[str, bool], str] = {
    ("forward_pre", False): "fn(module, args)",
    ("forward_pre", True): "fn(module, args, kwargs)",
    ("forward", False): "fn(module, args, output)",
    ("forward", True): "fn(module, args, kwargs, output)",
    ("backward_pre", False): "fn(module, grad_output)",
    ("backward", False): "fn(module, grad_input, grad_output)",
}

# Groups with hooks attached, weakly, by group number (ascending: insertion order). Strong
# references would keep every forgotten group's model and captured values alive for good.
_LIVE_GROUPS: weakref.WeakValueDictionary[int, HookGroup] = weakref.WeakValueDictionary()
_group_numbers = itertools.count(1)


def check_kind(kind: str) -> HookKind:
    """Return ``kind`` if it names a hook kind, else raise ``SpecError`` with the closest kind."""
    if kind in HOOK_KINDS:
        return kind  # type: ignore[return-value]
    close = difflib.get_close_matches(str(kind), HOOK_KINDS, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise SpecError(f"hook kind {kind!r} is unknown; expected one of {', '.join(HOOK_KINDS)}{hint}")


@dataclass(frozen=True)
class HookSpec:
    """One hook to attach: which module, which PyTorch hook kind, which function, which flags.

    ``fn`` is called exactly as PyTorch calls that kind of hook (see ``signature``); a value it
    returns replaces the inputs/output/gradients as PyTorch documents.
    """

    name: str
    module: nn.Module
    kind: HookKind
    fn: Callable[..., Any]
    with_kwargs: bool = False
    prepend: bool = False
    always_call: bool = False
    fitted: bool = False  # hookscope's own hooks, written for this kind: skip the signature check

    def __post_init__(self) -> None:
        check_kind(self.kind)
        if self.with_kwargs and self.kind not in ("forward_pre", "forward"):
            raise SpecError(f"with_kwargs=True applies to forward and forward_pre hooks, not {self.kind!r}")
        if self.always_call and self.kind != "forward":
            raise SpecError(f"always_call=True applies to forward hooks only, not {self.kind!r}")
        if not callable(self.fn):
            raise SpecError(
                f"the hook for {module_label(self.name)!r} is a {type(self.fn).__name__}, not callable; "
                f"expected a function called as {self.signature}"
            )
        if isinstance(self.module, torch.jit.ScriptModule):
            raise UnsupportedModelError(
                f"module {module_label(self.name)!r} is a TorchScript {type(self.module).__name__}: "
                "scripted code never runs Python hooks; hook the eager module instead, or pick "
                "modules outside the scripted part"
            )
        if not self.fitted:
            _check_arity(self)

    @property
    def signature(self) -> str:
        """How PyTorch will call ``fn``, e.g. ``fn(module, args, output)``."""
        return _SIGNATURES[(self.kind, self.with_kwargs)]


@dataclass(frozen=True)
class WrapSpec:
    """Run ``fn`` around one module's call or forward: ``fn(inner, args, kwargs)`` must return
    ``inner(*args, **kwargs)`` (it may run code before and after, in ``try``/``finally``).

    Why not hooks: hooks run in the order attached, so no hook can run *last before* the
    forward once another pre-hook is attached after it, and ``always_call`` forward hooks are
    skipped by a ``KeyboardInterrupt``. A wrapper of ``forward`` brackets the forward itself;
    a wrapper of the call (the instance's ``_call_impl``, which ``nn.Module.__call__`` looks up)
    brackets every hook of the module too.

    Installed as an instance attribute and removed by :class:`HookGroup` like a hook; if other
    code wrapped the same attribute after it (accelerate wraps ``forward``), removal leaves a
    pass-through in place rather than undo the other wrapper (it copies and pickles as what
    it wraps, so the model can still be saved). Under ``torch.compile`` a wrapped
    module runs eagerly, everything it calls included (a graph break around it): what a wrapper
    watches then runs as written.
    """

    name: str
    module: nn.Module
    around: WrapKind
    fn: Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]

    def __post_init__(self) -> None:
        if self.around not in _WRAPPED_ATTRIBUTE:
            raise SpecError(f"wrap kind {self.around!r} is unknown; expected 'call' or 'forward'")
        if self.around == "call" and nn.Module.__call__ is not getattr(nn.Module, "_wrapped_call_impl", None):
            raise UnsupportedModelError(
                f"this torch ({torch.__version__}) calls modules without looking up _call_impl on the instance, "
                "which op sites need; use torch 2.1 or later"
            )
        if self.around == "call" and not calls_through_call_impl(self.module):
            raise UnsupportedModelError(
                f"module {module_label(self.name)!r} ({type(self.module).__name__}) overrides __call__, so its "
                "forward may run without nn.Module's call: select a module that is called as nn.Module calls"
            )


def calls_through_call_impl(module: nn.Module) -> bool:
    """Whether calling ``module`` goes through ``nn.Module.__call__`` (so a ``"call"`` wrap sees
    the call): False for classes that override ``__call__`` (torch.compile's ``OptimizedModule``)."""
    return type(module).__call__ is nn.Module.__call__


class _Wrapper:
    """The callable put in the module's ``__dict__``; a pass-through once removed while other
    code's wrapper sits above it.

    Never compiled (a graph break around it under ``torch.compile``), and never copied: a
    ``copy.deepcopy`` of a wrapped module would keep a wrapper calling the *original* module,
    silently, so copying one is refused with the fix (as the hooks' anchors refuse it).
    ``had`` and ``previous`` are what the attribute held before it (``inner`` is that, or the
    class's method, bound), so a stack of wrappers can be taken apart in any order.
    """

    __slots__ = ("active", "fn", "had", "inner", "owner", "previous")

    def __init__(self, fn: Callable[..., Any], module: nn.Module, attribute: str, owner: str) -> None:
        self.fn = fn
        self.owner = owner
        self.had = attribute in module.__dict__
        self.previous = module.__dict__.get(attribute)
        self.inner: Callable[..., Any] = getattr(module, attribute)
        self.active = True

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        if self.active:
            return self.fn(self.inner, args, kwargs)
        return self.inner(*args, **kwargs)

    __call__ = never_compiled(_call)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        if not self.active:  # a pass-through left behind: the copy gets what it wraps, bound to the copy
            return copy.deepcopy(self.inner, memo)
        raise _copied(self.owner, "copied", "copy")

    def __reduce__(self) -> Any:
        if not self.active:
            # A pass-through left behind under other code's wrapper: it pickles as what it wraps
            # (memoised with the rest), through a stdlib function, so loading needs no hookscope.
            return (operator.getitem, ((self.inner,), 0))
        raise _copied(self.owner, "pickled", "save")


def _wrapped_attribute(module: nn.Module, around: WrapKind) -> str:
    """The instance attribute to wrap: ``_call_impl`` for the call; for the forward, the one
    that runs the module's own code: accelerate's ``_old_forward`` under its hook (its
    ``forward`` runs the hook's pre- and post-forward work around it, not the module's code)."""
    if around == "forward" and "_old_forward" in module.__dict__ and hasattr(module, "_hf_hook"):
        return "_old_forward"
    return _WRAPPED_ATTRIBUTE[around]


class _WrapHandle:
    """Removes one :class:`_Wrapper`, whatever the order: on top, it restores what the attribute
    held (and unwinds pass-throughs below it); under another hookscope wrapper, it is spliced
    out of the chain; under other code's wrapper, it stays as a pass-through."""

    def __init__(self, module: nn.Module, owner: str, around: WrapKind, fn: Callable[..., Any]) -> None:
        self._module = weakref.ref(module)
        self._attribute = _wrapped_attribute(module, around)
        self._wrapper = _Wrapper(fn, module, self._attribute, owner)
        module.__dict__[self._attribute] = self._wrapper

    def remove(self) -> None:
        wrapper = self._wrapper
        if not wrapper.active:
            return
        wrapper.active = False
        module = self._module()
        if module is None:
            return
        held = module.__dict__
        attribute = self._attribute
        if held.get(attribute) is wrapper:
            _unwind(held, attribute, wrapper)
            return
        above = held.get(attribute)
        while isinstance(above, _Wrapper):  # hookscope's own wrappers above it: splice it out
            if above.inner is wrapper:
                above.inner, above.had, above.previous = wrapper.inner, wrapper.had, wrapper.previous
                return
            above = above.inner
        if self._attribute == "forward" and held.get("_old_forward") is wrapper:
            held["_old_forward"] = wrapper.inner  # accelerate wrapped it since: give it what we wrapped
            return
        # under other code's wrapper: left as a pass-through


def _unwind(held: dict[str, Any], attribute: str, wrapper: _Wrapper) -> None:
    """Put back what ``wrapper`` replaced, and what each pass-through under it replaced."""
    while True:
        if wrapper.had:
            held[attribute] = wrapper.previous
        else:
            held.pop(attribute, None)
        below = held.get(attribute)
        if not (isinstance(below, _Wrapper) and not below.active):
            return
        wrapper = below


@dataclass(frozen=True)
class AttachedHook:
    """One live hookscope hook, as listed by :func:`attached`."""

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
    handle: RemovableHandle | _WrapHandle


class HookGroup:
    """Hooks attached together and removed together.

    Built from a list of :class:`HookSpec`; every hook is attached in the constructor or, if
    one fails, none stays attached. Use it as a context manager, or call :meth:`remove`
    (idempotent) when done::

        with HookGroup(model, [HookSpec("fc", model.fc, "forward", print_shapes)]) as group:
            model(x)
        assert not group.live

    With a :class:`~hookscope._core.sites.CallTracker`, the group also numbers each call of the
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
                handle = _WrapHandle(wrap.module, self.owner, wrap.around, wrap.fn)
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
            route = _WrapHandle(module, self.owner, around, fn)  # type: ignore[arg-type]
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
        (the one holding the parameter) by :func:`attached`, and removed with the group, by
        :func:`remove_all` too, whoever else forgot it."""
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


def refuse_uncalled(model: nn.Module, names: Sequence[str]) -> None:
    """Refuse hooks on submodules of a ``torch.fx.GraphModule`` that its graph never calls.

    An ``ExportedProgram.module()`` keeps its submodules only as holders of weights (its graph
    reads them with ``get_attr``), and a ``symbolic_trace``d model calls its leaves but never
    its containers: a hook on either would never fire, which is silent loss.
    """
    graph = getattr(model, "graph", None)
    if graph is None or not isinstance(model, torch.fx.GraphModule):
        return
    called = {str(node.target) for node in graph.nodes if node.op == "call_module"}
    never = [name for name in dict.fromkeys(names) if name and name not in called]
    if never:
        shown = ", ".join(repr(name) for name in never[:6]) + (" ..." if len(never) > 6 else "")
        usable = ", ".join(repr(name) for name in sorted(called)[:6]) or "none: only the root"
        raise UnsupportedModelError(
            f"{type(model).__name__} is a torch.fx GraphModule whose graph never calls {shown}, so hooks on "
            f"them would never fire (torch.export's ExportedProgram.module() reads the weights directly); "
            f"modules its graph calls: {usable}; hook the root, or the eager model before it is exported or traced"
        )


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
        raise _copied(self.group.owner, "copied", "copy")

    def __reduce__(self) -> Any:
        raise _copied(self.group.owner, "pickled", "save")


def _copied(owner: str, how: str, fix: str) -> HookscopeError:
    """The refusal to copy or pickle a module while hookscope is attached to it: the copy would
    carry the hooks (or op-site wrappers) and report into, or run, the original."""
    return HookscopeError(
        f"a module is being {how} while hookscope.{owner} is attached to it: the copy would carry its hooks "
        f"and report into (or run) the original; {fix} the model before "
        "attaching, or after removal (leave the with-block, or call .remove())"
    )


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


def _check_arity(spec: HookSpec) -> None:
    """Refuse, at attach time, a function PyTorch could not call with this kind's arguments."""
    try:
        signature = inspect.signature(spec.fn)
    except (TypeError, ValueError):  # builtins and some C callables: nothing to check
        return
    n_args = _arity(spec.signature)
    if _binds(signature, n_args):
        return
    fitting = [
        f"kind={kind!r}" + (", with_kwargs=True" if with_kwargs else "")
        for (kind, with_kwargs), text in _SIGNATURES.items()
        if _arity(text) != n_args and _binds(signature, _arity(text))
    ]
    hint = f"; did you mean {' or '.join(fitting)}?" if fitting else ""
    raise SpecError(
        f"hook {getattr(spec.fn, '__qualname__', spec.fn)!r} for {module_label(spec.name)!r} takes "
        f"{signature}, but a {spec.kind} hook is called as {spec.signature}{hint}"
    )


def _arity(call: str) -> int:
    """How many arguments a call written like ``fn(module, args, output)`` passes."""
    return call.count(",") + 1


def _binds(signature: inspect.Signature, n_args: int) -> bool:
    try:
        signature.bind(*range(n_args))
    except TypeError:
        return False
    return True


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

    >>> import torch
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

"""Op sites: watch the torch functions a selected module's own code calls, and only those.

Module hooks see what crosses a module's boundary; attention probabilities, pre-softmax scores
and the residual ``+=`` inside a block never do. :class:`OpWatcher` reports every torch
function call made inside selected modules, numbered per module call (``softmax#0``,
``softmax#1``), to a listener that may replace the result. :func:`~hookscope._core.op_list.list_ops` runs one forward
and lists every op site, so users can find their names.

How, and what it costs:

- **Scoped.** Each module inside the watch gets two wrappers (:class:`~hookscope._core.attach.WrapSpec`,
  instance attributes taken off on removal): one around its whole call, hooks included, one
  around its forward. The function mode is pushed when a selected module's forward starts,
  reports only while that module's own code runs, and is taken off in ``finally`` however the
  forward ends (an exception, Ctrl-C); modes the forward pushes meanwhile keep their order.
  Several watchers on one op see it in the order they were attached, as hooks do.
  Other modules, models and threads run with no mode at all: nothing is patched globally
  (torchlens wraps every torch function, 3-4x here).
- **A module's own code.** With ``children=False`` (the default) every submodule of a selected
  module (every descendant: a ModuleList's items are called by their grandparent) is wrapped
  too, and nothing is reported while it runs (the mode stays on the stack, reporting nothing):
  the ops of ``h.0.attn`` are its own, not those of its ``c_attn`` Linear. With
  ``children=True`` the submodules' forwards are reported as the selected module's. Nested
  selected modules: an op belongs to the innermost one running.
- **Other code's hooks are not the module's code.** The call wrapper runs outside every hook of
  the module, the forward wrapper inside them all, whenever they were attached: the ops of any
  hook (a capture's ``detach``, a user's ``output * 2``, an ``hs.edit`` attached later) are
  neither reported nor counted, so the k-th ``mul`` does not depend on which hooks are attached.
- **Torch functions as the code calls them.** A function mode sees each overridable torch
  function once, as called: ``F.softmax``, ``x.view(...)``, ``a + b``, ``torch.zeros(...)``. The
  mode runs the real function with itself off (torch takes a mode off the stack while its
  ``__torch_function__`` runs), so what that function calls inside is *not* reported:
  ``nn.MultiheadAttention``'s forward calls ``F.multi_head_attention_forward``, which is
  reported once, while the ``scaled_dot_product_attention`` it runs inside is not; ``F.layer_norm``
  is one ``layer_norm``. The k-th ``softmax`` is the k-th that the module's source calls.
- **Numbering follows execution.** ``add#1`` is the second ``add`` this call of the module ran:
  a branch not taken (an ``if`` on the input, a key/value cache present or not) shifts the
  indices after it, so list the sites with the inputs that will be used (:func:`~hookscope._core.op_list.list_ops`).
  A checkpointed block recomputing in backward reports its ops again (``replaying`` is True).
- **A forward run without its call** (the parent calls ``child.forward(x)``, not ``child(x)``):
  no hook sees that call, so it has no call index; inside a watched call's own code its ops are
  that call's (as for any code that is not a module call), else a selected module run so is
  refused, naming the caller to watch instead.
- **Only calls that return a tensor** (or a tuple or list holding one) are reported and numbered:
  ``x.size()``, ``x.shape``, ``x.dim()``, ``len(x)``, ``x[0] = 1`` (``setitem`` returns None) are not.
- **Threads.** The watcher follows the thread rule of
  :class:`~hookscope._core.tracker.CallTracker`: only the thread that attached it is watched
  (autograd's own thread recomputing a checkpointed block counts as it); a forward on another
  thread passes through, unreported and with no mode pushed there.
- **torch.compile**: the wrappers are never compiled (``torch.compiler.disable``), so a watched
  module runs eagerly inside a compiled model, a graph break around it, and its ops are the
  eager model's. A module whose own forward is compiled code (the ``OptimizedModule`` wrapper)
  calls no op one by one and reports none (a selector on it then never fires, an error).
- **nn.DataParallel** over several devices is refused: replicas copy the modules' attributes,
  wrappers included, which would run the original modules.
- **Cost.** Outside the selected modules one check per wrapped call; inside, a Python call per
  torch function (the mode) plus the listener's own work per op that returned a tensor;
  selected modules carry two wrappers and the two call counters, submodules one wrapper
  (``children=False``) or two.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from hookscope._core.attach import HookGroup, Scoped
from hookscope._core.compat.function_modes import put_under, take_off
from hookscope._core.live_hooks import remove_through
from hookscope._core.names import module_label, named_modules
from hookscope._core.op_mode import _INHERIT, _OFF, OpListener, _Frame, _Inherit, _Off, _OpMode
from hookscope._core.op_sites import OpPattern, OpSite, op_name, op_pattern
from hookscope._core.select import ensure_module
from hookscope._core.tracker import CallTracker
from hookscope._core.wrap import WrapSpec, calls_through_module_call, is_wrapper
from hookscope.errors import SpecError, UnsupportedModelError

__all__ = ["OpPattern", "OpSite", "OpWatcher", "op_name", "op_pattern", "set_forward_tap"]


def _refuse_replicas(model: nn.Module) -> None:
    """Refuse ``nn.DataParallel`` over several devices: its replicas copy the modules' ``__dict__``,
    wrappers included, whose calls would then run the original module."""
    for module in model.modules():
        if isinstance(module, nn.DataParallel) and len(module.device_ids) > 1:
            raise UnsupportedModelError(
                "op sites cannot watch a model run by nn.DataParallel over several devices (its replicas copy "
                "the modules without the watch); run the module inside it on one device, or use "
                "DistributedDataParallel, where each process runs its own model"
            )


def _bare_forward(name: str, module: nn.Module) -> UnsupportedModelError:
    """The refusal of a watched module whose forward its caller ran directly: hooks and the
    call wrapper never saw that call, so it has no call to number its ops under."""
    parent = name.rpartition(".")[0]
    return UnsupportedModelError(
        f"module {module_label(name)!r} ({type(module).__name__}) ran its forward without being called: its "
        "caller (usually its parent) calls .forward() directly, bypassing nn.Module.__call__, so hooks and op "
        f"watches cannot see its calls; watch the module making that call instead ({module_label(parent)!r}), "
        "whose op sites then include this module's ops"
    )


#: A forward tap per module (``id``): ``tap(module, forward, args, kwargs)`` runs instead of the
#: module's forward, inside the innermost op watch of the module (every watch's call open), and
#: returns what the forward returns; hookscope's arch layer sets one where a sub-site is read by
#: recomputing from the forward's arguments (:mod:`~hookscope._arch.ssm`).
_FORWARD_TAPS: dict[int, Callable[[nn.Module, Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]] = {}


class _Tapping(threading.local):
    """The modules whose forward tap runs on this thread now: a tap runs once per call."""

    def __init__(self) -> None:
        self.keys: set[int] = set()


_TAPPING = _Tapping()


def set_forward_tap(module: nn.Module, tap: Callable[..., Any] | None) -> None:
    """Make ``tap`` the forward tap of ``module`` (None: take it off)."""
    if tap is None:
        _FORWARD_TAPS.pop(id(module), None)
    else:
        _FORWARD_TAPS[id(module)] = tap


def _tapped(tap: Callable[..., Any], module: nn.Module, inner: Callable[..., Any], key: int) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        _TAPPING.keys.add(key)
        try:
            return tap(module, inner, args, kwargs)
        finally:
            _TAPPING.keys.discard(key)

    return forward


class OpWatcher(Scoped):
    """Report the torch ops run by the own code of selected modules, as it runs.

    Why a watcher of its own: op sites are the values that never cross a module boundary
    (attention patterns, residual adds), and a function mode is the one way to them that
    costs nothing outside the modules asked for (see the module docstring for the rules).

    Args:
        model: the model whose forward runs (its root numbers the passes).
        modules: ``(name, module)`` pairs to watch, e.g. from :func:`~hookscope._core.select.select`.
        listener: called for each op (see :class:`OpListener`); its return value replaces the op's.
        children: also report ops run inside the selected modules' submodules (as the selected
            module's); by default they are not.
        owner: the hook group's owner label, the ``hs.`` verb named in errors.
        restore_mode: restore every module's train/eval mode on removal.
        bare_to_caller: a watched module whose caller runs its ``.forward()`` directly (no call
            of it opens) inside a watched call: its ops are that call's, as if it were not
            watched (listing every module's ops: ``hs.layers``, a canonical map's check). By
            default it is refused, as outside one: a site selected at it would never fire.

    :attr:`seen` records, per selected module, each op name its code called and the most calls
    of it in one module call, in the order first seen: what a selector that never fired is
    answered with.

    >>> import torch
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.Softmax(dim=-1))
    >>> ops = []
    >>> def listen(module, call, op, index, args, kwargs, output):
    ...     ops.append(f"{module}#{call}:op[{op}#{index}]")
    >>> with OpWatcher(model, [("1", model[1])], listen) as watcher:
    ...     _ = model(torch.ones(1, 2))
    >>> ops, watcher.seen
    (['1#0:op[softmax#0]'], {'1': {'softmax': 1}})
    """

    def __init__(
        self,
        model: nn.Module,
        modules: Sequence[tuple[str, nn.Module]],
        listener: OpListener,
        *,
        children: bool = False,
        owner: str = "ops",
        restore_mode: bool = False,
        bare_to_caller: bool = False,
    ) -> None:
        ensure_module(model)
        _refuse_replicas(model)
        self.children = children
        self._bare_to_caller = bare_to_caller
        #: ``{module name: {op name: most calls in one module call}}``, in the order first seen.
        self.seen: dict[str, dict[str, int]] = {}
        self._mode = _OpMode(listener)
        self._stack: list[_Frame | _Off | _Inherit] = []  # innermost last
        self._on = False  # whether the mode is on the stack of the thread running the watched pass
        self._thread: int | None = None  # that thread, while the stack is not empty
        self._stranded = False  # the mode is to come off but torch held it when it was removed
        self._claim_lock = threading.Lock()
        self._tracker = CallTracker(listener=self, feature=owner)
        chosen = {id(module): (name, module) for name, module in modules}
        wraps: list[WrapSpec] = []
        for name, module in chosen.values():
            if calls_through_module_call(module):
                wraps.append(WrapSpec(name, module, "call", self._quiet()))
            wraps.append(WrapSpec(name, module, "forward", self._loud(name, module)))
        for name, module in self._submodules(model, chosen):
            if calls_through_module_call(module):
                wraps.append(WrapSpec(name, module, "call", self._quiet()))
            if children:
                wraps.append(WrapSpec(name, module, "forward", self._inherit()))
        self._group = HookGroup(
            model,
            [],
            owner=owner,
            tracker=self._tracker,
            count=list(chosen.values()),
            restore_mode=restore_mode,
            wraps=wraps,
        )
        remove_through(self._group, self.remove)

    def _submodules(self, model: nn.Module, chosen: dict[int, tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
        """Every descendant of a selected module that is not selected itself (a ModuleList's
        items are called by their grandparent, so children alone would not do)."""
        names = {id(module): name for name, module in named_modules(model)}
        inside: dict[int, tuple[str, nn.Module]] = {}
        for _, module in chosen.values():
            for sub in module.modules():
                if id(sub) not in chosen:
                    inside.setdefault(id(sub), (names.get(id(sub), type(sub).__name__), sub))
        return list(inside.values())

    # -- the wrappers: each pushes an entry, runs, and pops it in ``finally`` ----------------------

    def _run(self, entry: _Frame | _Off | _Inherit, inner: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """Run ``inner`` with ``entry`` innermost, and put the stack back however it ends
        (an exception, a ``KeyboardInterrupt``). The first entry makes this thread the one
        whose calls the watch follows until the stack is empty again."""
        stack = self._stack
        depth = len(stack)
        try:
            stack.append(entry)
            self._settle()
            return inner(*args, **kwargs)
        finally:
            del stack[depth:]
            if type(entry) is _Frame:
                self._note_seen(entry)
            self._settle()
            if not depth:
                self._thread = None
            if self._stranded and take_off(self._mode):
                self._stranded = False

    def _mine(self) -> bool:
        """Whether this thread runs the watched pass now (only ever asked with the stack non-empty)."""
        return self._thread == threading.get_ident()

    def _quiet(self) -> Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]:
        """Around a watched module's whole call: its hooks, anyone's, in any order, run unreported."""
        stack, mine, run = self._stack, self._mine, self._run

        def quiet(inner: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if not stack or not mine():
                return inner(*args, **kwargs)  # nothing watched is running (the cost outside), or another thread
            return run(_OFF, inner, args, kwargs)

        return quiet

    def _loud(
        self, selected: str, module: nn.Module
    ) -> Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]:
        """Around a selected module's forward: its own code's ops are reported as its call's."""
        stack, mine, run, claim, mode = self._stack, self._mine, self._run, self._claim, self._mode
        tracker, current, key, to_caller = self._tracker, self._tracker.current, id(module), self._bare_to_caller

        def loud(inner: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if (stack and not mine()) or (not stack and tracker.shared and tracker.foreign()):
                return inner(*args, **kwargs)  # another thread's forward: passes through
            try:
                call = current(module)  # before any claim
            except SpecError:  # no call of it is open: its caller ran its forward, not its call
                if to_caller and stack and mode.frame is not None:  # inside a watched call: its ops are that call's
                    return inner(*args, **kwargs)
                raise _bare_forward(selected, module) from None
            frame = _Frame(selected, call, key)
            if not stack and not claim():
                return inner(*args, **kwargs)
            tap = _FORWARD_TAPS.get(key)
            if tap is not None and not is_wrapper(inner) and key not in _TAPPING.keys:
                return run(frame, _tapped(tap, module, inner, key), args, kwargs)
            return run(frame, inner, args, kwargs)

        return loud

    def _claim(self) -> bool:
        """Make this thread the watched one, unless the call tracker's thread rule says it is a
        foreign thread, or another thread holds the watch right now."""
        tracker = self._tracker
        if tracker.shared and tracker.foreign():
            return False
        me = threading.get_ident()
        with self._claim_lock:
            if self._thread is None:
                self._thread = me
            return self._thread == me

    def _inherit(self) -> Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]:
        """Around a submodule's forward (``children=True``): its ops are the innermost selected call's."""
        stack, mine, run = self._stack, self._mine, self._run

        def inherit(inner: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if not stack or not mine():
                return inner(*args, **kwargs)
            return run(_INHERIT, inner, args, kwargs)

        return inherit

    def _note_seen(self, frame: _Frame) -> None:
        record = self.seen.setdefault(frame.module, {})
        for op, calls in frame.counts.items():
            if calls > record.get(op, 0):
                record[op] = calls

    # -- the mode -------------------------------------------------------------------------------

    def _settle(self) -> None:
        """Report to the innermost selected call exactly while one runs its own code (or, with
        ``children=True``, a submodule it called). The mode goes on this thread's stack at the
        first selected forward and comes off when the last entry closes, never in between: the
        modes other code pushes inside the forward (``with torch.device(...)``, a capture's
        guard) stay in the order they were pushed, and a listener that calls a watched module
        pushes nothing."""
        stack = self._stack
        at = len(stack) - 1
        while at >= 0 and type(stack[at]) is _Inherit:  # a submodule's forward (children=True) and
            at -= 1  # the call wrapper under it are transparent; a hook's region (another _Off) is not
            if at >= 0 and type(stack[at]) is _Off:
                at -= 1
        top = stack[at] if at >= 0 else None
        if type(top) is _Frame:
            self._mode.frame = top
            if not self._on:
                self._turn_on()
        else:
            self._mode.frame = None
            if self._on and not stack:
                self._turn_off()

    def _turn_on(self) -> None:
        # Below the modes of watchers attached later: an op's value reaches the watchers in the
        # order they were attached, as hooks run (a capture attached before an edit sees the
        # value before the edit), whichever forward wrapper pushed its mode first.
        order = self._mode.order
        put_under(self._mode, lambda other: isinstance(other, _OpMode) and other.order > order)
        self._on = True

    def _turn_off(self) -> None:
        self._on = False
        # Wherever it stands: a capture's guard may have been pushed above it. Not there when the
        # watch is removed from inside a listener (torch has lifted the mode while it handles the
        # op, and puts it back after): the open wrappers take it off on their way out.
        self._stranded = not take_off(self._mode)

    def _reset(self) -> None:
        """Forget every open call and take the mode off this thread's stack if it is there
        (removal from inside a forward: the wrappers' ``finally`` then finds nothing to pop)."""
        self._stack.clear()
        self._mode.frame = None
        self._thread = None
        if self._on:
            self._turn_off()

    # -- passes (told by the call tracker) and removal --------------------------------------------
    # The wrappers close every call they open, however the forward ends: a pass has nothing to reset.

    def pass_started(self, module: nn.Module) -> None:
        """A pass opens (nothing to do: see above)."""

    def pass_ended(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        """The pass closed (nothing to do: every wrapper has closed its call)."""

    def pass_abandoned(self) -> None:
        """The previous pass was cut short (nothing to do: its wrappers closed their calls)."""

    @property
    def replaying(self) -> bool:
        """True during a checkpointed block's recomputation in backward (its ops run again)."""
        return self._tracker.replaying

    def remove(self) -> None:
        """Remove every hook and take the mode off (if a cut-short forward left it on). Safe to call twice."""
        try:
            self._group.remove()
        finally:
            self._reset()

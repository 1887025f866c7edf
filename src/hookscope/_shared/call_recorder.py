"""One per-call recorder: what every feature that keeps a record per module call needs, once.

A feature that records calls (``trace``, ``detect_nonfinite``, ``watch_grads``, ``diff``) puts a
pre-hook and a closing forward hook on each chosen module, and the same questions come up in
each: which open call does this close belong to, did the call return or raise, is this pass a
checkpointed block recomputing in backward, is this hook running on another thread than the
one recorded, can this run inside compiled code. :class:`CallRecorder` answers them in one place and hands
the subclass only what is its own:

- ``watch(name, module)`` once per module at attach time: what the hooks need of it
  (a :class:`Watched`), so that nothing is looked up per call;
- ``open_call(...)`` when a call begins: a draft (an :class:`OpenCall`), or None to skip it;
- ``close_call(draft, output)`` when it returned, ``call_raised(draft, error)`` when it raised;
- ``start_pass``, ``end_pass`` and ``abandon_pass`` around each forward pass.

How the questions are answered:

- **Open calls** sit on one stack, innermost last (:attr:`CallRecorder.opened`). A close pops
  the top draft only when the draft is this module's: a close without a matching open (the
  call began before the hooks were attached, or the pass was reset meanwhile) is ignored.
- **Raised or returned.** The closing hook is registered with ``always_call=True``, so it also
  runs for a call an exception goes through. It tells the two apart by the exception being
  handled: a model called inside the user's ``except`` block sees that exception in
  ``sys.exc_info()`` throughout, so a call raised only if the exception at its close is not
  the one that was there when it began. The same comparison at the end of a pass tells
  ``end_pass`` whether the forward raised.
- **Recomputation.** A pass that the :class:`~hookscope._core.tracker.CallTracker` opens inside
  a backward pass is a checkpointed block recomputing its forward; :meth:`skips_pass` says
  whether to ignore it (by default yes: the real forward was recorded already).
- **Threads.** A recorder records the thread that attached it (see
  :class:`~hookscope._core.tracker.CallTracker`): a forward of the same model on another thread
  passes by unrecorded, and both hooks return at once for it (one attribute read until another
  thread has run the model). A ``nn.DataParallel`` replica is refused with one
  :class:`~hookscope.errors.ConcurrentPassError` naming :attr:`CallRecorder.feature`; PyTorch
  still runs that thread's ``always_call`` hooks, whose closes are ignored here.
- **Compiled code.** With ``escape_compiled=True`` each hook body runs eagerly under
  ``torch.compile`` (one graph break per hook) for work Dynamo cannot trace, such as reading
  values back to the host; otherwise the body is traced like any other code.

The hooks are closures made once per module with everything they use bound as locals; per call
they add one Python call to the subclass over writing the hook by hand.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from torch import nn

from hookscope._core.attach import HookGroup, HookSpec, Scoped, WrapSpec
from hookscope._core.compat.compiled import EAGER, is_compiling
from hookscope._core.tracker import CallTracker

__all__ = ["Args", "CallRecorder", "Handled", "Kwargs", "OpenCall", "Watched"]

#: What a forward hook is given of a call, and the exception being handled when it began.
Args = tuple[Any, ...]
Kwargs = dict[str, Any]
Handled = BaseException | None


@dataclass(eq=False)
class Watched:
    """A module a recorder watches, with what its hooks need of it, found once at attach time."""

    name: str
    class_name: str


W = TypeVar("W", bound=Watched)


@dataclass(eq=False)
class OpenCall(Generic[W]):
    """A call that has begun: whose it is, its index in the pass, and the exception being handled
    when it began (``sys.exc_info()[1]``; None outside an ``except`` block).

    Subclasses add what their feature keeps of a call.
    """

    site: W
    call: int
    handled: Handled


D = TypeVar("D", bound=OpenCall[Any])

PreHook = Callable[[nn.Module, Args, Kwargs], None]
Closer = Callable[[nn.Module, Args, Kwargs, Any], None]


def _eagerly(hook: Callable[..., None], *args: Any) -> None:
    """Run ``hook`` (a recorder's own) outside compiled code: one escape for every recorder. It is
    told so (``eager=True``) rather than asking ``is_compiling()`` again: torch's flag is
    process-wide, True on every thread while any thread compiles, and asking would recurse."""
    hook(*args, eager=True)


class CallRecorder(Scoped, Generic[W, D]):
    """A pre-hook and a closing hook on each chosen module, one draft per call, passes told apart.

    Subclasses set :attr:`feature` and implement :meth:`open_call` and :meth:`close_call`; the
    others have defaults that do nothing. The constructor attaches the hooks (the subclass sets
    up what they use first) and the :class:`~hookscope._core.attach.HookGroup` that removes them.

    >>> import torch
    >>> class Returns(CallRecorder[Watched, OpenCall[Watched]]):
    ...     feature = "example"
    ...     def __init__(self, model: nn.Module) -> None:
    ...         self.returned: list[str] = []
    ...         super().__init__(model, list(model.named_children()))
    ...     def open_call(self, site, call, handled, args, kwargs):
    ...         return OpenCall(site, call, handled)
    ...     def close_call(self, draft, output):
    ...         self.returned.append(f"{draft.site.name}#{draft.call}")
    >>> relu = nn.ReLU()
    >>> model = nn.Sequential(nn.Linear(2, 2), relu, relu)
    >>> with Returns(model) as recorder:
    ...     _ = model(torch.ones(1, 2))
    >>> recorder.returned
    ['0#0', '1#0', '1#1']
    """

    #: The feature's ``hs.`` verb: the hook group's owner and the name a refused replica is told.
    feature: ClassVar[str]

    def __init__(
        self,
        model: nn.Module,
        modules: Sequence[tuple[str, nn.Module]],
        *,
        escape_compiled: bool = False,
        wraps: Sequence[WrapSpec] = (),
    ) -> None:
        self._tracker = CallTracker(listener=self, feature=self.feature)
        #: The drafts of the calls open now, innermost last (cleared in place, never replaced).
        self.opened: list[D] = []
        #: True during a pass :meth:`skips_pass` turned down: every hook returns at once.
        self.skipping = False
        self._handled: Handled = None  # the exception being handled when the pass began
        specs = []
        for name, module in modules:
            site = self.watch(name, module)
            opener, closer = self._opener(site, escape_compiled), self._closer(site, escape_compiled)
            specs.append(HookSpec(name, module, "forward_pre", opener, with_kwargs=True, fitted=True))
            specs.append(HookSpec(name, module, "forward", closer, with_kwargs=True, always_call=True, fitted=True))
        self._group = HookGroup(
            model, specs, owner=self.feature, tracker=self._tracker, restore_mode=False, wraps=wraps
        )  # ``wraps``: a feature's own wrappers of a call, in the same group (removed with the hooks)

    # -- what subclasses implement ----------------------------------------------------------------

    def watch(self, name: str, module: nn.Module) -> W:
        """What the hooks of ``module`` need of it; called once per module, at attach time
        (by default its name and class: a plain :class:`Watched`)."""
        return Watched(name, type(module).__name__)  # type: ignore[return-value]

    def open_call(self, site: W, call: int, handled: Handled, args: Args, kwargs: Kwargs) -> D | None:
        """A call of the module ``site`` stands for begins (its ``call``-th in the pass): its
        draft, or None to leave it unrecorded. ``handled`` goes into the draft unchanged.

        A close takes the innermost draft if it is its module's: for a module that may call
        itself, return a draft (one shared "unrecorded" draft will do) rather than None, or the
        inner call's close would take the outer call's draft."""
        raise NotImplementedError

    def close_call(self, draft: D, output: Any) -> None:
        """The call of ``draft`` returned ``output``."""
        raise NotImplementedError

    def call_raised(self, draft: D, error: BaseException) -> None:
        """``error`` went through the call of ``draft`` (it may be caught further out)."""

    def skips_pass(self) -> bool:
        """Whether to ignore the pass that is starting; asked once per pass. By default a
        checkpointed block recomputing in backward is ignored: its forward was recorded."""
        return self._tracker.replaying

    def start_pass(self, module: nn.Module) -> None:
        """A pass begins with a call of ``module``."""

    def end_pass(self, module: nn.Module, error: BaseException | None) -> None:
        """The pass opened by a call of ``module`` ended; ``error`` is what the forward raised, if it did."""

    def abandon_pass(self) -> None:
        """The previous pass was cut short (``KeyboardInterrupt`` skips the closing hooks)."""

    # -- the hooks ----------------------------------------------------------------------------------

    def _opener(self, site: W, escape: bool) -> PreHook:
        opened, current, open_call, exc_info = self.opened, self._tracker.current, self.open_call, sys.exc_info
        tracker, foreign = self._tracker, self._tracker.foreign

        def open_hook(module: nn.Module, args: Args, kwargs: Kwargs, *, eager: bool = False) -> None:
            if escape and not eager and is_compiling():
                EAGER(_eagerly)(open_hook, module, args, kwargs)
                return
            if self.skipping or (tracker.shared and foreign()):
                return  # a pass turned down, or another thread's forward: passes by unrecorded
            draft = open_call(site, current(module), exc_info()[1], args, kwargs)
            if draft is not None:
                opened.append(draft)

        return open_hook

    def _closer(self, site: W, escape: bool) -> Closer:
        opened, owns, exc_info = self.opened, self._tracker.owns, sys.exc_info
        close_call, call_raised = self.close_call, self.call_raised

        def close_hook(module: nn.Module, args: Args, kwargs: Kwargs, output: Any, *, eager: bool = False) -> None:
            if escape and not eager and is_compiling():
                EAGER(_eagerly)(close_hook, module, args, kwargs, output)
                return
            if self.skipping or not opened or opened[-1].site is not site or not owns():
                return  # not opened here (or since a reset), or a call on another thread
            draft = opened.pop()
            error = exc_info()[1]
            if error is draft.handled:
                close_call(draft, output)
            elif error is not None:
                call_raised(draft, error)

        return close_hook

    # -- passes (told by the call tracker) ----------------------------------------------------------

    def pass_started(self, module: nn.Module) -> None:
        """A pass opens: forget calls left open, note the exception being handled, tell the subclass."""
        self.skipping = self.skips_pass()
        if self.skipping:
            return
        self.opened.clear()
        self._handled = sys.exc_info()[1]
        self.start_pass(module)

    def pass_ended(self, module: nn.Module, args: Args, kwargs: Kwargs, output: Any) -> None:
        """The pass's opening call closed: tell the subclass whether the forward raised."""
        if self.skipping:
            return
        error = sys.exc_info()[1]
        self.end_pass(module, None if error is self._handled else error)

    def pass_abandoned(self) -> None:
        """The previous pass was cut short: its open calls will never close."""
        self.opened.clear()
        self.abandon_pass()

"""``capture()`` and ``run_with_capture()``: keep what chosen layers take and return.

The hot path is one forward hook (and a pre-hook for inputs) per selected module. Everything
that can be decided once -- which calls to keep, the reduction, the conversions -- is decided at
attach time; inside the forward nothing syncs with the host or inspects a signature.

Correctness against in-place ops: by default (``copy="auto"``) a kept value that still shares
memory with the model's tensors is watched by :class:`~hookscope._capture.guard.CopyOnWrite`
and copied just before anything writes into it. At the end of the forward, kept values that
share memory with what leaves the forward (the model's inputs, output, parameters and buffers)
are copied too, since code outside the forward may change those later. ``copy=True`` copies
every value at once; ``copy=False`` never copies and raises ``CaptureError`` on reading a value
that was changed after capture.

Memory: a pass that ends holding 64 MiB or more of host memory asks glibc, once per process,
to keep that much freed memory resident instead of trimming it (``HOOKSCOPE_MALLOC=default``
opts out); the next capture then reuses those pages instead of faulting fresh ones in. Why
this and not an arena of reused buffers, with the numbers: :mod:`hookscope._shared.malloc`.
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hookscope._arch.plan import plan_sites
from hookscope._arch.std import canonical_source, stream_modules
from hookscope._capture.attn_sites import read_attention
from hookscope._capture.cache import Cache
from hookscope._capture.guard import storage_key
from hookscope._capture.keeper import Keeper
from hookscope._capture.latest import LatestPass
from hookscope._capture.leaves import copier, leaf_filter, writes_in_place
from hookscope._capture.options import CaptureOptions
from hookscope._capture.token_mask import token_mask_specs
from hookscope._core.attach import HookGroup, HookSpec, Scoped
from hookscope._core.names import call_label, raw_and_named_modules
from hookscope._core.op_sites import OpPattern
from hookscope._core.plan import attach_plan
from hookscope._core.select import (
    Selector,
    describe_selector,
    ensure_module,
    select_leaves,
)
from hookscope._core.sites import Site
from hookscope._core.tracker import CallTracker
from hookscope._core.tree import call_leaves, flatten_tensors, map_call_tensors, map_tensors_with_paths
from hookscope._shared import malloc as allocator
from hookscope._shared.dtypes import overflow_message
from hookscope._version import __version__
from hookscope.errors import CaptureError, CastOverflowWarning, SpecError

__all__ = ["Capture", "StopForward"]


class StopForward(Exception):  # noqa: N818 (a signal, not an error)
    """Raised inside the forward once every selected site is captured (``stop=True``)."""

    def __init__(self, owner: Capture) -> None:
        super().__init__("hookscope stopped the forward after the last captured layer (stop=True)")
        self.owner = owner


class Capture(Scoped, LatestPass):
    """Hooks that keep values of selected modules; reads like the :class:`Cache` of the latest pass.

    Made by :func:`capture`; attached at once, removed by ``remove()`` or on leaving ``with``.
    Each top-level forward starts a new :class:`Cache` (``capture.cache``); ``capture["fc"]``,
    ``capture.calls(...)``, ``capture.numpy()`` and ``capture.save(...)`` read it. A pass is a
    call of the model, or of a selected module called on its own.

    A capture sees each value as the hooks attached before it left it: attach edits first to
    capture edited values, the capture first to capture the originals.

    A capture records the forwards of the thread that made it (and, under ``nn.DataParallel``,
    its replicas, per device): a forward of the same model on another thread, such as a
    serving thread, passes through uncaptured and unchanged.
    """

    def __init__(
        self, model: nn.Module, selectors: tuple[Selector, ...], options: CaptureOptions | None = None, **opts: Any
    ) -> None:
        ensure_module(model)
        options = CaptureOptions.build(options, opts)
        allocator.check_setting()  # a mistyped HOOKSCOPE_MALLOC is refused now, not at a pass's end
        if not selectors:
            raise SpecError("capture needs at least one selector, e.g. hs.capture(model, 'fc') or (model, nn.Linear)")
        self.options = options
        self._keep_passes = options.passes == "all"
        self._passes: list[Cache] = []
        self._handled: BaseException | None = None
        self._whats = options.sides
        self._want = options.wants
        self._stop = options.stop
        self._tracker = CallTracker(listener=self, feature="capture")
        self._model = model
        plan = plan_sites(model, selectors, "read", owner="capture", error=CaptureError, check=_stop_check(options))
        std_names = plan.std
        self._ops = plan.ops
        if options.grads and plan.ops is not None:
            _refuse_ssm_grads(plan.ops.patterns)
        self._selected, self._leaves = (
            select_leaves(model, plan.selectors, whole_sides=self._whats) if plan.selectors else ([], {})
        )
        #: Modules whose input is read before their other pre-hooks: resid_mid at the next norm's input.
        self._first_inputs = stream_modules(model, std_names)
        meta = _describe(model, selectors, options)
        if std_names:
            meta["std"] = dict(std_names)
        if self._first_inputs:  # their inputs answer to "stream" canonical names (resid_mid) too
            meta["first_inputs"] = sorted(self._first_inputs)
        chosen = {id(module) for _, module in [*self._selected, *(self._ops.modules if self._ops else [])]}
        aliases = {
            raw: name for name, raw, module in raw_and_named_modules(model) if raw != name and id(module) in chosen
        }
        if aliases:  # names below a DDP or torch.compile wrapper, as spelled by named_modules()
            meta["aliases"] = aliases
        self._meta = meta  # with the canonical source, what every keeper of this capture shares
        self._canonical = canonical_source(model)
        self._keeper = Keeper(options, meta=meta, canonical=self._canonical)
        # Thread (the object, kept alive: a finished thread's ident is reused) -> (device, keeper).
        self._replica_keepers: dict[threading.Thread, tuple[str, Keeper]] = {}
        self._replica_lock = threading.Lock()
        self._pending: set[int] = set()
        self._passed_by: dict[str, int] = {}  # per pass: modules whose calls calls= passed by, and how many ran
        self._stopped = False
        self._group, _ = attach_plan(
            plan,
            lambda counted: HookGroup(
                model, self._specs(), owner="capture", tracker=self._tracker, count=counted, restore_mode=False
            ),
            lambda ops: ops.attach(model, self._keep_op, self._want, self._keep_attention),
            self.remove,  # hs.remove_all(model) also lets go of the write guard
        )

    # -- attaching --------------------------------------------------------------------------------

    def _whats_of(self, name: str) -> tuple[str, ...]:
        """What is kept of module ``name``: the ``keep`` option's sides, or those its leaf selectors name
        (with the ``keep`` sides where the module was also picked whole)."""
        leaves = self._leaves.get(name)
        if leaves is None:
            return self._whats
        return tuple(what for what in ("input", "output") if what in leaves)

    def _specs(self) -> list[HookSpec]:
        """The capture hooks; passes are told by the call tracker, which wraps every hook of the group."""
        specs = []
        for name, module in self._selected:
            whats = self._whats_of(name)
            if "input" in whats:
                first = name in self._first_inputs
                specs.append(
                    HookSpec(
                        name,
                        module,
                        "forward_pre",
                        self._input_hook(name),
                        with_kwargs=True,
                        prepend=first,
                        fitted=True,
                    )
                )
            if "output" in whats:
                specs.append(HookSpec(name, module, "forward", self._output_hook(name), with_kwargs=True, fitted=True))
        return specs + token_mask_specs(self._model, self._keeper, self.options)

    def _input_hook(self, name: str) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], Any]:
        current, want, keep, last_what = (
            self._tracker.current,
            self._want,
            self._keeper.keep_leaves,
            self._whats_of(name)[-1],
        )
        tracker, foreign, handover = self._tracker, self._tracker.foreign, self._keeper.take_handover
        chosen = leaf_filter(name, "input", self._leaves.get(name, {}).get("input"))

        def capture_input(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if tracker.shared and foreign():
                return None  # another thread's forward: not captured
            if tracker.replaying:
                return None  # a checkpointed block recomputing in backward: its values were kept already
            if self._stopped:
                raise StopForward(self)  # the model caught the first signal and went on: stop again
            call = current(module)
            if not want(call):
                self._passed_by[name] = call + 1  # ran, but calls= keeps not this call
                return None
            leaves = call_leaves(args, kwargs) if chosen is None else chosen(call_leaves(args, kwargs))
            if tracker.in_replica():
                self._keep_replica(name, call, "input", leaves, args)
                return None
            keep(name, call, "input", leaves, args)
            kept_in_graph = handover()
            if last_what == "input":
                self._done(module)
            if kept_in_graph:  # detach=False: the module goes on with copies of what was kept
                return map_call_tensors(copier(kept_in_graph), args, kwargs)
            return None

        return capture_input

    def _output_hook(self, name: str) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any], Any], Any]:
        current, want, keep = self._tracker.current, self._want, self._keeper.keep_leaves
        tracker, foreign, handover = self._tracker, self._tracker.foreign, self._keeper.take_handover
        chosen = leaf_filter(name, "output", self._leaves.get(name, {}).get("output"))

        def capture_output(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
            if tracker.shared and foreign():
                return None
            if tracker.replaying:
                return None
            if self._stopped:
                raise StopForward(self)
            call = current(module)
            if not want(call):
                self._passed_by[name] = call + 1  # ran, but calls= keeps not this call
                return None
            leaves = flatten_tensors(output, "") if chosen is None else chosen(flatten_tensors(output, ""))
            if tracker.in_replica():
                self._keep_replica(name, call, "output", leaves, output)
                return None
            keep(name, call, "output", leaves, output)
            kept_in_graph = handover()
            self._done(module)
            if kept_in_graph:  # detach=False: the model goes on with copies of what was kept
                return map_tensors_with_paths(copier(kept_in_graph), output)
            return None

        return capture_output

    def _keep_op(
        self, name: str, call: int, op: str, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        """Keep one selected op call's inputs and output (told by the op watcher, after the op ran)."""
        keep, handover = self._keeper.keep_leaves, self._keeper.take_handover
        if "input" in self._whats:
            leaves = call_leaves(args, kwargs)
            if writes_in_place(op, args, kwargs):  # the written argument holds the result now
                written = {id(tensor) for _, tensor in flatten_tensors(output, "")}
                leaves = [(path, tensor) for path, tensor in leaves if id(tensor) not in written]
            keep(name, call, "input", leaves, args, op=op)
            handover()  # the op has consumed its inputs: a later write is seen by the guard or the version check
        if "output" in self._whats:
            keep(name, call, "output", flatten_tensors(output, ""), output, op=op)
            kept_in_graph = handover()
            if kept_in_graph:  # detach=False: the model goes on with a copy of what was kept
                return map_tensors_with_paths(copier(kept_in_graph), output)
        return None

    def _keep_attention(
        self,
        name: str,
        call: int,
        index: int,
        kinds: list[str],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        output: Any,
    ) -> Any:
        """Keep the attention sub-sites asked for of one ``scaled_dot_product_attention`` call
        (``keep`` does not apply: each sub-site is the one tensor it names)."""
        keep, handover, keeper = self._keeper.keep_leaves, self._keeper.take_handover, self._keeper

        def room(kind: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
            keeper.check_room(Site(name, call, "output", "", op=f"attn.{kind}#{index}"), shape, dtype)

        counts = self._ops.head_counts(name) if self._ops is not None else None
        grads = self.options.grads
        read = read_attention(
            kinds, args, kwargs, output, detach=self.options.detach, counts=counts, grads=grads, room=room
        )
        replacement = read.output  # grads=True: the call spliced through the values, the model goes on with it
        for kind, value, fresh in read.values:
            op = f"attn.{kind}#{index}"
            keep(name, call, "output", [("", value)], value, op=op, fresh=fresh)
            kept_in_graph = handover()
            if kept_in_graph and kind == "z":  # detach=False: the model goes on with a copy of the output
                replacement = map_tensors_with_paths(
                    copier(kept_in_graph), output if replacement is None else replacement
                )
            if kind in read.no_grad:
                keeper.cache._note_no_grad(Site(name, call, "output", "", op=op), read.no_grad[kind])
        return replacement

    # -- nn.DataParallel replicas -----------------------------------------------------------------

    #: Told to the call tracker: threads running DataParallel replicas in a pass are numbered
    #: on their own and kept apart here, one cache per device.
    accepts_replicas = True

    def _keep_replica(
        self, name: str, call: int, what: str, leaves: list[tuple[str, torch.Tensor]], value: Any
    ) -> None:
        """Keep a replica's values in its device's cache (copies: no in-place guard on worker threads)."""
        thread = threading.current_thread()
        kept = self._replica_keepers.get(thread)
        if kept is None:
            if self._keep_passes:
                raise CaptureError(
                    "passes='all' keeps the model's passes, and DataParallel replicas run beside them in threads; "
                    "capture the replicas with the default passes='latest' (capture.replicas), one pass at a time",
                    site=call_label(name, call),
                )
            floating = [tensor for _, tensor in leaves if tensor.is_floating_point()]  # not lengths or counters
            device = str((floating or [tensor for _, tensor in leaves])[0].device) if leaves else "cpu"
            with self._replica_lock:
                if any(other == device for other, _ in self._replica_keepers.values()):
                    raise CaptureError(
                        f"two DataParallel replicas ran on {device} in one pass; captures keep one cache per "
                        "device (capture.replicas): give each replica its own device",
                        site=call_label(name, call),
                    )
                keeper = Keeper(self.options, meta=self._meta, canonical=self._canonical, copy=True)
                keeper.start()
                kept = self._replica_keepers[thread] = (device, keeper)
        kept[1].keep_leaves(name, call, what, leaves, value)

    @property
    def replicas(self) -> dict[str, Cache]:
        """Under ``nn.DataParallel``, the latest pass's values of each replica, by device
        (``{"cuda:0": Cache, "cuda:1": Cache}``); empty when no replica ran. The model's own
        thread (the wrapper, the gather) is in :attr:`cache`."""
        return {device: keeper.cache for device, keeper in self._replica_keepers.values()}

    # -- one forward pass -------------------------------------------------------------------------

    def pass_started(self, module: nn.Module) -> None:
        """A new pass: a new cache, every selected module still to capture (when stopping)."""
        if self._tracker.replaying:
            return  # a recomputation in backward is no new pass: the forward's cache stays
        self._pending = {id(m) for _, m in self._selected if m is not module}
        self._passed_by = {}
        self._replica_keepers = {}
        self._stopped = False
        self._handled = sys.exc_info()[1]  # an exception already being handled when the pass began
        self._keeper.start(refill_budget=not self._keep_passes)
        if self._ops is not None:
            self._ops.start()

    def pass_ended(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        """The pass is over: protect what outlives it, and report a stop the model swallowed."""
        if self._tracker.replaying:
            return
        self._keeper.finish(lambda: self._outliving_storages(args, kwargs, output))
        if self._keeper.cache._overflowed and sys.exc_info()[1] is self._handled:
            self._report_overflow(self._keeper.cache.overflowed)
        for _, keeper in self._replica_keepers.values():
            keeper.finish(set)  # copies already: only the device-to-host copies to wait for
        if self._keep_passes and sys.exc_info()[1] is self._handled:  # a forward that raised is no finished pass
            self._passes.append(self._keeper.cache)
        if self._ops is not None and sys.exc_info()[1] is self._handled:
            self._ops.check(self._tracker.counts(), self._want)
        if sys.exc_info()[1] is self._handled and not self._replica_keepers:
            self._refuse_calls_kept_none()
        if self._stopped and not isinstance(sys.exc_info()[1], StopForward):
            self._stopped = False
            raise CaptureError(
                f"{type(module).__name__}'s forward caught hookscope's stop signal (an 'except Exception' in "
                "the model?) and ran on; the values are captured, but use stop=False for this model"
            )

    def _refuse_calls_kept_none(self) -> None:
        """A selected module that ran, but none of whose calls ``calls=`` keeps, is an error at the end
        of the pass, not an empty cache read later (``calls=1`` of a module called once)."""
        kept = {site.module for site in self._keeper.cache.sites()}
        missed = {name: count for name, count in self._passed_by.items() if name not in kept}
        if not missed:
            return
        ran = ", ".join(f"{name!r} ran {count} call{'' if count == 1 else 's'}" for name, count in missed.items())
        raise CaptureError(
            f"calls={self.options.calls!r} kept nothing of {ran} in this pass (call indices start at 0); "
            "pick calls that run, e.g. calls='all' or calls='last'",
            site=next(iter(missed)),
        )

    def _report_overflow(self, counts: dict[str, int]) -> None:
        if self.options.overflow == "ignore" or self.options.torch_dtype is None:
            return
        message = overflow_message(counts, self.options.torch_dtype, "capture")
        if self.options.overflow == "error":
            raise CaptureError(message, site=next(iter(counts)))
        warnings.warn(message, CastOverflowWarning, stacklevel=2)

    def pass_abandoned(self) -> None:
        """The previous pass was cut short (KeyboardInterrupt skips closing hooks)."""
        self._keeper.abandon()

    def _outliving_storages(self, *escaping: Any) -> set[int]:
        """Memory that outlives the forward: its inputs and outputs, the parameters and buffers."""
        leaving = (t for _, t in flatten_tensors(escaping))
        return {storage_key(t) for t in (*leaving, *self._model.parameters(), *self._model.buffers())}

    def _done(self, module: nn.Module) -> None:
        if self._stop and id(module) in self._pending:
            self._pending.discard(id(module))
            if not self._pending:
                self._stopped = True
                raise StopForward(self)

    # -- lifetime ---------------------------------------------------------------------------------

    def remove(self) -> None:
        """Remove every hook of this capture; the values stay readable. Safe to call twice."""
        try:
            self._keeper.abandon()  # a pass left open (the forward was interrupted) lets go of the guard
        finally:
            try:
                if self._ops is not None:
                    self._ops.remove()
            finally:
                self._group.remove()

    def __exit__(self, *exc_info: object) -> bool:
        if len(exc_info) > 1 and not isinstance(exc_info[1], StopForward):
            self._group.note_failure(exc_info[1])
        self.remove()
        stopped = exc_info[1] if len(exc_info) > 1 else None
        return isinstance(stopped, StopForward) and stopped.owner is self  # the stop signal ends the block

    def __repr__(self) -> str:
        state = "live" if self.live else "removed"
        ops = f" and {len(self._ops.patterns)} op selectors" if self._ops is not None else ""
        return f"<Capture of {len(self._selected)} modules{ops}, {state}>\n{self.cache!r}"


def _stop_check(options: CaptureOptions) -> Callable[[list[OpPattern]], None]:
    """Refuse op selectors with ``stop=True``: the forward would stop before the ops ran."""

    def check(patterns: list[OpPattern]) -> None:
        if patterns and options.stop:
            raise SpecError(
                f"stop=True cannot be used with op selectors ({str(patterns[0])!r}) yet: the forward would stop "
                "before the ops ran; use stop=False"
            )

    return check


def _describe(model: nn.Module, selectors: tuple[Selector, ...], options: CaptureOptions) -> dict[str, Any]:
    recorded = options.to_dict()
    recorded["options_version"] = recorded.pop("version")
    return {
        "hookscope": __version__,
        "torch": torch.__version__,
        "model": type(model).__name__,
        "selectors": [describe_selector(s) for s in selectors],
        **recorded,
    }


def _refuse_ssm_grads(patterns: Any) -> None:
    """``grads=True`` cannot reach a state-space value: it is recomputed beside the model's
    forward (:mod:`hookscope._arch.ssm`), no part of the graph the backward runs through."""
    for pattern in patterns:
        if pattern.op.startswith("ssm."):
            raise CaptureError(
                f"grads=True and {str(pattern)!r}: a state-space value is recomputed beside the mixer's forward, "
                "no part of the graph a backward runs through, so it has no gradient; capture it without grads=True, "
                "or capture the gradients of the mixer's submodules (in_proj, out_proj) or of the mixer itself",
                site=str(pattern),
            )

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
this and not an arena of reused buffers, with the numbers: :mod:`hookscope._shared.allocator`.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hookscope._arch.plan import plan_sites
from hookscope._arch.std import canonical_source, stream_modules
from hookscope._capture.attn_sites import read_attention
from hookscope._capture.cache import Cache
from hookscope._capture.guard import storage_key
from hookscope._capture.keeper import Keeper
from hookscope._capture.options import CaptureOptions
from hookscope._core.attach import HookGroup, HookSpec, Scoped
from hookscope._core.compat.offload import ensure_loaded
from hookscope._core.names import call_label, leaf_label, raw_and_named_modules
from hookscope._core.op_sites import OpPattern
from hookscope._core.plan import attach_plan
from hookscope._core.select import (
    Selector,
    describe_selector,
    ensure_module,
    given_selectors,
    select_leaves,
)
from hookscope._core.sites import Site
from hookscope._core.tracker import CallTracker
from hookscope._core.tree import call_leaves, flatten_tensors, map_call_tensors, map_tensors_with_paths
from hookscope._shared import allocator
from hookscope._shared.dtypes import overflow_message
from hookscope._shared.options import with_options
from hookscope._version import __version__
from hookscope.errors import CaptureError, CastOverflowWarning, SpecError

__all__ = ["Capture", "capture", "run_with_capture"]


class _StopForward(Exception):  # noqa: N818 (a signal, not an error)
    """Raised inside the forward once every selected site is captured (``stop=True``)."""

    def __init__(self, owner: Capture) -> None:
        super().__init__("hookscope stopped the forward after the last captured layer (stop=True)")
        self.owner = owner


class Capture(Scoped):
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
        return specs

    def _input_hook(self, name: str) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], Any]:
        current, want, keep, last_what = (
            self._tracker.current,
            self._want,
            self._keeper.keep_leaves,
            self._whats_of(name)[-1],
        )
        tracker, foreign, handover = self._tracker, self._tracker.foreign, self._keeper.take_handover
        chosen = _leaf_filter(name, "input", self._leaves.get(name, {}).get("input"))

        def capture_input(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if tracker.shared and foreign():
                return None  # another thread's forward: not captured
            if tracker.replaying:
                return None  # a checkpointed block recomputing in backward: its values were kept already
            if self._stopped:
                raise _StopForward(self)  # the model caught the first signal and went on: stop again
            call = current(module)
            if not want(call):
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
                return map_call_tensors(_copier(kept_in_graph), args, kwargs)
            return None

        return capture_input

    def _output_hook(self, name: str) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any], Any], Any]:
        current, want, keep = self._tracker.current, self._want, self._keeper.keep_leaves
        tracker, foreign, handover = self._tracker, self._tracker.foreign, self._keeper.take_handover
        chosen = _leaf_filter(name, "output", self._leaves.get(name, {}).get("output"))

        def capture_output(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
            if tracker.shared and foreign():
                return None
            if tracker.replaying:
                return None
            if self._stopped:
                raise _StopForward(self)
            call = current(module)
            if not want(call):
                return None
            leaves = flatten_tensors(output, "") if chosen is None else chosen(flatten_tensors(output, ""))
            if tracker.in_replica():
                self._keep_replica(name, call, "output", leaves, output)
                return None
            keep(name, call, "output", leaves, output)
            kept_in_graph = handover()
            self._done(module)
            if kept_in_graph:  # detach=False: the model goes on with copies of what was kept
                return map_tensors_with_paths(_copier(kept_in_graph), output)
            return None

        return capture_output

    def _keep_op(
        self, name: str, call: int, op: str, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        """Keep one selected op call's inputs and output (told by the op watcher, after the op ran)."""
        keep, handover = self._keeper.keep_leaves, self._keeper.take_handover
        if "input" in self._whats:
            leaves = call_leaves(args, kwargs)
            if _writes_in_place(op, args, kwargs):  # the written argument holds the result now
                written = {id(tensor) for _, tensor in flatten_tensors(output, "")}
                leaves = [(path, tensor) for path, tensor in leaves if id(tensor) not in written]
            keep(name, call, "input", leaves, args, op=op)
            handover()  # the op has consumed its inputs: a later write is seen by the guard or the version check
        if "output" in self._whats:
            keep(name, call, "output", flatten_tensors(output, ""), output, op=op)
            kept_in_graph = handover()
            if kept_in_graph:  # detach=False: the model goes on with a copy of what was kept
                return map_tensors_with_paths(_copier(kept_in_graph), output)
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
                    _copier(kept_in_graph), output if replacement is None else replacement
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
        if self._stopped and not isinstance(sys.exc_info()[1], _StopForward):
            self._stopped = False
            raise CaptureError(
                f"{type(module).__name__}'s forward caught hookscope's stop signal (an 'except Exception' in "
                "the model?) and ran on; the values are captured, but use stop=False for this model"
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
                raise _StopForward(self)

    # -- reading: the cache of the latest pass ---------------------------------------------------

    @property
    def cache(self) -> Cache:
        """The :class:`Cache` of the latest forward pass."""
        return self._keeper.cache

    @property
    def passes(self) -> list[Cache]:
        """With ``passes="all"``, the :class:`Cache` of every finished forward pass, in order (a
        generation loop: the prefill, then one per new token); otherwise the latest one's."""
        if self._keep_passes:
            return list(self._passes)
        return [self._keeper.cache]

    def __getitem__(self, key: str | Site) -> torch.Tensor:
        return self.cache[key]

    def __contains__(self, key: object) -> bool:
        return key in self.cache

    def __iter__(self) -> Iterator[str]:
        return iter(self.cache)

    def __len__(self) -> int:
        return len(self.cache)

    def calls(self, key: str | Site) -> list[torch.Tensor]:
        """Every call's value for ``key``, in order (see :meth:`Cache.calls`)."""
        return self.cache.calls(key)

    def sites(self) -> list[Site]:
        """Every site captured in the latest pass."""
        return self.cache.sites()

    @property
    def nbytes(self) -> int:
        """Bytes held by the latest pass's values."""
        return self.cache.nbytes

    def numpy(self) -> dict[str, Any]:
        """The latest pass's values as numpy arrays (see :meth:`Cache.numpy`)."""
        return self.cache.numpy()

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Save the latest pass's values (see :meth:`Cache.save`)."""
        return self.cache.save(path)

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
        if len(exc_info) > 1 and not isinstance(exc_info[1], _StopForward):
            self._group.note_failure(exc_info[1])
        self.remove()
        stopped = exc_info[1] if len(exc_info) > 1 else None
        return isinstance(stopped, _StopForward) and stopped.owner is self  # the stop signal ends the block

    def __repr__(self) -> str:
        state = "live" if self.live else "removed"
        ops = f" and {len(self._ops.patterns)} op selectors" if self._ops is not None else ""
        return f"<Capture of {len(self._selected)} modules{ops}, {state}>\n{self.cache!r}"


def _writes_in_place(op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """True when the op may have written its result into an argument: ``add_``, ``out=``, and the
    functional ``F.relu(x, inplace=True)`` (or ``F.relu(x, True)``), named ``relu``; the argument
    it returns is then left out of the op's inputs (it holds the output)."""
    return (
        op.split("#")[0].endswith("_")
        or "out" in kwargs
        or kwargs.get("inplace") is True
        or any(arg is True for arg in args[1:])
    )


def _stop_check(options: CaptureOptions) -> Callable[[list[OpPattern]], None]:
    """Refuse op selectors with ``stop=True``: the forward would stop before the ops ran."""

    def check(patterns: list[OpPattern]) -> None:
        if patterns and options.stop:
            raise SpecError(
                f"stop=True cannot be used with op selectors ({str(patterns[0])!r}) yet: the forward would stop "
                "before the ops ran; use stop=False"
            )

    return check


def _leaf_filter(
    name: str, what: str, paths: list[tuple[str, bool]] | None
) -> Callable[[list[tuple[str, torch.Tensor]]], list[tuple[str, torch.Tensor]]] | None:
    """Keep the leaves at ``paths`` (and below them); None (no filter) for every leaf. A strict
    path that is not there is an error naming the tensors that are, also where the whole value
    is kept too (``["h.0", "h.0:output[0]"]``): a leaf that names nothing is never let pass."""
    if paths is None:
        return None
    every = any(path == "" for path, _ in paths)
    wanted = tuple(path for path, _ in paths)
    required = tuple(path for path, strict in paths if strict and path)
    if every and not required:
        return None

    def chosen(leaves: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        kept = leaves if every else [leaf for leaf in leaves if any(_at_or_below(leaf[0], path) for path in wanted)]
        missing = [path for path in required if not any(_at_or_below(p, path) for p, _ in kept)]
        if missing:
            there = ", ".join(repr(f"{name}:{leaf_label(what, p)}") for p, _ in leaves[:8]) or "no tensor"
            raise CaptureError(
                f"{name!r} {what} has no tensor at {', '.join(repr(leaf_label(what, p)) for p in missing)}; "
                f"its tensors: {there}",
                site=f"{name}:{leaf_label(what, missing[0])}",
            )
        return kept

    return chosen


def _at_or_below(path: str, wanted: str) -> bool:
    """``"[0][1]"`` is at or below ``"[0]"``; ``"[10]"`` is not."""
    return path == wanted or (path.startswith(wanted) and path[len(wanted)] in "[.")


def _copier(ids: set[int]) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """Replace the tensors named by ``ids`` with copies (one copy per tensor, so two places
    holding one tensor still hold one tensor), and leave the others."""
    copies: dict[int, torch.Tensor] = {}

    def copy(_path: str, tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in ids:
            return tensor
        if id(tensor) not in copies:
            copies[id(tensor)] = tensor.clone()
        return copies[id(tensor)]

    return copy


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


@with_options(CaptureOptions)
def capture(
    model: nn.Module,
    *selectors: Selector,
    layers: Selector | Sequence[Selector] | None = None,
    options: CaptureOptions | None = None,
    **opts: Any,
) -> Capture:
    """Keep the outputs (or inputs) of the modules the selectors pick, for each forward pass.

    The modules are chosen by selectors, given positionally or as ``layers=`` (one selector or
    a list). The options are those of :class:`CaptureOptions`, as keywords or whole
    (``options=hs.CaptureOptions(...)``, which a type checker reads field by field).

    Values are detached (``detach=False`` keeps the graph), stay on the device they were made on
    (``device="cpu"`` moves them; from CUDA through pinned memory, one sync per forward), and may
    be cast (``dtype``, floating values only) or reduced on the device first (``reduce="mean:1"``
    or a function). ``calls`` keeps ``"all"`` calls of a reused module, the ``"first"``, the
    ``"last"``, or one index. ``keep="input"`` or ``"both"`` also keeps inputs, keyword inputs
    included (paths ``[0]``, ``['scale']``). ``max_bytes`` (``1 << 30`` or ``"1GiB"``) stops a
    capture that would outgrow its budget with an error naming the largest sites. ``stop=True``
    ends the forward once every selected module has been captured (its first call, or the
    chosen index): the rest of the model does not run, and ``model(x)`` inside the ``with``
    block ends the block. A later in-place op never changes a kept value (see ``copy``).
    ``grads=True`` also keeps the gradient with respect to each kept value once a backward
    reaches it (``cache.grad["fc"]``, after ``loss.backward()``; ``run_with_capture(...,
    backward=metric)`` runs both), the gradient of the value as kept even if an in-place op
    changed it afterwards.
    Each call of the model is a pass and starts a new cache; ``passes="all"`` keeps every
    pass's cache (``capture.passes``; ``max_bytes`` then spans them all), for a loop that calls
    the model several times, such as ``generate``. A checkpointed block recomputing its forward
    in backward is not a pass: it neither adds values nor replaces them.

    Memory: once a pass ends holding 64 MiB or more on the host, glibc is asked (once per
    process) to keep freed memory resident up to twice that, at most 2 GiB, so the next
    forward reuses the pages instead of faulting them in again; ``HOOKSCOPE_MALLOC=default``
    in the environment leaves the allocator alone (see :mod:`hookscope._shared.allocator`).

    Op sites: a selector ``"h.0.attn:op[softmax#0]"`` keeps what a torch op called by the
    module's own code returns (``"h.*.attn:op[softmax]"``: every index, ``"layer1.0:op[add*]"``:
    a glob), read back as ``cap["h.0.attn:op[softmax#0]"]``, ``cap["h.0.attn#1:op[softmax#0]"]``
    (call 1), ``cap["h.0.attn:op[softmax]"]`` (the one index held), ``cap[":op[split#0][1]"]``
    (a leaf). ``keep="both"`` or ``"input"`` also keeps an op's tensor arguments
    (``:op[add#0]:input[1]``; not the argument an in-place op writes into, which holds its
    output by then). Every option above applies, but ``stop``. An op selector whose module
    ran but whose op never did raises ``CaptureError`` at the end of the pass, naming the ops
    the module called; under ``torch.compile`` op sites are refused (run the eager model).

    Attention sub-sites: ``"h.*.attn:attn.pattern"`` keeps, for each
    ``F.scaled_dot_product_attention`` call the module's own code makes (transformers'
    ``attn_implementation="sdpa"``), the probabilities; ``:attn.scores`` the pre-softmax scores
    (masked as the kernel masks, ``-inf`` where masked), ``:attn.q``, ``:attn.k``, ``:attn.v``
    the kernel's arguments, ``:attn.z`` its output per head (before the heads are merged). The
    scores and pattern are recomputed from the call's arguments only when selected: O(seq^2)
    memory per head, which ``reduce``, ``dtype`` and ``max_bytes`` apply to. ``#1`` picks the
    module's second kernel call (keys without an index name the first); ``keep`` does not apply.
    A module that never called the kernel (eager attention) raises with the fix;
    ``nn.MultiheadAttention`` is refused (it runs the kernel inside ``F.multi_head_attention_forward``).

    Example::

        with hs.capture(model, "layer*.conv2", "fc") as cap:
            model(x)
        cap["fc"]                      # fc's output (last call)
        cap.calls("layer1.0.conv2")    # every call, in order
        cap.numpy(); cap.save("feats.safetensors")
    """
    return Capture(model, given_selectors(selectors, layers, feature="capture"), CaptureOptions.build(options, opts))


@with_options(CaptureOptions, keep=("model_kwargs",))
def run_with_capture(
    model: nn.Module,
    *args: Any,
    layers: Selector | Sequence[Selector],
    options: CaptureOptions | None = None,
    backward: Callable[[Any], torch.Tensor] | None = None,
    model_kwargs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> tuple[Any, Cache]:
    """Run ``model(*args, **kwargs)`` once with a capture; return ``(output, cache)``.

    ``backward=metric`` also runs one backward from ``metric(output)`` (a scalar; one value per
    row is summed, so each row's gradients are its own metric's) and keeps the gradient with
    respect to every captured value as ``cache.grad[site]`` (``grads=True`` is implied). The
    backward reaches only the captured values: parameters' ``.grad`` are left as they were.

    >>> model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    >>> x = torch.randn(3, 4)
    >>> out, cache = run_with_capture(model, x, layers="1", backward=lambda out: out.sum())
    >>> h = model[0](x).tanh().detach().requires_grad_()
    >>> reference, = torch.autograd.grad(model[2](h).sum(), h)
    >>> torch.allclose(cache.grad["1"], reference), model[0].weight.grad is None
    (True, True)

    ``layers`` is one selector or a list of them; the options are :class:`CaptureOptions`'
    (:func:`capture`'s). Keyword arguments that are not options go to the model
    (``model_kwargs`` passes ones whose names clash with an option). With ``stop=True`` the
    output is ``None``.

    >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 2))
    >>> out, cache = run_with_capture(model, torch.randn(3, 4), layers=["0", "2"])
    >>> cache["0"].shape, torch.equal(cache["2"], out)
    (torch.Size([3, 8]), True)
    >>> bool((cache["0"] < 0).any())  # the in-place ReLU did not touch the kept value
    True

    Op sites are selectors too: ``"module:op[name#index]"`` keeps the output of a torch op
    that the module's own code calls (``keep="both"``: its tensor arguments as well, under
    ``:input[i]``); ``hs.layers(model, x, ops=True)`` lists them.

    >>> model = nn.Sequential(nn.Linear(4, 3), nn.Softmax(dim=-1))
    >>> out, cache = run_with_capture(model, torch.randn(2, 4), layers=["1:op[softmax#0]", "0"], keep="both")
    >>> torch.equal(cache["1:op[softmax#0]"], out), torch.equal(cache["1:op[softmax]:input[0]"], cache["0"])
    (True, True)
    >>> sorted(cache.numpy())
    ['0#0:input[0]', '0#0:output', '1#0:op[softmax#0]', '1#0:op[softmax#0]:input[0]']
    """
    chosen, model_kw = CaptureOptions.split(kwargs)
    ensure_loaded(ensure_module(model), (args, model_kw, model_kwargs))  # a meta model: one line, not torch's
    built = CaptureOptions.build(options, chosen)
    if backward is not None:
        if not callable(backward):
            raise SpecError(f"backward={backward!r}: expected a function of the model's output returning a scalar")
        if built.stop:
            raise SpecError("backward= needs the model's output, and stop=True ends the forward before it: use one")
        built = dataclasses.replace(built, grads=True)
    recorder = Capture(model, given_selectors((), layers, feature="capture"), built)
    with recorder:
        try:
            output = model(*args, **{**model_kw, **(model_kwargs or {})})
        except _StopForward as stopped:
            if stopped.owner is not recorder:
                raise
            output = None
    if backward is not None:
        _backward(backward, output, recorder._keeper.grad_edges)
    return output, recorder.cache


def _backward(metric: Callable[[Any], torch.Tensor], output: Any, edges: list[Any]) -> None:
    """Differentiate ``metric(output)`` with respect to the kept values only (their hooks keep
    the gradients); a metric that is not a differentiable tensor is refused with the reason."""
    value = metric(output)
    if not isinstance(value, torch.Tensor):
        raise SpecError(f"the backward metric returned {type(value).__name__}; expected a tensor (a scalar)")
    if value.dim() > 1:
        raise SpecError(
            f"the backward metric returned shape {tuple(value.shape)}; expected a scalar or one value per row"
        )
    if not value.requires_grad:
        raise CaptureError(
            "the backward metric does not depend on anything in autograd's graph (run the model outside "
            "torch.no_grad() and inference_mode(), with weights that require grad: frozen weights, "
            "requires_grad_(False), leave nothing to differentiate)"
        )
    if not edges:
        raise CaptureError(
            "no captured value is in autograd's graph, so no gradient can be kept: run the model outside "
            "torch.no_grad() and inference_mode(), and capture values the output depends on"
        )
    try:
        torch.autograd.grad(value.sum(), edges, allow_unused=True)
    except RuntimeError as error:
        if "reentrant" not in str(error):
            raise
        raise CaptureError(
            "backward= cannot reach values through a block checkpointed with use_reentrant=True (PyTorch allows "
            "only .backward() there); checkpoint with use_reentrant=False "
            "(model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}))"
        ) from error

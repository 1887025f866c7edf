"""``Keeper``: turn each tensor a hook sees into the value kept in the cache, within a budget.

The order of work per tensor is fixed so that cost is paid only where needed: detach, reduce on
the device, check the budget from shape and dtype *before* allocating anything, cast, move, and
then decide whether the value must be copied now or may be watched (see ``guard``):

- values that share memory with the model and are small (<= 64 KiB) are copied at once: a copy
  that size costs less than the guard's per-op dispatch for the rest of the forward;
- small views of large storages are copied, so a kept slice does not keep the whole storage
  alive behind the budget's back;
- values without storage (meta, sparse) are copied, since their memory cannot be watched;
- everything else that shares memory is watched, and copied only if something writes into it;
- with ``detach=False``, a value in autograd's graph is kept itself (a copy would be a new node
  that no loss depends on) and the hook hands the *model* a copy to go on with instead
  (:meth:`Keeper.take_handover`): in-place writes later in the forward land on that copy.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from hookscope._arch.std import StdMap
from hookscope._capture.cache import Cache, tensor_bytes
from hookscope._capture.guard import storage_bytes, storage_key, unwatch_writes, watch_writes
from hookscope._capture.options import CaptureOptions
from hookscope._core.compat.compiled import is_compiling
from hookscope._core.compat.internals import version_counter
from hookscope._core.op_sites import heads_first
from hookscope._core.sites import Site
from hookscope._shared import malloc as allocator
from hookscope._shared.dtypes import cast_checked, dtype_name
from hookscope._shared.reduce import reduce_value
from hookscope._shared.units import format_bytes
from hookscope.errors import CaptureError, SpecError

__all__ = ["EAGER_COPY_BYTES", "Keeper"]

EAGER_COPY_BYTES = 64 * 1024


def _no_grad_reason(fresh: bool) -> str:
    """Why a kept value gets no gradient: outside autograd's graph, or recomputed off it."""
    if not torch.is_grad_enabled():
        return (
            "it is not in autograd's graph: it was made with gradients off (torch.no_grad(), "
            "inference_mode(), or inside a block checkpointed with use_reentrant=True, whose forward runs "
            "without them: use use_reentrant=False) or from inputs and weights that do not require grad"
        )
    if fresh:
        return (
            "it was recomputed from the kernel's arguments, which are not in autograd's graph: they were made "
            "from inputs and weights that do not require grad (frozen weights: requires_grad_(False))"
        )
    return (
        "it is not in autograd's graph: it was made from inputs and weights that do not require grad "
        "(frozen weights: requires_grad_(False))"
    )


class Keeper:
    """Holds one forward pass's values: the :class:`Cache`, the bytes used, the watched storages."""

    def __init__(
        self,
        options: CaptureOptions,
        *,
        meta: dict[str, Any],
        canonical: Callable[[], StdMap] | None = None,
        copy: object = None,
    ) -> None:
        """Keep values as ``options`` say (``copy``: in place of ``options.copy``, for a replica's
        keeper, which copies every value); ``meta``: the cache's description of the capture;
        ``canonical``: the model's canonical map, for reading ``std:`` names later."""
        self._detach = options.detach
        self._reduce = options.reduction
        self._reduce_spec = options.reduce
        self._dtype = options.torch_dtype
        self._device = options.torch_device
        self._copy = options.copy if copy is None else copy
        self._budget = options.budget
        self._last_call_only = options.calls == "last"
        self._meta = meta
        self._grads = options.grads
        self._canonical = canonical
        self.cache = self._new_cache()
        #: ``grads=True``: where each kept value sits in autograd's graph, as it was when kept
        #: (an in-place write later makes a new node; this edge stays on the kept value's).
        self.grad_edges: list[GradientEdge] = []
        self._bytes = 0
        self._watched: dict[int, list[Site]] = {}
        self._guards = self._copy == "auto"  # watch values and copy them before a write (else: copy now, or never)
        self._guard_on = False
        self._latest_call: dict[str, int] = {}
        self._module_sites: dict[str, list[Site]] = {}
        self._sync_streams: list[torch.cuda.Stream] = []
        self._deferred: list[tuple[str, int, str, list[tuple[str, torch.Tensor, torch.Tensor | None]], str]] = []
        self._overflows: list[tuple[Site, torch.Tensor]] = []  # a cast's count of values turned +-inf
        self._handover: set[int] = set()  # ids of graph tensors kept as they are: the model gets copies
        #: The current model call's mask of real tokens (``token_mask``), for reductions over dim 1.
        self.token_mask: torch.Tensor | None = None

    # -- a pass -----------------------------------------------------------------------------------

    def start(self, *, refill_budget: bool = True) -> None:
        """Begin a new forward pass: a new cache, nothing watched, the budget full (unless the
        earlier passes' caches are kept too: then the budget spans them all)."""
        self.cache = self._new_cache()
        self.grad_edges = []
        if refill_budget:
            self._bytes = 0
        self._watched.clear()
        self._latest_call.clear()
        self._module_sites.clear()
        self._overflows.clear()

    def _new_cache(self) -> Cache:
        cache = Cache(meta=self._meta)
        cache._canonical = self._canonical
        return cache

    def finish(self, outliving: Callable[[], set[int]]) -> None:
        """End the pass: copy watched values that share memory with anything that outlives it.

        ``outliving`` names that memory; it is asked only when something is still watched.
        """
        self._keep_deferred()  # a pass ends eagerly, also one that opened in compiled code
        self.leave_guard()
        if self._watched:
            outside = outliving()
            for key in [key for key in self._watched if key in outside]:
                self.copy_before_write(key, keep_graph=True)
            self._watched.clear()
        self.wait_for_copies()
        self._count_overflows()
        if allocator.would_change(self._bytes):  # host bytes are at most these: else no scan
            allocator.keep_freed_memory(self._host_bytes())

    def _host_bytes(self) -> int:
        """The bytes of the values this keeper holds on the host: only host memory comes from the C
        allocator that :mod:`hookscope._shared.malloc` tunes (a GPU model's values do not)."""
        return sum(tensor_bytes(value) for _, value in self.cache._items() if value.device.type == "cpu")

    def _count_overflows(self) -> None:
        """Read the pass's overflow counts at once (one wait for the device, only when a
        narrowing cast ran) into ``cache.overflowed``."""
        if not self._overflows:
            return
        device = self._overflows[0][1].device
        counts = torch.stack([count.to(device) for _, count in self._overflows]).tolist()
        for (site, _), count in zip(self._overflows, counts, strict=True):
            if count:
                self.cache._overflowed[str(site)] = int(count)
        self._overflows.clear()

    def abandon(self) -> None:
        """Drop the pass's bookkeeping after it was cut short without its closing hooks."""
        self.leave_guard()
        self._watched.clear()
        self.wait_for_copies()

    def wait_for_copies(self) -> None:
        """Wait once for the non-blocking device-to-host copies of this pass."""
        streams, self._sync_streams = self._sync_streams, []
        for stream in streams:
            stream.synchronize()

    def leave_guard(self) -> None:
        """Stop watching writes if this keeper watched; the last keeper to stop takes the mode off."""
        if not self._guard_on:
            return
        self._guard_on = False
        unwatch_writes(self._watched)

    # -- values -----------------------------------------------------------------------------------

    def keep_leaves(
        self,
        name: str,
        call: int,
        what: str,
        leaves: list[tuple[str, torch.Tensor]],
        value: Any,
        op: str = "",
        *,
        fresh: bool = False,
    ) -> None:
        """Keep every tensor leaf of one module call's input or output, or (``op``: ``"softmax#0"``)
        of one op's inside it. ``fresh``: the tensors were made for the capture (an attention
        pattern recomputed from the kernel's arguments), so nothing else can write into them:
        kept as they are, neither copied nor watched."""
        if op:  # an op site: never in compiled code (the op watcher refuses it)
            self._keep_leaves(name, call, what, leaves, type(value).__name__, op=op, fresh=fresh)
            return
        if is_compiling():  # Dynamo cannot build Sites in a graph: copies now, kept at the pass's end
            copies = [(path, *self._prepared(tensor)) for path, tensor in leaves]
            self._deferred.append((name, call, what, copies, type(value).__name__))
            return
        self._keep_leaves(name, call, what, leaves, type(value).__name__)

    def _keep_deferred(self) -> None:
        """Keep what compiled code handed over, at the pass's end (which runs eagerly)."""
        deferred, self._deferred = self._deferred, []
        for name, call, what, copies, kind in deferred:
            self._keep_leaves(name, call, what, [(path, value) for path, value, _ in copies], kind, owned=True)
            for path, _, overflowed in copies:
                if overflowed is not None:
                    self._overflows.append((Site(name, call, what, path), overflowed))  # type: ignore[arg-type]

    def _keep_leaves(
        self,
        name: str,
        call: int,
        what: str,
        leaves: list[tuple[str, torch.Tensor]],
        kind: str,
        owned: bool = False,
        op: str = "",
        fresh: bool = False,
    ) -> None:
        if self._last_call_only and not self._make_room_for(name, call):
            return
        if not leaves and not op:
            self.cache._note_empty(name, what, kind)
        for path, tensor in leaves:
            site = Site(name, call, what, path, op)  # type: ignore[arg-type]
            self._keep(site, tensor, owned=owned, fresh=fresh)
            if self._last_call_only:
                self._module_sites.setdefault(name, []).append(site)

    def _make_room_for(self, name: str, call: int) -> bool:
        """``calls="last"``: keep only the highest call index of each module; False to skip."""
        latest = self._latest_call.get(name)
        if latest is not None and call < latest:
            return False  # an outer call finishing after an inner one (recursion)
        if latest is not None and call > latest:
            for site in self._module_sites.pop(name, []):
                self._forget(site)
        self._latest_call[name] = call
        return True

    def _keep(self, site: Site, tensor: torch.Tensor, *, owned: bool = False, fresh: bool = False) -> None:
        if owned:  # made by _prepared in compiled code: reduced, cast and moved already
            self._charge(site, tensor_bytes(tensor))
            self.cache._put(site, tensor, version_counter(tensor))
            if self._grads:
                self.cache._note_no_grad(site, "it was kept inside torch.compile'd code: capture the eager model")
            return
        value = tensor.detach() if self._detach else tensor
        if self._reduce is not None:
            value = self._reduced(site, value)
        cast = self._dtype if self._dtype is not None and value.is_floating_point() else None
        self._charge(site, tensor_bytes(value) if cast is None else value.numel() * cast.itemsize)
        if cast is not None:
            value, overflowed = cast_checked(value, cast)
            if overflowed is not None:
                self._overflows.append((site, overflowed))
        if self._device is not None and value.device != self._device:
            value = self._moved(value)
        if not fresh:
            value = self._owned(site, value, tensor)
        self.cache._put(site, value, version_counter(value))
        if self._grads:
            self._keep_grad(site, tensor, fresh)

    def _keep_grad(self, site: Site, tensor: torch.Tensor, fresh: bool) -> None:
        """``grads=True``: put the gradient with respect to ``tensor``, as it is now, into this
        pass's cache when a backward reaches it. A tensor hook stays on the node that made this
        version, so an in-place write later does not change whose gradient it gets."""
        cache = self.cache
        if not tensor.requires_grad:  # a recomputed value in the graph is on the model's path (spliced)
            cache._note_no_grad(site, _no_grad_reason(fresh))
            return
        dtype, device = self._dtype, self._device

        def keep_grad(grad: torch.Tensor) -> None:
            kept = grad.detach()
            if dtype is not None and kept.is_floating_point():
                kept = kept.to(dtype)
            if device is not None:
                kept = kept.to(device)
            cache._add_grad(site, kept)

        tensor.register_hook(keep_grad)  # type: ignore[no-untyped-call]
        self.grad_edges.append(get_gradient_edge(tensor))

    def _prepared(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """In compiled code: the value as it will be kept (detached or not, reduced, cast, moved),
        copied in the graph, since no storage address tells there whether anything else holds it.
        The budget is charged once the graph has run (from the kept sizes, not before); the
        cast's overflow count is read then too."""
        value = tensor.detach() if self._detach else tensor
        if self._reduce is not None:
            value = reduce_value(self._reduce, value, self.token_mask)
        overflowed = None
        if self._dtype is not None and value.is_floating_point():
            value, overflowed = cast_checked(value, self._dtype)
        if self._device is not None and value.device != self._device:
            value = value.to(self._device)
        return value.clone(), overflowed

    def _reduced(self, site: Site, value: torch.Tensor) -> torch.Tensor:
        assert self._reduce is not None
        mask = None if heads_first(site.op) else self.token_mask
        try:
            return reduce_value(self._reduce, value, mask)
        except (RuntimeError, IndexError, TypeError, ValueError) as error:
            raise SpecError(
                f"reduce={self._reduce_spec!r} failed on {str(site)!r}, a {tuple(value.shape)} "
                f"{dtype_name(value.dtype)} tensor: {error}; pick dimensions that fit every "
                "selected layer's values, or capture those layers separately"
            ) from error

    def check_room(self, site: Site, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Refuse, before it is made, a value of ``shape`` and ``dtype`` that ``max_bytes`` has
        no room for as kept (cast to the capture's dtype; a reduction is not foreseen: no check)."""
        if self._budget is None or self._reduce is not None:
            return
        kept = self._dtype if self._dtype is not None and dtype.is_floating_point else dtype
        size = math.prod(shape) * kept.itemsize
        if self._bytes + size > self._budget:
            raise CaptureError(self._over_budget(site, size), site=str(site))

    def _charge(self, site: Site, size: int) -> None:
        previous = self.cache._get(site)
        if previous is not None:
            self._bytes -= tensor_bytes(previous)
        if self._budget is not None and self._bytes + size > self._budget:
            raise CaptureError(self._over_budget(site, size), site=str(site))
        self._bytes += size

    def _moved(self, value: torch.Tensor) -> torch.Tensor:
        assert self._device is not None
        if value.is_cuda and self._device.type == "cpu":  # pinned + non-blocking; one wait per pass
            pinned = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            pinned.copy_(value, non_blocking=True)
            stream = torch.cuda.current_stream(value.device)
            if stream not in self._sync_streams:
                self._sync_streams.append(stream)
            return pinned
        return value.to(self._device)

    def _owned(self, site: Site, value: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
        """``value`` itself if nothing else can write into it, a copy, or ``value`` watched."""
        key = storage_key(value)
        if key != 0 and key != storage_key(original):
            return value  # made here (reduced, cast, moved): nobody else holds it
        if not self._detach and original.requires_grad and self._copy is not False:
            self._handover.add(id(original))  # kept in the graph; the model goes on with a copy
            if self._guards and key != 0:  # another holder (the caller of an input) may still write
                self._watch(key, site)
            return value
        if self._copy is False:
            if value.is_inference():
                raise CaptureError(
                    f"copy=False cannot tell whether {str(site)!r} is changed later: tensors made under "
                    "torch.inference_mode() have no version counter; run under torch.no_grad(), or use "
                    "copy='auto' (the default)",
                    site=str(site),
                )
            return value
        size = tensor_bytes(value)
        if self._copy is True or key == 0 or size <= EAGER_COPY_BYTES or storage_bytes(value) > 2 * size:
            return value.clone()
        self._watch(key, site)
        return value

    def take_handover(self) -> set[int]:
        """The ids of the tensors just kept in autograd's graph (``detach=False``), which the
        hook must replace by copies in what the model goes on with; empty almost always."""
        if not self._handover:
            return self._handover
        taken, self._handover = self._handover, set()
        return taken

    def _watch(self, key: int, site: Site) -> None:
        self._watched.setdefault(key, []).append(site)
        if self._guards and not self._guard_on:
            watch_writes(self._watched, self.copy_before_write)
            self._guard_on = True

    def copy_before_write(self, key: int, *, keep_graph: bool = False) -> None:
        """Replace the kept values on storage ``key`` by copies, before something writes there.

        Sites that hold the very same view (an ``Identity`` after a layer, an output kept as the
        next layer's input) share one copy. A value kept in autograd's graph (``detach=False``)
        is copied only before a real write (its gradient is then the copy's, through the same
        graph); ``keep_graph`` leaves it as it is at the pass's end, where no write is coming
        and its version counter guards it from then on.
        """
        copies: dict[tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype], torch.Tensor] = {}
        for site in self._watched.pop(key, []):
            kept = self.cache._get(site)
            if keep_graph and kept is not None and kept.requires_grad and not self._detach:
                continue  # the model's own tensor, kept in the graph (see _owned)
            if kept is None or version_counter(kept) != self.cache._version_of(site):
                continue  # already changed behind the guard's back: leave it for the read check
            view = (kept.data_ptr(), tuple(kept.shape), kept.stride(), kept.dtype)
            copy = copies.get(view)
            if copy is None:
                copy = copies[view] = kept.clone()
            self.cache._put(site, copy, version_counter(copy))

    def _forget(self, site: Site) -> None:
        if self._overflows:
            self._overflows = [(other, count) for other, count in self._overflows if other != site]
        kept = self.cache._get(site)
        if kept is not None:
            self._bytes -= tensor_bytes(kept)
        self.cache._drop(site)

    def _over_budget(self, site: Site, size: int) -> str:
        held = sorted(((tensor_bytes(t), str(s)) for s, t in self.cache._items()), reverse=True)
        largest = ", ".join(f"{name} ({format_bytes(n)})" for n, name in held[:5])
        hints = ["capture fewer layers"]
        if self._reduce is None:
            hints.append("reduce them on the device (reduce='mean:1')")
        if not self._last_call_only:
            hints.append("keep calls='last'")
        hints.append("or raise max_bytes")
        return (
            f"capture would hold {format_bytes(self._bytes + size)}, over max_bytes={format_bytes(self._budget or 0)}, "
            f"at {str(site)!r} ({format_bytes(size)}); largest kept: {largest or 'none'}; {', '.join(hints)}"
        )

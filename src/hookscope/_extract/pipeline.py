"""The forward side of an extraction: captures per reduction, batches in, values out.

Each reduction is one :func:`hookscope.capture` over the modules it applies to (a capture
applies one reduction), each reading the batch's mask of real tokens off the model's call. After each
forward the values of every site are checked against the layout and handed to the writer
thread; from a GPU through reused pinned buffers with non-blocking copies and an event that
the writer waits on, so the main thread never waits for the device and goes on to the next
batch.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from hookscope._arch.positions import POSITION_WORDS
from hookscope._capture import Capture, CaptureOptions, capture
from hookscope._core.names import escape_name, leaf_label, named_modules, split_leaf_selector
from hookscope._core.op_sites import op_pattern, split_op_label
from hookscope._core.plan import split_op_selectors
from hookscope._core.select import LeafPaths, Selector, describe_selector, select, select_leaves
from hookscope._core.sites import Site
from hookscope._core.tree import map_tensors
from hookscope._extract.data import Batch
from hookscope._extract.experts import ExpertRows
from hookscope._extract.inputs import input_parts
from hookscope._extract.provenance import Provenance
from hookscope._extract.reduce import describe_reduction, extraction_reduction
from hookscope._extract.writer import Work, WriterThread
from hookscope._shared.dtypes import overflow_message
from hookscope._shared.reduce import Reduction, mask_of
from hookscope._store import Layout, regions
from hookscope.errors import CastOverflowWarning, DataError, SpecError

__all__ = ["HostCopier", "ProbeValues", "SiteCaptures", "check_batch_first", "forward", "run_batches"]

ReduceOption = str | Reduction | None | Mapping[Any, str | Reduction | None]
_WHAT_ORDER = {"input": 0, "output": 1}


class SiteCaptures:
    """The captures of one extraction, attached together; ``collect()`` reads the latest forward."""

    def __init__(
        self,
        model: nn.Module,
        layers: list[Selector],
        *,
        reduce: ReduceOption,
        options: CaptureOptions,
    ) -> None:
        self.model = model
        ops, module_layers = _split_ops(layers)
        self._experts = ExpertRows(model, ops)  # expert rows go back to their tokens (per_token)
        ops += self._experts.companions
        layers = [*layers, *self._experts.companions]
        # SelectionError with the closest names, before anything runs (an empty list's too)
        picked = module_layers or not ops
        chosen, leaves = select_leaves(model, module_layers, whole_sides=options.sides) if picked else ([], {})
        self.order = {name: index for index, (name, _) in enumerate(named_modules(model))}
        groups = _groups(model, chosen, ops, reduce)  # checks every reduction now, before anything attaches
        self._experts.refuse_reduction([op for spec, _, members in groups if spec is not None for op in members])
        self.reductions = {
            name: describe_reduction(spec) for spec, members, op_members in groups for name in [*members, *op_members]
        }
        if len(groups) == 1:  # one capture: it reads the selectors as given, leaf and op selectors included
            self._groups: list[tuple[Reduction | None, list[Selector]]] = [
                (extraction_reduction(groups[0][0]), list(layers))
            ]
        else:  # a capture per reduction: each module named on its own (a leaf of one, by its exact name)
            self._groups = [
                (
                    extraction_reduction(spec),
                    [s for name, module in members.items() for s in _named(name, module, leaves)] + list(op_members),
                )
                for spec, members, op_members in groups
            ]
        #: Each capture's reduction as given, and its op selectors, in the order of the captures.
        self._given = [(spec, op_members) for spec, _, op_members in groups]
        #: Which capture kept each site of the latest forward.
        self._kept_by: dict[Site, int] = {}
        self._options = options
        self._captures: list[Capture] = []
        #: Values the dtype cast turned into +-inf, by site, over every batch so far.
        self.overflowed: dict[str, int] = {}

    def __enter__(self) -> SiteCaptures:
        try:
            for reduction, modules in self._groups:
                # a warning per batch would bury the run's output: one for the run, at its end
                overflow = "ignore" if self._options.overflow == "warn" else self._options.overflow
                chosen = dataclasses.replace(self._options, reduce=reduction, overflow=overflow)
                self._captures.append(capture(self.model, *modules, options=chosen))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        captures, self._captures = self._captures, []
        for made in captures:
            if len(exc) == 3:
                made.__exit__(*exc)  # a forward that raised gets a note naming where
            else:
                made.remove()
        dtype = self._options.torch_dtype
        if exc and exc[0] is None and self.overflowed and self._options.overflow == "warn" and dtype is not None:
            warnings.warn(overflow_message(self.overflowed, dtype, "extract"), CastOverflowWarning, stacklevel=2)

    def spec_of(self, site: Site) -> str | Reduction | None:
        """The reduction given for ``site`` (read after :meth:`collect`): its capture's."""
        return self._given[self._kept_by[site]][0]

    def reduction_of(self, site: Site) -> str | None:
        """How the store records ``site``'s reduction (see :attr:`reductions`)."""
        return describe_reduction(self.spec_of(site))

    def collect(self, rows: int) -> dict[Site, torch.Tensor]:
        """Every site of the latest forward (a batch of ``rows``), in model order, then call, then
        the module's own values before its ops', then input before output; expert sub-sites per
        token (:class:`~hookscope._extract.experts.ExpertRows`)."""
        for made in self._captures:
            for label, count in made.cache.overflowed.items():
                self.overflowed[label] = self.overflowed.get(label, 0) + count
        found: dict[Site, torch.Tensor] = {}
        self._kept_by = {}
        for number, made in enumerate(self._captures):
            for site in made.cache.sites():
                if site in self._kept_by:
                    raise self._kept_twice(site, self._kept_by[site], number)
                self._kept_by[site] = number
                found[site] = made.cache[site]
        found = self._experts.per_token(found, rows)
        return dict(sorted(found.items(), key=lambda item: self._rank(item[0])))

    def _kept_twice(self, site: Site, first: int, second: int) -> SpecError:
        """Op selectors of two reductions name one site (modules are shared out between reductions
        before anything runs; op sites are known only once they ran)."""
        named = " and ".join(
            f"{', '.join(map(repr, self._given[number][1]))} (reduce {describe_reduction(self._given[number][0])})"
            for number in (first, second)
        )
        return SpecError(
            f"op site {str(site)!r} is named by op selectors of two reductions, {named}; name each op site "
            "in layers= through selectors of one reduction"
        )

    def _rank(self, site: Site) -> tuple[int, int, str, int, int, str]:
        # a module's own values first (op ""), then its ops by name and index (the order they ran is not kept)
        name, index = split_op_label(site.op) if site.op else ("", -1)
        return (self.order.get(site.module, -1), site.call, name, index, _WHAT_ORDER.get(site.what, 2), site.path)


def _named(name: str, module: nn.Module, leaves: dict[str, LeafPaths]) -> list[Selector]:
    """What the capture of ``module`` is given: the module, or the leaf selectors of its leaves."""
    if name not in leaves:
        return [module]
    return [
        f"{escape_name(name)}:{leaf_label(what, path)}" for what, paths in leaves[name].items() for path, _ in paths
    ]


def _split_ops(layers: list[Selector]) -> tuple[list[str], list[Selector]]:
    """The op selectors (``"h.*.attn:attn.pattern"``, as written) and the module selectors; a
    malformed op selector is a ``SpecError`` now."""
    patterns, others = split_op_selectors(layers)
    return [str(pattern) for pattern in patterns], others


Group = tuple[str | Reduction | None, dict[str, nn.Module], list[str]]


def _groups(model: nn.Module, chosen: list[tuple[str, nn.Module]], ops: list[str], reduce: ReduceOption) -> list[Group]:
    """Modules and op selectors grouped by reduction. With a dict, a module takes the first key
    that selects it, and an op selector the key written as it is (an op's values are not its
    module's: ``"h.0.attn"``'s reduction is not its pattern's); a site no key names is stored whole."""
    if not isinstance(reduce, Mapping):
        return [(reduce, dict(chosen), ops)]
    assigned: dict[str, str | Reduction | None] = {}
    chosen_names = {name for name, _ in chosen}
    for key, spec in reduce.items():
        extraction_reduction(spec)  # every value is checked, also one no layer ends up using
        pattern = op_pattern(key) if isinstance(key, str) else None
        if pattern is not None:
            written = str(pattern)
            if written not in ops:
                raise SpecError(
                    f"reduce key {key!r} is an op selector that layers= does not hold (it holds "
                    f"{', '.join(map(repr, ops)) or 'no op selector'}); key an op site's reduction by its selector "
                    "exactly as given in layers="
                )
            assigned.setdefault(written, spec)
            continue
        split = split_leaf_selector(key)  # "h.0:output[0]" reduces the module it names
        hits = [name for name, _ in select(model, key if split is None else split[0])]
        if not set(hits) & chosen_names:
            named = ", ".join(hits[:3]) + (", ..." if len(hits) > 3 else "")
            ops_note = " (an op site takes only a key written as its op selector is in layers=)" if ops else ""
            raise SpecError(
                f"reduce key {describe_selector(key)} selects {named}, none of the layers being extracted; "
                f"use a key that names some of them{ops_note}"
            )
        for name in hits:
            assigned.setdefault(name, spec)
    groups: dict[tuple[str, object], Group] = {}

    def group_of(spec: str | Reduction | None) -> Group:
        key = ("name", spec) if isinstance(spec, str) else ("object", id(spec))  # equal texts share a capture
        return groups.setdefault(key, (spec, {}, []))

    for name, module in chosen:
        group_of(assigned.get(name))[1][name] = module
    for written in ops:
        group_of(assigned.get(written))[2].append(written)
    return list(groups.values())


class ProbeValues:
    """The first batch's values, handed on once instead of running that batch again, then let go.

    Let go at the first batch this rank runs, whether it is that batch or not: on a rank that does
    not own the first chunk, or a resumed run that has it, they would otherwise stay in memory
    (on the GPU, for unreduced sites) for the whole run.
    """

    def __init__(self, batch: Batch, values: dict[Site, torch.Tensor]) -> None:
        self.batch = batch  # a copy of its inputs taken before its forward, for their checksum
        self.values: dict[Site, torch.Tensor] | None = values

    def take(self, batch: Batch) -> dict[Site, torch.Tensor] | None:
        values, self.values = self.values, None
        same = batch.start == self.batch.start and batch.rows == self.batch.rows
        return values if same else None


class HostCopier:
    """Device values to host memory: pinned buffers reused across batches, copies that do not block.

    CPU values pass through untouched. CUDA values are copied into pinned buffers (one pool
    per shape and dtype, refilled when the writer is done with a batch) on the current stream
    of their device, followed by an event on that stream for the writer to wait on: one per
    device, so a model spread over several GPUs is waited for on each. Other devices are
    copied synchronously.
    """

    def __init__(self) -> None:
        self._free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def work(self, start: int, values: list[torch.Tensor], input_parts: list[tuple[int, int, int]]) -> Work:
        if all(v.device.type == "cpu" for v in values):
            return Work(start, values, input_parts)
        host: list[torch.Tensor] = []
        pinned: list[torch.Tensor] = []
        devices: dict[torch.device, None] = {}
        for value in values:
            if value.is_cuda:
                buffer = self._take(value)
                buffer.copy_(value, non_blocking=True)  # queued on the current stream of value's device
                host.append(buffer)
                pinned.append(buffer)
                devices[value.device] = None
            else:
                host.append(value.cpu())
        ready = []
        for device in devices:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(device))
            ready.append(event)
        return Work(start, host, input_parts, ready, release=lambda: self._give_back(pinned))

    def _take(self, value: torch.Tensor) -> torch.Tensor:
        key = (tuple(value.shape), value.dtype)
        with self._lock:
            spare = self._free.get(key)
            if spare:
                return spare.pop()
        return torch.empty(value.shape, dtype=value.dtype, pin_memory=True)

    def _give_back(self, buffers: list[torch.Tensor]) -> None:
        with self._lock:
            for buffer in buffers:
                self._free.setdefault((tuple(buffer.shape), buffer.dtype), []).append(buffer)


def run_batches(
    model: nn.Module,
    batches: Iterable[Batch],
    *,
    captures: SiteCaptures,
    layout: Layout,
    writer: WriterThread,
    device: torch.device,
    mask_key: str | None,
    mask_required: bool,
    reused: ProbeValues | None,
    on_batch: Callable[[int], None],
    skipped: Callable[[Batch], None] | None = None,
    provenance: Provenance | None = None,
) -> int:
    """Run every batch the writer still wants, hand its values on; return the rows the data held.

    ``reused`` holds a batch already run (the probe) and its values, handed on instead of run again;
    ``skipped`` sees each batch the writer does not want (a stream's rows a resumed store has:
    their checksums are checked). The checksum of each batch's input rows is taken before its
    forward, so a model that writes into its inputs does not change it; so are its ``provenance``
    rows (data index, tokens, mask), handed on after the sites' values.
    """
    sites = {Site.parse(site.site): site for site in layout.sites}
    copier = HostCopier()
    end = 0
    for batch in batches:
        end = max(end, batch.stop)
        if layout.rows is not None and batch.stop > layout.rows:
            raise DataError(
                f"the data yielded rows up to {batch.stop - 1}, past the {layout.rows} rows it held when counted; "
                "it must yield the same rows in every pass over it",
                rows=range(max(batch.start, layout.rows), batch.stop),
            )
        if not writer.writer.wants(batch.start, batch.stop):
            if skipped is not None:  # the probe's inputs as they were before its forward, where this is the probe
                probe = reused.batch if reused is not None else None
                same = probe is not None and (probe.start, probe.rows) == (batch.start, batch.rows)
                skipped(probe if same and probe is not None else batch)
            continue  # a stream's batch inside chunks a resumed store already has
        cut = regions(layout, batch.start, batch.stop)
        values = reused.take(batch) if reused is not None else None
        if values is None:
            parts = input_parts(batch, cut)
            kept = provenance.values(batch) if provenance is not None else []
            values = forward(model, batch, captures, device, mask_key, mask_required)
        else:  # the probe: its inputs as they were before its forward
            assert reused is not None
            parts = input_parts(reused.batch, cut)
            kept = provenance.values(reused.batch) if provenance is not None else []
        ordered = _checked(values, sites, batch) + kept
        writer.submit(copier.work(batch.start, ordered, parts))
        on_batch(batch.rows)
    return end


def forward(
    model: nn.Module,
    batch: Batch,
    captures: SiteCaptures,
    device: torch.device,
    mask_key: str | None,
    mask_required: bool,
) -> dict[Site, torch.Tensor]:
    """One forward of ``batch`` on ``device`` under ``no_grad``; the values of every captured site.

    The captures read the batch's mask of real tokens off the model's call themselves (their
    ``token_mask``); a mask named by key is checked here first, so its absence names the rows."""
    args, kwargs = map_tensors(lambda t: t.to(device, non_blocking=True), (batch.args, batch.kwargs))
    _check_mask(kwargs, mask_key, mask_required, batch)
    with torch.no_grad():
        model(*args, **kwargs)
    return captures.collect(batch.rows)


def _check_mask(kwargs: dict[str, Any], key: str | None, required: bool, batch: Batch) -> None:
    if key is None or key in POSITION_WORDS or mask_of(kwargs, key) is not None:
        return  # image or text positions: read off input_ids by the capture
    if required:
        present = ", ".join(repr(k) for k in kwargs) or "none"
        raise SpecError(
            f"mask={key!r}: the batch of rows {batch.start}..{batch.stop - 1} has no 2-D tensor {key!r} "
            f"(keyword inputs: {present}); name the key that holds the padding mask, or mask=None"
        )


def _checked(values: dict[Site, torch.Tensor], sites: Mapping[Site, Any], batch: Batch) -> list[torch.Tensor]:
    """The values in layout order, each checked against its site's shape and dtype."""
    missing = [str(site) for site in sites if site not in values]
    extra = [str(site) for site in values if site not in sites]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"{', '.join(missing[:3])} did not run")
        if extra:
            parts.append(f"{', '.join(extra[:3])} ran but not in the first batch")
        raise DataError(
            f"rows {batch.start}..{batch.stop - 1}: {'; '.join(parts)}; every batch must reach the same sites "
            "(a module that runs a data-dependent number of times cannot fill a fixed set of arrays: "
            "pick calls='last')",
            rows=range(batch.start, batch.stop),
        )
    ordered = []
    for site, layout in sites.items():
        value = values[site]
        layout.check(value, batch.rows, batch.start)
        ordered.append(value)
    return ordered


def check_batch_first(batch: Batch, values: dict[Site, torch.Tensor]) -> None:
    """Raise ``SpecError`` for a site of the probe whose first dimension is not the batch."""
    for site, value in values.items():
        if value.dim() == 0 or value.shape[0] != batch.rows:
            raise SpecError(
                f"site {str(site)!r} gave shape {tuple(value.shape)} for a batch of {batch.rows} rows; its first "
                "dimension must be the batch: pick a module whose output is batch-first, or reduce so it is"
            )

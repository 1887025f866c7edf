"""One process's part of an extraction: the steps of ``hs.extract``, each followed by a meeting.

:func:`~hookscope._extract.api.extract` checks the arguments and builds a :class:`_Job`; the
job reads what ``out`` holds, runs the probe, makes or resumes the store, writes this rank's
chunks and marks the store complete (the steps are listed in ``api``'s module doc). Separate
from the entry point because this is the part that talks to the store and the other ranks,
while ``api`` only turns the caller's arguments into a job.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from hookscope._arch.positions import POSITION_WORDS
from hookscope._core.sites import Site
from hookscope._core.tree import map_tensors
from hookscope._extract.config import data_identity
from hookscope._extract.data import Batch, IndexedSource, Source
from hookscope._extract.inputs import InputCheck
from hookscope._extract.pipeline import ProbeValues, SiteCaptures, check_batch_first, forward, run_batches
from hookscope._extract.progress import ExtractProgress
from hookscope._extract.provenance import Provenance, TokensOption
from hookscope._extract.ranks import Ranks
from hookscope._extract.resume import (
    check_stored,
    existing_meta,
    reopen_if_repaired,
    reusable_chunk_rows,
    same_config,
    store_meta,
)
from hookscope._extract.writer import ChunkWriter, WriterThread, remote_flushers
from hookscope._shared.dtypes import dtype_name
from hookscope._store import (
    Layout,
    Manifest,
    SiteLayout,
    Store,
    StoreHold,
    Target,
    array_names,
    choose_chunk_rows,
    clear,
    create_store,
    merged_stats,
    open_group,
    open_store,
    read_meta,
    remove_partial_files,
    stored_layout,
    write_meta,
)
from hookscope.errors import DataError, SpecError, StoreWriteError

__all__: list[str] = []

T = TypeVar("T")


@dataclass(frozen=True)
class _Job:
    """One process's part of an extraction (see :mod:`hookscope._extract.api` for the steps)."""

    model: nn.Module
    source: Source
    target: Target
    ranks: Ranks
    captures: SiteCaptures
    device: torch.device
    mask_key: str | None
    mask_required: bool
    progress: bool | None
    compression_level: int | None
    tokens: TokensOption = "auto"

    def step(self, name: str, work: Callable[[], T], *, main_only: bool = False) -> T:
        """Run ``work`` (on rank 0 alone with ``main_only``), then meet: a failure on any rank is raised on all."""
        failure: Exception | None = None
        result: Any = None
        try:
            if self.ranks.is_main or not main_only:
                result = work()
        except Exception as error:
            failure = error
        self.ranks.agree(failure, name)
        return result  # type: ignore[no-any-return]

    def run(
        self, config: dict[str, Any], chunk_rows: int | None, *, resume: bool, overwrite: bool, command: str | None
    ) -> Store:
        hold = StoreHold(self.target, command=command)
        # a live writer is named first; what out holds is refused before the record goes into it,
        # and read again once the store is held
        self.step("reading the store", hold.refuse_if_held)
        found = self.step("reading the store", lambda: existing_meta(self.target, resume=resume, overwrite=overwrite))
        complete = found is not None and found.get("state") == "complete"
        self.step("taking the store", lambda: hold.take(read_only_ok=complete), main_only=True)
        try:
            return self._run_held(config, chunk_rows, hold, resume=resume, overwrite=overwrite, command=command)
        finally:
            hold.release()  # idempotent; nothing to do on the ranks that did not take it

    def _run_held(
        self,
        config: dict[str, Any],
        chunk_rows: int | None,
        hold: StoreHold,
        *,
        resume: bool,
        overwrite: bool,
        command: str | None,
    ) -> Store:
        existing = self.step(
            "reading the store", lambda: existing_meta(self.target, resume=resume, overwrite=overwrite)
        )
        probe = self.step("reading the first batch", self.source.probe)
        config = self.step("describing the data", lambda: self._described(config, probe, chunk_rows))
        checked = False
        if existing is not None and existing.get("state") == "complete":  # compare, check, and run only to repair
            complete = existing
            stored = complete["config"].get("chunk_rows")
            wanted = {"config": {**config, "chunk_rows": chunk_rows or stored}, "sites": complete.get("sites", [])}
            self.step("comparing configurations", lambda: same_config(self.target, complete, wanted))
            self.step(
                "checking the stored chunks",
                lambda: check_stored(self.target, self.source, self.ranks, complete, repair=not hold.read_only),
            )
            self.step("reopening the store", lambda: reopen_if_repaired(self.target, complete), main_only=True)
            existing = self.step("reading the store", lambda: read_meta(self.target))
            if existing is None or existing.get("state") == "complete":
                return self._opened(written=0)  # checked, nothing to write
            checked = True
        reusable = reusable_chunk_rows(existing, self.source.batch_size) if chunk_rows is None else chunk_rows
        # the probe's values are handed to the first batch of this rank's work, then dropped
        stored = stored_layout(existing).extras if existing is not None else None  # a resumed store's, as they are
        first, layout, provenance = self.step("on the first batch", lambda: self._layout(probe, reusable, stored))
        meta = store_meta({**config, "chunk_rows": layout.chunk_rows}, layout, command)
        if existing is not None:
            self.step("comparing configurations", lambda: same_config(self.target, existing, meta))
        self.step("making the store", lambda: self._make(existing, layout, meta), main_only=True)
        if existing is not None and not checked:
            self.step(
                "checking the stored chunks",
                lambda: check_stored(self.target, self.source, self.ranks, existing, repair=True),
            )
        group, manifest, done = self.step("reading the manifest", self._manifest)  # all read before any writes
        kept_chunks = set(done)  # ``done`` grows as chunks land
        confirm = hold.confirm if self.ranks.is_main else None
        rows = self.step(
            "writing chunks", lambda: self._write(group, manifest, done, layout, first, confirm, provenance)
        )
        self.step(
            "completing the store", lambda: self._complete(group, manifest, layout, meta, rows, hold), main_only=True
        )
        # every rank read the same manifest before any wrote: what was not done then is what this run wrote
        kept = sum(max(0, min(rows, (c + 1) * layout.chunk_rows) - c * layout.chunk_rows) for c in kept_chunks)
        return self._opened(written=rows - kept)

    def _described(self, config: dict[str, Any], probe: Batch, chunk_rows: int | None) -> dict[str, Any]:
        """The configuration with what the data says of itself; ``chunk_rows`` checked before any comparison."""
        if chunk_rows is not None:
            choose_chunk_rows(self.source.batch_size, 1, None, chunk_rows)
        return {**config, "batch_size": self.source.batch_size, "data": data_identity(probe, self.source)}

    def _manifest(self) -> tuple[Any, Manifest, set[int]]:
        group = open_group(self.target, writable=True)
        manifest = Manifest(group)
        return group, manifest, manifest.done()

    def _opened(self, *, written: int) -> Store:
        store = open_store(self.target)
        store.written_rows = written
        return store

    # -- steps ------------------------------------------------------------------------------------

    def _layout(
        self, probe: Batch, chunk_rows: int | None, stored: tuple[SiteLayout, ...] | None = None
    ) -> tuple[ProbeValues, Layout, Provenance]:
        """Run the first batch; its sites, row shapes and dtypes make the layout, its inputs the
        provenance arrays."""
        inputs = map_tensors(lambda t: t.clone(), (probe.args, probe.kwargs))  # as they were before the forward
        values = forward(self.model, probe, self.captures, self.device, self.mask_key, self.mask_required)
        probe = Batch(probe.start, probe.rows, *inputs)
        if not values:
            raise SpecError(
                "the layers captured no tensor on the first batch: they did not run, or returned no tensor; "
                "check the layers with hs.layers(model, batch)"
            )
        check_batch_first(probe, values)
        names = array_names(list(values))
        sites = tuple(
            SiteLayout(
                name=names[site],
                site=str(site),
                layer=site.module,
                shape=tuple(value.shape[1:]),
                dtype=dtype_name(value.dtype),
                reduce=self.captures.reduction_of(site),
                sparse=self._sparse(site, value),
            )
            for site, value in values.items()
        )
        widest = max(site.row_bytes for site in sites)
        batch = self.source.batch_size
        rows = choose_chunk_rows(batch, widest, self.source.rows, chunk_rows)
        if stored is not None:  # ``probe`` holds the inputs as they were before the forward
            provenance = Provenance.adopt(
                stored, probe, mask_key=padding_key(self.mask_key), source_index=self.source.source_index
            )
        else:
            provenance = Provenance.plan(
                probe,
                tokens=self.tokens,
                mask_key=padding_key(self.mask_key),
                source_index=self.source.source_index,
                lengths={site.shape[0] for site in sites if len(site.shape) >= 2},  # sparse (seq, 2k) too
            )
        layout = Layout(sites, self.source.rows, batch, rows, provenance.arrays)
        return ProbeValues(probe, values), layout, provenance

    def _sparse(self, site: Site, value: torch.Tensor) -> dict[str, int] | None:
        """``{"k", "width"}`` for a site reduced by a ``SparseTopk`` (stored packed, read back sparse)."""
        found = getattr(self.captures.spec_of(site), "sparse_latents", None)
        if found is None:
            return None
        k, width = found
        if value.dtype != torch.float32 or value.shape[-1] != 2 * k or width is None:
            raise SpecError(
                f"site {str(site)!r}: sparse latents (k={k}) are stored as float32 (..., {2 * k}), values then "
                f"indices, and the reduction gave {tuple(value.shape)} {dtype_name(value.dtype)}; extract them "
                "without dtype= (a narrower float would round the indices)"
            )
        return {"k": int(k), "width": int(width)}

    def _make(self, existing: dict[str, Any] | None, layout: Layout, meta: dict[str, Any]) -> None:
        if existing is not None:
            remove_partial_files(self.target)  # temporary files of writes a killed run left half-done
            return
        found = read_meta(self.target)
        if found is not None:
            clear(self.target, found)  # overwrite=True, or a store cut short while it was being made
        create_store(self.target, layout, meta, self.compression_level)

    def _write(
        self,
        group: Any,
        manifest: Manifest,
        done: set[int],
        layout: Layout,
        first: ProbeValues,
        confirm: Callable[[], None] | None,
        provenance: Provenance,
    ) -> int:
        """Run and write this rank's chunks; return the rows the data held."""
        source = self.source
        owned: set[int] | None = None
        if isinstance(source, IndexedSource):
            assert layout.chunks is not None
            todo = [c for c in range(layout.chunks) if c not in done]
            mine = todo[self.ranks.rank :: self.ranks.world_size]
            owned = set(mine)
            total: int | None = sum(layout.rows_in(c) for c in mine)
            batches = source.batches([layout.span(c) for c in mine])
        else:
            total = None if layout.rows is None else layout.rows - sum(layout.rows_in(c) for c in done)
            batches = source.stream()
        writer = ChunkWriter(
            group=group,
            layout=layout,
            manifest=manifest,
            done=done,
            owned=owned,
            label=self.target.label,
            confirm=confirm,
            flushers=remote_flushers(layout) if self.target.remote else 1,
            secrets=self.target.secrets,
        )
        # a local store by its folder's name; one at a URL by the URL (without credentials)
        where = self.target.label if self.target.url is not None else Path(self.target.label).name
        name = where + (f" (rank {self.ranks.rank})" if self.ranks.world_size > 1 else "")
        shown = self.progress if self.ranks.is_main else False
        with ExtractProgress(
            total, enabled=shown, label=f"extract → {name}", written=lambda: writer.bytes_written
        ) as bar:
            thread = WriterThread(writer)
            try:
                end = run_batches(
                    self.model,
                    batches,
                    captures=self.captures,
                    layout=layout,
                    writer=thread,
                    device=self.device,
                    mask_key=padding_key(self.mask_key),
                    mask_required=self.mask_required,
                    reused=first,
                    on_batch=bar.advance,
                    skipped=None if isinstance(source, IndexedSource) else InputCheck(layout, manifest).see,
                    provenance=provenance,
                )
            except BaseException:
                with contextlib.suppress(BaseException):  # the forward's error is the one to report
                    thread.close()  # what was queued lands, and is recorded, before it propagates
                raise
            thread.close(end)
        if not isinstance(source, IndexedSource) and layout.rows is not None and end != layout.rows:
            raise DataError(
                f"the data yielded {end} rows; expected {layout.rows}, the rows it held when counted",
                rows=range(end, layout.rows),  # the batches never go past it: run_batches refuses that
            )
        held = max(group[site.name].shape[0] for site in layout.sites) if layout.rows is None else end
        if held > end:
            raise DataError(
                f"the data ended at row {end}, but the store holds {held} rows from an earlier run: the stream "
                "changed since; overwrite=True (--overwrite) starts again",
                rows=range(end, held),
            )
        short = writer.unfinished()
        if short:
            chunk, filled, wanted = short[0]
            start, _ = layout.span(chunk)
            raise DataError(
                f"chunk {chunk} received {filled} of its {wanted} rows: the data yielded fewer rows than it said "
                "it held (check the data set's __len__)",
                rows=range(start + filled, start + wanted),
            )
        return end

    def _complete(
        self, group: Any, manifest: Manifest, layout: Layout, meta: dict[str, Any], end: int, hold: StoreHold
    ) -> None:
        hold.confirm()  # a run that lost the store (paused past the stale limit) must not mark it complete
        rows = layout.rows if layout.rows is not None else end
        chunks = math.ceil(rows / layout.chunk_rows)
        missing = sorted(set(range(chunks)) - manifest.done())
        if missing:
            raise StoreWriteError(
                f"{len(missing)} of {chunks} chunks are not recorded as done (first: {missing[0]}); run the same "
                "extraction again to write them"
            )
        stats = {name: found.to_json() for name, found in merged_stats(manifest, layout, chunks).items()}
        write_meta(group, {**meta, "state": "complete", "rows": rows, "chunks": chunks, "stats": stats})


def padding_key(mask_key: str | None) -> str | None:
    """The batch key of the padding mask a store keeps: with ``mask="image"`` or ``"text"``
    (reductions over a vision-language model's image or text positions) still the batch's
    ``attention_mask``, so that statistics and the loader leave padding out as ever."""
    return "attention_mask" if mask_key in POSITION_WORDS else mask_key

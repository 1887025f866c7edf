"""Training batches from a feature store: ``store.loader(sites, batch_size, ...)``.

A store is far larger than memory and is read chunk by chunk (each chunk is ``store.chunk_rows``
rows of every array, compressed), so a loader that shuffles row by row would decompress a
whole chunk for every row. This one shuffles in two stages, as streaming loaders for web-scale
data do, and reads only whole chunks:

1. **Chunk order.** Each epoch permutes the chunks (``numpy.random.default_rng([seed, epoch])``).
2. **Shuffle window.** The *units* of the chunks in that order (rows, or with ``tokens=True``
   the token positions of ``(N, seq, ...)`` rows, padding left out) form one stream. A window of
   ``buffer_chunks`` consecutive chunks is read, its units permuted, and cut into batches.

Memory is bounded: one window (``buffer_chunks`` chunks) plus ``read_ahead`` chunks being read
by threads (zarr decompresses outside the GIL) plus one partial batch. ``held_peak`` records the
most chunks held at once by the last iteration in this process.

**Splitting.** The epoch's unit stream is cut into ``world_size`` contiguous ranges of equal size
(to one unit; with ``drop_last`` exactly equal, so every rank takes the same number of steps, as
``DistributedSampler`` does), so every unit is visited once per epoch across ranks and none
twice. A chunk on the boundary of two ranges is read by both, each keeping its own part. A
rank's batches are then split among ``DataLoader`` workers in contiguous runs of whole batches,
sized so that the DataLoader's round-robin over workers is the same sequence as a single
process would yield with ``num_workers`` slots: the *set* of a rank's batches does not depend on
the number of workers, only their order does. A worker reads only the windows its run touches.

**Determinism and resuming.** Batches depend only on (seed, epoch, rank, world_size, and for
their order num_workers). ``start_step=k`` skips the first ``k`` batches of the epoch this rank
would yield through a ``DataLoader(loader, batch_size=None, num_workers=W)`` with the same ``W``
(or iterating the loader itself: ``W = 0``), so the batches after a resume equal the tail of
the uninterrupted epoch, in order. Skipped windows are not read; their shuffles are seeded per
window (``[seed, epoch, world_size, rank, window]``), so nothing needs replaying.

**Partial stores** (opened with ``partial=True``) are read over the chunks recorded as done when
the loader is made; every other chunk is left out.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from hookscope._shared.bits import bits_to_tensor
from hookscope._store.array import StoreArray
from hookscope._store.loader_options import count_option, device_option, dtype_option, flag_option, ranks_option
from hookscope._store.verify import present_chunks, unreadable_error
from hookscope._store.window import Read, Window, gather, join, runs
from hookscope.errors import SiteNotFoundError, SpecError, StoreError

# ``Store`` (hookscope._store.store) is not imported: the store makes its loaders
# (``Store.loader``), and the package allows no import loop, even one for type hints.
Store = Any

__all__ = ["StoreLoader"]

Batch = Tensor | dict[str, Tensor]
_OPTIONS = (
    "shuffle",
    "seed",
    "epoch",
    "rank",
    "world_size",
    "dtype",
    "device",
    "tokens",
    "skip_padding",
    "start_step",
    "buffer_chunks",
    "read_ahead",
    "drop_last",
    "with_rows",
)


@dataclass(frozen=True)
class _Piece:
    """Units ``first..stop-1`` of chunk ``chunk`` (its position in the store's chunks)."""

    chunk: int
    first: int
    stop: int


class StoreLoader(torch.utils.data.IterableDataset[Batch]):
    """Batches of a store's sites for training: shuffled across the whole store in bounded memory.

    ``StoreLoader(store, sites, batch_size, **options)``, usually ``store.loader(...)``. A batch is a
    tensor for one site given as a string, else a dict ``{array name: tensor}`` with rows aligned
    across sites; ``with_rows=True`` adds ``"row"`` (each item's store row, to look up
    ``store.tokens`` or ``store.row_index``) and with tokens ``"position"``.

    Options: ``shuffle`` (True), ``seed`` (0), ``epoch`` (0; or :meth:`set_epoch`), ``rank`` and
    ``world_size`` (default: ``torch.distributed`` when initialised, else the ``RANK`` and
    ``WORLD_SIZE`` variables, else 0 and 1), ``dtype`` (floating values cast to it), ``device``
    (batches moved there, pinned first for CUDA; only without DataLoader workers), ``tokens``
    (False: flatten ``(N, seq, ...)`` sites to token rows ``(units, ...)``), ``skip_padding`` (True:
    with ``tokens``, leave out positions ``store.attention_mask`` marks as padding),
    ``start_step`` (0: batches of this epoch to skip, see below), ``buffer_chunks`` (8: chunks
    mixed in one shuffle window), ``read_ahead`` (4: chunks read ahead on threads; 0 reads in the
    iterating thread), ``drop_last`` (False), ``with_rows`` (False).

    Iterate it directly or through ``torch.utils.data.DataLoader(loader, batch_size=None,
    num_workers=W)`` (``batch_size=None``: the loader makes the batches; a fresh, not persistent,
    set of workers each epoch sees :meth:`set_epoch`; a store at a URL makes its connections anew in
    each worker). ``len(loader)`` is the number of batches this
    rank yields in the epoch after ``start_step``. Every row (or token) is yielded once per epoch
    across all ranks and workers. To resume at step ``k`` of epoch ``e`` (``k`` batches already
    taken on each rank), make the loader with ``epoch=e, start_step=k`` and the same seed, ranks
    and ``num_workers``: it yields the rest of that epoch exactly as the first run would have.

    >>> import tempfile, torch
    >>> from torch import nn
    >>> import hookscope as hs
    >>> out = tempfile.mkdtemp() + "/feats.zarr"
    >>> model = nn.Sequential(nn.Linear(4, 3))
    >>> store = hs.extract(model, torch.randn(10, 4), layers="0", out=out, batch_size=2, chunk_rows=4, progress=False)
    >>> loader = store.loader("0", batch_size=4, seed=1)
    >>> [tuple(batch.shape) for batch in loader], len(loader)
    ([(4, 3), (4, 3), (2, 3)], 3)
    >>> batch = next(iter(store.loader(["0"], batch_size=4, with_rows=True, shuffle=False)))
    >>> batch["row"].tolist(), torch.equal(batch["0"], store.torch("0", slice(0, 4)))
    ([0, 1, 2, 3], True)
    """

    def __init__(self, store: Store, sites: str | Sequence[str], batch_size: int, **options: Any) -> None:
        unknown = sorted(set(options) - set(_OPTIONS))
        if unknown:
            raise SpecError(
                f"store.loader got unknown option(s) {', '.join(map(repr, unknown))}; the options are "
                f"{', '.join(_OPTIONS)}"
            )
        self.store = store
        self.batch_size = count_option("batch_size", batch_size, least=1)
        self.shuffle = flag_option("shuffle", options.get("shuffle", True))
        self.seed = count_option("seed", options.get("seed", 0), least=0)
        self.epoch = count_option("epoch", options.get("epoch", 0), least=0)
        self.tokens = flag_option("tokens", options.get("tokens", False))
        self.skip_padding = flag_option("skip_padding", options.get("skip_padding", True))
        self.buffer_chunks = count_option("buffer_chunks", options.get("buffer_chunks", 8), least=1)
        self.read_ahead = count_option("read_ahead", options.get("read_ahead", 4), least=0)
        self.drop_last = flag_option("drop_last", options.get("drop_last", False))
        self.with_rows = flag_option("with_rows", options.get("with_rows", False))
        self.dtype = dtype_option(options.get("dtype"))
        self.device = device_option(options.get("device"))
        self.rank, self.world_size = ranks_option(options.get("rank"), options.get("world_size"))
        self.single = isinstance(sites, str)
        self._arrays = self._resolve(store, [sites] if isinstance(sites, str) else sites)
        self.sites = [array.name for array in self._arrays]
        self._chunk_rows = store.chunk_rows
        self._rows = int(self._arrays[0].shape[0])
        self._chunks = self._readable_chunks()
        self._mask = store.attention_mask if self.tokens and self.skip_padding else None
        self._seq = self._check_tokens() if self.tokens else 1
        self._units = self._unit_counts()
        self._check_files()
        self.held_peak = 0  # the most chunks held at once by the last iteration in this process
        self.start_step = 0
        self.set_epoch(self.epoch, count_option("start_step", options.get("start_step", 0), least=0))

    # -- arguments --------------------------------------------------------------------------------

    def _resolve(self, store: Store, keys: Sequence[str]) -> list[StoreArray]:
        """The arrays ``keys`` name; unknown or repeated names are refused, naming the store's sites."""
        if not isinstance(keys, (list, tuple)) or not all(isinstance(key, str) for key in keys) or not keys:
            raise SpecError(
                f"sites must be a site name or a non-empty list of them, got {keys!r}; the store has "
                f"{', '.join(map(repr, store.sites[:8]))}"
            )
        arrays = []
        for key in keys:
            try:
                arrays.append(store[key])
            except SiteNotFoundError as error:
                raise SpecError(f"store.loader: {error.args[0]}") from None
        names = [array.name for array in arrays]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise SpecError(f"sites name {', '.join(map(repr, repeated))} more than once; name each site once")
        taken = {"row", "position"} & set(names) if self.with_rows else set()
        if taken:
            raise SpecError(
                f"with_rows=True adds the key(s) {sorted(taken)}, which a site of the store is named too; "
                "pass with_rows=False and read store.row_index yourself"
            )
        return arrays

    def _readable_chunks(self) -> np.ndarray:
        """The chunks to read: all of a complete store, the done ones of a partial one."""
        count = math.ceil(self._rows / self._chunk_rows)
        if self.store.complete:
            return np.arange(count, dtype=np.int64)
        return np.array(sorted(c for c in self.store.done_chunks() if c < count), dtype=np.int64)

    def _check_tokens(self) -> int:
        """The sequence length token rows are cut from; sites without that dimension are refused."""
        mask = self.store.attention_mask
        seq = int(mask.shape[1]) if mask is not None else None
        for array in self._arrays:
            shape = array.shape[1:]
            expected = seq if seq is not None else (shape[0] if len(shape) >= 2 else None)
            reduced = len(shape) == 1 and array.layout.reduce is not None
            if not shape or expected is None or shape[0] != expected or reduced:
                what = f"the attention mask's {seq} positions" if seq is not None else "a (N, seq, ...) shape"
                raise SpecError(
                    f"tokens=True flattens (N, seq, ...) sites to token rows, but site {array.name!r} is "
                    f"(N, {', '.join(map(str, shape))}) (reduce={array.layout.reduce!r}), which has no dimension "
                    f"1 of {what}; load it without tokens=True (store.loader({array.name!r}, ...)), or extract "
                    "it without reducing over the tokens"
                )
            seq = expected
        assert seq is not None
        return seq

    def _unit_counts(self) -> np.ndarray:
        """Units (rows, or kept token positions) in each readable chunk; the mask is read once here."""
        rows = np.minimum(self._chunk_rows, self._rows - self._chunks * self._chunk_rows)
        if self._mask is None:
            return np.asarray(rows * self._seq, dtype=np.int64)
        counts = np.zeros(len(self._chunks), dtype=np.int64)
        chunks = self._chunks.tolist()
        for run in runs(chunks, _MASK_BLOCK):  # consecutive chunks in one read: zarr fetches them at once
            start = chunks[run.start] * self._chunk_rows
            kept = self._read_run(self._mask, chunks[run.start : run.stop])
            per_row = np.count_nonzero(kept.reshape(len(kept), -1), axis=1)
            for index in run:
                offset = chunks[index] * self._chunk_rows - start
                counts[index] = int(per_row[offset : offset + int(rows[index])].sum())
        return counts

    def _check_files(self) -> None:
        """Refuse a store whose chunk files are gone (zarr would read them as zeros): one listing per array."""
        if self.store.meta.get("format") == 1 or not len(self._chunks):
            return
        arrays = [*self._arrays, *([self._mask] if self._mask is not None else [])]
        wanted = set(self._chunks.tolist())
        for array in arrays:  # listed anew by every loader: a file may have gone since the last one
            try:
                gone = sorted(wanted - present_chunks(array.zarr))
            except Exception as error:  # the listing failed: the network, not the store
                first = int(self._chunks[0])
                reason = f"{type(error).__name__}: {error}"
                raise unreadable_error(array.name, first, array.chunk_span(first), reason, array.secrets) from error
            if gone:
                raise StoreError(
                    f"chunk {gone[0]} of {array.name!r} is damaged: its file is gone (the chunk is recorded as "
                    f"written; {len(gone)} such chunk(s)); run the same extraction again, which writes it anew",
                    array=array.name,
                    chunk=gone[0],
                )

    # -- the epoch ------------------------------------------------------------------------------

    def set_epoch(self, epoch: int, start_step: int | None = None) -> None:
        """Shuffle as epoch ``epoch`` (call it before each epoch, as with ``DistributedSampler``).

        ``start_step`` batches of that epoch are skipped; left out, it is kept when the epoch does
        not change (so ``set_epoch(e)`` at the start of a resumed epoch ``e`` keeps the resume) and
        is 0 for another epoch.
        """
        epoch = count_option("epoch", epoch, least=0)
        if start_step is None:
            start_step = self.start_step if epoch == self.epoch else 0
        start_step = count_option("start_step", start_step, least=0)
        total = self._rank_batches()
        if start_step > total:
            raise SpecError(
                f"start_step={start_step} is past the end of epoch {epoch}, which has {total} batch(es) on rank "
                f"{self.rank} of {self.world_size}; pass a start_step of at most {total}, or start the next epoch"
            )
        self.epoch, self.start_step = epoch, start_step

    def _rank_range(self) -> tuple[int, int]:
        """This rank's units of the epoch's stream: equal ranges, the same for every epoch."""
        total = int(self._units.sum())
        if self.drop_last:
            share = total // self.world_size
            first = self.rank * share
            return first, first + share // self.batch_size * self.batch_size
        return self.rank * total // self.world_size, (self.rank + 1) * total // self.world_size

    def _rank_batches(self) -> int:
        first, stop = self._rank_range()
        return math.ceil((stop - first) / self.batch_size)

    def __len__(self) -> int:
        return self._rank_batches() - self.start_step

    def _pieces(self) -> list[_Piece]:
        """This rank's range of the epoch's unit stream, as parts of chunks in the epoch's order."""
        order = np.arange(len(self._chunks))
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self._chunks))
        counts = self._units[order]
        ends = np.cumsum(counts)
        first, stop = self._rank_range()
        pieces = []
        for at in range(int(np.searchsorted(ends, first, side="right")), len(order)):
            begin = int(ends[at] - counts[at])
            if begin >= stop:
                break
            low, high = max(first, begin) - begin, min(stop, int(ends[at])) - begin
            if high > low:
                pieces.append(_Piece(int(order[at]), low, high))
        return pieces

    def _worker_run(self) -> tuple[int, int]:
        """The units of this rank's stream this worker yields: whole batches, start_step skipped.

        With ``W`` workers, a DataLoader yields step ``p`` from worker ``p % W`` (round-robin), so
        logical worker ``w`` owns the steps ``w, w + W, ...``: as many batches, as one contiguous
        run of the rank's batches. After ``start_step = k`` the DataLoader begins again at its
        worker 0, so worker ``i`` plays logical worker ``(i + k) % W``, which makes the resumed
        sequence the uninterrupted one's tail.
        """
        info = torch.utils.data.get_worker_info()
        workers, worker = (1, 0) if info is None else (info.num_workers, info.id)
        batches, skip = self._rank_batches(), self.start_step
        logical = (worker + skip) % workers
        before = sum(len(range(w, batches, workers)) for w in range(logical))
        owned = len(range(logical, batches, workers))
        skipped = len(range(logical, skip, workers))
        first, stop = self._rank_range()
        run_first = first + (before + skipped) * self.batch_size
        run_stop = min(stop, first + (before + owned) * self.batch_size)
        return run_first, max(run_first, run_stop)

    # -- reading --------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        if self.device is not None and self.device.type != "cpu" and torch.utils.data.get_worker_info() is not None:
            raise SpecError(
                f"device={str(self.device)!r} moves batches in the process that iterates, here a DataLoader "
                "worker; pass device=None and move batches in the training loop (DataLoader(pin_memory=True))"
            )
        pieces = self._pieces()
        run_first, run_stop = self._worker_run()
        windows = [pieces[at : at + self.buffer_chunks] for at in range(0, len(pieces), self.buffer_chunks)]
        plan = []  # (window number, its first unit in the rank's stream, its pieces), only those overlapping the run
        offset = self._rank_range()[0]
        for number, window in enumerate(windows):
            size = sum(piece.stop - piece.first for piece in window)
            if offset < run_stop and offset + size > run_first:
                plan.append((number, offset, window))
            offset += size
        self.held_peak = 0
        return self._batches(plan, run_first, run_stop)

    def _batches(self, plan: list[tuple[int, int, list[_Piece]]], run_first: int, run_stop: int) -> Iterator[Batch]:
        """Read the planned windows (reading ahead), shuffle each, and cut the run into batches."""
        pending: list[tuple[dict[str, np.ndarray], np.ndarray]] = []
        waiting = 0
        held = 0
        queue: deque[Future[Read] | Read] = deque()
        todo = iter([piece for _, _, window in plan for piece in window])
        pool = ThreadPoolExecutor(self.read_ahead, thread_name_prefix="hookscope-loader") if self.read_ahead else None

        def submit() -> None:
            nonlocal held
            piece = next(todo, None)
            if piece is not None and pool is not None:
                queue.append(pool.submit(self._read_piece, piece))
                held += 1
                self.held_peak = max(self.held_peak, held)

        try:
            for _ in range(self.read_ahead):
                submit()
            for number, offset, window in plan:
                joined, wheres, ids_parts, reads = 0, [], [], []
                for piece in window:
                    if pool is None:
                        read = self._read_piece(piece)
                        held += 1
                    else:
                        done = queue.popleft()
                        read = done.result() if isinstance(done, Future) else done
                        submit()
                    self.held_peak = max(self.held_peak, held)
                    wheres.append(read.where + joined)
                    ids_parts.append(read.ids)
                    joined += len(read.values[self.sites[0]])
                    reads.append(read)
                values = Window(reads)
                del reads
                where, ids = self._shuffled(np.concatenate(wheres), np.concatenate(ids_parts), number)
                low, high = max(run_first, offset) - offset, min(run_stop, offset + len(where)) - offset
                at = low
                if waiting:
                    take = min(self.batch_size - waiting, high - at)
                    pending.append(gather(values, where[at : at + take], ids[at : at + take]))
                    waiting, at = waiting + take, at + take
                    if waiting == self.batch_size:
                        yield self._finish(join(pending))
                        pending, waiting = [], 0
                while high - at >= self.batch_size:
                    yield self._finish(gather(values, where[at : at + self.batch_size], ids[at : at + self.batch_size]))
                    at += self.batch_size
                if at < high:
                    pending.append(gather(values, where[at:high], ids[at:high]))
                    waiting += high - at
                held -= len(window)
                del values
            if waiting:
                yield self._finish(join(pending))
        finally:
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)

    def _read_piece(self, piece: _Piece) -> Read:
        """One piece's values (every site, only the rows its units lie in) as tensors of units."""
        chunk = int(self._chunks[piece.chunk])
        start = chunk * self._chunk_rows
        rows = min(self._chunk_rows, self._rows - start)
        if self._mask is not None:
            flat = np.flatnonzero(self._read_zarr(self._mask, start, start + rows).reshape(-1))[
                piece.first : piece.stop
            ]
        else:
            flat = np.arange(piece.first, piece.stop, dtype=np.int64)
        low, high = int(flat[0]) // self._seq, int(flat[-1]) // self._seq + 1
        values = {}
        for array in self._arrays:
            raw = self._read_zarr(array, start + low, start + high)
            values[array.name] = raw.reshape(-1, *raw.shape[2:]) if self.tokens else raw
        return Read(values, flat - low * self._seq, flat + start * self._seq)

    def _read_run(self, array: StoreArray, chunks: list[int]) -> np.ndarray:
        """Consecutive ``chunks`` of ``array`` in one read; a failure names the chunk that broke it."""
        start, stop = chunks[0] * self._chunk_rows, min(self._rows, (chunks[-1] + 1) * self._chunk_rows)
        try:
            return self._read_zarr(array, start, stop)
        except StoreError:
            for chunk in chunks:  # read one by one: only on this error path
                self._read_zarr(array, chunk * self._chunk_rows, min(self._rows, (chunk + 1) * self._chunk_rows))
            raise

    @staticmethod
    def _read_zarr(array: StoreArray, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` of ``array`` straight from zarr (one chunk: no per-read checks); a failed
        read is a ``StoreError`` naming the chunk: damaged where its bytes are, a ``StoreReadError``
        where they could not be fetched."""
        try:
            return np.asarray(array.zarr[start:stop])
        except Exception as error:
            raise array.fault(start // array.zarr.chunks[0], error) from error

    def _shuffled(self, where: np.ndarray, ids: np.ndarray, number: int) -> tuple[np.ndarray, np.ndarray]:
        """Window ``number``'s units in the order they are yielded: permuted by the window's own seed."""
        if not self.shuffle:
            return where, ids
        order = np.random.default_rng([self.seed, self.epoch, self.world_size, self.rank, number]).permutation(
            len(where)
        )
        return where[order], ids[order]

    def _finish(self, batch: tuple[dict[str, np.ndarray], np.ndarray]) -> Batch:
        """The batch as the caller asked: cast, with rows, on the device, a tensor for one site."""
        found, ids = batch
        dtypes = {array.name: array.layout.torch_dtype for array in self._arrays}
        values = {name: bits_to_tensor(value, dtypes[name]) for name, value in found.items()}
        if self.dtype is not None:
            values = {k: v.to(self.dtype) if v.is_floating_point() else v for k, v in values.items()}
        if self.with_rows:
            values["row"] = torch.from_numpy(ids // self._seq)
            if self.tokens:
                values["position"] = torch.from_numpy(ids % self._seq)
        if self.device is not None:
            pin = self.device.type == "cuda"
            values = {k: (v.pin_memory() if pin else v).to(self.device, non_blocking=pin) for k, v in values.items()}
        if self.single and not self.with_rows:
            return values[self.sites[0]]
        return values

    def __repr__(self) -> str:
        what = "token rows" if self.tokens else "rows"
        return (
            f"<StoreLoader {self.sites} {what}, batch_size={self.batch_size}, epoch {self.epoch}, rank {self.rank} of "
            f"{self.world_size}: {len(self)} batch(es)>"
        )


#: Chunks of the mask read at once when counting tokens (a block in memory at a time).
_MASK_BLOCK = 256

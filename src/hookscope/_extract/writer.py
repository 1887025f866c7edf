"""Rows into chunks, chunks onto the store, and the thread that does it beside the forward.

The forward of batch i+1 runs while batch i is copied into its chunk buffer, compressed and
written: the main thread hands each batch to :class:`WriterThread` through a bounded queue
(so memory holds at most a few batches however long the data set is) and goes on.

:class:`ChunkWriter` places rows into a buffer per chunk and writes a chunk only when all its
rows are there, so a chunk file is written whole, once, by the one process that owns it.
After every site's chunk has landed, the manifest records it; a crash before that leaves the
chunk to be written again.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hookscope._shared.bits import bits_to_tensor, tensor_to_numpy
from hookscope._shared.credentials import scrub
from hookscope._shared.memory import ResidentWatch
from hookscope._shared.units import format_bytes
from hookscope._store import MASK, Layout, Manifest, chunk_part, combine, crc32c, stats_widths, vectors_of
from hookscope.errors import StoreWriteError

__all__ = ["ChunkWriter", "Work", "WriterThread", "remote_flushers"]

#: Chunks written at once to object storage: enough to hide a round trip of tens of milliseconds
#: behind the forward, each holding one chunk buffer (every array's rows of the chunk) until it
#: lands, and together at most REMOTE_BUFFER_BYTES.
REMOTE_FLUSHERS = 8
REMOTE_BUFFER_BYTES = 512 * 2**20


def remote_flushers(layout: Layout) -> int:
    """Chunks written at once to a remote store: up to 8, fewer where a chunk of every array is large."""
    chunk_bytes = layout.chunk_rows * sum(array.row_bytes for array in layout.arrays)
    return max(1, min(REMOTE_FLUSHERS, REMOTE_BUFFER_BYTES // max(chunk_bytes, 1)))


@dataclass
class _Chunk:
    arrays: list[np.ndarray]
    filled: int = 0
    input_parts: list[int] = field(default_factory=list)  # see hookscope._store.checksums


@dataclass
class ChunkWriter:
    """Writes the chunks one process owns; remembers what it wrote."""

    group: Any
    layout: Layout
    manifest: Manifest
    done: set[int]
    owned: set[int] | None  # None: every chunk that is not done (one process)
    label: str
    #: Raises if this run no longer holds the store (see ``holder.StoreHold.confirm``): called
    #: before each chunk is recorded, on the process that holds it.
    confirm: Callable[[], None] | None = None
    #: Chunks written at once: 1 on a local disk; more on object storage, where each write waits
    #: on the network rather than the disk (a stream, whose arrays grow, always writes one at a time).
    flushers: int = 1
    #: What the failure's message must not show (the store's credentials; see ``Target.secrets``).
    secrets: tuple[str, ...] = ()
    bytes_written: int = 0
    _chunks: dict[int, _Chunk] = field(default_factory=dict)
    _free: list[list[np.ndarray]] = field(default_factory=list)

    def __post_init__(self) -> None:
        # every chunk gets its file, all-zero ones too (a run-time setting of zarr's, not stored
        # with the array): a done chunk without a file is then a lost chunk
        self._arrays = [self.group[site.name].with_config({"write_empty_chunks": True}) for site in self.layout.arrays]
        kept = stats_widths(self.layout)
        self._stats = [(index, site) for index, site in enumerate(self.layout.sites) if site.name in kept]
        masks = [index for index, array in enumerate(self.layout.arrays) if array.name == MASK]
        self._mask = masks[0] if masks else None
        self._pool = _FlushPool(self.flushers if self.layout.rows is not None else 1)
        self._lock = threading.Lock()  # the free buffers, bytes_written and done: the pool's threads share them

    def wants(self, start: int, stop: int) -> bool:
        """True if any row in ``[start, stop)`` belongs to a chunk this writer still has to write."""
        return any(self._mine(chunk) for chunk in self.layout.chunks_of(start, stop))

    def _mine(self, chunk: int) -> bool:
        return chunk not in self.done and (self.owned is None or chunk in self.owned)

    def put(self, start: int, values: Sequence[np.ndarray], input_parts: Sequence[tuple[int, int, int]] = ()) -> None:
        """Rows ``start .. start + len(values[0])`` of every site, in layout order, and the checksum
        parts of their input rows (``(chunk, part, rows)``, see :mod:`hookscope._extract.inputs`)."""
        stop = start + len(values[0])
        parts = {chunk: part for chunk, part, _ in input_parts}
        for chunk in self.layout.chunks_of(start, stop):
            if not self._mine(chunk):
                continue
            first, last = self.layout.span(chunk)
            low, high = max(start, first), min(stop, last)
            pending = self._chunks.get(chunk) or self._new_chunk(chunk)
            for buffer, value in zip(pending.arrays, values, strict=True):
                buffer[low - first : high - first] = value[low - start : high - start]
            pending.filled += high - low
            if chunk in parts:
                pending.input_parts.append(parts[chunk])
            if pending.filled == last - first:  # every row of the chunk is there
                self._flush(chunk, pending.filled)

    def finish(self, rows: int | None) -> None:
        """Write the last, shorter chunk of a stream whose end (``rows``) only now is known, and wait
        for every chunk being written."""
        if self.layout.rows is None and rows is not None:
            for chunk in sorted(self._chunks):
                first, _ = self.layout.span(chunk)
                if first + self._chunks[chunk].filled == rows:
                    self._flush(chunk, self._chunks[chunk].filled)
        self.drain()

    def drain(self) -> None:
        """Wait for the chunks being written; raise the first error one of them met."""
        self._pool.drain()

    def unfinished(self) -> list[tuple[int, int, int]]:
        """``(chunk, rows filled, rows expected)`` for chunks begun and not written (the data ran short)."""
        return [(chunk, pending.filled, self.layout.rows_in(chunk)) for chunk, pending in sorted(self._chunks.items())]

    def _new_chunk(self, chunk: int) -> _Chunk:
        with self._lock:
            spare = self._free.pop() if self._free else None
        arrays = spare or [
            np.empty((self.layout.chunk_rows, *site.shape), dtype=site.stored) for site in self.layout.arrays
        ]
        self._chunks[chunk] = made = _Chunk(arrays)  # fresh parts: a reused buffer's were combined
        return made

    def _flush(self, chunk: int, rows: int) -> None:
        """Write ``chunk`` now, or hand it to the pool (waiting while ``flushers`` chunks are in flight)."""
        pending = self._chunks.pop(chunk)
        self._pool.run(lambda: self._write_chunk(chunk, pending, rows))

    def _write_chunk(self, chunk: int, pending: _Chunk, rows: int) -> None:
        """Every site's chunk, then the manifest entry (on the writer thread or one of the pool's)."""
        first = chunk * self.layout.chunk_rows
        digests = []
        for site, array, buffer in zip(self.layout.arrays, self._arrays, pending.arrays, strict=True):
            digests.append(crc32c(buffer[:rows]))
            try:
                if array.shape[0] < first + rows:  # a stream: the arrays grow as chunks land
                    array.resize((first + rows, *site.shape))
                array[first : first + rows] = buffer[:rows]
            except Exception as error:
                raise self._failure(chunk, rows, site.name, error) from error
        stats = self._chunk_stats(pending.arrays, rows)
        if self.confirm is not None:
            self.confirm()
        try:
            self.manifest.mark(chunk, (combine(pending.input_parts), digests), stats)
        except Exception as error:
            raise self._failure(chunk, rows, "the manifest", error) from error
        with self._lock:
            self.bytes_written += sum(buffer[:rows].nbytes for buffer in pending.arrays)
            self.done.add(chunk)
            self._free.append(pending.arrays)

    def _chunk_stats(self, buffers: list[np.ndarray], rows: int) -> dict[str, np.ndarray]:
        """Each floating site's part of the running statistics for this chunk, padding left out."""
        mask = buffers[self._mask][:rows] if self._mask is not None else None
        found = {}
        for index, site in self._stats:
            values = buffers[index][:rows]
            if site.as_bits:
                values = bits_to_tensor(values, site.torch_dtype).float().numpy()
            found[site.name] = chunk_part(vectors_of(values, mask))
        return found

    def _failure(self, chunk: int, rows: int, what: str, error: Exception) -> StoreWriteError:
        first = chunk * self.layout.chunk_rows
        of = f" of {self.layout.chunks}" if self.layout.chunks is not None else ""
        said = scrub(f"{type(error).__name__}: {error}", self.secrets)
        return StoreWriteError(
            f"writing chunk {chunk} (rows {first}..{first + rows - 1}) of {what!r} to {self.label} failed: "
            f"{said}; {len(self.done)}{of} chunks are recorded as done and stay valid "
            f"({format_bytes(self.bytes_written)} written here): fix the cause (e.g. free disk space) and run the "
            "same extraction again to resume after them"
        )


class _FlushPool:
    """Runs chunk writes on up to ``size`` threads, at most ``size`` at a time (so at most that many
    chunk buffers wait on the network); with ``size`` 1, on the caller's thread.

    An error of one write is raised at the next ``run`` or at ``drain``; the writes already
    started finish first, so whatever they recorded stays recorded.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(size)
        self._threads: concurrent.futures.ThreadPoolExecutor | None = None
        self._error: BaseException | None = None

    def run(self, write: Callable[[], None]) -> None:
        self._raise()
        if self.size == 1:
            write()
            return
        if self._threads is None:
            self._threads = concurrent.futures.ThreadPoolExecutor(self.size, thread_name_prefix="hookscope-chunk")
        self._slots.acquire()
        self._threads.submit(write).add_done_callback(self._done)

    def drain(self) -> None:
        if self._threads is not None:
            self._threads.shutdown(wait=True)
            self._threads = None
        self._raise()

    def _done(self, future: concurrent.futures.Future[None]) -> None:
        with self._lock:
            error = future.exception()
            if error is not None and self._error is None:
                self._error = error
        self._slots.release()

    def _raise(self) -> None:
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error


@dataclass
class Work:
    """One batch on its way to the store: its first row, one CPU tensor per site, what to wait for.

    ``ready`` holds an event per GPU the values were copied from; ``release`` hands pinned
    buffers back once the rows are in the chunk buffers.
    """

    start: int
    values: list[torch.Tensor]
    input_parts: list[tuple[int, int, int]] = field(default_factory=list)
    ready: list[torch.cuda.Event] = field(default_factory=list)
    release: Callable[[], None] | None = None


class WriterThread:
    """Runs a :class:`ChunkWriter` on its own thread, fed through a bounded queue.

    An error on the thread is kept and raised on the main thread at its next ``submit`` or at
    ``close``; the thread goes on draining the queue, so the main thread never blocks on it.
    """

    def __init__(self, writer: ChunkWriter, depth: int = 2) -> None:
        self.writer = writer
        self._queue: queue.Queue[Work | None] = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.memory = ResidentWatch()
        self._rows: int | None = None
        self._thread = threading.Thread(target=self._run, name="hookscope-extract-writer", daemon=True)
        self._thread.start()

    def submit(self, work: Work) -> None:
        """Queue one batch; blocks while the queue is full; raises the thread's error, if any."""
        self._raise()
        self._queue.put(work)

    def close(self, rows: int | None = None) -> None:
        """Write what is queued (and the last chunk of a stream of ``rows`` rows), stop, raise any error."""
        self._rows = rows  # read by the thread after it takes the None below
        self._queue.put(None)
        self._thread.join()
        self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        while True:
            work = self._queue.get()
            if work is None:
                break
            if self.error is not None:
                continue  # failed: drain, so that the main thread is never blocked on a full queue
            try:
                for event in work.ready:
                    event.synchronize()  # the device-to-host copies of this batch have finished
                self.writer.put(work.start, [tensor_to_numpy(value) for value in work.values], work.input_parts)
                if work.release is not None:
                    work.release()
                self.memory.check()  # trims free memory if resident memory drifted up (see hookscope._shared.memory)
            except BaseException as error:
                self.error = error
        try:
            if self.error is None:
                self.writer.finish(self._rows)
            else:
                self.writer.drain()  # the chunks already being written land and are recorded
        except BaseException as error:
            self.error = self.error or error

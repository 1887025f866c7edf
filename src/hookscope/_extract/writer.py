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

import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hookscope._extract.checksums import combine, crc32c
from hookscope._extract.layout import Layout
from hookscope._extract.zarr_io import Manifest
from hookscope._shared.bits import tensor_to_numpy
from hookscope._shared.memory import ResidentWatch
from hookscope._shared.units import format_bytes
from hookscope.errors import StoreWriteError

__all__ = ["ChunkWriter", "Work", "WriterThread"]


@dataclass
class _Chunk:
    arrays: list[np.ndarray]
    filled: int = 0
    input_parts: list[int] = field(default_factory=list)  # see hookscope._extract.checksums


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
    bytes_written: int = 0
    _chunks: dict[int, _Chunk] = field(default_factory=dict)
    _free: list[list[np.ndarray]] = field(default_factory=list)

    def __post_init__(self) -> None:
        # every chunk gets its file, all-zero ones too (a run-time setting of zarr's, not stored
        # with the array): a done chunk without a file is then a lost chunk
        self._arrays = [self.group[site.name].with_config({"write_empty_chunks": True}) for site in self.layout.sites]

    def wants(self, start: int, stop: int) -> bool:
        """True if any row in ``[start, stop)`` belongs to a chunk this writer still has to write."""
        return any(self._mine(chunk) for chunk in self.layout.chunks_of(start, stop))

    def _mine(self, chunk: int) -> bool:
        return chunk not in self.done and (self.owned is None or chunk in self.owned)

    def put(self, start: int, values: Sequence[np.ndarray], input_parts: Sequence[tuple[int, int, int]] = ()) -> None:
        """Rows ``start .. start + len(values[0])`` of every site, in layout order, and the checksum
        parts of their input rows (``(chunk, part, rows)``, see :mod:`hookscope._extract.checksums`)."""
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
        """Write the last, shorter chunk of a stream whose end (``rows``) only now is known."""
        if self.layout.rows is not None or rows is None:
            return
        for chunk in sorted(self._chunks):
            first, _ = self.layout.span(chunk)
            if first + self._chunks[chunk].filled == rows:
                self._flush(chunk, self._chunks[chunk].filled)

    def unfinished(self) -> list[tuple[int, int, int]]:
        """``(chunk, rows filled, rows expected)`` for chunks begun and not written (the data ran short)."""
        return [(chunk, pending.filled, self.layout.rows_in(chunk)) for chunk, pending in sorted(self._chunks.items())]

    def _new_chunk(self, chunk: int) -> _Chunk:
        arrays = (
            self._free.pop()
            if self._free
            else [np.empty((self.layout.chunk_rows, *site.shape), dtype=site.stored) for site in self.layout.sites]
        )
        self._chunks[chunk] = made = _Chunk(arrays)  # fresh parts: a reused buffer's were combined
        return made

    def _flush(self, chunk: int, rows: int) -> None:
        first = chunk * self.layout.chunk_rows
        pending = self._chunks.pop(chunk)
        digests = []
        for site, array, buffer in zip(self.layout.sites, self._arrays, pending.arrays, strict=True):
            digests.append(crc32c(buffer[:rows]))
            try:
                if array.shape[0] < first + rows:  # a stream: the arrays grow as chunks land
                    array.resize((first + rows, *site.shape))
                array[first : first + rows] = buffer[:rows]
            except Exception as error:
                raise self._failure(chunk, rows, site.name, error) from error
            self.bytes_written += buffer[:rows].nbytes
        if self.confirm is not None:
            self.confirm()
        try:
            self.manifest.mark(chunk, (combine(pending.input_parts), digests))
        except Exception as error:
            raise self._failure(chunk, rows, "the manifest", error) from error
        self.done.add(chunk)
        self._free.append(pending.arrays)

    def _failure(self, chunk: int, rows: int, what: str, error: Exception) -> StoreWriteError:
        first = chunk * self.layout.chunk_rows
        of = f" of {self.layout.chunks}" if self.layout.chunks is not None else ""
        return StoreWriteError(
            f"writing chunk {chunk} (rows {first}..{first + rows - 1}) of {what!r} to {self.label} failed: "
            f"{type(error).__name__}: {error}; {len(self.done)}{of} chunks are recorded as done and stay valid "
            f"({format_bytes(self.bytes_written)} written here): fix the cause (e.g. free disk space) and run the "
            "same extraction again to resume after them"
        )


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
        if self.error is None:
            try:
                self.writer.finish(self._rows)
            except BaseException as error:
                self.error = error

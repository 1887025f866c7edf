"""What ``extract`` reads: data sets, loaders and iterables of batches, as numbered batches.

A store row is one input, numbered from 0 in the data's order, and a resumed or sharded run
must see the same rows in the same places. So everything becomes one of two sources:

- an **indexed** source (a map-style ``Dataset``, a tensor or array of rows, a dict of them,
  or a ``DataLoader`` over a map-style dataset that does not shuffle): any range of rows can
  be fetched on its own, so a resumed run loads only the chunks still to do, and several
  processes each load their own chunks;
- a **stream** (an ``IterableDataset``, a generator, a list of batches, a loader with a batch
  sampler of its own): batches come in order, each numbered by the rows before it; a resumed
  run reads past the done rows without running the model on them. One process only.

A batch becomes the model's arguments by ``split_batch`` (or the caller's ``inputs``): a
tensor is the one positional input, a dict holds keyword inputs, and of a tuple or list (the
``(inputs, labels)`` of most data sets) the first element is the input.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
    default_collate,
)

from hookscope._core.tree import flatten_tensors
from hookscope.errors import DataError, SpecError

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "Batch",
    "IndexedSource",
    "Inputs",
    "Source",
    "StreamSource",
    "TensorRows",
    "make_source",
    "numbered",
    "split_batch",
]

DEFAULT_BATCH_SIZE = 32
Inputs = Callable[[Any], tuple[tuple[Any, ...], dict[str, Any]]]
_SHUFFLING = (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)


@dataclass
class Batch:
    """Rows ``start .. start + rows`` of the data, as the model's ``(args, kwargs)``."""

    start: int
    rows: int
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    @property
    def stop(self) -> int:
        return self.start + self.rows


def split_batch(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The model's ``(args, kwargs)`` for one batch: ``model(*args, **kwargs)``.

    >>> x = torch.zeros(2, 3)
    >>> split_batch(x)[0][0] is x, split_batch({"input_ids": x})[1].keys(), split_batch((x, "labels"))[0][0] is x
    (True, dict_keys(['input_ids']), True)
    """
    if isinstance(batch, torch.Tensor):
        return (batch,), {}
    if isinstance(batch, Mapping):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], (torch.Tensor, Mapping)):
        return split_batch(batch[0])  # (inputs, labels, ...): the labels are not the model's
    raise SpecError(
        f"a batch of type {type(batch).__name__} is not understood; expected a tensor, a dict of the model's "
        "keyword inputs, or a tuple/list whose first element is the input (what follows, e.g. labels, is "
        "ignored); pass inputs=lambda batch: ((positional, ...), {keyword: ...}) to say how to call the model"
    )


def batch_rows(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Rows in a batch: the first dimension of its first tensor input."""
    for _, tensor in flatten_tensors((args, kwargs)):
        if tensor.dim() > 0:
            return int(tensor.shape[0])
    raise SpecError(
        "a batch holds no tensor with a batch dimension, so its rows cannot be counted; "
        "each batch must give the model at least one tensor shaped (batch, ...)"
    )


class TensorRows(torch.utils.data.Dataset[Any]):
    """Rows of a tensor or array, or of a dict of them sharing their first dimension.

    Fetching a batch slices every column once (``__getitems__``), instead of indexing row by
    row and stacking; numpy arrays (memory-mapped ``.npy`` files too) become tensors per batch.

    >>> rows = TensorRows({"input_ids": torch.arange(12).reshape(6, 2)})
    >>> len(rows), rows.__getitems__([2, 3])["input_ids"].tolist()
    (6, [[4, 5], [6, 7]])
    """

    collates_itself = True

    def __init__(self, columns: torch.Tensor | np.ndarray | Mapping[str, torch.Tensor | np.ndarray]) -> None:
        self.single = not isinstance(columns, Mapping)
        self.columns: dict[str, torch.Tensor | np.ndarray] = (
            {"": columns} if not isinstance(columns, Mapping) else dict(columns)
        )
        if not self.columns:
            raise SpecError("the dict of columns is empty; expected tensors or arrays of rows")
        lengths = {name: _length(name, column) for name, column in self.columns.items()}
        if len(set(lengths.values())) != 1:
            sizes = ", ".join(f"{name!r}: {n}" for name, n in lengths.items())
            raise SpecError(
                f"the columns have different numbers of rows ({sizes}); every column needs one row per input"
            )
        self.length = next(iter(lengths.values()))

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:
        return self.__getitems__([index])  # a batch of one: the collate step is the identity

    def __getitems__(self, indices: Sequence[int]) -> Any:
        first, count = indices[0], len(indices)
        contiguous = indices[-1] - first == count - 1 and all(b - a == 1 for a, b in itertools.pairwise(indices))
        picked = {
            name: _as_tensor(column[first : first + count] if contiguous else column[list(indices)])
            for name, column in self.columns.items()
        }
        return picked[""] if self.single else picked


def _length(name: str, column: object) -> int:
    if not isinstance(column, (torch.Tensor, np.ndarray)) or column.ndim == 0:
        label = f"column {name!r}" if name else "the data"
        raise SpecError(f"{label} is a {type(column).__name__}; expected a tensor or array of rows, shaped (N, ...)")
    return int(column.shape[0])


def _as_tensor(values: torch.Tensor | np.ndarray) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values
    return torch.from_numpy(np.array(values))  # a copy: memory-mapped arrays are read-only


def keep_as_is(batch: Any) -> Any:
    """The collate step of a data set that says ``collates_itself``: its ``__getitems__`` makes the batch."""
    return batch


class IndexedSource:
    """Rows fetched by index: any range, in any process, through a ``DataLoader`` of our own."""

    def __init__(
        self,
        dataset: Any,
        *,
        indices: Sequence[int] | None,
        batch_size: int,
        collate_fn: Callable[[Any], Any],
        num_workers: int,
        loader_options: dict[str, Any],
        inputs: Inputs,
    ) -> None:
        self.dataset = dataset
        self.indices = indices
        self.rows: int | None = len(indices) if indices is not None else len(dataset)
        self.batch_size = batch_size
        self.collate_fn = collate_fn
        self.num_workers = num_workers
        self.loader_options = loader_options
        self.inputs = inputs
        if self.rows == 0:
            raise SpecError("the data holds no rows; expected at least one input")

    def _index(self, row: int) -> int:
        return row if self.indices is None else int(self.indices[row])

    def source_index(self, start: int, stop: int) -> torch.Tensor:
        """The data set's indices of rows ``[start, stop)`` (int64)."""
        if self.indices is None:
            return torch.arange(start, stop, dtype=torch.int64)
        return torch.as_tensor([int(self.indices[row]) for row in range(start, stop)], dtype=torch.int64)

    def probe(self) -> Batch:
        """The first batch, fetched here (no worker processes) to learn the layout."""
        assert self.rows is not None
        wanted = [self._index(row) for row in range(min(self.batch_size, self.rows))]
        if hasattr(self.dataset, "__getitems__"):
            raw = self.collate_fn(self.dataset.__getitems__(wanted))
        else:
            raw = self.collate_fn([self.dataset[index] for index in wanted])
        return self._batch(0, len(wanted), raw)

    def batches(self, ranges: Sequence[tuple[int, int]]) -> Iterator[Batch]:
        """Batches covering ``ranges`` (row ranges that start on the batch grid), in order."""
        plan = _BatchPlan(ranges, self.batch_size, self._index)
        if not len(plan):
            return
        loader = DataLoader(
            self.dataset,
            batch_sampler=plan,
            collate_fn=self.collate_fn,
            num_workers=self.num_workers,
            **self.loader_options,
        )
        for (start, count), raw in zip(plan.spans(), loader, strict=True):
            yield self._batch(start, count, raw)

    def _batch(self, start: int, expected: int, raw: Any) -> Batch:
        batch = numbered(self.inputs, start, raw)
        if batch.rows != expected:
            raise DataError(
                f"the batch of rows {start}..{start + expected - 1} has {batch.rows} rows, not {expected}: the "
                "collate function must stack one row per index along dimension 0",
                rows=range(start, start + expected),
            )
        return batch


class _BatchPlan:
    """The index lists of the batches covering some row ranges, made as the loader asks for them.

    A ``DataLoader`` batch sampler with a length: nothing is listed up front, so a run over a
    hundred million rows starts at once and holds one batch's indices at a time.
    """

    def __init__(self, ranges: Sequence[tuple[int, int]], batch_size: int, index: Callable[[int], int]) -> None:
        self.ranges = list(ranges)
        self.batch_size = batch_size
        self.index = index

    def spans(self) -> Iterator[tuple[int, int]]:
        """``(first row, rows)`` of each batch, in order."""
        for first, stop in self.ranges:
            for start in range(first, stop, self.batch_size):
                yield start, min(start + self.batch_size, stop) - start

    def __iter__(self) -> Iterator[list[int]]:
        for start, count in self.spans():
            yield [self.index(row) for row in range(start, start + count)]

    def __len__(self) -> int:
        return sum(-(-(stop - first) // self.batch_size) for first, stop in self.ranges)


class StreamSource:
    """Batches read in order from an iterable; each numbered by the rows that came before it."""

    def __init__(self, iterable: Iterable[Any], *, rows: int | None, inputs: Inputs) -> None:
        self.iterable = iterable
        self.rows = rows
        self.inputs = inputs
        self._iterator: Iterator[Any] | None = None
        self._first: Batch | None = None

    @property
    def batch_size(self) -> int:
        return self.probe().rows

    def source_index(self, start: int, stop: int) -> torch.Tensor:
        """A stream's rows are numbered by their place in it."""
        return torch.arange(start, stop, dtype=torch.int64)

    def probe(self) -> Batch:
        """The first batch; :meth:`stream` yields it again without reading it twice."""
        if self._first is None:
            self._iterator = iter(self.iterable)
            try:
                raw = next(self._iterator)
            except StopIteration:
                raise SpecError("the data yielded no batch; expected at least one") from None
            self._first = numbered(self.inputs, 0, raw)
        return self._first

    def stream(self) -> Iterator[Batch]:
        """Every batch from the first, numbered by rows."""
        first = self.probe()
        assert self._iterator is not None
        yield first
        start = first.rows
        for raw in self._iterator:
            batch = numbered(self.inputs, start, raw)
            yield batch
            start = batch.stop


Source = IndexedSource | StreamSource


def numbered(inputs: Inputs, start: int, raw: Any) -> Batch:
    """A raw batch from the data as the model's inputs, numbered from row ``start``."""
    args, kwargs = _inputs(inputs, raw)
    return Batch(start, batch_rows(args, kwargs), args, kwargs)


def _inputs(inputs: Inputs, raw: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    made = inputs(raw)
    if not isinstance(made, tuple) or len(made) != 2 or not isinstance(made[0], tuple) or not isinstance(made[1], dict):
        raise SpecError(
            f"inputs(batch) returned {type(made).__name__}; expected a pair (args tuple, kwargs dict), "
            "e.g. lambda batch: ((batch['x'],), {})"
        )
    return made


def make_source(
    data: Any,
    *,
    batch_size: int | None,
    num_workers: int | None,
    indices: Sequence[int] | None,
    inputs: Inputs | None,
) -> Source:
    """Turn what the caller passed as ``data`` into a source (see the module doc for the rules)."""
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise SpecError(f"batch_size={batch_size!r} must be a positive int")
    split = inputs or split_batch
    if isinstance(data, DataLoader):
        return _from_loader(data, batch_size, num_workers, indices, split)
    if isinstance(data, IterableDataset):
        _no_indices(indices, "an IterableDataset")
        if num_workers:
            raise SpecError(
                f"num_workers={num_workers} would make each worker yield the whole IterableDataset; pass a DataLoader "
                "of your own whose dataset shards itself with torch.utils.data.get_worker_info(), or num_workers=0"
            )
        loader = DataLoader(data, batch_size=batch_size or DEFAULT_BATCH_SIZE)
        return StreamSource(loader, rows=None, inputs=split)
    if isinstance(data, (torch.Tensor, np.ndarray)) or (
        isinstance(data, Mapping) and data and all(isinstance(v, (torch.Tensor, np.ndarray)) for v in data.values())
    ):
        return _indexed(TensorRows(data), batch_size, num_workers, indices, split, keep_as_is, {})
    if isinstance(data, (list, tuple)):
        _no_indices(indices, "a list of batches")
        if batch_size is not None:
            raise SpecError("batch_size applies to a data set; a list of batches is already batched: drop batch_size")
        rows = sum(numbered(split, 0, raw).rows for raw in data)
        return StreamSource(data, rows=rows, inputs=split)
    if hasattr(data, "__getitem__") and hasattr(data, "__len__") and not isinstance(data, (str, bytes, Mapping)):
        collate = keep_as_is if getattr(data, "collates_itself", False) else default_collate
        return _indexed(data, batch_size, num_workers, indices, split, collate, {})
    if isinstance(data, Iterable) and not isinstance(data, (str, bytes, Mapping)):
        _no_indices(indices, "an iterable of batches")
        if batch_size is not None:
            raise SpecError("batch_size applies to a data set; an iterable of batches is already batched")
        return StreamSource(data, rows=None, inputs=split)
    raise SpecError(
        f"data of type {type(data).__name__} is not understood; expected a DataLoader, a map-style Dataset, "
        "a tensor or array of rows (or a dict of them), or an iterable of batches"
    )


def _indexed(
    dataset: Any,
    batch_size: int | None,
    num_workers: int | None,
    indices: Sequence[int] | None,
    split: Inputs,
    collate_fn: Callable[[Any], Any],
    options: dict[str, Any],
) -> IndexedSource:
    if indices is not None:
        indices = _checked_indices(indices, len(dataset))
    return IndexedSource(
        dataset,
        indices=indices,
        batch_size=batch_size or DEFAULT_BATCH_SIZE,
        collate_fn=collate_fn,
        num_workers=_workers(num_workers),
        loader_options=options,
        inputs=split,
    )


def _from_loader(
    loader: DataLoader[Any],
    batch_size: int | None,
    num_workers: int | None,
    indices: Sequence[int] | None,
    split: Inputs,
) -> Source:
    workers = loader.num_workers if num_workers is None else _workers(num_workers)
    if isinstance(loader.dataset, IterableDataset):
        _no_indices(indices, "a DataLoader over an IterableDataset")
        return StreamSource(loader, rows=None, inputs=split)
    batch_sampler = loader.batch_sampler
    sampler = batch_sampler.sampler if isinstance(batch_sampler, BatchSampler) else loader.sampler
    if isinstance(sampler, DistributedSampler):
        raise SpecError(
            "the DataLoader's sampler is a DistributedSampler; extract shards the rows between processes itself: "
            "pass the data set, or a loader without that sampler, on every rank"
        )
    if isinstance(sampler, _SHUFFLING):
        raise SpecError(
            f"the DataLoader shuffles ({type(sampler).__name__}): store rows would not line up with the data, nor "
            "between a run and its resumption; make the loader with shuffle=False, or pass the data set"
        )
    if not isinstance(batch_sampler, BatchSampler) or loader.batch_size is None:
        _no_indices(indices, "a DataLoader with a batch sampler of its own")
        rows = sum(len(batch) for batch in batch_sampler) if batch_sampler is not None else None
        return StreamSource(loader, rows=rows, inputs=split)
    if batch_size is not None and batch_size != loader.batch_size:
        raise SpecError(
            f"batch_size={batch_size} differs from the DataLoader's batch_size={loader.batch_size}; drop one"
        )
    order: Sequence[int] | None = None if isinstance(sampler, SequentialSampler) else [int(i) for i in sampler]
    if order is not None and indices is not None:
        order = [order[i] for i in _checked_indices(indices, len(order))]
    elif indices is not None:
        order = list(_checked_indices(indices, len(loader.dataset)))  # type: ignore[arg-type]
    total = len(order) if order is not None else len(loader.dataset)  # type: ignore[arg-type]
    if loader.drop_last:
        total -= total % loader.batch_size
        order = order[:total] if order is not None else range(total)
    options = {"pin_memory": loader.pin_memory, "timeout": loader.timeout, "worker_init_fn": loader.worker_init_fn}
    if workers > 0:
        options["multiprocessing_context"] = loader.multiprocessing_context
        options["prefetch_factor"] = loader.prefetch_factor
    return IndexedSource(
        loader.dataset,
        indices=order,
        batch_size=loader.batch_size,
        collate_fn=loader.collate_fn,
        num_workers=workers,
        loader_options=options,
        inputs=split,
    )


def _checked_indices(indices: Sequence[int], length: int) -> Sequence[int]:
    if isinstance(indices, range) and (not indices or (min(indices) >= 0 and max(indices) < length)):
        return indices
    try:
        checked = [_index(i) for i in indices]
    except (TypeError, ValueError):
        raise SpecError(
            f"indices={indices!r:.60} must be integers, the positions of rows in the data set (ints, numpy ints or "
            "an integer tensor; not floats, which would be truncated to other rows, nor bools)"
        ) from None
    bad = [i for i in checked if not 0 <= i < length]
    if bad:
        raise SpecError(f"indices hold {bad[0]}, outside the data's {length} rows; expected 0 <= index < {length}")
    return checked


def _index(value: Any) -> int:
    """One row position: an int, numpy int or 0-d integer tensor; ``TypeError`` for anything else.

    ``int(1.9)`` is 1: a float would silently pick another row, and a bool is not a position.
    """
    if isinstance(value, torch.Tensor):
        dtype = value.dtype
        if value.dim() == 0 and not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool:
            return int(value)
        raise TypeError(value)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(value)
    return int(value)


def _no_indices(indices: Sequence[int] | None, what: str) -> None:
    if indices is not None:
        raise SpecError(f"indices= picks rows of a map-style data set; {what} cannot be indexed: drop indices")


def _workers(num_workers: int | None) -> int:
    if num_workers is None:
        return 0
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise SpecError(f"num_workers={num_workers!r} must be an int >= 0")
    return num_workers

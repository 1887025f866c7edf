"""The shuffle window of a :class:`~hookscope.StoreLoader`: the pieces of chunks read, and batches
gathered from them in place.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

__all__ = ["Read", "Window", "gather", "join", "runs"]


@dataclass
class Read:
    """A piece read: each array's values flattened to units, where its units lie, and their ids."""

    values: dict[str, np.ndarray]  # as stored (bfloat16 and float8 as their bits), viewed as torch at the end
    where: np.ndarray  # int64 positions into ``values`` of the piece's units, in stream order
    ids: np.ndarray  # int64 global id of each unit: its row, or row * seq + position


def runs(chunks: list[int], longest: int) -> Iterator[range]:
    """Index ranges of ``chunks`` (sorted) whose chunks follow one another, at most ``longest`` long.

    >>> [list(run) for run in runs([0, 1, 2, 5, 6, 9], 2)]
    [[0, 1], [2], [3, 4], [5]]
    """
    start = 0
    for index in range(1, len(chunks) + 1):
        if index == len(chunks) or chunks[index] != chunks[index - 1] + 1 or index - start == longest:
            yield range(start, index)
            start = index


class Window:
    """The pieces of one window, gathered from in place: joining them first would copy every value
    once more (padding too), which costs more than reading them."""

    def __init__(self, reads: list[Read]) -> None:
        self.reads = reads
        self.starts = np.cumsum([0] + [len(next(iter(read.values.values()))) for read in reads])

    def gather(self, where: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """The values at ``where`` (positions in the joined pieces), grouped by piece, and the order
        they come in (indices into ``where``).

        Each piece's items are taken by one ``np.take`` straight into the batch: one copy of
        the batch, none of the window. Within a batch the items come grouped by piece rather than
        in the window's shuffled order: which items make a batch is what the shuffle decides, and
        putting them back in that order would copy the batch once more.
        """
        piece = np.searchsorted(self.starts, where, side="right") - 1
        grouped_order = np.argsort(piece, kind="stable")
        counts = np.bincount(piece, minlength=len(self.reads))
        local = where[grouped_order] - self.starts[piece[grouped_order]]
        found = {}
        for name, first in self.reads[0].values.items():
            # numpy, not torch: a torch op wakes its thread pool, whose spinning threads then take
            # the cores zarr decompresses the next chunks on
            grouped = np.empty((len(where), *first.shape[1:]), dtype=first.dtype)
            at = 0
            for number, count in enumerate(counts.tolist()):
                if count:
                    np.take(
                        self.reads[number].values[name], local[at : at + count], axis=0, out=grouped[at : at + count]
                    )
                    at += count
            found[name] = grouped
        return found, grouped_order


def gather(values: Window, where: np.ndarray, ids: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
    found, order = values.gather(where)
    return found, ids[order]


def join(parts: list[tuple[dict[str, np.ndarray], np.ndarray]]) -> tuple[dict[str, np.ndarray], np.ndarray]:
    if len(parts) == 1:
        return parts[0]
    names = parts[0][0]
    joined = {name: np.concatenate([part[0][name] for part in parts]) for name in names}
    return joined, np.concatenate([part[1] for part in parts])

"""What each row of a store is, read off the batches: its index in the data, and for token models its
tokens and mask (the arrays' names: ``hookscope._store.provenance``).

A latent found in a store is only useful once it can be traced back to the text that made it.
So beside the sites' arrays, in the group ``_rows``, a store keeps per row:

- ``_rows/index``: the row's index in the data set (with ``indices=``, the index picked; for a
  stream, the row's number in it);
- ``_rows/tokens``: the token ids the model was given (the batch's ``input_ids``, or a first
  positional input of integer dtype shaped ``(batch, seq)``);
- ``_rows/attention_mask``: the batch's padding mask (the ``mask`` key, ``attention_mask`` by
  default), which also lets a reader of ``(N, seq, d)`` values skip padding.

They are written like sites' arrays (same chunks, the same checksums, by the process that owns
the chunk). Tokens and mask have the width of the first batch: a shorter batch is padded (ids
``-1``, mask 0), a longer one is refused with the fix (pad every batch to one length, or
``tokens=False``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from hookscope._extract.data import Batch
from hookscope._store import INDEX, MASK, TOKENS, SiteLayout, provenance_array
from hookscope.errors import DataError, SpecError

__all__ = ["Provenance", "TokensOption"]

TokensOption = bool | Literal["auto"]
_PAD_TOKEN = -1


@dataclass(frozen=True)
class Provenance:
    """Which provenance arrays a store keeps, and how to read them off a batch.

    ``source_index(start, stop)`` gives the data indices of rows ``[start, stop)``.
    """

    arrays: tuple[SiteLayout, ...]
    tokens_key: str | int | None  # a keyword input, or 0 for the first positional input
    mask_key: str | None
    source_index: Callable[[int, int], torch.Tensor]
    tokens: TokensOption | None = None  # the option it was planned with (None: adopted from a stored store)

    @classmethod
    def plan(
        cls,
        probe: Batch,
        *,
        tokens: TokensOption,
        mask_key: str | None,
        source_index: Callable[[int, int], torch.Tensor],
        lengths: set[int],
    ) -> Provenance:
        """The arrays for a new store whose first batch is ``probe``.

        ``lengths`` holds dimension 1 of every site stored per position (``(N, seq, ...)``, sparse
        latents too). The mask is kept when it fits one of them (statistics and the loader leave
        padding out by it), whatever ``tokens`` says. Token ids: ``tokens=True`` always,
        ``False`` never, ``"auto"`` when they fit one of them, so a store of values reduced over
        the tokens, from batches each padded to its own length, runs as ever.
        """
        if tokens not in (True, False, "auto"):
            raise SpecError(f"tokens={tokens!r} is not True, False or 'auto' (store the token ids when there are some)")
        arrays = [provenance_array(INDEX, "int64", ())]
        key = _tokens_key(probe) if tokens is not False else None
        if tokens is True and key is None:
            raise SpecError(
                "tokens=True, but the first batch has no token ids: no 'input_ids' keyword input and no first "
                "positional input of integer dtype shaped (batch, seq); tokens='auto' stores them only when there "
                "are some"
            )
        ids = _get(probe, key)
        if tokens == "auto" and ids is not None and int(ids.shape[1]) not in lengths:
            key, ids = None, None  # values reduced over the tokens: a width that varies by batch is fine there
        if ids is not None:
            arrays.append(provenance_array(TOKENS, "int64", (int(ids.shape[1]),)))
        mask = _get(probe, mask_key)
        width = int(mask.shape[1]) if mask is not None and _is_2d(mask, probe.rows) else None
        # the mask of a site stored per position (to leave its padding out), or the mask of the ids kept
        if width is not None and (width in lengths or (ids is not None and width == ids.shape[1])):
            arrays.append(provenance_array(MASK, "bool", (width,)))
        else:
            mask_key = None
        return cls(tuple(arrays), key, mask_key, source_index, tokens)

    @classmethod
    def adopt(
        cls,
        stored: tuple[SiteLayout, ...],
        probe: Batch,
        *,
        mask_key: str | None,
        source_index: Callable[[int, int], torch.Tensor],
    ) -> Provenance:
        """The arrays a store being resumed already has (none, for one made before provenance):
        its chunks must all have the same, whatever a plan would say now."""
        names = {array.name for array in stored}
        if MASK in names and mask_key is None:
            raise SpecError(
                f"the store keeps each row's padding mask ({MASK!r}), and mask=None keeps none: resume with the "
                "mask it was made with (mask='auto' or its key)"
            )
        key = _tokens_key(probe) if TOKENS in names else None
        if TOKENS in names and key is None:
            raise DataError(
                f"the store keeps each row's tokens ({TOKENS!r}), and the first batch has no token ids; resume with "
                "the data it was made with",
                rows=range(probe.start, probe.stop),
            )
        return cls(stored, key, mask_key if MASK in names else None, source_index)

    def values(self, batch: Batch) -> list[torch.Tensor]:
        """The provenance rows of ``batch`` (CPU tensors), in the order of ``arrays``."""
        if not self.arrays:
            return []
        found = [self.source_index(batch.start, batch.stop)]
        for array in self.arrays[1:]:
            key = self.tokens_key if array.name == TOKENS else self.mask_key
            value = _get(batch, key)
            if not _is_2d(value, batch.rows):
                raise DataError(
                    f"rows {batch.start}..{batch.stop - 1} have no {_described(key)} shaped (batch, seq), and the "
                    f"first batch had one, which the store keeps as {array.name!r}; every batch must carry it",
                    rows=range(batch.start, batch.stop),
                )
            assert value is not None
            found.append(_fit(value.detach().cpu(), array, batch, key, self.tokens))
        return found


def _tokens_key(batch: Batch) -> str | int | None:
    ids = batch.kwargs.get("input_ids")
    if _is_2d(ids, batch.rows) and not ids.dtype.is_floating_point:  # type: ignore[union-attr]
        return "input_ids"
    first = batch.args[0] if batch.args else None
    if _is_2d(first, batch.rows) and first.dtype in _INTEGER:  # type: ignore[union-attr]
        return 0
    return None


_INTEGER = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)


def _get(batch: Batch, key: str | int | None) -> torch.Tensor | None:
    if key is None:
        return None
    found: Any = batch.args[key] if isinstance(key, int) and key < len(batch.args) else batch.kwargs.get(str(key))
    return found if isinstance(found, torch.Tensor) else None


def _is_2d(value: Any, rows: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[0] == rows


def _fit(
    value: torch.Tensor, array: SiteLayout, batch: Batch, key: str | int | None, tokens: TokensOption | None
) -> torch.Tensor:
    """``value`` in the array's dtype and width: a shorter batch padded, a longer one refused."""
    width = array.shape[0]
    converted = value.to(
        torch.bool if array.dtype == "bool" else torch.int64, copy=True
    )  # the model may write into its inputs
    if value.shape[1] == width:
        return converted
    if value.shape[1] > width:
        raise DataError(
            f"rows {batch.start}..{batch.stop - 1} have {value.shape[1]} positions of {_described(key)}, and the "
            f"store keeps {width}, the first batch's: pad every batch to one length (e.g. padding='max_length')"
            + _other_fix(array, tokens),
            rows=range(batch.start, batch.stop),
        )
    padded = torch.full((value.shape[0], width), 0 if array.dtype == "bool" else _PAD_TOKEN, dtype=converted.dtype)
    padded[:, : value.shape[1]] = converted
    return padded


def _other_fix(array: SiteLayout, tokens: TokensOption | None) -> str:
    """What else lets a longer batch through, for the array that refused it."""
    if tokens is None:  # a store being resumed: its arrays are what they are
        return ", as the store's earlier rows were"
    if array.name == MASK:
        return (
            "; the mask is kept because a site's dimension 1 had the first batch's width, as values stored per "
            "token do: if none is, mask=None keeps no mask (reductions over the tokens then include padding)"
        )
    if tokens == "auto":
        return (
            ", or tokens=False: tokens='auto' kept them because a site's dimension 1 had the first batch's width, "
            "as values stored per token do"
        )
    return ", or tokens='auto' (kept only for values stored per token) or False"


def _described(key: str | int | None) -> str:
    return "the first positional input" if isinstance(key, int) else repr(key)

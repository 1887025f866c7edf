"""Turn the ``--data`` text of ``hookscope extract`` into something ``hs.extract`` reads.

Forms::

    random:N[:SHAPE]          N random rows shaped SHAPE (e.g. 3x32x32; token ids of length
                              SHAPE for a transformers text model, with decoder start tokens
                              for an encoder-decoder one), seeded per row by --seed
    path.npy                  one array of rows, memory-mapped
    path.npz / .safetensors   arrays of rows sharing their first dimension
    path.pt                   a dict of tensors (torch.load(weights_only=True))
    package.module:factory    a Dataset, DataLoader or iterable of batches (called if callable)
    path/to/file.py:factory   the same, from a file

A single array is the model's main input (``input_ids``/``pixel_values`` for transformers
models, else the one positional input); several arrays are keyword inputs by their names.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import hookscope as hs
from hookscope.cli.parse.specs import COUNT_MAX, load_attribute, make_input, parse_shape
from hookscope.errors import HookscopeError, SpecError

__all__ = ["DATA_FORMS", "RandomRows", "load_data"]

DATA_FORMS = (
    "'random:N[:SHAPE]', a .npy/.npz/.pt/.safetensors file, 'package.module:factory' or 'path/to/file.py:factory'"
)
_FILE_SUFFIXES = (".npy", ".npz", ".pt", ".safetensors")


class RandomRows(torch.utils.data.Dataset[Any]):
    """``rows`` random inputs, each made from its own seed, so any row is the same in every run.

    Row ``i`` does not depend on which other rows are fetched with it, so a resumed run and
    every process of a sharded one see the same data without it being stored anywhere.

    >>> rows = RandomRows(10, (3,), seed=0)
    >>> torch.equal(rows.__getitems__([4, 5])[1], rows.__getitems__([5])[0])
    True
    """

    collates_itself = True

    def __init__(
        self,
        rows: int,
        shape: tuple[int, ...],
        *,
        seed: int,
        key: str | None = None,
        vocab_size: int = 0,
        constant: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        self.rows = rows
        self.constant = dict(constant or {})  # the same row in every batch: an encoder-decoder's decoder_input_ids
        self.shape = shape
        self.seed = seed
        self.key = key
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, index: int) -> Any:
        return self.__getitems__([index])

    def __getitems__(self, indices: Sequence[int]) -> Any:
        values = torch.stack([self._row(int(index)) for index in indices])
        if self.key is None:
            return values
        same = {name: row.expand(len(indices), *row.shape).clone() for name, row in self.constant.items()}
        return {self.key: values, **same}

    def _row(self, index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}:{index}".encode()))
        if self.vocab_size:
            return torch.randint(0, self.vocab_size, self.shape, generator=generator)
        return torch.randn(self.shape, generator=generator)


def load_data(spec: str, model: nn.Module, *, seed: int = 0) -> Any:
    """The data ``spec`` names, ready for ``hs.extract`` (see the module doc for the forms)."""
    text = spec.strip()
    if text.startswith("random:"):
        return _random(text, model, seed)
    suffix = Path(text).suffix.lower()
    if suffix in _FILE_SUFFIXES:
        return _file(text, Path(text).expanduser(), suffix, model)
    if ":" in text:
        found, attribute = load_attribute(text, kind="data", forms=DATA_FORMS)
        return _made(text, found, attribute)
    raise SpecError(f"data {spec!r} is not understood; expected {DATA_FORMS}")


def _random(spec: str, model: nn.Module, seed: int) -> RandomRows:
    parts = spec.split(":")
    if len(parts) not in (2, 3) or not parts[1].strip().isdecimal() or not 1 <= int(parts[1]) <= COUNT_MAX:
        raise SpecError(
            f"data {spec!r}: expected 'random:N' or 'random:N:SHAPE' with 1 <= N <= 2**63 - 1, e.g. random:1000:3x32x32"
        )
    rows = int(parts[1])
    sample_shape = f"1x{parts[2]}" if len(parts) == 3 else None
    if len(parts) == 3:
        parse_shape(parts[2])  # the message names the shape itself
    try:
        args, kwargs = make_input(model, sample_shape)  # the model's kind of input: token ids, pixels, a tensor
    except SpecError as error:  # its hint names the other commands' --input-shape, which extract has not
        name = type(model).__name__
        if sample_shape is None:
            raise SpecError(
                f"data {spec!r}: {name} declares no example input shape, so a row's shape must be given: "
                f"random:{rows}:SHAPE, e.g. random:{rows}:3x32x32"
            ) from error
        raise SpecError(
            f"data {spec!r}: {name} takes token ids, one sequence per row, so SHAPE is a row's length: "
            f"e.g. random:{rows}:16"
        ) from error
    key, sample = next(iter(kwargs.items())) if kwargs else (None, args[0])
    constant = {name: value[0] for name, value in list(kwargs.items())[1:]}  # decoder_input_ids: start tokens
    vocab = getattr(getattr(model, "config", None), "vocab_size", 0) if not sample.is_floating_point() else 0
    shape = tuple(sample.shape[1:])
    return RandomRows(rows, shape, seed=seed, key=key, vocab_size=int(vocab or 0), constant=constant)


def _file(spec: str, path: Path, suffix: str, model: nn.Module) -> Any:
    """The rows of a file as ``hs.extract`` reads them: one array of rows, or a dict of named columns."""
    if not path.is_file():
        raise SpecError(f"data {spec!r}: file not found (looked at {path.resolve()}); check the path")
    try:
        columns = _read(path, suffix)
    except HookscopeError:
        raise
    except Exception as error:
        raise SpecError(f"data {spec!r} cannot be read as {suffix}: {type(error).__name__}: {error}") from error
    if isinstance(columns, Mapping) and len(columns) == 1:
        columns = next(iter(columns.values()))
    if not isinstance(columns, Mapping):
        main = getattr(model, "main_input_name", None)
        return {main: columns} if isinstance(main, str) else columns
    return dict(columns)


def _read(path: Path, suffix: str) -> Any:
    """One memory-mapped array (``.npy``), or the named tensors of a file the capture's reader reads."""
    if suffix == ".npy":
        return np.load(path, mmap_mode="r")
    tensors, _ = hs.load_tensors(path)  # .npz, .pt and .safetensors, with their errors and dtypes
    return tensors


def _made(spec: str, found: object, attribute: str) -> Any:
    readable = (torch.utils.data.Dataset, torch.utils.data.DataLoader, torch.Tensor, np.ndarray)
    if isinstance(found, readable) or not callable(found):
        return found
    try:
        return found()
    except Exception as error:
        raise SpecError(
            f"data {spec!r}: factory {attribute!r} raised {type(error).__name__}: {error}; it is called with no "
            "arguments and must return a Dataset, a DataLoader or an iterable of batches"
        ) from error

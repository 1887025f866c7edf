"""Save and load a flat set of named tensors plus JSON metadata; the file's suffix picks the format.

- ``.safetensors``: no pickle, so safe to open from anyone; memory-mappable and readable from other
  frameworks and languages. Needs the optional ``safetensors`` package.
- ``.npz``: for analysis code with numpy but without torch (``np.load(path, allow_pickle=False)``).
- ``.pt``: ``torch.save``; holds every torch dtype as it is. Read back only with
  ``torch.load(weights_only=True)``, which refuses pickled Python objects, so no code runs on load.

Every file carries, under a reserved name, one JSON text: a format version, the caller's metadata,
and each tensor's torch dtype and shape in the order given; loading restores order and dtypes from
it. A dtype the format lacks is stored as its bits, viewed as the unsigned integer of the same
width: numpy has no bfloat16 or float8, so ``.npz`` holds ``t.view(torch.uint16)`` for bfloat16
and ``t.view(torch.uint8)`` for float8, and loading views them back with ``.view(dtype)``. A dtype
wider than any unsigned integer (complex128 in safetensors) is stored as flat uint8 bytes. Every
round trip is bit-exact, NaN payloads included, and checked: the metadata holds each tensor's
BLAKE2b checksum, and loading a tensor whose bytes differ raises ``FileFormatError`` naming the
file and the tensor (safetensors and torch's zip reader check nothing). Files written by other
tools (no hookscope metadata) load with metadata ``{}`` and the dtypes they store.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import zipfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hookscope._shared.bits import UINT_OF_WIDTH
from hookscope._shared.dtypes import dtype_name
from hookscope._shared.files import atomic_path
from hookscope._shared.optional import require
from hookscope.errors import FileFormatError, HookscopeError, SpecError

__all__ = ["SUPPORTED_SUFFIXES", "load_tensors", "save_tensors", "tensor_file_format"]

SUPPORTED_SUFFIXES: tuple[str, ...] = (".safetensors", ".npz", ".pt")

_RESERVED = "__hookscope__"  # the npz member (and forbidden tensor key) that holds the metadata
_FORMAT = "hookscope.tensors"
_VERSION = 1
_NUMPY_DTYPES = frozenset(
    {torch.bool, torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.int8, torch.int16, torch.int32}
    | {torch.int64, torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128}
)
_SAFETENSORS_BASE = frozenset(
    {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16}
    | {torch.float32, torch.float64}
)
_FORMAT_NAMES = {".safetensors": "safetensors", ".npz": "numpy .npz", ".pt": "torch .pt"}


def tensor_file_format(path: str | os.PathLike[str]) -> str:
    """The format a file name picks: ``"safetensors"``, ``"npz"`` or ``"pt"``; else ``SpecError``.

    :func:`save_tensors`, :func:`load_tensors`, ``Cache.save`` and ``hs.load`` choose the
    format by this rule. Check an output path with it before a long run, so that a mistyped
    extension fails at once rather than after the run, when the values are saved.

    >>> tensor_file_format("acts.safetensors"), tensor_file_format("runs/acts.NPZ")
    ('safetensors', 'npz')
    >>> tensor_file_format("acts.csv")
    Traceback (most recent call last):
    ...
    hookscope.errors.SpecError: 'acts.csv': suffix '.csv' is not one of .safetensors, .npz, .pt; ...
    """
    return _suffix(Path(path)).removeprefix(".")


def save_tensors(
    path: str | os.PathLike[str], tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any] | None = None
) -> Path:
    """Write named ``tensors`` and the JSON-serialisable ``meta`` to ``path``, in the format its suffix names.

    For values that must come back exactly, in any dtype: ``.npz`` and ``.safetensors`` lack
    bfloat16 or float8, so those are stored as their bits and restored on load, and a ``.pt``
    file needs no pickle of anything but tensors to be read back (``weights_only=True``). The
    write is atomic: on any error nothing is left under ``path`` (an older file there stays as
    it was). Tensors are written from CPU, contiguous, each owning its memory.

    >>> import tempfile
    >>> path = Path(tempfile.mkdtemp()) / "acts.npz"
    >>> save_tensors(path, {"fc#0:output": torch.ones(2, dtype=torch.bfloat16)}, {"model": "mlp"}).name
    'acts.npz'
    """
    final = Path(path)
    suffix = _suffix(final, "save")
    if suffix == ".safetensors":
        _require_safetensors("saving")
    with atomic_path(final) as temporary:  # the path is checked before the tensors are copied and hashed
        prepared = _prepare(tensors)
        _WRITERS[suffix](temporary, prepared, _header(prepared, {} if meta is None else meta))
    return final


def load_tensors(path: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read named tensors from a ``.safetensors``, ``.npz`` or ``.pt`` file: ``(tensors, meta)``, on CPU.

    A file written by :func:`save_tensors` comes back bit-exact: saved order, dtypes (bfloat16
    and float8 too) and ``meta``. A file written by another tool (``np.savez``, safetensors'
    ``save_file``, ``torch.save`` of a dict of tensors) loads with the dtypes it stores and
    ``meta == {}``. A ``.pt`` file is read with ``weights_only=True``, so opening one from
    anyone runs no code.

    >>> import tempfile
    >>> path = save_tensors(Path(tempfile.mkdtemp()) / "a.pt", {"x": torch.arange(3)}, {"step": 1})
    >>> load_tensors(path)
    ({'x': tensor([0, 1, 2])}, {'step': 1})
    """
    final = Path(path)
    suffix = _suffix(final, "read")
    if suffix == ".safetensors":
        _require_safetensors("loading")
    if not final.exists():
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(final))
    with _reading(final, suffix):
        stored, header = _READERS[suffix](final)
        return _decode(stored, header, final)


def _suffix(path: Path, action: str | None = None) -> str:
    """The lower-case suffix of ``path`` if it names a format; the error says what failed (save / read)."""
    suffix = path.suffix.lower()
    if suffix not in SUPPORTED_SUFFIXES:
        where = f"cannot {action} {str(path)!r}" if action else repr(str(path))
        raise SpecError(
            f"{where}: suffix {suffix or '(none)'!r} is not one of {', '.join(SUPPORTED_SUFFIXES)}; "
            "name the file e.g. 'activations.safetensors'"
        )
    return suffix


def _require_safetensors(action: str) -> None:
    """Raise :class:`MissingDependencyError` if the optional ``safetensors`` package is missing."""
    hint = " (or save to .npz or .pt)" if action == "saving" else ""
    require("safetensors.torch", purpose=f"{action} .safetensors files", hint=hint)


def _check_entry(key: object, value: object) -> None:
    """Refuse a key or value that cannot be saved as a named dense tensor."""
    if not isinstance(key, str):
        raise SpecError(f"tensor key {key!r} is a {type(key).__name__}; keys must be str, e.g. 'fc#0:output'")
    if key == _RESERVED:
        raise SpecError(f"tensor key {_RESERVED!r} is reserved for hookscope's metadata; rename that tensor")
    if not isinstance(value, torch.Tensor):
        raise SpecError(f"tensors[{key!r}] is a {type(value).__name__}, not a torch.Tensor; save tensors only")
    if value.layout != torch.strided or value.is_meta or value.is_quantized:
        kind = "meta" if value.is_meta else "quantized" if value.is_quantized else str(value.layout)
        raise SpecError(f"tensors[{key!r}] is a {kind} tensor; only dense tensors with data can be saved")


def _prepare(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Plain contiguous CPU tensors, each the sole user of its own memory (shared ones cloned)."""
    prepared: dict[str, torch.Tensor] = {}
    taken: set[int] = set()
    for key, value in tensors.items():
        _check_entry(key, value)
        tensor = value.detach().cpu().resolve_conj().resolve_neg().contiguous()
        if not tensor.numel():  # an empty tensor may have zero strides, which .view(dtype) refuses
            tensor = torch.empty(tensor.shape, dtype=tensor.dtype)
        storage = tensor.untyped_storage()
        whole = tensor.storage_offset() == 0 and storage.nbytes() == tensor.nbytes
        if tensor.nbytes and (storage.data_ptr() in taken or not whole):
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        if tensor.nbytes:
            taken.add(tensor.untyped_storage().data_ptr())
        prepared[key] = tensor
    return prepared


def _check_json(value: object, where: str, parents: frozenset[int] = frozenset()) -> None:
    """Raise :class:`SpecError` naming the first part of ``value`` that JSON cannot round-trip."""
    if value is None or isinstance(value, (str, int, float)):
        return
    if id(value) in parents:
        raise SpecError(f"metadata {where} contains itself; JSON cannot hold a cycle")
    inner = parents | {id(value)}
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_json(item, f"{where}[{index}]", inner)
    elif isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise SpecError(f"metadata {where} has key {key!r}; JSON object keys must be str, e.g. str(key)")
            _check_json(item, f"{where}[{key!r}]", inner)
    else:
        raise SpecError(
            f"metadata {where} is of type {type(value).__name__}, which JSON cannot hold; "
            "use str, int, float, bool, None, lists and dicts (e.g. str(value))"
        )


def _header(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> str:
    """The JSON text stored beside the tensors: version, meta, and each tensor's dtype and shape."""
    if not isinstance(meta, Mapping):
        raise SpecError(f"meta is a {type(meta).__name__}; pass a dict of JSON values, e.g. {{'model': 'gpt2'}}")
    meta = dict(meta)
    _check_json(meta, "meta")
    records = {
        key: {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "blake2b": _digest(t)} for key, t in tensors.items()
    }
    return json.dumps({"format": _FORMAT, "version": _VERSION, "tensors": records, "meta": meta})


def _encode(tensor: torch.Tensor, native: frozenset[torch.dtype]) -> torch.Tensor:
    """``tensor`` if the format holds its dtype, else its bits as a same-width uint (or flat bytes)."""
    if tensor.dtype in native:
        return tensor
    same_width = UINT_OF_WIDTH.get(tensor.element_size())
    if same_width is not None and same_width in native:
        return tensor.view(same_width)
    return tensor.reshape(-1).view(torch.uint8)


def _decode(
    stored: dict[str, torch.Tensor], header: str | None, path: Path
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Restore saved order and dtypes from ``header``; a file without one loads as stored."""
    if header is None:
        return stored, {}
    records, meta = _parse_header(header, path)
    tensors: dict[str, torch.Tensor] = {}
    for key, (dtype, shape, digest) in records.items():
        if key not in stored:
            raise FileFormatError(f"{path}: its metadata lists tensor {key!r} but the file holds none; it is damaged")
        tensor = stored[key]
        if tensor.dtype != dtype:
            tensor = tensor.reshape(-1).view(dtype)
        tensors[key] = tensor.reshape(shape)
        if digest is not None and _digest(tensors[key]) != digest:
            raise FileFormatError(
                f"{path}: the bytes of tensor {key!r} differ from those saved (checksum mismatch); "
                "the file is damaged: save it again or restore a copy"
            )
    tensors.update((key, tensor) for key, tensor in stored.items() if key not in tensors)
    return tensors, meta


def _parse_header(
    header: str, path: Path
) -> tuple[dict[str, tuple[torch.dtype, list[int], str | None]], dict[str, Any]]:
    """``({key: (dtype, shape, checksum)}, meta)`` from the stored JSON text (older files have no checksum)."""
    record = json.loads(header)
    if not isinstance(record, dict) or record.get("format") != _FORMAT:
        raise FileFormatError(f"{path}: its {_RESERVED!r} entry is not hookscope metadata; the file is damaged")
    if not isinstance(record.get("version"), int) or record["version"] > _VERSION:
        version = record.get("version")
        raise FileFormatError(f"{path} has format version {version!r}; this hookscope reads <= {_VERSION}: upgrade it")
    records = {
        key: (_dtype_named(item["dtype"], path), list(item["shape"]), item.get("blake2b"))
        for key, item in record["tensors"].items()
    }
    return records, dict(record["meta"])


def _digest(tensor: torch.Tensor) -> str:
    """The BLAKE2b checksum of a tensor's bytes, as saved: safetensors and torch's zip do not check
    their data on load (npz's zip CRC does), so a flipped bit would otherwise load as a value."""
    data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.blake2b(data.data, digest_size=16).hexdigest()


def _dtype_named(name: str, path: Path) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise FileFormatError(f"{path} holds dtype {name!r}, which this torch {torch.__version__} lacks; upgrade torch")
    return dtype


@contextmanager
def _reading(path: Path, suffix: str) -> Iterator[None]:
    """Turn a library's complaint about a file's contents into :class:`FileFormatError`."""
    try:
        yield
    except (HookscopeError, FileNotFoundError, PermissionError, IsADirectoryError):
        raise
    except Exception as error:
        detail = f"{type(error).__name__}: {error}".strip().splitlines()[0]
        if suffix == ".pt" and isinstance(error, pickle.UnpicklingError):
            detail = "torch.load(weights_only=True) refused it: damaged, or holds pickled objects besides tensors"
        raise FileFormatError(
            f"cannot read {path} as a {_FORMAT_NAMES[suffix]} file ({detail}); "
            f"check that it is complete and really is a {suffix} file"
        ) from error


def _write_safetensors(path: Path, tensors: Mapping[str, torch.Tensor], header: str) -> None:
    from safetensors.torch import save_file

    native = _safetensors_dtypes()
    save_file({key: _encode(t, native) for key, t in tensors.items()}, str(path), metadata={"hookscope": header})


def _read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], str | None]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as file:
        header = (file.metadata() or {}).get("hookscope")
        return {key: file.get_tensor(key) for key in file.keys()}, header  # noqa: SIM118 (not a dict)


def _safetensors_dtypes() -> frozenset[torch.dtype]:
    """The dtypes the installed safetensors writes as they are (newer versions know more)."""
    import safetensors.torch

    known = getattr(safetensors.torch, "_TYPES", None)  # private: fall back to what every version knows
    return frozenset(known.values()) if isinstance(known, dict) else _SAFETENSORS_BASE


def _write_npz(path: Path, tensors: Mapping[str, torch.Tensor], header: str) -> None:
    # np.savez takes names as keyword arguments, so keys "file" or "allow_pickle" would clash:
    # write the same zip of .npy members directly.
    arrays = {key: _encode(t, _NUMPY_DTYPES).numpy() for key, t in tensors.items()}
    arrays[_RESERVED] = np.array(header)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
        for key, array in arrays.items():
            with archive.open(f"{key}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, array, allow_pickle=False)


def _read_npz(path: Path) -> tuple[dict[str, torch.Tensor], str | None]:
    with path.open("rb") as handle:  # np.load leaks the handle it opens itself when the zip is damaged
        loaded = np.load(handle, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):
            raise FileFormatError(f"{path} holds one array, not an .npz archive of named arrays; save with np.savez")
        with loaded:
            members = {key: loaded[key] for key in loaded.files}
    header = members.pop(_RESERVED, None)
    if header is not None and (header.ndim != 0 or header.dtype.kind != "U"):
        raise FileFormatError(f"{path}: its {_RESERVED!r} member is not hookscope metadata; it is damaged")
    tensors = {key: _from_numpy(array) for key, array in members.items()}
    return tensors, None if header is None else str(header.item())


def _from_numpy(array: np.ndarray[Any, Any]) -> torch.Tensor:
    """A tensor owning a native-byte-order, C-contiguous, writable copy of ``array``'s values."""
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    array = np.ascontiguousarray(array)
    if not array.flags.writeable:
        array = array.copy()
    tensor = torch.from_numpy(array)
    return tensor if tensor.numel() else torch.empty(tensor.shape, dtype=tensor.dtype)  # numpy gives zero strides


def _write_pt(path: Path, tensors: Mapping[str, torch.Tensor], header: str) -> None:
    # Through a Python file, so that a failed write is an OSError torch's error carries as its
    # context: given a path, torch writes itself and says only "enforce fail at inline_container.cc".
    with path.open("wb") as stream:
        torch.save({"tensors": dict(tensors), "hookscope": header}, stream)


def _read_pt(path: Path) -> tuple[dict[str, torch.Tensor], str | None]:
    loaded = torch.load(path, weights_only=True, map_location="cpu")
    header: str | None = None
    if isinstance(loaded, dict) and set(loaded) == {"tensors", "hookscope"} and isinstance(loaded["hookscope"], str):
        loaded, header = loaded["tensors"], loaded["hookscope"]
    if not isinstance(loaded, dict) or not all(
        isinstance(key, str) and isinstance(value, torch.Tensor) for key, value in loaded.items()
    ):
        raise FileFormatError(f"{path} holds a {type(loaded).__name__}, not a dict of named tensors; save a dict")
    return dict(loaded), header


_Writer = Callable[[Path, Mapping[str, torch.Tensor], str], None]
_Reader = Callable[[Path], tuple[dict[str, torch.Tensor], str | None]]
_WRITERS: dict[str, _Writer] = {".safetensors": _write_safetensors, ".npz": _write_npz, ".pt": _write_pt}
_READERS: dict[str, _Reader] = {".safetensors": _read_safetensors, ".npz": _read_npz, ".pt": _read_pt}

"""The zarr side of a store: where it lives, what is there already, making it (its manifest: ``manifest``).

zarr is imported here (``import hookscope`` stays light), and by ``fsspec_store`` for a store
at a URL. A store is one zarr v3 group: the hookscope attributes, one array per site, and a
subgroup ``_hookscope`` whose ``done`` array is the manifest of completed chunks. The manifest is
an array with one element per chunk and one chunk per element, so each process writes its own
chunk files and never another's; an element is 1 once every site's chunk has landed. It is not inferred from the
presence of chunk files: zarr writes no file for a chunk that holds only its fill value.

The hookscope attributes say ``state``: ``"creating"`` until every array exists (a store cut
short there holds no data and is made again), ``"writing"``, and ``"complete"``.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from hookscope._shared.credentials import scrub, scrub_url, secrets_of, userinfo
from hookscope._shared.optional import require
from hookscope._store.layout import Layout
from hookscope._store.manifest import MANIFEST_GROUP, WRITER_RECORD, Manifest, stats_widths
from hookscope._store.provenance import ROWS_GROUP
from hookscope.errors import MissingDependencyError, StoreError

__all__ = [
    "FORMAT",
    "META_KEY",
    "READABLE_FORMATS",
    "Target",
    "check_only_ours",
    "clear",
    "create_store",
    "open_group",
    "read_meta",
    "remove_partial_files",
    "target_of",
    "write_meta",
    "zarr_module",
]

FORMAT = 2  # 2: checksums per chunk, a CRC32C per chunk file, a writer record (provenance and stats when present)
READABLE_FORMATS = (1, 2)
META_KEY = "hookscope"


def zarr_module() -> ModuleType:
    """``zarr`` (3.1 or newer), or ``MissingDependencyError`` with the install line."""
    return require("zarr", purpose="a feature store", minimum=(3, 1), hint=" (on Python 3.11 or newer)")


@dataclass(frozen=True)
class Target:
    """Where a store goes: a local path (``path`` set), an fsspec URL (``url`` set: ``s3://``,
    ``gs://``, ``memory://``, ...) or any zarr store object.

    ``label`` is how messages name it (a URL without credentials); ``secrets`` what no message
    may show (see :meth:`said`). Neither the URL nor the secrets are in its repr.
    """

    store: Any
    label: str
    path: Path | None
    url: str | None = field(default=None, repr=False)
    secrets: tuple[str, ...] = field(default=(), repr=False, compare=False)

    @property
    def remote(self) -> bool:
        """True for a store on an fsspec file system (a URL): writes wait on a network, not a disk."""
        return self.url is not None or type(self.store).__name__ in ("FsspecStore", "ProcessFsspecStore")

    def said(self, error: BaseException) -> str:
        """``"Kind: text"`` of another library's error, for a message: without this store's secrets."""
        return scrub(f"{type(error).__name__}: {error}", self.secrets)

    def __repr__(self) -> str:
        return f"Target({self.label!r})"


def target_of(out: Any, storage_options: Mapping[str, Any] | None = None) -> Target:
    """A :class:`Target` for ``out``: a path (str or ``PathLike``), an fsspec URL, or a ``zarr.abc.store.Store``.

    A URL goes through zarr's ``FsspecStore`` with ``storage_options`` (any mapping: credentials,
    endpoint, ...: those of the fsspec file system, e.g. s3fs's ``endpoint_url``, ``key``,
    ``secret``). ``file://`` URLs are local paths. An ``s3://`` URL is checked before any request:
    credentials written into it (which s3fs would take for part of the bucket's name, and
    botocore then quote in its error) and a malformed bucket name are refused.
    """
    zarr = zarr_module()
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise StoreError(  # never its repr: it may hold credentials
            f"storage_options is a {type(storage_options).__name__}; expected a mapping of the file system's "
            "options, e.g. {'endpoint_url': 'http://127.0.0.1:9000'}"
        )
    options = dict(storage_options) if storage_options is not None else None
    if isinstance(out, str) and _URL.match(out):
        if out.split("://", 1)[0].lower() != "file":
            _check_s3_url(out)
            return Target(_fsspec_store(out, options), scrub_url(out), None, out, secrets_of(url=out, options=options))
        parts = urllib.parse.urlsplit(out)
        if parts.netloc not in ("", "localhost"):
            raise StoreError(f"out={scrub_url(out)!r} names another host; a file:// URL is a path on this machine")
        out = urllib.parse.unquote(parts.path)
    if options:
        raise StoreError(
            f"storage_options were given, but out={str(out)!r} is a local path: they are for stores such as "
            "'s3://bucket/feats.zarr'; drop them for a local path"
        )
    if isinstance(out, (str, os.PathLike)):
        path = Path(out).expanduser()
        return Target(zarr.storage.LocalStore(path), str(path), path)
    if isinstance(out, zarr.abc.store.Store):
        return Target(out, repr(out), None)
    raise StoreError(
        f"out is a {type(out).__name__}; expected a path such as 'feats.zarr', a URL such as "
        "'s3://bucket/feats.zarr', or a zarr Store"
    )


_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
#: What botocore accepts as a bucket: a name (AWS itself asks 3-63 lowercase letters, digits, dots
#: and hyphens; other S3 stores are looser) or an access point's ARN.
_S3_BUCKET = re.compile(r"^(?:[a-zA-Z0-9.\-_]{1,255}|arn:[^/]+)$")


def _check_s3_url(url: str) -> None:
    """Refuse an ``s3://`` URL that s3fs would send on as a malformed bucket name, naming the fix."""
    if url.split("://", 1)[0].lower() not in ("s3", "s3a"):
        return
    shown = scrub_url(url)
    if userinfo(url) is not None:
        raise StoreError(
            f"out {shown!r} has credentials written into the URL, which s3fs does not read (it would take them "
            "for part of the bucket's name); pass them as storage_options={'key': ..., 'secret': ...} "
            "(--storage-option key=...), or in the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)"
        )
    bucket = url.split("://", 1)[1].partition("/")[0].partition("?")[0]
    if not _S3_BUCKET.match(bucket):
        raise StoreError(
            f"out {shown!r} names the bucket {bucket!r}, which is not an S3 bucket name: S3 buckets are named with "
            "3 to 63 lowercase letters, digits, dots and hyphens (or an access point's ARN); write the URL as "
            "s3://BUCKET/path/feats.zarr"
        )


def _fsspec_store(url: str, storage_options: dict[str, Any] | None) -> Any:
    """A zarr ``FsspecStore`` for ``url`` whose file system is each process's own (see
    ``hookscope._store.fsspec_store``); a missing file-system package is named with its install line."""
    require("fsspec", purpose=f"a store at {scrub_url(url)}", hint=" and the file system's package (s3fs, gcsfs)")
    from hookscope._store.fsspec_store import ProcessFsspecStore

    protocol = url.split("://", 1)[0]
    # no cached listings: other processes (torchrun ranks, a second writer) change the store under us
    options = {"use_listings_cache": False, **(storage_options or {})}
    try:
        return ProcessFsspecStore.from_url(url, storage_options=options, read_only=False)
    except ImportError as error:
        package = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}
        wanted = package.get(protocol, f"the fsspec implementation of {protocol}://")
        raise MissingDependencyError(f"a store at {scrub_url(url)} needs {wanted}: pip install {wanted}") from error
    except (TypeError, ValueError) as error:
        said = scrub(str(error), secrets_of(url=url, options=storage_options))
        raise StoreError(
            f"out {scrub_url(url)!r} cannot be opened: {said}; check the URL and storage_options"
        ) from error


def read_meta(target: Target) -> dict[str, Any] | None:
    """The hookscope attributes of the store at ``target``; None where nothing is stored yet.

    Raises ``StoreError`` for something that is not a store hookscope made, naming the fix.
    """
    zarr = zarr_module()
    if target.path is not None:
        if target.path.exists() and not target.path.is_dir():
            raise StoreError(f"out {target.label!r} is a file; expected a directory for a zarr store, e.g. feats.zarr")
        if not target.path.exists() or not [e for e in target.path.iterdir() if not _only_a_writer_record(e)]:
            return None
        if not (target.path / "zarr.json").exists():
            raise StoreError(
                f"out {target.label!r} holds files and is not a zarr store; hookscope replaces only stores: "
                "choose another path, or remove it yourself"
            )
    elif not [e for e in _entries(target) if e != MANIFEST_GROUP] and not _has_zarr_json(target):
        return None
    try:
        group = zarr.open_group(store=target.store, mode="r")
    except Exception as error:
        said = target.said(error)
        raise StoreError(f"out {target.label!r} holds something that is not a zarr group ({said})") from error
    meta = group.attrs.asdict().get(META_KEY)
    if not isinstance(meta, dict):
        return {}  # a zarr store hookscope did not make
    return meta


def clear(target: Target, meta: dict[str, Any]) -> None:
    """Remove what hookscope wrote at ``target`` (``overwrite=True``), after checking nothing else is there.

    A store's own entries are its ``zarr.json``, the arrays its attributes name, the manifest
    group and temporary files of zarr's writes. Anything else (a file of
    someone's, an array added to the group) is refused by name before anything is deleted:
    ``overwrite`` replaces a store, not a folder. ``meta`` is what :func:`read_meta` returned
    (``{}`` for a zarr group hookscope did not make: only its ``zarr.json`` may be replaced).
    """
    entries = check_only_ours(target, meta)
    zarr = zarr_module()
    if meta:  # a crash part-way leaves a store that the next run makes anew, not one that lacks arrays
        with contextlib.suppress(Exception):
            write_meta(zarr.open_group(store=target.store, mode="r+"), {**meta, "state": "creating"})
    ordered = [e for e in entries if e != "zarr.json"]
    ordered += [e for e in entries if e == "zarr.json"]
    for entry in ordered:
        if entry == MANIFEST_GROUP:  # everything in it but the writer record, which is the caller's
            _clear_manifest(target)
        elif target.path is not None:
            found = target.path / entry
            if found.is_dir() and not found.is_symlink():
                shutil.rmtree(found)
            else:
                found.unlink(missing_ok=True)
        else:
            zarr.core.sync.sync(target.store.delete_dir(entry))
            zarr.core.sync.sync(target.store.delete(entry))


def _clear_manifest(target: Target) -> None:
    """Delete the manifest group's contents, keeping the writer record (``_hookscope/writer.json``)."""
    if target.path is not None:
        folder = target.path / MANIFEST_GROUP
        if not folder.is_dir() or folder.is_symlink():
            folder.unlink(missing_ok=True)
            return
        for found in folder.iterdir():
            if found.name == WRITER_RECORD or found.name.startswith(".writer."):
                continue
            if found.is_dir() and not found.is_symlink():
                shutil.rmtree(found)
            else:
                found.unlink(missing_ok=True)
        return
    zarr = zarr_module()

    async def listed() -> list[str]:
        return [key async for key in target.store.list_prefix(f"{MANIFEST_GROUP}/")]

    for key in zarr.core.sync.sync(listed()):
        if key != f"{MANIFEST_GROUP}/{WRITER_RECORD}":
            zarr.core.sync.sync(target.store.delete(key))


def _only_a_writer_record(entry: Path) -> bool:
    """True for a ``_hookscope`` folder that holds nothing but a writer record (a store about to be made)."""
    if entry.name != MANIFEST_GROUP or not entry.is_dir():
        return False
    return all(found.name == WRITER_RECORD or found.name.startswith(".writer.") for found in entry.iterdir())


def _has_zarr_json(target: Target) -> bool:
    return bool(zarr_module().core.sync.sync(target.store.exists("zarr.json")))


def check_only_ours(target: Target, meta: dict[str, Any]) -> list[str]:
    """The entries at the top of ``target``; ``StoreError`` naming any that hookscope did not write."""
    sites = meta.get("sites")
    named = {site.get("name") for site in sites if isinstance(site, dict)} if isinstance(sites, list) else set()
    # the manifest group also holds the writer record, made before anything else, in any store
    ours = {"zarr.json", MANIFEST_GROUP} | ({n for n in named if isinstance(n, str)} if meta else set())
    if meta.get("provenance"):
        ours.add(ROWS_GROUP)
    entries = _entries(target)
    foreign = [e for e in entries if e not in ours and not _PARTIAL.search(e)]
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        what = "a feature store" if meta else "a zarr group hookscope did not make"
        raise StoreError(
            f"out {target.label!r} is {what} but also holds {shown}, which hookscope did not write; overwrite=True "
            "replaces only a store's own files: move those elsewhere, or choose another path"
        )
    return entries


def _entries(target: Target) -> list[str]:
    """The names at the top of the store: files and folders of a local one, keys' first parts of others."""
    if target.path is not None:
        return sorted(p.name for p in target.path.iterdir()) if target.path.is_dir() else []

    async def listed() -> list[str]:
        return [name async for name in target.store.list_dir("")]

    return sorted({name.split("/")[0] for name in zarr_module().core.sync.sync(listed())})


def create_store(target: Target, layout: Layout, meta: dict[str, Any], compression_level: int | None) -> Any:
    """Make the group, one array per site and the manifest; return the group, state ``"writing"``."""
    zarr = zarr_module()
    try:
        if target.path is not None:
            target.path.mkdir(parents=True, exist_ok=True)
        group = zarr.create_group(  # not overwrite=True: zarr would delete everything under the path
            store=target.store, overwrite=False, attributes={META_KEY: {**meta, "state": "creating"}}
        )
        # zstd, then a CRC32C of the compressed bytes that zarr checks on every read: a flipped bit
        # is an error, never other values
        compressors = [zarr.codecs.ZstdCodec(level=compression_level)] if compression_level is not None else []
        compressors.append(zarr.codecs.Crc32cCodec())
        rows = layout.rows if layout.rows is not None else 0
        for site in layout.arrays:
            group.create_array(
                site.name,
                shape=(rows, *site.shape),
                chunks=(layout.chunk_rows, *site.shape),
                dtype=site.stored,
                compressors=compressors,
                fill_value=0,
                # every written chunk has a file, so a missing file is a lost chunk, not zeros
                config={"write_empty_chunks": True},
                dimension_names=["row", *(f"{site.name}.{axis}" for axis in range(1, len(site.shape) + 1))],
                attributes={META_KEY: site.to_json()},
            )
        Manifest.create(group, layout.chunks or 0, len(layout.arrays), stats_widths(layout))
        write_meta(group, {**meta, "state": "writing"})
    except OSError as error:
        said = target.said(error)
        raise StoreError(f"out {target.label!r} cannot be written: {said}; choose a writable path") from error
    return group


_PARTIAL = re.compile(r"\.[0-9a-f]{32}\.partial$")  # zarr's local store writes <name>.<uuid>.partial, then renames


def remove_partial_files(target: Target) -> None:
    """Remove the temporary files of writes that a killed process left half-done (a local store only)."""
    if target.path is None:
        return
    for path in target.path.rglob("*.partial"):
        if _PARTIAL.search(path.name):
            path.unlink(missing_ok=True)


def open_group(target: Target, *, writable: bool) -> Any:
    return zarr_module().open_group(store=target.store, mode="r+" if writable else "r")


def write_meta(group: Any, meta: dict[str, Any]) -> None:
    """Replace the hookscope attributes (one atomic write of the group's ``zarr.json`` on a local disk)."""
    group.attrs.update({META_KEY: meta})

"""The writer record in an object store, written with S3's conditional writes where there are some.

An object store has no file locks and no rename, so exclusivity comes from the store itself:
S3 (and stores speaking its protocol: MinIO, R2, moto) creates an object only if none exists
(``If-None-Match: *``) and replaces or deletes one only if it is still the version read
(``If-Match: <ETag>``). With those, exactly one of two writers creates the record, exactly one
of two newcomers takes a stale record over, and a writer's heartbeat never overwrites the record
of a writer that took the store over from it.

Other stores (zarr's memory store, ``gs://`` through gcsfs, any zarr ``Store`` object) fall back
to the heartbeat object alone: create if absent, read back, and whoever's record is there wins.
Two writers that start within the same moment may then both believe they won for one heartbeat;
the next heartbeat tells the loser (see ``StoreHold.confirm``), before it records a chunk.
"""

from __future__ import annotations

import contextlib
from typing import Any

from hookscope._store.zarr_io import Target, zarr_module
from hookscope.errors import StoreError

__all__ = ["ObjectRecord"]


class ObjectRecord:
    """Create, read, replace and delete one small object of a store that is not a local folder."""

    def __init__(self, target: Target, key: str) -> None:
        self.target = target
        self.key = key
        self._fs, self._path = _s3_of(target, key)
        #: The ETag of the version this process last wrote (conditional writes only).
        self.etag: str | None = None

    @property
    def conditional(self) -> bool:
        """True when the store takes conditional writes (S3's ``If-None-Match`` / ``If-Match``)."""
        return self._fs is not None

    def create(self, body: bytes) -> bool:
        """Write ``body`` unless the object exists; True when this call created it."""
        if self._fs is not None:
            return self._put(body, IfNoneMatch="*")
        zarr_module().core.sync.sync(self.target.store.set_if_not_exists(self.key, _buffer(body)))
        return True  # the caller reads it back: whoever's record is there won

    def read(self) -> tuple[bytes | None, str | None]:
        """``(the object's bytes, its ETag)``; ``(None, None)`` when there is none (the ETag is None
        without conditional writes)."""
        if self._fs is not None:
            try:
                found = self._call("get_object")
            except FileNotFoundError:
                return None, None
            body = found["Body"]
            try:
                data: bytes = zarr_module().core.sync.sync(body.read())
            finally:
                with contextlib.suppress(Exception):
                    body.close()
            return data, found.get("ETag")
        zarr = zarr_module()
        found = zarr.core.sync.sync(
            self.target.store.get(self.key, prototype=zarr.core.buffer.default_buffer_prototype())
        )
        return (None if found is None else bytes(found.to_bytes())), None

    def replace(self, body: bytes, *, if_etag: str | None) -> bool:
        """Write ``body`` over the version ``if_etag`` (conditional stores); False when another
        version is there now. Without conditional writes it writes and returns True."""
        if self._fs is not None and if_etag is not None:
            return self._put(body, IfMatch=if_etag)
        zarr_module().core.sync.sync(self.target.store.set(self.key, _buffer(body)))
        return True

    def delete(self, *, if_etag: str | None = None) -> bool:
        """Delete the object (only the version ``if_etag``, where the store can say so); False when
        another version is there now."""
        if self._fs is not None and if_etag is not None:
            try:
                self._call("delete_object", IfMatch=if_etag)
            except FileNotFoundError:
                return False
            except OSError as error:
                if _precondition_failed(error):
                    return False
                if not _unsupported(error):
                    raise
                self._call("delete_object")  # a store without conditional deletes: the caller compared first
            return True
        zarr_module().core.sync.sync(self.target.store.delete(self.key))
        return True

    def _put(self, body: bytes, **condition: str) -> bool:
        """A conditional ``PutObject``; False when its condition did not hold."""
        try:
            found = self._call("put_object", Body=body, **condition)
        except FileExistsError:
            return False
        except FileNotFoundError as error:
            if "IfMatch" in condition:  # the version to replace is gone
                return False
            raise StoreError(
                f"out {self.target.label!r} cannot be written: {self.target.said(error)}; check that the bucket exists "
                "and the credentials may write to it"
            ) from error
        except OSError as error:
            if _precondition_failed(error):
                return False
            raise
        self.etag = found.get("ETag")
        return True

    def _call(self, method: str, **kwargs: Any) -> Any:
        assert self._fs is not None
        bucket, key = self._path
        return zarr_module().core.sync.sync(self._fs._call_s3(method, Bucket=bucket, Key=key, **kwargs))


def _buffer(body: bytes) -> Any:
    """``body`` as the buffer a zarr store writes."""
    return zarr_module().core.buffer.default_buffer_prototype().buffer.from_bytes(body)


def _s3_of(target: Target, key: str) -> tuple[Any, tuple[str, str]]:
    """``(s3fs file system, (bucket, object key))`` for ``key`` of a store on S3; ``(None, ...)`` otherwise."""
    store = target.store
    fs = getattr(store, "fs", None)
    if fs is None or not hasattr(fs, "_call_s3") or not hasattr(fs, "split_path"):
        return None, ("", "")
    path = f"{store.path.rstrip('/')}/{key}"
    bucket, object_key, _ = fs.split_path(path)
    return fs, (bucket, object_key)


def _precondition_failed(error: OSError) -> bool:
    """True for S3's 412 (a conditional write whose condition did not hold) or 409 (a concurrent
    conditional write won), as s3fs raises them."""
    text = str(error)
    return "pre-condition" in text or "PreconditionFailed" in text or "ConditionalRequestConflict" in text


def _unsupported(error: OSError) -> bool:
    text = str(error)
    return "NotImplemented" in text or "not implemented" in text.lower()

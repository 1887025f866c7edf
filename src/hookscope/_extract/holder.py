"""The writer record: one process writes a store at a time, and a second one is told who does.

Two extractions into one path would otherwise both run, each making or resuming the store as
if it were alone: the store ends up holding one of them, or rows of both. So a writer first
creates ``_hookscope/writer.json`` in the store, exclusively (the create fails when the file
exists), holding its host, pid, start, command and a heartbeat that a thread renews every
:data:`HEARTBEAT_S` seconds; it deletes the record when it is done, however it ends.

A record found there belongs to a live writer, and the newcomer is refused with
:class:`~hookscope.errors.StoreBusyError` naming it, unless the record is stale:

- same host, and its pid no longer runs (or runs another program: the pid was reused, which the
  process's start time in ``/proc`` tells) — a killed or crashed run, taken over at once;
- its heartbeat is older than :data:`STALE_AFTER_S` — a writer on another host that is gone.

A stale record is taken over by renaming it away first (on a local disk exactly one of two
newcomers can do that) and then creating the new one exclusively. Under ``torch.distributed``
rank 0 holds the record for the whole job.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shlex
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from hookscope._extract.zarr_io import MANIFEST_GROUP, WRITER_RECORD, Target, zarr_module
from hookscope.errors import StoreBusyError, StoreError

__all__ = ["HEARTBEAT_S", "RECORD_KEY", "STALE_AFTER_S", "StoreHold", "describe_holder"]

RECORD_KEY = f"{MANIFEST_GROUP}/{WRITER_RECORD}"
#: How often a writer renews its heartbeat.
HEARTBEAT_S = 15.0
#: A record whose heartbeat is older than this belongs to a writer that is gone.
STALE_AFTER_S = 120.0


class StoreHold:
    """``with StoreHold(target):`` holds the store for this process; refuses while another does.

    ``take()`` raises :class:`~hookscope.errors.StoreBusyError` when a live writer holds the
    store; ``release()`` stops the heartbeat and deletes the record (idempotent).
    """

    def __init__(self, target: Target, *, command: str | None = None, heartbeat_s: float = HEARTBEAT_S) -> None:
        self.target = target
        self.token = secrets.token_hex(8)
        self.heartbeat_s = heartbeat_s
        self._record = _own_record(self.token, command)
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self._made_folders: list[Path] = []

    def __enter__(self) -> StoreHold:
        self.take()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def take(self) -> None:
        """Create the record, taking over a stale one; ``StoreBusyError`` naming a live holder."""
        self._make_folders()
        try:
            for _ in range(3):  # a stale record taken over by someone else meanwhile: look again
                if self._create():
                    self._start_heartbeat()
                    return
                found = self._read()
                if found is None:
                    continue  # released between our create and our read
                if not is_stale(found):
                    raise StoreBusyError(_busy_message(self.target.label, found), holder=found)
                self._remove_stale(found)
            raise StoreBusyError(
                f"out {self.target.label!r}: another writer took it over while this one tried to; run again once "
                "it is done",
                holder=self._read() or {},
            )
        except BaseException:
            self._remove_folders()
            raise

    def release(self) -> None:
        """Stop the heartbeat and delete the record if it is still ours."""
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
            self._beat = None
            with contextlib.suppress(Exception):  # a store deleted under us: nothing left to release
                found = self._read()
                if found is not None and found.get("token") == self.token:
                    self._delete(RECORD_KEY)
        self._remove_folders()

    # -- the record in the store ----------------------------------------------------------------

    def _make_folders(self) -> None:
        """A local store's folder and its ``_hookscope`` folder, remembering which were made here."""
        if self.target.path is None:
            return
        for folder in (self.target.path, self.target.path / MANIFEST_GROUP):
            if not folder.exists():
                try:
                    folder.mkdir(parents=True)
                except FileExistsError:
                    continue
                except OSError as error:
                    raise StoreError(
                        f"out {self.target.label!r} cannot be written: {error}; choose a writable path"
                    ) from error
                self._made_folders.append(folder)

    def _remove_folders(self) -> None:
        """Folders made only to hold the record, if nothing else came into them (a refused run)."""
        for folder in reversed(self._made_folders):
            with contextlib.suppress(OSError):
                folder.rmdir()  # only when empty
        self._made_folders = []

    def _create(self) -> bool:
        """True if the record was created by this call (it did not exist)."""
        body = json.dumps(self._record).encode()
        if self.target.path is not None:
            try:
                with open(self.target.path / RECORD_KEY, "xb") as file:
                    file.write(body)
                    file.flush()
                    os.fsync(file.fileno())
            except FileExistsError:
                return False
            except OSError as error:
                raise StoreError(
                    f"out {self.target.label!r} cannot be written: {error}; choose a writable path"
                ) from error
            return True
        zarr = zarr_module()
        buffer = zarr.core.buffer.default_buffer_prototype().buffer.from_bytes(body)
        zarr.core.sync.sync(self.target.store.set_if_not_exists(RECORD_KEY, buffer))
        found = self._read()  # an object store may not create exclusively: whoever's record is there wins
        return found is not None and found.get("token") == self.token

    def _read(self) -> dict[str, Any] | None:
        """The record in the store; None when there is none. A record that does not parse is stale."""
        if self.target.path is not None:
            try:
                text = (self.target.path / RECORD_KEY).read_bytes()
            except FileNotFoundError:
                return None
        else:
            zarr = zarr_module()
            found = zarr.core.sync.sync(
                self.target.store.get(RECORD_KEY, prototype=zarr.core.buffer.default_buffer_prototype())
            )
            if found is None:
                return None
            text = found.to_bytes()
        try:
            record = json.loads(text)
        except ValueError:
            return {"unreadable": True}  # a writer killed while writing it: there is no holder to name
        return record if isinstance(record, dict) else {"unreadable": True}

    def _write(self) -> None:
        """Renew the heartbeat: replace the record (one atomic rename on a local disk)."""
        self._record = {**self._record, "heartbeat": time.time()}
        body = json.dumps(self._record).encode()
        if self.target.path is not None:
            path = self.target.path / RECORD_KEY
            temporary = path.with_name(f".writer.{self.token}.tmp")
            temporary.write_bytes(body)
            os.replace(temporary, path)
            return
        zarr = zarr_module()
        buffer = zarr.core.buffer.default_buffer_prototype().buffer.from_bytes(body)
        zarr.core.sync.sync(self.target.store.set(RECORD_KEY, buffer))

    def _delete(self, key: str) -> None:
        if self.target.path is not None:
            (self.target.path / key).unlink(missing_ok=True)
            return
        zarr_module().core.sync.sync(self.target.store.delete(key))

    def _remove_stale(self, found: dict[str, Any]) -> None:
        """Move a stale record out of the way; of two newcomers on a local disk only one succeeds."""
        if self.target.path is None:
            self._delete(RECORD_KEY)
            return
        aside = self.target.path / MANIFEST_GROUP / f".writer.stale.{self.token}"
        with contextlib.suppress(FileNotFoundError):  # another newcomer moved it first
            os.rename(self.target.path / RECORD_KEY, aside)
            aside.unlink(missing_ok=True)

    def _start_heartbeat(self) -> None:
        self._stop.clear()
        self._beat = threading.Thread(target=self._beating, name="hookscope-store-heartbeat", daemon=True)
        self._beat.start()

    def _beating(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            with contextlib.suppress(Exception):  # a heartbeat that fails once is renewed the next time
                found = self._read()
                if found is None or found.get("token") != self.token:
                    return  # taken over (we were stale): the new holder's record stays
                self._write()


def _own_record(token: str, command: str | None) -> dict[str, Any]:
    now = time.time()
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "process_start": _process_start(os.getpid()),
        "started": now,
        "heartbeat": now,
        "command": command if command is not None else shlex.join(sys.argv),
        "token": token,
    }


def is_stale(record: dict[str, Any], *, now: float | None = None) -> bool:
    """True when the writer that left ``record`` is gone (see the module doc)."""
    if record.get("unreadable"):
        return True
    heartbeat = record.get("heartbeat")
    if not isinstance(heartbeat, (int, float)) or (now or time.time()) - heartbeat > STALE_AFTER_S:
        return True
    if record.get("host") != socket.gethostname():
        return False  # another machine: only its heartbeat tells
    pid = record.get("pid")
    if not isinstance(pid, int):
        return True
    if not _running(pid):
        return True
    started = record.get("process_start")
    return started is not None and _process_start(pid) not in (None, started)  # the pid runs another program


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    except OSError:
        return True
    return True


def _process_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux); None where it cannot be read."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    try:
        return int(text.rsplit(")", 1)[1].split()[19])  # field 22; the name in parentheses may hold spaces
    except (IndexError, ValueError):
        return None


def describe_holder(record: dict[str, Any], *, now: float | None = None) -> str:
    """``"pid 4242 on gpu-3, started 2026-12-03 05:12:09, last heartbeat 4 s ago (hookscope extract ...)"``."""
    if record.get("unreadable"):
        return "a writer whose record cannot be read"
    now = now or time.time()
    started = record.get("started")
    heartbeat = record.get("heartbeat")
    parts = [f"pid {record.get('pid', '?')} on {record.get('host', '?')}"]
    if isinstance(started, (int, float)):
        parts.append(f"started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(started))}")
    if isinstance(heartbeat, (int, float)):
        parts.append(f"last heartbeat {max(now - heartbeat, 0):.0f} s ago")
    command = record.get("command")
    text = ", ".join(parts)
    return f"{text} ({command})" if command else text


def _busy_message(label: str, record: dict[str, Any]) -> str:
    return (
        f"out {label!r} is being written by another process: {describe_holder(record)}; expected one writer per "
        f"store: wait for it to finish (the same command then resumes or finds the store complete), or write to "
        f"another path; a writer that is gone is taken over by itself (same host: at once; another host: after "
        f"{STALE_AFTER_S:.0f} s without a heartbeat)"
    )

"""The writer record: one process writes a store at a time, and a second one is told who does.

Two extractions into one path would otherwise both run, each making or resuming the store as
if it were alone: the store ends up holding one of them, or rows of both. So a writer first
creates ``_hookscope/writer.json`` in the store, exclusively (the create fails when the file
exists), holding its host, pid, start, command and a heartbeat that a thread renews every
:data:`HEARTBEAT_S` seconds; it deletes the record when it is done, however it ends.

A record found there belongs to a live writer, and the newcomer is refused with
:class:`~hookscope.errors.StoreBusyError` naming it, unless the record is stale:

- on this machine (same host name, boot and pid namespace), its pid no longer runs (or runs
  another program: the pid was reused, which the process's start time in ``/proc`` tells) — a
  killed or crashed run, taken over at once; a live pid holds, however old its heartbeat (a
  writer paused with Ctrl-Z);
- from another machine (or container), its heartbeat is older than :data:`STALE_AFTER_S` — a
  writer that is gone (the clocks of the two machines are compared: keep them in sync).

A writer that was paused on another machine past that limit and taken over finds out at its
next chunk (:meth:`StoreHold.confirm`) and stops without recording more.

A stale record is taken over by renaming it away first (on a local disk exactly one of two
newcomers can do that) and then creating the new one exclusively. Under ``torch.distributed``
rank 0 holds the record for the whole job.
"""

from __future__ import annotations

import contextlib
import errno
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

from hookscope._shared.credentials import redacted_command
from hookscope._store.manifest import MANIFEST_GROUP, WRITER_RECORD
from hookscope._store.object_record import ObjectRecord
from hookscope._store.zarr_io import Target
from hookscope.errors import StoreBusyError, StoreError

__all__ = ["HEARTBEAT_S", "RECORD_KEY", "STALE_AFTER_S", "StoreHold", "describe_holder", "is_stale"]

RECORD_KEY = f"{MANIFEST_GROUP}/{WRITER_RECORD}"
#: How often a writer renews its heartbeat.
HEARTBEAT_S = 15.0
#: A record from another machine whose heartbeat is older than this belongs to a writer that is gone.
STALE_AFTER_S = 120.0
# A store that refuses writes for these reasons can still be checked by reading it.
_READ_ONLY = {errno.EROFS, errno.EACCES, errno.EPERM}


class StoreHold:
    """``with StoreHold(target):`` holds the store for this process; refuses while another does.

    ``take()`` raises :class:`~hookscope.errors.StoreBusyError` when a live writer holds the
    store; ``release()`` stops the heartbeat and deletes the record (idempotent).
    """

    def __init__(self, target: Target, *, command: str | None = None, heartbeat_s: float = HEARTBEAT_S) -> None:
        self.target = target
        self.token = secrets.token_hex(8)
        self.heartbeat_s = heartbeat_s
        #: True after ``take(read_only_ok=True)`` found the store read-only: nothing is held, and
        #: nothing may be written.
        self.read_only = False
        self._record = _own_record(self.token, command)
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self._made_folders: list[Path] = []
        self._lost_to: dict[str, Any] | None = None
        self._object = ObjectRecord(target, RECORD_KEY) if target.path is None else None

    def __enter__(self) -> StoreHold:
        self.take()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def take(self, *, read_only_ok: bool = False) -> None:
        """Create the record, taking over a stale one; ``StoreBusyError`` naming a live holder.

        With ``read_only_ok``, a store that cannot be written (a read-only mount, no permission)
        is not an error: ``read_only`` is set and nothing is held (a complete store is checked
        by reading alone).
        """
        try:
            self._take()
        except StoreError as error:
            if not (read_only_ok and isinstance(error.__cause__, OSError) and error.__cause__.errno in _READ_ONLY):
                raise
            self.read_only = True

    def refuse_if_held(self) -> None:
        """``StoreBusyError`` if a live writer holds the store now (a look, nothing created): said
        before any other reason to refuse, since the store may change under that writer."""
        found = self._read() if self.target.path is None or self.target.path.exists() else None
        if found is not None and not is_stale(found):
            raise StoreBusyError(_busy_message(self.target.label, found), holder=found)

    def confirm(self) -> None:
        """``StoreBusyError`` if another writer has taken the store over since (this one was paused
        past the stale limit on another host): its rows must not be recorded as this run's."""
        if self.read_only or self._beat is None:
            return
        found = self._lost_to if self._lost_to is not None else self._read()
        if found is None or found.get("token") != self.token:
            holder = found or {}
            raise StoreBusyError(
                f"out {self.target.label!r} was taken over by another writer while this run was stopped: "
                f"{describe_holder(holder) if holder else 'its record is gone'}; this run stops here without "
                "recording more; the chunks recorded stay valid, and running the same command again once the other "
                "writer is done resumes",
                holder=holder,
            )

    def _take(self) -> None:
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
                self._delete_own()
        self._remove_folders()

    # -- the record in the store ----------------------------------------------------------------

    def _make_folders(self) -> None:
        """A local store's folder (and any parent missing) and its ``_hookscope`` folder,
        remembering which were made here, to remove them again if nothing else came into them."""
        if self.target.path is None:
            return
        missing = [self.target.path / MANIFEST_GROUP]
        parent = self.target.path
        while not parent.exists() and parent != parent.parent:
            missing.insert(0, parent)
            parent = parent.parent
        for folder in missing:
            try:
                folder.mkdir()
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
        assert self._object is not None
        if not self._object.create(body):
            return False
        if self._object.conditional:
            return True
        found = self._read()  # a store without conditional writes: whoever's record is there wins
        return found is not None and found.get("token") == self.token

    def _read(self) -> dict[str, Any] | None:
        """The record in the store; None when there is none. A record that does not parse is stale."""
        if self.target.path is not None:
            try:
                text = (self.target.path / RECORD_KEY).read_bytes()
            except (FileNotFoundError, NotADirectoryError):  # no record; out is a file (refused later)
                return None
            return _parsed(text)
        return self._read_object()[0]

    def _read_object(self) -> tuple[dict[str, Any] | None, str | None]:
        """``(the record, its ETag)`` in an object store (see ``_read``; the ETag is None without
        conditional writes)."""
        assert self._object is not None
        body, etag = self._object.read()
        return (None if body is None else _parsed(body)), etag

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
        assert self._object is not None
        if self._object.replace(body, if_etag=self._object.etag):
            return
        # another version is there: a takeover, or our own earlier write whose reply was lost
        record, etag = self._read_object()
        if record is not None and record.get("token") == self.token:
            self._object.etag = etag  # ours after all: renew from that version next time
            return
        self._lost_to = record if record and not record.get("unreadable") else {}  # taken over: leave its record
        self._stop.set()

    def _delete_own(self) -> None:
        """Delete the record if it is ours: on object storage only the version read as ours (a
        renewal whose reply was lost left one this process never wrote itself)."""
        if self.target.path is not None:
            found = self._read()
            if found is not None and found.get("token") == self.token:
                (self.target.path / RECORD_KEY).unlink(missing_ok=True)
            return
        record, etag = self._read_object()
        if record is not None and record.get("token") == self.token:
            assert self._object is not None
            self._object.delete(if_etag=etag)

    def _remove_stale(self, found: dict[str, Any]) -> None:
        """Move the stale record ``found`` out of the way, and only it: a newcomer that moved a
        live record (another newcomer's, made meanwhile) puts it back. On a local disk the
        rename lets exactly one of two newcomers move a given record."""
        if self.target.path is None:
            now, etag = self._read_object()
            if now == found:  # only the version read: with conditional deletes, one newcomer of two moves it
                assert self._object is not None
                self._object.delete(if_etag=etag)
            return
        record = self.target.path / RECORD_KEY
        aside = self.target.path / MANIFEST_GROUP / f".writer.stale.{self.token}"
        try:
            os.rename(record, aside)
        except FileNotFoundError:  # another newcomer moved it first
            return
        try:
            moved = _parsed(aside.read_bytes())
        except OSError:
            moved = {"unreadable": True}
        if moved != found and not moved.get("unreadable"):
            with contextlib.suppress(FileExistsError):  # never over a record made meanwhile
                os.link(aside, record)
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
                    self._lost_to = found or {}  # taken over: confirm() says so; the new holder's record stays
                    return
                self._write()


def _parsed(body: bytes) -> dict[str, Any]:
    """A record's bytes as a dict; one that does not parse (a writer killed while writing it: there
    is no holder to name) is ``{"unreadable": True}``, which is stale."""
    try:
        record = json.loads(body)
    except ValueError:
        return {"unreadable": True}
    return record if isinstance(record, dict) else {"unreadable": True}


def _own_record(token: str, command: str | None) -> dict[str, Any]:
    now = time.time()
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "process_start": _process_start(os.getpid()),
        "boot_id": _BOOT_ID,
        "pid_namespace": _PID_NAMESPACE,
        "started": now,
        "heartbeat": now,
        "command": redacted_command(command if command is not None else shlex.join(sys.argv)),
        "token": token,
    }


def is_stale(record: dict[str, Any], *, now: float | None = None) -> bool:
    """True when the writer that left ``record`` is gone (see the module doc).

    On this machine (same host name, boot and pid namespace) a writer is gone exactly when its
    pid no longer runs the program that wrote the record, however old its heartbeat: a writer
    paused with Ctrl-Z or SIGSTOP still holds the store. Elsewhere only the heartbeat tells.
    """
    if record.get("unreadable"):
        return True
    if _same_machine(record):
        pid = record.get("pid")
        if not isinstance(pid, int) or not _running(pid):
            return True
        started = record.get("process_start")
        return started is not None and _process_start(pid) not in (None, started)  # the pid runs another program
    if record.get("host") == socket.gethostname() and record.get("boot_id") not in (None, _BOOT_ID):
        return True  # this machine, booted since: the writer is gone
    heartbeat = record.get("heartbeat")
    return not isinstance(heartbeat, (int, float)) or (now or time.time()) - heartbeat > STALE_AFTER_S


def _same_machine(record: dict[str, Any]) -> bool:
    """True when the record's pid means a process here: same host, same boot, same pid namespace
    (a container sharing the host's name but not its pids is another machine for this)."""
    if record.get("host") != socket.gethostname():
        return False
    for key, mine in (("boot_id", _BOOT_ID), ("pid_namespace", _PID_NAMESPACE)):
        theirs = record.get(key)
        if theirs is not None and mine is not None and theirs != mine:
            return False
    return True


def _read_text(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


_BOOT_ID = _read_text("/proc/sys/kernel/random/boot_id")
_PID_NAMESPACE = _pid_namespace()


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
    here = record.get("pid") == os.getpid() and _same_machine(record)
    who = "another extraction in this process (another thread)" if here else "another process"
    return (
        f"out {label!r} is being written by {who}: {describe_holder(record)}; expected one writer per "
        f"store: wait for it to finish (the same command then resumes or finds the store complete), or write to "
        f"another path; a writer that is gone is taken over by itself (same host: at once; another host: after "
        f"{STALE_AFTER_S:.0f} s without a heartbeat)"
    )

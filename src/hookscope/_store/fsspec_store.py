"""zarr's ``FsspecStore`` with a file system of each process's own: a store survives a fork.

An asynchronous fsspec file system (s3fs, gcsfs) holds an HTTP session bound to the event loop
it was first used on. A process forked after that (a ``DataLoader`` worker, the default on
Linux) inherits the session, but not the thread running its loop: zarr starts a new loop in
the child, and every request there fails with "attached to a different loop" (before this
store, a healthy chunk then read as damaged). A file system unpickled in a new process
(``spawn``, ``forkserver``) is made anew by fsspec, but one forked is not.

So the store remembers the process that made its file system, and a process that finds another
one makes the file system anew, the way unpickling does (fsspec's ``__reduce__``: the same class
and options; fsspec's instance cache is emptied after a fork, so it is a new one). Every zarr
group and array opened on the store, and everything holding them (a ``Store``, its arrays, a
``StoreLoader``), then works in the child without being opened again.

This module imports zarr at its top: it is imported only when a store has a URL (``zarr_io``).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from zarr.storage import FsspecStore

__all__ = ["ProcessFsspecStore"]

#: One lock per process (a lock held by a thread of the parent at the fork stays held in the child).
_LOCKS: dict[int, threading.Lock] = {}


class ProcessFsspecStore(FsspecStore):
    """An ``FsspecStore`` whose ``fs`` is made anew in a process other than the one that made it."""

    _fs: Any
    _fs_pid: int

    @property
    def fs(self) -> Any:
        pid = os.getpid()
        if self._fs_pid != pid:
            with _LOCKS.setdefault(pid, threading.Lock()):  # the loader's reading threads ask at once
                if self._fs_pid != pid:
                    self._fs = _anew(self._fs)
                    self._fs_pid = pid
        return self._fs

    @fs.setter
    def fs(self, value: Any) -> None:
        self._fs = value
        self._fs_pid = os.getpid()


def _anew(fs: Any) -> Any:
    """A file system of this process with ``fs``'s class and options, as unpickling makes one."""
    make, arguments = fs.__reduce__()[:2]
    return make(*arguments)

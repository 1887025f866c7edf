"""Write files so that a failed run never leaves a half-written one behind, and says why in one line.

Every file hookscope writes goes through :func:`atomic_path`: checked first (:func:`check_output_path`),
written beside the target under a temporary name, flushed to the disk (``fsync``) and renamed onto
the target. A path that cannot be written is an :class:`~hookscope.errors.OutputPathError` naming
the real path and the cause, raised before the work where it can be known then, and a write that
fails part-way (disk full) an :class:`~hookscope.errors.OutputWriteError`, never a raw
``FileNotFoundError`` naming the hidden temporary file.

The temporary file is ``.NAME.PID-RANDOM.partial``: a writer killed with ``kill -9`` cannot remove
its own, so each write first removes those of ``NAME`` whose process is gone (on this machine).
"""

from __future__ import annotations

import errno
import os
import re
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hookscope.errors import HookscopeError, OutputPathError, OutputWriteError

__all__ = ["atomic_path", "check_output_path", "os_error_in", "write_text"]

_OS_ERROR_CODE = re.compile(r"os error (\d+)")  # how Rust libraries (safetensors) spell an errno


def check_output_path(target: str | os.PathLike[str], *, what: str = "output") -> Path:
    """``target`` as a path, or :class:`~hookscope.errors.OutputPathError` if it cannot be written.

    Call it before a long run, so that a path in ``/proc``, below a file, or in a folder this
    user may not write fails at once rather than after the run, when the result is saved.
    Missing parent folders are fine (the write makes them); the nearest existing one must be a
    folder this process can create files in, which is tried (a probe file made and removed),
    since permission bits say nothing to root or to a read-only mount. ``what`` names the
    option in the message (``"--csv"``, ``"out"``).

    >>> import tempfile
    >>> check_output_path(Path(tempfile.mkdtemp()) / "new" / "acts.npz").name
    'acts.npz'
    >>> check_output_path("/proc/acts.npz")
    Traceback (most recent call last):
    ...
    hookscope.errors.OutputPathError: cannot write output '/proc/acts.npz': ...
    """
    final = Path(target)
    shown = f"cannot write {what} {os.fspath(final)!r}"
    if final.is_dir():
        raise OutputPathError(f"{shown}: it is a folder; name a file in it", path=final, errno=errno.EISDIR)
    folder = final.parent
    while not folder.exists() and not folder.is_symlink() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise OutputPathError(
            f"{shown}: {os.fspath(folder)!r} is a file, not a folder; pick a path in a folder",
            path=final,
            errno=errno.ENOTDIR,
        )
    try:
        os.close(os.open(probe := folder / f".{final.name}.{os.getpid()}-probe.partial", _CREATE, 0o600))
        probe.unlink()
    except OSError as error:
        raise OutputPathError(f"{shown}: {_cause(error)}; pick another folder", path=final, errno=error.errno) from None
    return final


@contextmanager
def atomic_path(target: str | os.PathLike[str], *, what: str = "output") -> Iterator[Path]:
    """Yield a temporary path beside ``target``; move it onto ``target`` only if the block succeeds.

    The rename is atomic on one file system, so readers see the old file or the whole new one,
    and an exception inside the block removes the temporary file and leaves ``target`` as it was.
    The file and its folder are ``fsync``-ed around the rename, so after a power loss the target
    is the old file or the whole new one, not an empty one. The file is made as ``open(path, "w")``
    would make it: mode 0666 less the umask in force (``tempfile.mkstemp`` would make it private).

    The path is checked first (:func:`check_output_path`); an ``OSError`` while writing (disk
    full, quota) becomes :class:`~hookscope.errors.OutputWriteError` naming ``target``, not the
    temporary file, and so does a library's error that carries one (:func:`os_error_in`: torch's
    zip writer, safetensors).

    >>> import tempfile
    >>> with atomic_path(Path(tempfile.mkdtemp()) / "x.txt") as tmp:
    ...     _ = tmp.write_text("done")
    """
    final = check_output_path(target, what=what)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_partials(final)
        temporary = _new_file(final)
    except OSError as error:
        raise _write_error(final, what, error) from error
    try:
        yield temporary
        _sync(temporary)
        os.replace(temporary, final)
        _sync(final.parent)
    except HookscopeError:
        raise
    except Exception as error:  # torch and safetensors report a full disk in their own words
        cause = os_error_in(error)
        if cause is None:
            raise
        raise _write_error(final, what, cause) from error
    finally:
        temporary.unlink(missing_ok=True)


def write_text(target: str | os.PathLike[str], text: str, *, what: str = "output") -> Path:
    """Write ``text`` to ``target`` as UTF-8 through :func:`atomic_path`; returns the path.

    A lone surrogate (a module named ``chr(0xDCFF)``, from undecodable bytes) is written as its
    escape ``\\udcff`` rather than failing the whole write after the work.

    >>> import tempfile
    >>> write_text(Path(tempfile.mkdtemp()) / "a.txt", "x" + chr(0xDCFF)).read_text()
    'x\\\\udcff'
    """
    with atomic_path(target, what=what) as temporary:
        temporary.write_text(text, encoding="utf-8", errors="backslashreplace")
    return Path(target)


def os_error_in(error: BaseException) -> OSError | None:
    """The operating system's error behind ``error``: itself, one it was raised from or during,
    or the errno a Rust library wrote into its message (``"(os error 28)"``); None if none.

    torch's zip writer raises ``RuntimeError('[enforce fail at inline_container.cc:...]')``
    when the disk fills, and safetensors a ``SafetensorError``; the errno says what happened.

    >>> os_error_in(RuntimeError("I/O error: No space left on device (os error 28)")).errno
    28
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    found = _OS_ERROR_CODE.search(str(error))
    if found is None:
        return None
    code = int(found.group(1))
    return OSError(code, os.strerror(code))


_CREATE = os.O_CREAT | os.O_EXCL | os.O_WRONLY


def _cause(error: OSError) -> str:
    """``"No space left on device (ENOSPC)"``: the reason without the path (the message names the real one)."""
    name = errno.errorcode.get(error.errno or 0)
    reason = error.strerror or str(error)
    return f"{reason} ({name})" if name else reason


def _write_error(final: Path, what: str, error: OSError) -> OutputWriteError:
    return OutputWriteError(
        f"writing {what} {os.fspath(final)!r} failed: {_cause(error)}; nothing was written there "
        "(an older file stays as it was): free space or pick another path",
        path=final,
        errno=error.errno,
    )


def _sync(path: Path) -> None:
    """Flush ``path`` (a file, or a folder's entries) to the disk; a folder that refuses is left."""
    handle = os.open(path, os.O_RDONLY)
    try:
        os.fsync(handle)
    except OSError:
        if not path.is_dir():  # some file systems cannot fsync a folder; a file must be flushed
            raise
    finally:
        os.close(handle)


def _remove_stale_partials(final: Path) -> None:
    """Remove the temporary files of ``final`` left by writers that were killed (their pid is gone)."""
    pattern = re.compile(rf"\.{re.escape(final.name)}\.(\d+)-[0-9a-f]+\.partial")
    for entry in final.parent.glob(f".{_glob_escape(final.name)}.*.partial"):
        found = pattern.fullmatch(entry.name)
        if found is not None and not _alive(int(found.group(1))):
            entry.unlink(missing_ok=True)


def _glob_escape(name: str) -> str:
    """``name`` with glob's special characters made literal."""
    return re.sub(r"([*?\[])", r"[\1]", name)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _new_file(final: Path) -> Path:
    """An empty file of a name no one else has, beside ``final``; the kernel applies the umask."""
    while True:
        candidate = final.parent / f".{final.name}.{os.getpid()}-{secrets.token_hex(4)}.partial"
        try:
            handle = os.open(candidate, _CREATE, 0o666)
        except FileExistsError:
            continue
        os.close(handle)
        return candidate

"""Write files so that a failed run never leaves a half-written one behind."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["atomic_path"]


@contextmanager
def atomic_path(target: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``target``; move it onto ``target`` only if the block succeeds.

    The rename is atomic on one file system, so readers see the old file or the whole new one,
    and an exception inside the block removes the temporary file and leaves ``target`` as it was.
    The file is made as ``open(path, "w")`` would make it: mode 0666 less the umask in force
    (``tempfile.mkstemp`` would make it private, 0600).

    >>> import tempfile
    >>> with atomic_path(Path(tempfile.mkdtemp()) / "x.txt") as tmp:
    ...     _ = tmp.write_text("done")
    """
    final = Path(target)
    final.parent.mkdir(parents=True, exist_ok=True)
    temporary = _new_file(final)
    try:
        yield temporary
        os.replace(temporary, final)
    finally:
        temporary.unlink(missing_ok=True)


def _new_file(final: Path) -> Path:
    """An empty file of a name no one else has, beside ``final``; the kernel applies the umask."""
    while True:
        candidate = final.parent / f".{final.name}.{secrets.token_hex(4)}.partial"
        try:
            handle = os.open(candidate, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
        except FileExistsError:
            continue
        os.close(handle)
        return candidate

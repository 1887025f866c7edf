"""Write files so that a failed run never leaves a half-written one behind."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["atomic_path"]

# mkstemp makes private files (0600); a finished file gets the mode a plain open() would give it.
_UMASK = os.umask(0o022)
os.umask(_UMASK)


@contextmanager
def atomic_path(target: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``target``; move it onto ``target`` only if the block succeeds.

    The rename is atomic on one file system, so readers see the old file or the whole new one,
    and an exception inside the block removes the temporary file and leaves ``target`` as it was.
    The finished file has the permissions of a file opened for writing (0666 less the umask).

    >>> with atomic_path(Path(tempfile.mkdtemp()) / "x.txt") as tmp:
    ...     _ = tmp.write_text("done")
    """
    final = Path(target)
    final.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".partial", dir=final.parent)
    os.close(handle)
    temporary = Path(name)
    try:
        yield temporary
        if temporary.is_file():
            temporary.chmod(0o666 & ~_UMASK)
        os.replace(temporary, final)
    finally:
        temporary.unlink(missing_ok=True)

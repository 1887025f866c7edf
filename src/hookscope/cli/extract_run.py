"""What ``hookscope extract`` needs around ``hs.extract``: reductions from text, torchrun, sizes.

Under ``torchrun`` (``WORLD_SIZE`` > 1 in the environment) the command joins the process group
itself: gloo for CPU runs, nccl with each rank on its own GPU (``LOCAL_RANK``) for ``--device
cuda``, and leaves it again at the end.
"""

from __future__ import annotations

import json
import math
import os
import shlex
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hookscope.errors import HookscopeError, SpecError
from hookscope.redaction import scrub, secret_key, secrets_of

__all__ = [
    "Recorded",
    "distributed_job",
    "done_line",
    "every_module",
    "interrupted_note",
    "parse_reductions",
    "parse_storage_options",
    "recorded",
    "refused_first_batch",
    "store_size",
]


def every_module(name: str, module: nn.Module) -> bool:
    """The selector of a ``--reduce`` given without ``SELECTOR=``: every layer not named before."""
    return True


def parse_reductions(options: list[str], layers: Sequence[object] = ()) -> Any:
    """``--reduce`` values: one spec for every layer, or ``SELECTOR=SPEC`` pairs (first match wins).
    A spec without ``SELECTOR=`` beside pairs applies to every module and op site no pair named: an
    op site takes only a key written as its selector (see ``hs.extract``), so each op selector of
    ``layers`` is keyed with it too.

    >>> parse_reductions(["mean:1"]), parse_reductions(["h.*=mean:1", "last"])
    ('mean:1', {'h.*': 'mean:1', <function every_module ...>: 'last'})
    >>> parse_reductions(["h.*=mean:1", "last"], ["h.*", "h.0:op[add#0]"])[ "h.0:op[add#0]"]
    'last'
    """
    if not options:
        return None
    pairs: dict[Any, str] = {}
    default: str | None = None
    for option in options:
        selector, equals, spec = option.rpartition("=")
        if not equals:
            if default is not None:
                raise SpecError(f"--reduce {default!r} and --reduce {option!r} both apply to every layer; keep one")
            default = option.strip()
            continue
        if not selector.strip() or not spec.strip():
            raise SpecError(f"--reduce {option!r} is not SELECTOR=SPEC, e.g. 'h.*=mean:1'")
        pairs[selector.strip()] = spec.strip()
    if not pairs:
        return default
    if default is not None:
        for layer in layers:
            if isinstance(layer, str) and (":op[" in layer or ":attn." in layer):  # an op selector
                pairs.setdefault(layer, default)
        pairs[every_module] = default
    return pairs


@contextmanager
def distributed_job(device: str | None) -> Iterator[tuple[int, torch.device]]:
    """``(rank, device)`` of this process; joins torchrun's process group when launched by it."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or dist.is_initialized():
        rank = dist.get_rank() if dist.is_initialized() else 0
        yield rank, torch.device(device or "cpu")
        return
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device is not None and device.startswith("cuda"):
        run_on = torch.device("cuda", local) if device == "cuda" else torch.device(device)
        torch.cuda.set_device(run_on)
        backend = "nccl"
    else:
        run_on, backend = torch.device(device or "cpu"), "gloo"
    dist.init_process_group(backend=backend)
    try:
        yield dist.get_rank(), run_on
    finally:
        dist.destroy_process_group()


def store_size(out: str) -> int | None:
    """Bytes on disk under ``out``; None when it is not a local directory (an ``s3://`` store)."""
    if "://" in out and not out.startswith("file://"):
        return None
    path = Path(out.removeprefix("file://")).expanduser()
    if not path.is_dir():
        return None
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@contextmanager
def refused_first_batch(model: nn.Module, data: str) -> Iterator[None]:
    """A model that raises on the first batch it is given refuses the data: ``SpecError``, exit 2.

    As with the sample input of the other commands, a forward that fails before any batch went
    through is about the input's shape, which changing ``--data`` fixes; one that fails on a later
    batch is a failure at run time (exit 1), after which the same command resumes. The two are told
    apart by a hook pair on the model counting forwards begun and finished.
    """
    begun, finished = [0], [0]

    def on_begin(module: nn.Module, args: Any) -> None:
        begun[0] += 1

    def on_finish(module: nn.Module, args: Any, output: Any) -> None:
        finished[0] += 1

    import hookscope as hs

    try:
        with hs.hooks(model, {"": on_begin}, kind="forward_pre"), hs.hooks(model, {"": on_finish}):
            yield
    except HookscopeError:
        raise
    except Exception as error:
        if begun[0] and not finished[0]:
            raise SpecError(
                f"the model refuses the first batch of --data {data!r}: it raised {type(error).__name__}: {error}; "
                "give --data rows the model takes (random:N:SHAPE sets the shape of one row)"
            ) from error
        raise


@dataclass(frozen=True)
class Recorded:
    """What a store holds so far: chunks recorded as done (of ``chunks``), and their rows (of ``rows``)."""

    done: int
    chunks: int
    done_rows: int
    rows: int

    def describe(self) -> str:
        """``"37 of 500 chunks (296 of 4,000 rows)"``."""
        return f"{self.done:,} of {self.chunks:,} chunks ({self.done_rows:,} of {self.rows:,} rows)"


def parse_storage_options(options: list[str]) -> dict[str, Any] | None:
    """``--storage-option KEY=VALUE`` values as a dict; a value that reads as JSON (true, 3, null) is that.

    >>> parse_storage_options(["endpoint_url=http://127.0.0.1:9000", "anon=true", "default_block_size=5242880"])
    {'endpoint_url': 'http://127.0.0.1:9000', 'anon': True, 'default_block_size': 5242880}
    >>> parse_storage_options(["secret=12345"])
    {'secret': '12345'}
    """
    found: dict[str, Any] = {}
    for option in options:
        key, equals, value = option.partition("=")
        if not equals or not key.strip():
            raise SpecError(
                f"--storage-option {_shown(option)!r} is not KEY=VALUE (a value that may be a credential is shown as "
                "***); e.g. --storage-option endpoint_url=http://127.0.0.1:9000"
            )
        found[key.strip()] = value if secret_key(key) else _value(value)  # a numeric secret stays a string
    return found or None


def _shown(option: str) -> str:
    """A malformed ``--storage-option`` as an error shows it: what may be a credential as ``***``.

    >>> _shown("secret:Sup3rSecret"), _shown("=Sup3rSecret"), _shown("Sup3rSecret"), _shown("endpoint_url")
    ('secret:***', '=***', '***', 'endpoint_url')
    """
    return scrub(option, secrets_of(argv=["--storage-option", option]))


def _value(text: str) -> Any:
    """``true``, ``null``, ``3``, ``2.5`` as JSON reads them; anything else as written."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def recorded(out: str, storage_options: dict[str, Any] | None = None) -> Recorded | None:
    """What the store at ``out`` holds now, read from its manifest; None when there is no store to read.

    Read by the command line after Ctrl-C and before a resumed run writes, so that it can say how
    much a stopped run kept without the extraction having to report it.
    """
    import hookscope as hs

    try:
        store = hs.open_store(out, partial=True, storage_options=storage_options)
        done, rows, chunk_rows = store.done_chunks(), len(store), store.chunk_rows
    except Exception:  # nothing there yet, or cut short while being made: nothing recorded
        return None
    done_rows = sum(max(0, min(chunk_rows, rows - chunk * chunk_rows)) for chunk in done)
    return Recorded(len(done), max(math.ceil(rows / chunk_rows), len(done)), done_rows, rows)


def interrupted_note(out: str, command: str, storage_options: dict[str, Any] | None = None) -> str:
    """The line after Ctrl-C: what the store kept, and the command that resumes after it (its
    credentials shown as ``***``: the line goes to terminals and logs)."""
    kept = recorded(out, storage_options)
    secrets = secrets_of(argv=[*shlex.split(command), out])
    shown = scrub(command, secrets)
    again = "the same command" + (" (its credentials shown as ***)" if shown != command else "")
    if kept is None or kept.done == 0:
        note = f"interrupted (Ctrl-C) before any chunk was recorded in {out}; run {again} again to start: {command}"
    else:
        note = (
            f"interrupted (Ctrl-C): {kept.describe()} are recorded in {out}; run {again} again to resume after them: "
            f"{command}"
        )
    return scrub(note, secrets)


def done_line(store: Any, out: str, elapsed: float, size: int | None) -> str:
    """The line after the store is complete: what this run wrote, or that it only checked a complete store.

    >>> class Done:
    ...     sites, written_rows = ["h.1"], 0
    ...     def __len__(self): return 4096
    >>> done_line(Done(), "s3://acts/f.zarr", 2.04, None)
    'verified 4,096 rows of 1 site in s3://acts/f.zarr in 2.0 s: the store was complete, nothing was written'
    """
    rows, sites, written = len(store), _counted(len(store.sites), "site"), store.written_rows
    where = scrub(out, secrets_of(argv=[out]))
    disk = f" ({size:,} bytes on disk)" if size is not None else ""
    if written == 0:
        return (
            f"verified {_counted(rows, 'row')} of {sites} in {where} in {elapsed:.1f} s: the store was complete, "
            "nothing was written"
        )
    line = f"wrote {_counted(rows, 'row')} of {sites} to {where} in {elapsed:.1f} s"
    if written is not None and written < rows:
        line += f", {written:,} of them in this run (the others were stored already)"
    return line + disk


def _counted(count: int, noun: str) -> str:
    """``1 site``, ``2 sites``: a count with its noun, plural unless one."""
    return f"{count:,} {noun}{'' if count == 1 else 's'}"

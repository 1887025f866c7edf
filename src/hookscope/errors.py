"""Errors raised by hookscope.

Every error derives from :class:`HookscopeError` and from the builtin exception it resembles, so
``except LookupError`` catches a selector that matched nothing just as ``except HookscopeError``
does::

    HookscopeError (Exception)
    ├── SelectionError (LookupError)       a selector matched no module
    │                                      (.selector, .suggestions)
    ├── SiteNotFoundError (KeyError)       a site name names nothing that was captured
    │                                      (.key, .candidates)
    ├── SpecError (ValueError)             an argument has the wrong form: an unknown hook kind,
    │                                      a hook that is not callable, an unusable selector
    ├── StdMapError (ValueError)           canonical names cannot be mapped onto the model: its
    │                                      family table no longer fits, or the structural detector
    │                                      could not place a role (.family, .check)
    ├── FileFormatError (ValueError)       a file is not what its extension or contents promise
    ├── DataError (ValueError)             data broke a promise it made before: fewer rows than
    │                                      its length, a batch unlike the first (.rows)
    ├── UnsupportedModelError (TypeError)  the object is not an eager ``torch.nn.Module``
    │                                      (a TorchScript module, a list, a function, ...)
    ├── MissingDependencyError (ImportError)  an optional package is needed and not installed
    ├── CaptureError (RuntimeError)        a capture cannot be kept correctly: over its memory
    │                                      budget, or its value was changed in place after capture
    │                                      (.site)
    ├── ConcurrentPassError (RuntimeError)  calls of another thread would mix into a recorded pass:
    │                                      a DataParallel replica, autograd's thread (.feature, .module)
    ├── NonFiniteError (FloatingPointError)  a module made a NaN/Inf from finite inputs
    │                                      (.module, .call, .what, .path, .nan, .posinf, .neginf)
    ├── SinkError (RuntimeError)           a monitor's sinks failed to take a step or to close;
    │                                      every other sink took it (.step, .failures)
    ├── EditError (ValueError)             an edit returned a value the model cannot take (wrong
    │                                      shape, dtype or device) or named a part that is not there
    ├── StoreError (OSError)               a feature store cannot be made, resumed or read as asked:
    │   │                                  ``out`` is taken or unwritable, the stored configuration
    │   │                                  differs, the store is incomplete or damaged
    │   │                                  (.array, .chunk)
    │   ├── StoreBusyError                 another process is writing the store (.holder)
    │   ├── StoreIndexError (IndexError)   rows the array does not have
    │   ├── StoreReadError                 a chunk could not be fetched (network, credentials, a
    │   │                                  timeout); the store is not known to be damaged
    │   └── StoreWriteError                writing failed part-way (disk full, ...); what landed is
    │                                      recorded, and the same call resumes after it
    └── OutputPathError (OSError)          a file cannot be written where asked: the parent is a
        │                                  file, the folder is read-only or ``/proc`` (.path, .errno)
        └── OutputWriteError               writing it failed part-way (disk full, ...); nothing
                                           was left there, an older file stays as it was

A message says what happened, what was expected, and how to fix it, in one line: the command
line prints exactly that line. It ends with a link to the error's entry on the errors page
(:func:`docs_link`), which says what the error means, its usual causes and the fix. The same
facts are attributes (in parentheses above), so a program can act on an error without reading
its message: ``error.suggestions[0]`` is the name a mistyped selector probably meant. Which
exit code the command line gives each error is the command line's business
(``hookscope.cli.app``), not the errors'.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = [
    "CaptureError",
    "CastOverflowWarning",
    "ConcurrentPassError",
    "DataError",
    "EditError",
    "FileFormatError",
    "HookscopeError",
    "MissingDependencyError",
    "NonFiniteError",
    "OutputPathError",
    "OutputWriteError",
    "PairingWarning",
    "SelectionError",
    "SinkError",
    "SiteNotFoundError",
    "SpecError",
    "StaleCompiledCodeWarning",
    "StdMapError",
    "StoreBusyError",
    "StoreError",
    "StoreIndexError",
    "StoreReadError",
    "StoreRepairWarning",
    "StoreWriteError",
    "UnsupportedModelError",
]


#: Where the documentation site lives; an error's message ends with its entry on the errors page.
DOCS_URL = "https://hookscope.readthedocs.io/en/latest"

# A docs link at the end of a message; one is dropped from a message that another error's text was
# written into, so a wrapped message ends with the wrapping error's link only.
_LINK = re.compile(r" \(docs: \S+\)")


def docs_link(error_type: type[BaseException]) -> str:
    """The errors page's entry of ``error_type`` (autodoc's anchor: the class's public name).

    >>> docs_link(SelectionError)
    'https://hookscope.readthedocs.io/en/latest/reference/errors.html#hookscope.SelectionError'
    """
    return f"{DOCS_URL}/reference/errors.html#hookscope.{error_type.__name__}"


class HookscopeError(Exception):
    """Base class of every error hookscope raises on purpose.

    Its text is the message it was raised with, followed by a link to its entry on the errors page
    (what the error means, its usual causes, the fix); ``error.args[0]`` is the message alone.

    >>> str(SpecError("unknown hook kind 'fwd'; expected 'forward'"))  # doctest: +ELLIPSIS
    "unknown hook kind 'fwd'; expected 'forward' (docs: https://.../reference/errors.html#hookscope.SpecError)"
    """

    def __str__(self) -> str:
        # One argument (the usual case) is shown bare: KeyError would quote it, OSError would
        # format (errno, strerror) pairs.
        message = str(self.args[0]) if len(self.args) == 1 else super().__str__()
        return f"{_LINK.sub('', message)} (docs: {docs_link(type(self))})"


class SelectionError(HookscopeError, LookupError):
    """A selector matched none of the model's modules.

    The message names the closest existing names, e.g. ``selector 'blocks.*.mpl' matched 0 of 143
    modules; did you mean 'blocks.*.mlp'?``.

    Attributes:
        selector: the selector that matched nothing, as given; in a list of selectors, the member
            that matched nothing (a typo inside a list is still a typo).
        suggestions: the names or corrected patterns the message offers, closest first; empty
            when none is close (the message then lists the model's names or types instead).

    >>> error = SelectionError("selector 'fcc' matched 0 of 3 modules", selector="fcc", suggestions=("fc",))
    >>> error.selector, error.suggestions
    ('fcc', ('fc',))
    """

    def __init__(self, message: str, *, selector: object = None, suggestions: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.selector = selector
        self.suggestions = tuple(suggestions)


class SpecError(HookscopeError, ValueError):
    """An argument was understood but has the wrong form (unknown kind, not callable, ...)."""


class StdMapError(HookscopeError, ValueError):
    """Canonical names (``"std:blocks.3.resid_post"``) cannot be mapped onto this model.

    Raised when the map is made, never later: a family table whose modules or residual
    identities no longer fit the model (transformers changed the architecture's code), or a
    model the structural detector cannot read (no block list, a role it cannot place).

    Attributes:
        family: the family table used, or ``"detected"``.
        check: what failed, in words (``"resid_post of block 0 is not resid_pre of block 1"``).

    >>> StdMapError("no block list", family="detected", check="no block list").check
    'no block list'
    """

    def __init__(self, message: str, *, family: str = "", check: str = "") -> None:
        super().__init__(message)
        self.family = family
        self.check = check


class UnsupportedModelError(HookscopeError, TypeError):
    """The model is not something hooks can be attached to (not an eager ``nn.Module``)."""


class SiteNotFoundError(HookscopeError, KeyError):
    """A site name (``"fc"``, ``"h.0#1:output[0]"``) names nothing that was captured.

    The message lists the closest captured names, or the leaf paths when a structured output
    has several tensors and the name did not say which one.

    Attributes:
        key: the key that was looked up, as text (a ``Site`` as its full name).
        candidates: keys that do name something, closest first: the captured names close to
            ``key`` (every captured name when none is close), or the values, calls or tensors
            to choose from; empty when there is nothing to offer.

    >>> error = SiteNotFoundError("no site 'fcc'", key="fcc", candidates=("fc",))
    >>> error.key, error.candidates
    ('fcc', ('fc',))
    """

    def __init__(self, message: str, *, key: str | None = None, candidates: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.key = key
        self.candidates = tuple(candidates)


class FileFormatError(HookscopeError, ValueError):
    """A file cannot be read or written in the format its extension names."""


class DataError(HookscopeError, ValueError):
    """Data broke a promise it made before: its length, its first batch, an earlier run's rows.

    A data set yielded fewer rows than its ``len()``, a stream ended before rows an earlier run
    stored, a batch reached other sites or gave other shapes than the first batch did. Data
    that is wrong from the start is a :class:`SpecError`; this error means the data changed its
    story part-way, which no argument can fix: the data itself (or its loader) must.

    Attributes:
        rows: the rows concerned, e.g. ``range(96, 128)`` for a batch; None when no row range
            tells more than the message.

    >>> DataError("the data yielded 90 rows; expected 100", rows=range(90, 100)).rows
    range(90, 100)
    """

    def __init__(self, message: str, *, rows: range | None = None) -> None:
        super().__init__(message)
        self.rows = rows


class MissingDependencyError(HookscopeError, ImportError):
    """An optional package is needed for this call; the message names the ``pip install``."""


class CaptureError(HookscopeError, RuntimeError):
    """A captured value cannot be kept correctly.

    Raised when keeping a value would exceed the capture's ``max_bytes`` budget (the message
    names the largest sites), or, on read, when a value kept without a copy was changed in
    place after it was captured.

    Attributes:
        site: the full name of the site concerned (``"fc#0:output"``); None when the error is
            about the capture as a whole.

    >>> CaptureError("the value captured at 'fc#0:output' was changed in place", site="fc#0:output").site
    'fc#0:output'
    """

    def __init__(self, message: str, *, site: str | None = None) -> None:
        super().__init__(message)
        self.site = site


class ConcurrentPassError(HookscopeError, RuntimeError):
    """Calls on another thread would have mixed into the forward pass a feature is recording.

    Features that record or change a forward (``capture``, ``trace``, ``edit``,
    ``detect_nonfinite``, ``watch_grads``, ``diff``, ``extract``, call-counting ``hooks``) act on
    the thread that attached them: a plain forward of the same model on any other thread passes
    through untouched (not recorded, not edited) and raises nothing. This error is left for the
    threads that belong to a pass yet cannot be kept apart in it: an ``nn.DataParallel``
    replica entering a feature that does not keep replicas per device (``hs.capture`` and
    ``hs.edit`` do; trace the bare model instead), and autograd's own thread recomputing a
    checkpointed block while a forward pass is open on another thread. The refused call fails;
    the pass goes on whole. ``feature`` names the feature recording (``"trace"``, ...) and
    ``module`` the module the refused call entered (``""`` for the model itself).
    """

    def __init__(self, message: str, *, feature: str = "", module: str = "") -> None:
        super().__init__(message)
        self.feature = feature
        self.module = module


class NonFiniteError(HookscopeError, FloatingPointError):
    """A module returned a NaN or Inf although its inputs were finite (``detect_nonfinite``).

    ``module``, ``call``, ``what`` and ``path`` name the culprit: module name, call index in the
    pass, which value (``"output"``; ``"input"`` when the NaN/Inf came in with the model's input)
    and the leaf's path in it, as a :class:`~hookscope.Site` has them (``""`` for the value
    itself, ``"[0]"`` for the first item of a tuple). ``nan``, ``posinf`` and ``neginf`` count
    the values of each kind in that leaf, so that a -inf is not reported as a NaN; they are None
    where the leaf was gone before its sum was read (an accelerator without
    ``raise_immediately=True``).

    >>> error = NonFiniteError("...", module="fc", what="output", nan=3, posinf=0, neginf=2)
    >>> error.nan, error.neginf
    (3, 2)
    """

    def __init__(
        self,
        message: str,
        *,
        module: str = "",
        call: int = 0,
        what: str = "output",
        path: str = "",
        nan: int | None = None,
        posinf: int | None = None,
        neginf: int | None = None,
        step: int | None = None,
    ) -> None:
        super().__init__(message)
        self.module = module
        self.call = call
        self.what = what
        self.path = path
        self.nan = nan
        self.posinf = posinf
        self.neginf = neginf
        self.step = step  # the training step, where a monitor saw it (hs.monitor, the callbacks)


class SinkError(HookscopeError, RuntimeError):
    """One or more of a monitor's sinks failed to write a logged step (a full disk, a tracking
    server that is down) or to close. Every sink is given every step: this is raised after the
    others took it, naming each sink that failed.

    Attributes:
        step: the step that was being written; None when closing failed.
        failures: ``(sink, description, error)`` for each failed sink, in sink order.

    >>> error = SinkError("1 of 2 sinks failed at step 3: ...", step=3)
    >>> error.step, error.failures
    (3, ())
    """

    def __init__(
        self, message: str, *, step: int | None = None, failures: tuple[tuple[Any, str, BaseException], ...] = ()
    ) -> None:
        super().__init__(message)
        self.step = step
        self.failures = failures


class EditError(HookscopeError, ValueError):
    """An edit cannot be applied as asked.

    Raised at the call where it happens, naming the site: an edit that returned a different
    shape, dtype or device than the value it replaces, a path or index that is not there.
    """


class StoreError(HookscopeError, OSError):
    """A feature store (``hs.extract``, ``hs.open_store``) cannot be made, resumed or read as asked.

    Raised before any work when ``out`` holds something else or cannot be written, when a store
    is resumed with a different configuration (the message lists each difference), on opening
    a store that was left incomplete, and when what is stored contradicts itself: a chunk whose
    checksum does not match, a chunk file recorded as written that is gone, metadata whose rows
    or shapes disagree with the arrays.

    Attributes:
        array: the array concerned (``"h.0"``, or ``"_hookscope/done"`` for the manifest); None
            when the error is about the store as a whole.
        chunk: the chunk concerned (rows ``chunk * chunk_rows`` on); None when not one chunk.

    >>> StoreError("chunk 3 of 'h.0' is damaged", array="h.0", chunk=3).chunk
    3
    """

    def __init__(self, message: str, *, array: str | None = None, chunk: int | None = None) -> None:
        super().__init__(message)
        self.array = array
        self.chunk = chunk


class StoreIndexError(StoreError, IndexError):
    """Rows asked of a store's array that it does not have (an index past its end, a mask of
    another length); also an ``IndexError``, so ``for row in store[site]`` ends as Python expects.

    >>> isinstance(StoreIndexError("row 10 of 'h.0': the array has rows 0..9", array="h.0"), IndexError)
    True
    """


class StoreBusyError(StoreError):
    """Another process holds the store: it is writing it now, or was, and its record is fresh.

    Every writer of a store leaves a record (host, pid, start, heartbeat) in it while it runs;
    a second writer is refused, naming the holder, instead of mixing its rows with the first's.
    A record whose process is gone (same host, pid no longer running) or whose heartbeat
    stopped for longer than the stale limit is taken over without a word.

    Attributes:
        holder: the record: ``{"host", "pid", "started", "heartbeat", "command"}``.

    >>> StoreBusyError("busy", holder={"host": "a", "pid": 7}).holder["pid"]
    7
    """

    def __init__(self, message: str, *, holder: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.holder = holder or {}


class StoreReadError(StoreError):
    """Reading a feature store's chunk failed on the way, not in what is stored: the network,
    the credentials, a timeout, the file system. The chunk's bytes were not found damaged, so
    running the extraction again would not help: read again once the store can be reached.
    ``.array`` and ``.chunk`` name what was being read.
    """


class StoreWriteError(StoreError):
    """Writing a feature store failed part-way, e.g. the disk is full.

    Every chunk recorded as done has landed; running the same extraction again resumes after them.
    """


class OutputPathError(HookscopeError, OSError):
    """A file cannot be written at the path given: ``cache.save``, ``trace.to_csv``, ``hs.report(out=)``.

    Raised before the work when the path can be seen to be unwritable (its parent is a file,
    the folder refuses new files), so a long run does not end in a failed save. The message
    names the path asked for, never the temporary file the write goes through.

    Attributes:
        path: the path that was asked for, as a ``Path``.
        errno: the operating system's error number (``errno.ENOSPC``, ...), or None.

    >>> import errno
    >>> error = OutputPathError("cannot write output 'x/a.npz': 'x' is a file", path="x/a.npz", errno=errno.ENOTDIR)
    >>> error.path, error.errno == errno.ENOTDIR
    ('x/a.npz', True)
    """

    def __init__(self, message: str, *, path: object = None, errno: int | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.errno = errno

    def __reduce__(self) -> tuple[object, ...]:  # errno lives in a slot, not in __dict__
        return (type(self), self.args, {**vars(self), "errno": self.errno})


class OutputWriteError(OutputPathError):
    """Writing a file failed part-way (disk full, quota, I/O error): nothing was left at the path,
    and a file that was there before stays as it was."""


class StaleCompiledCodeWarning(UserWarning):
    """Hooks were attached to a model whose ``torch.compile``'d code was made without them: the
    model runs eagerly while they are attached, so that they fire (no compiled code is dropped).
    Attach hooks before the first compiled call to have them compiled in."""


class CastOverflowWarning(UserWarning):
    """A ``dtype=`` cast (``capture(dtype=torch.float16)``, ``extract(dtype="fp16")``) turned
    finite values past the dtype's range into +-inf; the message names the sites and counts.
    Keep such values in bfloat16 or float32, or pass ``overflow="error"`` to refuse them."""


class StoreRepairWarning(UserWarning):
    """A resumed extraction found stored chunks damaged (checksum, missing file) and wrote them again."""


class PairingWarning(UserWarning):
    """``hs.diff(match="order")`` paired calls of modules of different kinds (a layer with a
    container, or layers of different classes): the two models' call orders differ there, and
    those rows compare unrelated values. Pair by name or by a mapping of name patterns instead."""


def __dir__() -> list[str]:
    """``__all__`` and the dunders, not the imports: what tab completion offers (this module imports
    nothing of the package, so it does not use ``hookscope._shared.names``)."""
    return sorted({*__all__, *(key for key in globals() if key.startswith("__") and key.endswith("__"))})

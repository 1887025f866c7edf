"""One line a user can act on for each way a model type fails in the sweep, and the class of
that line for the ledger's summary.

Exceptions from transformers' constructors and forwards are long and specific; the ledger wants
one line per model type that says what is missing (a backbone library, remote code, a pretrained
sub-model) or which input the forward wanted, so known messages are rewritten by the patterns
below and anything else keeps its type and first line.
"""

from __future__ import annotations

import re

__all__ = ["MAX_REASON", "reason_class", "reason_for", "short_reason"]

MAX_REASON = 240
_DOCS_LINK = re.compile(r"\s*\(docs: \S+\)$")

# (pattern on "Type: message", the line the ledger shows, its class in the summary)
_KNOWN: tuple[tuple[str, str, str], ...] = (
    (r"\btimm\b", "needs a timm backbone (pip install timm)", "needs a library"),
    (r"trust_remote_code", "needs trust_remote_code (its modeling code is not in transformers)", "needs remote code"),
    (
        r"requires the (\w[\w-]*) library|requires (\w[\w-]*) to be installed|No module named '(\w+)",
        "needs the {0} library installed",
        "needs a library",
    ),
    (
        r"Can't load|does not appear to have a file|offline mode|LocalEntryNotFoundError|is not a local folder",
        "config requires a pretrained sub-model or file (downloads are off)",
        "needs pretrained files",
    ),
    (r"MemoryError|can't allocate memory|not enough memory", "out of memory under the sweep's limit", "too large"),
    (
        r"^LookupError: no model class",
        "a part of a composite model: no model class takes this config alone (see its parent type)",
        "part of another model",
    ),
    (r"_forward_unimplemented", "has no forward of its own (a component used by another model)", "no forward"),
)


def reason_for(error: BaseException) -> str:
    """The ledger's one-line reason for ``error``."""
    message = str(error).strip().splitlines()[0] if str(error).strip() else ""
    message = _DOCS_LINK.sub("", message)  # hookscope's errors end in a link the ledger does not need
    text = f"{type(error).__name__}: {message}"
    for pattern, line, _ in _KNOWN:
        match = re.search(pattern, text)
        if match:
            groups = [group for group in match.groups() if group]
            return line.format(*groups) if groups else line
    return text[:MAX_REASON]


def reason_class(reason: str | None, stage: str | None) -> str:
    """The summary's class of a failure: a known class, or the stage it stopped in."""
    if reason is None:
        return "runs"
    for _, line, kind in _KNOWN:
        if reason == line or re.fullmatch(line.replace("{0}", r"\S+"), reason):
            return kind
    if reason.startswith("timed out"):
        return "too slow"
    if reason.startswith(("out of memory", "killed")):
        return "too large"
    if reason.startswith("SpecError"):
        return "input not made"
    return f"{stage} error" if stage else "error"


def short_reason(reason: str) -> str:
    """``reason`` without a trailing documentation link, for the page's table."""
    return _DOCS_LINK.sub("", reason)

"""Credentials out of what a store records and shows: its command line, its writer record, its name.

A store is read by others (a team's bucket), and it records the command that made it, and its
writer record the command that writes it. A command line may carry credentials: storage options
(``--storage-option secret=...``), a URL with a key in it (``s3://KEY:SECRET@bucket/...``), a
presigned URL's query (``?X-Amz-Security-Token=...``). They are recorded as ``***``; what the user
typed is shown back to the user alone (the note after Ctrl-C).
"""

from __future__ import annotations

import re
import shlex

__all__ = ["redacted_command", "shown_url"]

#: Storage options recorded as written: they name where, not who.
SHOWN_OPTIONS = frozenset(
    {"endpoint_url", "region_name", "anon", "requester_pays", "default_block_size", "use_ssl", "use_listings_cache"}
)
# userinfo with a secret: "KEY:SECRET@" right after "://" (a secret may hold '/', a path may hold '@')
_USERINFO = re.compile(r"(?<=://)[^/@:]*:[^@]*@")
_QUERY = re.compile(r"\?[^\s'\"]*")
_OPTION = "--storage-option"


def shown_url(url: str) -> str:
    """``url`` without credentials written into it, nor its query.

    >>> shown_url("s3://AKIA:se/cret@bucket/feats.zarr?token=x"), shown_url("s3://b/runs/step@10/f.zarr")
    ('s3://bucket/feats.zarr', 's3://b/runs/step@10/f.zarr')
    """
    return _QUERY.sub("", _USERINFO.sub("", url)).partition("#")[0]


def redacted_command(command: str) -> str:
    """``command`` as a store records it: credentials replaced by ``***``.

    >>> redacted_command("hookscope extract m -o s3://AK:se/c@b/f.zarr --storage-option secret=x "
    ...                  "--storage-option=endpoint_url=https://u:p@minio:9000 --out=s3://b/f?token=y")
    "hookscope extract m -o 's3://***@b/f.zarr' --storage-option 'secret=***' \
'--storage-option=endpoint_url=https://***@minio:9000' '--out=s3://b/f?***'"
    """
    try:
        words = shlex.split(command)
    except ValueError:  # not a shell line: redact what can be found in the text
        return _url(re.sub(rf"({_OPTION}[= ])([^=\s]+)=\S+", lambda m: _option(m.group(2) + "=x", m.group(1)), command))
    shown = []
    after = False
    for word in words:
        if after:
            word = _option(word)
        elif word.startswith(f"{_OPTION}="):
            word = _option(word.removeprefix(f"{_OPTION}="), f"{_OPTION}=")
        shown.append(_url(word))
        after = word == _OPTION
    return shlex.join(shown)


def _option(option: str, prefix: str = "") -> str:
    key, equals, value = option.partition("=")
    if not equals:
        return prefix + option
    return prefix + (f"{key}={value}" if key.strip() in SHOWN_OPTIONS else f"{key}=***")


def _url(text: str) -> str:
    if "://" not in text:
        return text
    return _QUERY.sub("?***", _USERINFO.sub("***@", text))

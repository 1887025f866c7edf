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
#: Words of an option's name that say its value is a secret (``--hf-token``, ``--api-key``).
SECRET_WORDS = frozenset({"key", "secret", "token", "password", "passwd", "credential", "credentials", "apikey"})
_OPTION = "--storage-option"
_QUERY = re.compile(r"\?[^\s'\"#]*")
_URL = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"]*")


def shown_url(url: str) -> str:
    """``url`` without credentials written into it, nor its query.

    >>> shown_url("s3://AKIA:se/cret@bucket/feats.zarr?token=x"), shown_url("s3://b/runs/step@10/f.zarr")
    ('s3://bucket/feats.zarr', 's3://b/runs/step@10/f.zarr')
    >>> shown_url("https://ghp_T@host/x"), shown_url("s3://AK:p@ss@b/f"), shown_url("http://minio:9000/r@1/f")
    ('https://host/x', 's3://b/f', 'http://minio:9000/r@1/f')
    """
    return _without_credentials(url, "")


def redacted_command(command: str) -> str:
    """``command`` as a store records it: credentials replaced by ``***``.

    >>> redacted_command("hookscope extract m -o s3://AK:se/c@b/f.zarr --storage-option secret=x "
    ...                  "--storage-option=endpoint_url=https://u:p@minio:9000 --out=s3://b/f?token=y")
    "hookscope extract m -o 's3://***@b/f.zarr' --storage-option 'secret=***' \
'--storage-option=endpoint_url=https://***@minio:9000' '--out=s3://b/f?***'"
    >>> redacted_command("python run.py --hf-token hf_x --api-key=k1 --tokens auto")
    "python run.py --hf-token '***' '--api-key=***' --tokens auto"
    """
    try:
        words = shlex.split(command)
    except ValueError:  # not a shell line: what can be found in the text
        return _URL.sub(lambda found: _without_credentials(found.group(0), "***@", "?***"), _text_options(command))
    shown = []
    secret_next = option_next = False
    for word in words:
        if secret_next:
            word = "***"
        elif option_next:
            word = _option(word)
        elif word.startswith(f"{_OPTION}="):
            word = f"{_OPTION}=" + _option(word.removeprefix(f"{_OPTION}="))
        elif word.startswith("--") and "=" in word and _secret_name(word.partition("=")[0]):
            word = word.partition("=")[0] + "=***"
        shown.append(_URL.sub(lambda found: _without_credentials(found.group(0), "***@", "?***"), word))
        option_next = word == _OPTION
        secret_next = word.startswith("--") and "=" not in word and _secret_name(word)
    return shlex.join(shown)


def _secret_name(option: str) -> bool:
    return any(part in SECRET_WORDS for part in re.split(r"[-_]+", option.lstrip("-").lower()))


def _option(option: str) -> str:
    key, equals, _ = option.partition("=")
    if not equals or key.strip() in SHOWN_OPTIONS:
        return option
    return f"{key}=***"


def _text_options(text: str) -> str:
    """``--storage-option K=V`` redacted in a text that is not a shell line."""
    return re.sub(rf"(?<={_OPTION}[= ])([^=\s]+)=(\S+)", lambda found: _option(found.group(0)), text)


def _without_credentials(url: str, userinfo: str, query: str = "") -> str:
    """``url`` with its userinfo replaced by ``userinfo`` and its query by ``query``.

    The authority ends at the first ``/`` (as ``urllib`` reads it), so ``@`` in a path stays;
    a secret holding ``/`` (``KEY:SE/CRET@bucket``) is caught by its colon not being a port's.
    """
    scheme, found, rest = url.partition("://")
    if not found:
        return url
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        authority = userinfo + authority.rpartition("@")[2]
    elif ":" in authority and not authority.rpartition(":")[2].isdigit() and "@" in path:
        tail = rest.partition("@")[2]  # KEY:SE/CRET@bucket/...: the secret ran past a '/'
        authority, slash, path = (userinfo + tail).partition("/")
    path = _QUERY.sub(query and "?***", path)
    authority = _QUERY.sub(query and "?***", authority)
    return f"{scheme}://{authority}{slash}{path}".partition("#")[0]

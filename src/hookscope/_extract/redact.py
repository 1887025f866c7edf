"""Credentials out of what a store records and shows: its command line, its writer record, its name.

A store is read by others (a team's bucket), and it records the command that made it, and its
writer record the command that writes it. A command line may carry credentials: storage options
(``--storage-option secret=...``), a URL with a key in it (``s3://KEY:SECRET@bucket/...``), a
presigned URL's query (``?X-Amz-Security-Token=...``). They are recorded as ``***``.

Messages never show them either: a store's name is its URL without credentials (:func:`shown_url`),
and the text of another library's error that a message quotes (botocore quotes a bucket, aiohttp
a URL) goes through :func:`scrub` with the secrets of the store (:func:`secrets_of`) first.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["redacted_command", "redacted_options", "scrub", "secrets_of", "shown_url", "userinfo"]

#: Storage options recorded as written: they name where, not who.
SHOWN_OPTIONS = frozenset(
    {"endpoint_url", "region_name", "anon", "requester_pays", "default_block_size", "use_ssl", "use_listings_cache"}
)
#: Words of an option's name that say its value is a secret (``--hf-token``, ``--api-key``).
SECRET_WORDS = frozenset({"key", "secret", "token", "password", "passwd", "credential", "credentials", "apikey"})
_OPTION = "--storage-option"
_QUERY = re.compile(r"\?[^\s'\"#]*")
#: Shorter values are not taken for secrets to scrub: replacing "1" in a message would hide numbers.
_SHORTEST_SECRET = 4
_URL = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"]*")


def shown_url(url: str) -> str:
    """``url`` without credentials written into it, nor its query.

    >>> shown_url("s3://AKIA:se/cret@bucket/feats.zarr?token=x"), shown_url("s3://b/runs/step@10/f.zarr")
    ('s3://bucket/feats.zarr', 's3://b/runs/step@10/f.zarr')
    >>> shown_url("https://ghp_T@host/x"), shown_url("s3://AK:p@ss@b/f"), shown_url("http://minio:9000/r@1/f")
    ('https://host/x', 's3://b/f', 'http://minio:9000/r@1/f')
    """
    return _without_credentials(url, "")


def userinfo(url: str) -> str | None:
    """The credentials written into ``url`` (``KEY:SECRET`` of ``s3://KEY:SECRET@bucket/...``), or None.

    >>> userinfo("s3://AKIA:se/cret@bucket/f.zarr"), userinfo("s3://b/runs/step@10/f.zarr"), userinfo("x")
    ('AKIA:se/cret', None, None)
    """
    _, found, rest = url.partition("://")
    if not found:
        return None
    authority, _, path = rest.partition("/")
    if "@" in authority:
        return authority.rpartition("@")[0]
    if ":" in authority and not authority.rpartition(":")[2].isdigit() and "@" in path:
        return rest.partition("@")[0]  # KEY:SE/CRET@bucket/...: the secret ran past a '/'
    return None


def secrets_of(url: str | None, options: Mapping[str, Any] | None) -> tuple[str, ...]:
    """What no message about a store at ``url`` opened with ``options`` may show: the credentials
    in the URL (whole, and each part), its query's values, and every storage option's value but
    the harmless ones (:data:`SHOWN_OPTIONS`), nested ones too; short values (under 4 characters)
    are left out.

    >>> secrets_of("s3://AK12:se/cret@b/f?token=tok1", {"secret": "hunter2", "anon": False, "endpoint_url": "http://h"})
    ('AK12:se/cret', 'AK12', 'se/cret', 'tok1', 'hunter2')
    """
    found: list[str] = []
    if url is not None:
        credentials = userinfo(url)
        if credentials:
            found += [credentials, *credentials.split(":", 1)]
        query = url.partition("?")[2].partition("#")[0]
        found += [part.partition("=")[2] for part in query.split("&")]
    found += _option_values(options or {})
    unique = dict.fromkeys(text for text in found if len(text) >= _SHORTEST_SECRET)
    return tuple(unique)


def _option_values(options: Mapping[str, Any]) -> list[str]:
    found: list[str] = []
    for key, value in options.items():
        if str(key) in SHOWN_OPTIONS:
            continue
        if isinstance(value, Mapping):
            found += _option_values(value)
        elif isinstance(value, (str, bytes)):
            found.append(value.decode(errors="replace") if isinstance(value, bytes) else value)
        elif isinstance(value, (list, tuple)):
            found += [str(item) for item in value if isinstance(item, str)]
    return found


def scrub(text: str, secrets: Iterable[str]) -> str:
    """``text`` with each of ``secrets`` replaced by ``***``, and the credentials and query of any URL
    in it removed: for the text of another library's error, which a message quotes.

    >>> scrub('Invalid bucket name "AKIA:hunter2@b": see s3://u:p@h/x?sig=1', ["hunter2"])
    'Invalid bucket name "AKIA:***@b": see s3://h/x'
    """
    for secret in sorted(secrets, key=len, reverse=True):  # a whole before its parts
        if len(secret) >= _SHORTEST_SECRET:
            text = text.replace(secret, "***")
    return _URL.sub(lambda found: _without_credentials(found.group(0), ""), text)


def redacted_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """Storage options as a repr or a record shows them: harmless ones as given, others ``***``.

    >>> redacted_options({"endpoint_url": "http://h:9000", "key": "AKIA", "client_kwargs": {"region_name": "x"}})
    {'endpoint_url': 'http://h:9000', 'key': '***', 'client_kwargs': {'region_name': 'x'}}
    """
    return {
        key: value if str(key) in SHOWN_OPTIONS else redacted_options(value) if isinstance(value, Mapping) else "***"
        for key, value in options.items()
    }


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

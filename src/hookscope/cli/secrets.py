"""Credentials given on a command line, kept out of everything the command prints.

A command may be given credentials (``--storage-option secret=...``, ``-o s3://KEY:SECRET@b/f``,
``--hf-token ...``), and what it prints goes to terminals, CI logs and bug reports. An error of
another library may quote them (botocore quotes a bucket, and with it what precedes its ``@``),
so every line the command line prints for an error or an interruption has them replaced by
``***`` (:func:`scrub`), whatever raised it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

__all__ = ["scrub", "secrets_in"]

#: Storage options whose values are shown: they name where, not who.
_SHOWN_OPTIONS = frozenset(
    {"endpoint_url", "region_name", "anon", "requester_pays", "default_block_size", "use_ssl", "use_listings_cache"}
)
#: Words of an option's name that say its value is a secret (``--hf-token``, ``--api-key``).
_SECRET_WORDS = frozenset({"key", "secret", "token", "password", "passwd", "credential", "credentials", "apikey"})
#: Shorter values are not taken for secrets: replacing "1" would hide every number of a message.
_SHORTEST = 4
_URL = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"]*")
_STORAGE_OPTION = "--storage-option"


def secrets_in(argv: Sequence[str]) -> tuple[str, ...]:
    """The values in ``argv`` that are credentials: a URL's user information (and each part) and
    query values, storage options but the harmless ones, and options named for a secret.

    >>> secrets_in(["extract", "m", "-o", "s3://AKIA:se/cret@b/f", "--storage-option", "secret=hunter2",
    ...             "--storage-option=endpoint_url=http://h:9000", "--hf-token", "hf_abcd", "--api-key=k123"])
    ('AKIA:se/cret', 'AKIA', 'se/cret', 'hunter2', 'hf_abcd', 'k123')
    """
    found: list[str] = []
    previous = ""
    for word in argv:
        for url in _URL.findall(word):
            found += _url_secrets(url)
        if previous == _STORAGE_OPTION or word.startswith(f"{_STORAGE_OPTION}="):
            key, _, value = word.removeprefix(f"{_STORAGE_OPTION}=").partition("=")
            if key.strip() not in _SHOWN_OPTIONS:
                found.append(value)
        elif previous.startswith("--") and "=" not in previous and _secret_name(previous):
            found.append(word)
        elif word.startswith("--") and "=" in word and _secret_name(word.partition("=")[0]):
            found.append(word.partition("=")[2])
        previous = word
    return tuple(dict.fromkeys(text for text in found if len(text) >= _SHORTEST))


def scrub(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every one of ``secrets`` replaced by ``***``, the longest first, and any URL's
    user information too.

    >>> scrub('Invalid bucket name "AKIA:hunter2@b" (s3://u:pw@b/f)', ["AKIA:hunter2", "hunter2"])
    'Invalid bucket name "***@b" (s3://***@b/f)'
    """
    for secret in sorted(secrets, key=len, reverse=True):
        if len(secret) >= _SHORTEST:
            text = text.replace(secret, "***")
    return _URL.sub(lambda found: _without_userinfo(found.group(0)), text)


def _secret_name(option: str) -> bool:
    return any(part in _SECRET_WORDS for part in re.split(r"[-_]+", option.lstrip("-").lower()))


def _url_secrets(url: str) -> list[str]:
    """A URL's user information (whole and each part) and its query's values."""
    rest = url.partition("://")[2]
    authority, _, path = rest.partition("/")
    found: list[str] = []
    if "@" in authority:
        found.append(authority.rpartition("@")[0])
    elif ":" in authority and not authority.rpartition(":")[2].isdigit() and "@" in path:
        found.append(rest.partition("@")[0])  # KEY:SE/CRET@bucket/...: the secret ran past a '/'
    if found:
        found += found[0].split(":", 1)
    query = url.partition("?")[2].partition("#")[0]
    return found + [part.partition("=")[2] for part in query.split("&") if part]


def _without_userinfo(url: str) -> str:
    scheme, _, rest = url.partition("://")
    authority, slash, path = rest.partition("/")
    if "@" not in authority:
        return url
    return f"{scheme}://***@{authority.rpartition('@')[2]}{slash}{path}"

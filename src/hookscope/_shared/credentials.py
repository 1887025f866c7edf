"""Credentials kept out of everything hookscope shows or records: messages, reprs, stored commands.

A store is opened with storage options (``secret=...``), a URL may carry credentials
(``s3://KEY:SECRET@bucket/...``) or a presigned query (``?X-Amz-Signature=...``), and a command
line may hold both (``--storage-option secret=...``, ``--hf-token ...``). What hookscope prints
goes to terminals, CI logs and bug reports, and a store records its command for whoever reads the
bucket. One rule decides what is a secret, everywhere:

- an option whose name has a secret's word in it (:func:`secret_key`: ``secret``, ``token``,
  ``password``, ``aws_secret_access_key``, ``X-Amz-Signature``): its value, nested ones too;
- a URL's user information (``KEY:SECRET@``), shown as ``***@``, and the values of its query's
  secret parameters, shown as ``***`` (:func:`scrub_url`).

Other values are shown as given: ``profile=local`` names a profile, not who you are, and a
message about a local path keeps its words. The text of another library's error, which a message
quotes (botocore quotes a bucket, aiohttp a URL), goes through :func:`scrub` with the secrets of
what it was given (:func:`secrets_of`): each token holding one is replaced whole by ``***``.
"""

from __future__ import annotations

import json
import re
import shlex
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["redacted_command", "redacted_options", "scrub", "scrub_url", "secret_key", "secrets_of", "userinfo"]

#: Words of an option's name that say its value is a secret.
SECRET_WORDS = frozenset(
    {
        "key",
        "secret",
        "token",
        "password",
        "passwd",
        "passphrase",
        "pwd",
        "credential",
        "credentials",
        "apikey",
        "auth",
        "authorization",
        "cookie",
        "signature",
        "sig",
    }
)
#: Whole names of secrets none of whose words says so (Azure's connection string holds its key).
SECRET_NAMES = frozenset({"connection_string", "conn_str"})
#: Secrets shorter than this are replaced only where they stand alone: "ab" in "tabs" is not a leak.
_SHORT = 4
_URL = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"]*")
_WORD = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|[0-9]+")
_TOKEN = "[A-Za-z0-9_]"
_PARAMETER = re.compile(r"(?<=[?&;#])([^=&;#?]+)=([^&;#]*)")
_STORAGE_OPTION = "--storage-option"
_OPTION_NAME = re.compile(r"[a-z]+(?:_[a-z]+)*")


def secret_key(name: str) -> bool:
    """True for an option whose value is a secret, by its name's words (``_``, ``-``, camelCase).

    >>> [secret_key(n) for n in ("secret", "aws_secret_access_key", "--hf-token", "AccountKey", "X-Amz-Signature")]
    [True, True, True, True, True]
    >>> [secret_key(n) for n in ("endpoint_url", "profile", "region_name", "--tokens", "version_aware")]
    [False, False, False, False, False]
    """
    words = [word.lower() for word in _WORD.findall(name)]
    return any(word in SECRET_WORDS for word in words) or "_".join(words) in SECRET_NAMES


def scrub_url(url: str) -> str:
    """``url`` with its user information shown as ``***@`` and its secret query values as ``***``.

    >>> scrub_url("s3://AKIA:se/cret@bucket/f.zarr"), scrub_url("s3://b/runs/step@10/f.zarr")
    ('s3://***@bucket/f.zarr', 's3://b/runs/step@10/f.zarr')
    >>> scrub_url("https://h/f?X-Amz-Date=20250101&X-Amz-Signature=abc123&token=t"), scrub_url("http://m:9000/r@1")
    ('https://h/f?X-Amz-Date=20250101&X-Amz-Signature=***&token=***', 'http://m:9000/r@1')
    """
    scheme, found, rest = url.partition("://")
    if not found:
        return url
    userinfo, after = _userinfo(rest)
    if userinfo is not None:
        rest = f"***@{after}"
    cut = min((rest.find(mark) for mark in "?#" if mark in rest), default=len(rest))  # parameters from here
    parameters = _PARAMETER.sub(lambda p: f"{p[1]}=***" if secret_key(_unquoted(p[1])) else p[0], rest[cut:])
    return f"{scheme}://{rest[:cut]}{parameters}"


def userinfo(url: str) -> str | None:
    """The user information written into ``url`` (``KEY:SECRET`` of ``s3://KEY:SECRET@bucket/...``), or None.

    >>> userinfo("s3://AKIA:se/cret@bucket/f.zarr"), userinfo("s3://b/runs/step@10/f.zarr"), userinfo("x")
    ('AKIA:se/cret', None, None)
    """
    _, found, rest = url.partition("://")
    return _userinfo(rest)[0] if found else None


def secrets_of(
    *, url: str | None = None, options: Mapping[str, Any] | None = None, argv: Sequence[str] = ()
) -> tuple[str, ...]:
    """The secrets in a store's ``url``, its storage ``options`` and a command line ``argv``: what
    :func:`scrub` replaces in a message about them. Longest first, each once.

    >>> secrets_of(url="s3://AK12:se/cret@b/f?sig=s1g9", options={"secret": "hunter2", "profile": "local"})
    ('AK12:se/cret', 'se/cret', 'hunter2', 'AK12', 's1g9')
    >>> secrets_of(argv=["-o", "s3://b/f", "--storage-option", "key=AKIA1", "--hf-token", "hf_ab", "--tokens",
    ...                  "auto", "--storage-option=client_kwargs={\\"aws_secret_access_key\\": \\"s3cr\\"}"])
    ('AKIA1', 'hf_ab', 's3cr')
    """
    found = [*_url_secrets(url or ""), *_option_secrets(options or {}, secret=False), *_argv_secrets(argv)]
    return tuple(sorted(dict.fromkeys(text for text in found if text and text != "***"), key=len, reverse=True))


def scrub(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every token holding one of ``secrets`` replaced whole by ``***`` (a short secret
    only where it stands alone), and every URL in it as :func:`scrub_url` shows it.

    >>> scrub('Invalid bucket name "AKIA:hunter2@b": see s3://u:p@h/x?sig=1 (a local path)', ["hunter2", "local1"])
    'Invalid bucket name "AKIA:***@b": see s3://***@h/x?sig=*** (a local path)'
    >>> scrub("token%3Dhunter2x and hunter and pw", ["hunter2", "pw"])
    'token%*** and hunter and ***'
    """
    for secret in sorted(secrets, key=len, reverse=True):  # a whole before its parts
        if not secret:
            continue
        edge = "" if len(secret) < _SHORT else f"{_TOKEN}*"
        before, after = (f"(?<!{_TOKEN})", f"(?!{_TOKEN})") if len(secret) < _SHORT else ("", "")
        text = re.sub(f"{before}{edge}{re.escape(secret)}{edge}{after}", "***", text)
    return _URL.sub(lambda found: scrub_url(found[0]), text)


def redacted_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """Storage options as a repr or a record shows them: a secret option's value ``***``, nested
    mappings alike, URLs as :func:`scrub_url` shows them, the others as given.

    >>> redacted_options({"endpoint_url": "http://u:pw@h:9000", "key": "AKIA", "client_kwargs": {"region_name": "x"}})
    {'endpoint_url': 'http://***@h:9000', 'key': '***', 'client_kwargs': {'region_name': 'x'}}
    """
    return {str(key): "***" if secret_key(str(key)) else _redacted_value(value) for key, value in options.items()}


def redacted_command(command: str) -> str:
    """``command`` as a store records it: its secrets (those :func:`secrets_of` finds) as ``***``.

    >>> redacted_command("hookscope extract m -o s3://AK:se/c@b/f.zarr --storage-option secret=x1 "
    ...                  "--storage-option=endpoint_url=https://u:p@minio:9000 --out=s3://b/f?token=y")
    "hookscope extract m -o 's3://***@b/f.zarr' --storage-option 'secret=***' \
'--storage-option=endpoint_url=https://***@minio:9000' '--out=s3://b/f?token=***'"
    >>> redacted_command("python run.py --hf-token hf_x --api-key=k1 --tokens auto --storage-option profile=dev")
    "python run.py --hf-token '***' '--api-key=***' --tokens auto --storage-option profile=dev"
    """
    try:
        words = shlex.split(command)
    except ValueError:  # not a shell line: what its words hold
        return scrub(command, secrets_of(argv=command.split()))
    secrets = secrets_of(argv=words)
    return shlex.join(scrub(word, secrets) for word in words)


def _redacted_value(value: Any) -> Any:
    if isinstance(value, Mapping):
        return redacted_options(value)
    if isinstance(value, str):
        return _URL.sub(lambda found: scrub_url(found[0]), value)
    if isinstance(value, (list, tuple)):
        return type(value)(_redacted_value(item) for item in value)
    return value


def _userinfo(rest: str) -> tuple[str | None, str]:
    """The user information of a URL's part after ``://`` and what follows its ``@``; ``(None, rest)``
    for none. The authority ends at the first ``/`` (as ``urllib`` reads it), so an ``@`` in a path
    stays; a secret holding ``/`` (``KEY:SE/CRET@bucket``) is caught by its colon not being a port's.
    """
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        userinfo, _, host = authority.rpartition("@")
        return userinfo, f"{host}{slash}{path}"
    if ":" in authority and not authority.rpartition(":")[2].isdigit() and "@" in path:
        userinfo, _, after = rest.partition("@")
        return userinfo, after
    return None, rest


def _unquoted(text: str) -> str:
    return urllib.parse.unquote(text)


def _url_secrets(url: str) -> list[str]:
    """A URL's user information (whole, each part, and as decoded) and its secret query values."""
    _, found, rest = url.partition("://")
    if not found:
        return []
    userinfo, _ = _userinfo(rest)
    secrets: list[str] = []
    if userinfo:
        secrets += [userinfo, *userinfo.split(":", 1)]
    cut = min((rest.find(mark) for mark in "?#" if mark in rest), default=len(rest))
    secrets += [value for key, value in _PARAMETER.findall(rest[cut:]) if secret_key(_unquoted(key))]
    return secrets + [_unquoted(text) for text in secrets if _unquoted(text) != text]


def _option_secrets(value: Any, *, secret: bool) -> list[str]:
    """The secrets in an option's value: all of it under a secret name, URLs' credentials elsewhere."""
    if isinstance(value, Mapping):
        return [
            found
            for key, item in value.items()
            for found in _option_secrets(item, secret=secret or secret_key(str(key)))
        ]
    if isinstance(value, (list, tuple, set, frozenset)):
        return [found for item in value for found in _option_secrets(item, secret=secret)]
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    if isinstance(value, str):
        return ([value] if secret else []) + [found for url in _URL.findall(value) for found in _url_secrets(url)]
    if secret and isinstance(value, (int, float)) and not isinstance(value, bool):
        return [str(value)]  # a numeric secret (a PIN) as a message would show it
    return []


def _argv_secrets(argv: Sequence[str]) -> list[str]:
    """The secrets of a command line: URLs', storage options', and the values of options named for one."""
    found: list[str] = []
    previous = ""
    for word in argv:
        found += [secret for url in _URL.findall(word) for secret in _url_secrets(url)]
        if previous == _STORAGE_OPTION or word.startswith(f"{_STORAGE_OPTION}="):
            option = word.removeprefix(f"{_STORAGE_OPTION}=")
            key, equals, value = option.partition("=")
            if equals:
                found += _option_secrets({key.strip(): _json_value(value)}, secret=False)
                found += [value] if secret_key(key) or not key.strip() else []  # as written; a value without a key
            else:  # not KEY=VALUE: what follows its name may be a credential typed after a wrong separator
                name = re.split(r"[^A-Za-z0-9_.-]", option, maxsplit=1)[0]
                found.append(option[len(name) + 1 :] if name != option else _not_a_name(option))
        elif previous.startswith("--") and "=" not in previous and secret_key(previous):
            found.append(word)
        elif word.startswith("--") and "=" in word and secret_key(word.partition("=")[0]):
            found.append(word.partition("=")[2])
        previous = word
    return found


def _not_a_name(word: str) -> str:
    """``word`` unless it reads as an option's name (``endpoint_url``: lowercase words joined by ``_``),
    which a message may show; anything else given alone may be a credential pasted without its key."""
    return "" if _OPTION_NAME.fullmatch(word) else word


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text

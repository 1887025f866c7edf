"""Flags derived from the options classes, so an option is declared once: on its field.

A command's flag for an option takes the option's name (``max_bytes`` is ``--max-bytes``), its
default and its help from the options class (:meth:`hookscope.CaptureOptions.field_docs`), so
the flag cannot drift from what the library does with it. :func:`plain` turns the reST of
docstrings into the plain text a terminal shows.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import typer

__all__ = ["option_default", "option_flag", "plain"]

_ROLE = re.compile(r":[a-z]+:`~?(?:[\w.]+\.)?([^`]+)`")  # :class:`~hookscope.X` -> X
_LITERAL = re.compile(r"``(.+?)``|`([^`]+)`")  # ``literal`` or `literal`


def plain(text: str) -> str:
    """reST as a terminal shows it: roles and literals unmarked, a string literal unquoted,
    each paragraph's lines joined (the terminal wraps them to its width).

    >>> plain('``"output"`` (default) or\\n``"both"``; see :class:`~hookscope.CastOverflowWarning`.')
    'output (default) or both; see CastOverflowWarning.'
    """
    text = _ROLE.sub(r"\1", text)
    text = _LITERAL.sub(lambda match: _unquoted(match.group(1) or match.group(2)), text)
    paragraphs = re.split(r"\n\s*\n", text.strip())
    return "\n\n".join(" ".join(paragraph.split()) for paragraph in paragraphs)


def _unquoted(literal: str) -> str:
    quoted = len(literal) >= 2 and literal[0] == literal[-1] and literal[0] in "'\""
    return literal[1:-1] if quoted else literal


def option_flag(options: type[Any], name: str, *declarations: str, **settings: Any) -> Any:
    """The ``typer.Option`` of ``options``' field ``name``: ``--name-with-dashes`` unless
    ``declarations`` name the flags, and the field's docstring as help.

    >>> import hookscope as hs
    >>> flag = option_flag(hs.CaptureOptions, "max_bytes")
    >>> flag.default, flag.help.split(";")[0]  # typer keeps the first flag as the default
    ('--max-bytes', 'A budget in bytes (1073741824, 1GiB, 512MiB)')
    """
    docs = options.field_docs()
    if name not in docs:
        raise KeyError(f"{options.__name__} has no documented option {name!r}; document its field")
    flags = declarations or (f"--{name.replace('_', '-')}",)
    return typer.Option(*flags, help=plain(docs[name]), **settings)


def option_default(options: type[Any], name: str) -> Any:
    """The default of ``options``' field ``name``, for the flag's parameter.

    >>> import hookscope as hs
    >>> option_default(hs.CaptureOptions, "keep"), option_default(hs.EditOptions, "on")
    ('output', 'output')
    """
    for field in dataclasses.fields(options):
        if field.name == name:
            return field.default
    raise KeyError(f"{options.__name__} has no option {name!r}")

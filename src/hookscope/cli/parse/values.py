"""Small values of the command line: counts, call indices, token choices, selector lists."""

from __future__ import annotations

from typing import Any, Literal

import hookscope as hs
from hookscope.cli.parse.options import split_selectors
from hookscope.errors import SpecError

__all__ = ["calls_value", "counted", "int_option", "selector_list", "tokens_choice"]


def tokens_choice(text: str) -> bool | Literal["auto"]:
    """``--tokens``: auto, yes or no (true and false too).

    >>> tokens_choice("Yes"), tokens_choice("auto")
    (True, 'auto')
    """
    choice = {"auto": "auto", "yes": True, "true": True, "no": False, "false": False}.get(text.strip().lower())
    if choice is None:
        raise SpecError(f"--tokens {text!r} is not auto, yes or no")
    return choice  # type: ignore[return-value]


def int_option(name: str, text: str) -> int:
    """An integer option given as text (so that its error names the option), e.g. ``--positions``."""
    if not text.strip().lstrip("-").isdecimal():
        raise SpecError(f"{name} {text!r} is not an integer")
    return int(text)


def counted(count: int, noun: str) -> str:
    """``1 site``, ``2 sites``: a count with its noun, plural unless one.

    >>> counted(1, "site"), counted(2048, "byte")
    ('1 site', '2,048 bytes')
    """
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def calls_value(text: str) -> Any:
    """``--calls``: a call index, call indices (``0,2``), or a word the options check (all, first, last).

    >>> calls_value("2"), calls_value("0, 2"), calls_value("first")
    (2, [0, 2], 'first')
    """
    parts = [part.strip() for part in text.split(",")]
    if len(parts) > 1 and all(part.isdigit() for part in parts):
        return [int(part) for part in parts]
    return int(text) if text.isdigit() else text


def selector_list(options: list[str]) -> list[hs.Selector]:
    """Selectors from a repeatable option whose values may also be comma-separated (a comma
    inside a regex's ``{1,2}`` or a glob's ``[0,1]`` stays in its selector)."""
    return list(split_selectors(options))

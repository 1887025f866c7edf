"""A resolved map of canonical names: what each name is on one model, and what is missing and why.

:class:`StdMap` is what :func:`~hookscope._arch.std.registry.std_map` returns and what every
feature reads when it meets a ``"std:..."`` selector. Each :class:`StdSite` names the value in
hookscope's own site grammar twice: ``read`` (what a capture or an extraction keeps: a module
boundary where one carries the value, the cheapest way to it) and ``write`` (what an edit
changes so that the rest of the forward sees it: for a residual add inside a block's code, the
add itself, an op site). ``module`` is the module whose output carries the value, for the
features that work per module (trace, gradients, diff), or None where no module's output is it.
"""

from __future__ import annotations

import difflib
import fnmatch
import html
import itertools
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

from hookscope.errors import SelectionError

__all__ = ["STD_PREFIX", "StdMap", "StdSite", "is_std_selector", "std_matches", "std_pattern"]

#: Canonical selectors start with this: ``"std:blocks.*.resid_post"``.
STD_PREFIX = "std:"

SiteKind = Literal["module", "output", "input", "stream", "op", "attn"]


def is_std_selector(selector: object) -> bool:
    """True for a ``"std:..."`` selector text."""
    return isinstance(selector, str) and selector.startswith(STD_PREFIX)


def std_pattern(selector: str) -> str:
    """The canonical name or pattern of a ``"std:..."`` selector (``"blocks.*.attn"``)."""
    return selector[len(STD_PREFIX) :] if selector.startswith(STD_PREFIX) else selector


@dataclass(frozen=True)
class StdSite:
    """One canonical name resolved on one model.

    Attributes:
        name: the canonical name, ``"blocks.3.resid_post"``.
        read: the selector a capture or an extraction uses, ``"transformer.h.3:output[0]"``.
        write: the selector an edit uses (the same, or the op site of a residual add).
        module: the module whose output is the value (trace, gradients, diff), or None.
        kind: what ``read`` names: a whole module, one output or input tensor, an op, an
            attention sub-site; ``"stream"``: the residual stream as the next module takes it
            (``resid_mid`` at the next norm's input), read before any other pre-hook of that
            module, which may change what the module takes but not the stream.
    """

    name: str
    read: str
    write: str
    module: str | None
    kind: SiteKind


def std_matches(pattern: str, name: str) -> bool:
    """A canonical pattern matches part by part: ``*`` stands for one dotted part, so
    ``blocks.*`` is the blocks and ``blocks.*.attn.*`` their attention sub-sites."""
    parts, name_parts = pattern.split("."), name.split(".")
    return len(parts) == len(name_parts) and all(
        fnmatch.fnmatchcase(part, want) for part, want in zip(name_parts, parts, strict=True)
    )


@dataclass(frozen=True)
class StdMap(Mapping[str, StdSite]):
    """Canonical names resolved on one model, checked on one forward.

    A mapping ``{canonical name: StdSite}`` in model order; :attr:`missing` holds each name the
    architecture does not define, with the reason. ``print(std)`` shows the map as a table.

    Attributes:
        family: the family table used (``"GPT-2"``), or ``"detected"`` for the structural detector.
        sites: the resolved names.
        missing: ``{canonical name: why it is not defined here}``.
        checks: the checks the forward passed, as sentences.
    """

    family: str
    sites: dict[str, StdSite]
    missing: dict[str, str] = field(default_factory=dict)
    checks: tuple[str, ...] = ()

    def __getitem__(self, name: str) -> StdSite:
        name = std_pattern(name)
        site = self.sites.get(name)
        if site is not None:
            return site
        raise self._miss(name)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and std_pattern(name) in self.sites

    def get(self, name: str, default: StdSite | None = None) -> StdSite | None:  # type: ignore[override]
        """The site of a canonical name, or ``default`` where this model does not define it."""
        return self.sites.get(std_pattern(name), default)

    def __iter__(self) -> Iterator[str]:
        return iter(self.sites)

    def __len__(self) -> int:
        return len(self.sites)

    def expand(self, selector: str) -> list[StdSite]:
        """The sites a canonical name or pattern names, in map order; one that names nothing is a
        :class:`~hookscope.errors.SelectionError` saying why (not defined here, or a typo).

        >>> site = StdSite("blocks.0.attn", "h.0.attn", "h.0.attn", "h.0.attn", "module")
        >>> std = StdMap("demo", {"blocks.0.attn": site})
        >>> [site.read for site in std.expand("std:blocks.*.attn")]
        ['h.0.attn']
        """
        pattern = std_pattern(selector)
        if not any(char in pattern for char in "*?["):
            return [self[pattern]]
        found = [site for name, site in self.sites.items() if std_matches(pattern, name)]
        if found:
            return found
        raise self._miss(pattern)

    def _miss(self, pattern: str) -> SelectionError:
        shown = STD_PREFIX + pattern
        missing = [(name, why) for name, why in self.missing.items() if std_matches(pattern, name) or name == pattern]
        if missing:
            name, why = missing[0]
            more = f" (and {len(missing) - 1} more like it)" if len(missing) > 1 else ""
            return SelectionError(
                f"canonical site {shown!r} is not defined for this {self.family} model: {name}{more}: {why}",
                selector=shown,
            )
        beyond = self._beyond_last_block(pattern)
        if beyond is not None:
            return SelectionError(f"canonical site {shown!r} {beyond}", selector=shown)
        generic = sorted({_generic(name) for name in self.sites})
        close = difflib.get_close_matches(_generic(pattern), generic, n=3, cutoff=0.6)
        hint = (
            "did you mean " + " or ".join(repr(STD_PREFIX + c) for c in close) + "?"
            if close
            else "hs.std_map(model) prints every canonical name of this model"
        )
        return SelectionError(
            f"canonical site {shown!r} names nothing on this {self.family} model ({len(self.sites)} canonical "
            f"sites, blocks numbered from 0); {hint}",
            selector=shown,
            suggestions=tuple(STD_PREFIX + c for c in close),
        )

    def _beyond_last_block(self, pattern: str) -> str | None:
        """Why a name of block ``i`` names nothing when the model has ``i`` blocks or fewer
        (``blocks.7.resid_post`` on a 2-block model), else None: the count is the fix."""
        found = _BLOCK.match(pattern)
        if found is None:
            return None
        stack, number = found.group(1), int(found.group(2))
        numbers = {int(m.group(2)) for name in self.sites if (m := _BLOCK.match(name)) and m.group(1) == stack}
        if not numbers or number in numbers:
            return None
        count = max(numbers) + 1
        owner = f"model's {stack[: -len('.blocks')]}" if stack != "blocks" else "model"
        return (
            f"names block {number}, and this {self.family} {owner} has {count} block{'s' if count != 1 else ''} "
            f"({stack}.0 to {stack}.{count - 1}; blocks are numbered from 0): pick a number below {count}"
        )

    def __repr__(self) -> str:
        return self.table()

    def table(self) -> str:
        """The map as text: one row per canonical name, each block's names once with ``{i}`` for
        the block number (a block that differs is shown in full), then the names not defined
        here, one row per reason."""
        title, rows, missing = self._layout()
        width = max((len(name) for name, _, _ in rows), default=4)
        lines = [title, *(f"  {name:<{width}}  {_described(read, write)}" for name, read, write in rows)]
        if missing:
            lines.append("not defined here:")
            lines.extend(f"  {names}: {why}" for names, why in missing)
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        """The map as Jupyter shows it: the rows of :meth:`table` in columns (name, read, edits),
        every name escaped, the names not defined here below."""
        title, rows, missing = self._layout()

        def cell(text: str) -> str:
            return f'<td style="text-align:left">{html.escape(text)}</td>'

        head = "".join(f'<th style="text-align:left">{h}</th>' for h in ("canonical name", "read", "edits"))
        body = "".join(
            f"<tr>{cell(name)}{cell(read)}{cell('' if write == read else write)}</tr>" for name, read, write in rows
        )
        parts = [f"<p><b>{html.escape(title)}</b></p>"]
        if rows:
            parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        parts.extend(f"<p>not defined here: {html.escape(names)}: {html.escape(why)}</p>" for names, why in missing)
        return "".join(parts)

    def _layout(self) -> tuple[str, list[tuple[str, str, str]], list[tuple[str, str]]]:
        """The title, the rows ``(name, read, write)`` with each block's names once, and the
        names not defined here grouped by reason ``(names, why)``: what text and HTML show."""
        rows: list[tuple[str, str, str]] = []
        shown_generic: set[tuple[str, str, str]] = set()
        for site in self.sites.values():
            generic = _numbered(site)
            if generic is None:
                rows.append((site.name, site.read, site.write))
                continue
            if generic in shown_generic:
                continue
            shown_generic.add(generic)
            rows.append(generic)
        blocks = {found.group(1, 2) for n in self.sites if (found := _BLOCK.match(n)) is not None}
        count = f"{len(blocks)} blocks, " if blocks else ""
        title = f"canonical sites of a {self.family} model ({count}{len(self.sites)} names; select them as 'std:NAME')"
        reasons: dict[str, list[str]] = {}
        for name, why in self.missing.items():
            reasons.setdefault(why, []).append(_generic(name))
        missing = [(_short_list(list(dict.fromkeys(names))), why) for why, names in reasons.items()]
        return title, rows, missing


def _described(read: str, write: str) -> str:
    return read if write == read else f"{read}   (edits: {write})"


_BLOCK = re.compile(r"^((?:[a-z]+\.)?blocks)\.(\d+)(\..+)?$")


def _numbered(site: StdSite) -> tuple[str, str, str] | None:
    """``(blocks.{i}.attn, h.{i}.attn:output[0], ...)`` for a block's site, where the block's
    number appears once in its module path; None for a site outside the blocks."""
    found = _BLOCK.match(site.name)
    if found is None:
        return None
    number = found.group(2)
    pattern = re.compile(rf"(?<=\.){number}(?=[.:#]|$)")
    read, write = pattern.subn("{i}", site.read, count=1), pattern.subn("{i}", site.write, count=1)
    if read[1] != 1 or write[1] != 1:
        return None
    name = f"{found.group(1)}.{{i}}{found.group(3) or ''}"
    expert = _EXPERT.search(name)
    if expert is not None and read[0].endswith(f"#{expert.group(1)}") and write[0] == read[0]:
        # one row for every expert of a block: blocks.{i}.mlp.experts.{e}.post, ...:expert.post#{e}
        number = expert.group(1)
        name = f"{name[: expert.start(1)]}{{e}}{name[expert.end(1) :]}"
        read = (f"{read[0][: -len(number)]}{{e}}", 1)
        return name, read[0], read[0]
    return name, read[0], write[0]


_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def _short_list(names: list[str]) -> str:
    """Neighbours sharing a stem written once: ``blocks.*.cross_attn.{q,k,v}``."""
    parts = []
    for stem, group in itertools.groupby(names, key=lambda name: name.rpartition(".")[0]):
        lasts = [name.rpartition(".")[2] for name in group]
        parts.append(
            f"{stem}.{{{','.join(lasts)}}}"
            if stem and len(lasts) > 1
            else ", ".join(f"{stem}.{last}" if stem else last for last in lasts)
        )
    return ", ".join(parts)


def _generic(name: str) -> str:
    """``blocks.3.attn`` -> ``blocks.*.attn``: the name with its block number as a pattern."""
    return ".".join("*" if part.isdigit() else part for part in name.split("."))

"""One reading of a site's name, for everything that looks a value up after a run.

A capture's :class:`~hookscope.Cache`, a gradient monitor's history, a diff and a trace hold
values by :class:`~hookscope._core.sites.Site`. A person names them the short way, and every
one of them reads the name here, so that one spelling works everywhere:

=======================  ================================================================
``"fc"``                 the module's value (its output, unless only its input was kept)
                         in its last call (or first: the holder says), when that is one tensor
``"fc#0"``               call 0 of ``fc``
``"fc:input"``           which value; ``"fc#1:output[0]"``, ``"fc:output.logits"``: a leaf
``"(root)"``, ``":output"``  the model itself (its name is ``""``)
``"fc\\#1"``             a module whose name holds ``#`` or ``:``, escaped; unescaped
                         when the grammar reads it no other way
``"h.0:op[softmax#0]"``  an op's output inside the module (``[1]``: a leaf; ``:input[0]``: an
                         input); ``"h.0:op[softmax]"`` when one index of that op is held
``"h.0:attn.pattern"``   an attention sub-site of the module's first ``scaled_dot_product_attention``
                         call (``"h.0:attn.z#1"``: of its second)
``"std:blocks.1.attn"``  a canonical name: the site it was held under, or, for a holder that
                         knows its model's canonical map, the site the map names (a value
                         captured as ``"h.1"`` answers ``"std:blocks.1.resid_post"`` too)
a :class:`Site`          itself
=======================  ================================================================

A name that names nothing raises :class:`~hookscope.errors.SiteNotFoundError` with the closest
names held, in its message and as ``candidates``.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Literal

from hookscope._core.names import MODULE_TEXT, ROOT_LABEL, escape_name, split_leaf, split_leaf_selector, unescape_name
from hookscope._core.op_sites import op_text, split_op_leaf
from hookscope._core.sites import Site
from hookscope._core.std_names import STD_PREFIX, StdMap
from hookscope.errors import SelectionError, SiteNotFoundError, SpecError

__all__ = ["SiteIndex"]

_KEY = re.compile(rf"^(?P<module>{MODULE_TEXT})(?:#(?P<call>\d+))?(?::(?P<leaf>.*))?$", re.DOTALL)
_Index = dict[tuple[str, str, str], dict[int, dict[str, Site]]]  # (module, what, op) -> call -> path -> site


class SiteIndex:
    """The sites held by one result, and :meth:`resolve`, which reads any spelling of one.

    Args:
        sites: the sites held, in any order.
        aliases: names that stand for a held module's name (``"module.fc"`` below a wrapper
            for ``"fc"``); read at each lookup, so the holder may fill it later.
        notes: per module, why it holds nothing (``"ran, but its output held no tensor"``).
        verb: what happened to the values, for messages: ``captured``, ``recorded``.
        empty_hint: the message's hint when nothing is held at all.
        default_call: the call a name without ``#call`` means: the ``last`` (a cache) or the
            ``first`` (a trace, a diff).
        std: ``{canonical name: site text}`` of the values held by canonical name.
        canonical: the canonical map of the model the values came from, asked (only) for a
            ``"std:"`` name that ``std`` lacks: one value answers to every name it has. It
            raises ``SiteNotFoundError`` saying why there is no map.
        first_inputs: the modules whose input was read before their other pre-hooks. A
            ``"stream"`` name (``resid_mid``, read at the next norm's input before anything
            attached there can change it) answers through ``canonical`` only with such a value:
            one read by module name came after those hooks, so it is what the norm took.

    >>> index = SiteIndex([Site("fc", 0), Site("fc", 1), Site("h", 0, "output", "[0]")])
    >>> index.resolve("fc"), index.resolve("fc#0:output"), index.resolve("h")
    (Site(module='fc', call=1, what='output', path=''), Site(module='fc', call=0, what='output', path=''), \
Site(module='h', call=0, what='output', path='[0]'))
    >>> index.resolve("fcc")
    Traceback (most recent call last):
    ...
    hookscope.errors.SiteNotFoundError: nothing was captured for 'fcc'; did you mean 'fc'?
    """

    def __init__(
        self,
        sites: Iterable[Site],
        *,
        aliases: Mapping[str, str] | None = None,
        notes: Mapping[str, str] | None = None,
        verb: str = "captured",
        empty_hint: str = "nothing is held",
        default_call: Literal["first", "last"] = "last",
        std: Mapping[str, str] | None = None,
        canonical: Callable[[], StdMap] | None = None,
        first_inputs: Iterable[str] = (),
    ) -> None:
        ordered = list(dict.fromkeys(sites))  # leaves are offered in the order they were held
        self._sites = set(ordered)
        self._aliases: Mapping[str, str] = aliases if aliases is not None else {}
        self._std: Mapping[str, str] = std if std is not None else {}  # canonical name -> site text
        self._canonical = canonical
        self._first_inputs = frozenset(first_inputs)
        self._notes: Mapping[str, str] = notes if notes is not None else {}
        self._verb = verb
        self._empty_hint = empty_hint
        self._pick = max if default_call == "last" else min
        self._index: _Index = {}
        for site in ordered:
            self._index.setdefault((site.module, site.what, site.op), {}).setdefault(site.call, {})[site.path] = site
        self._modules = sorted({site.module for site in self._sites})

    def resolve(self, key: str | Site, *, whole: bool = False) -> Site:
        """The held :class:`Site` that ``key`` names; raises ``SiteNotFoundError`` if none.

        ``whole=True`` is for holders of whole calls (a trace's rows): a key that names a call
        but no leaf gives the call's first held site even when the call holds several tensors.
        """
        if isinstance(key, Site):
            if key.module in self._aliases:  # "module.fc" below a wrapper is kept as "fc"
                key = dataclasses.replace(key, module=self._aliases[key.module])
            if key not in self._sites:
                hint, close = self.module_hint(key.module)
                raise SiteNotFoundError(
                    f"site {str(key)!r} was not {self._verb}; {hint}", key=str(key), candidates=close
                )
            return key
        if not isinstance(key, str):
            raise SpecError(f"a site key is a site name such as 'fc' or 'fc#0:output', not {type(key).__name__}")
        if key.startswith(STD_PREFIX):
            text = self._std_site(key)
            try:
                return self.resolve(text, whole=whole)
            except SiteNotFoundError as error:
                raise SiteNotFoundError(
                    f"canonical site {key!r} is {text!r} on this model: {error}", key=key, candidates=error.candidates
                ) from None
        literal = self._literal_name(key)
        if literal is not None:  # a module whose name holds '#' or ':', named as it is
            return self._literal_module(key, literal, whole=whole)
        match = _KEY.match(key)
        if match is None:
            raise SiteNotFoundError(f"{key!r} is not a site name such as 'fc', 'fc#1' or 'h.0:output[0]'", key=key)
        try:
            op_leaf = split_op_leaf(match["leaf"] or "", shown=repr(key))
            if op_leaf is None:
                what, path = split_leaf(match["leaf"] or "", shown=repr(key))
        except SpecError as error:
            raise SiteNotFoundError(str(error), key=key) from None
        module = self._module(match["module"] or "")
        if op_leaf is not None:
            return self._resolve_op(key, module, match["call"], *op_leaf, whole=whole)
        return self._resolve_parts(key, module, match["call"], what, path, whole=whole)

    def _std_site(self, key: str) -> str:
        """The site text a canonical key (``"std:blocks.3.resid_post"``) was held under, or
        names on the model's canonical map."""
        text = self._std.get(key[len(STD_PREFIX) :])
        if text is not None:
            return text
        if self._canonical is not None:
            try:
                std = self._canonical()
            except SiteNotFoundError as error:
                raise SiteNotFoundError(
                    f"canonical site {key!r} was not {self._verb} by that name; {error}", key=key
                ) from None
            try:
                site = std[key]
            except SelectionError as error:
                raise SiteNotFoundError(str(error), key=key, candidates=tuple(error.suggestions)) from None
            split = split_leaf_selector(site.read) if site.kind == "stream" else None
            if split is not None and split[0] not in self._first_inputs:
                raise SiteNotFoundError(
                    f"canonical site {key!r} is the residual stream, read at {site.read!r} before that module's other "
                    f"pre-hooks (one there, such as an input edit, changes what the module takes, not the stream); "
                    f"the value held for {site.read!r} was {self._verb} by module name, after them, so it is not "
                    f"{key!r}: capture {key!r} itself to read it",
                    key=key,
                )
            return site.read
        names = list(self._std)
        close = difflib.get_close_matches(key[len(STD_PREFIX) :], names, n=3, cutoff=0.6)
        if not names:
            hint = "nothing was selected by a canonical name: select 'std:...' names when capturing"
        else:
            hint = "canonical names held: " + ", ".join(STD_PREFIX + n for n in (close or names[:8]))
        raise SiteNotFoundError(
            f"canonical site {key!r} was not {self._verb}; {hint}",
            key=key,
            candidates=tuple(STD_PREFIX + n for n in close),
        )

    def every_call(self, key: str | Site) -> list[Site]:
        """The site ``key`` names in every call of its module, in call order (a call index in
        ``key`` is ignored: ``"h#1"`` and ``"h"`` both give every call of ``h``).

        >>> SiteIndex([Site("h", 1), Site("h", 0)]).every_call("h#1")
        [Site(module='h', call=0, what='output', path=''), Site(module='h', call=1, what='output', path='')]
        """
        if isinstance(key, str) and self._literal_name(key) is None:
            match = _KEY.match(key)
            if match is not None and match["call"] is not None:  # the call index, not a '#' in a name
                key = match["module"] + (f":{match['leaf']}" if match["leaf"] is not None else "")
        site = self.resolve(key)
        by_call = self._index[(site.module, site.what, site.op)]
        return [by_call[call][site.path] for call in sorted(by_call) if site.path in by_call[call]]

    def module_hint(self, module: str) -> tuple[str, tuple[str, ...]]:
        """The hint for a module that holds nothing here, and the held names it offers instead."""
        if not self._modules:
            return self._empty_hint, ()
        close = difflib.get_close_matches(module, self._modules, n=3, cutoff=0.5)
        if close:
            return f"did you mean {' or '.join(repr(m) for m in close)}?", tuple(close)
        shown = ", ".join(repr(m) for m in self._modules[:10]) + (", ..." if len(self._modules) > 10 else "")
        return f"{self._verb} modules: {shown}", tuple(self._modules)

    def _module(self, spelled: str) -> str:
        """The held module a name's module part (escaped, maybe an alias or ``(root)``) names."""
        name = unescape_name(spelled)
        if name == ROOT_LABEL and not any(module == ROOT_LABEL for module, _, _ in self._index):
            return ""
        return str(self._aliases.get(name, name))

    def _literal_name(self, key: str) -> str | None:
        """The held module that ``key`` names letter for letter (through an alias) when that
        name holds ``#`` or ``:``, which the site grammar would read otherwise (``fc#1``: call 1
        of ``fc``); else None."""
        if "#" not in key and ":" not in key:
            return None
        literal = str(self._aliases.get(key, key))
        return literal if any(module == literal for module, _, _ in self._index) else None

    def _literal_module(self, key: str, literal: str, *, whole: bool = False) -> Site:
        """``key`` names module ``literal``; refused when the grammar reads it as another site too."""
        match = _KEY.match(key)
        if match is not None:
            module = self._module(match["module"] or "")
            try:
                other = self._resolve_parts(key, module, match["call"], *split_leaf(match["leaf"] or ""), whole=whole)
            except (SiteNotFoundError, SpecError):
                other = None
            if other is not None:
                raise SiteNotFoundError(
                    f"{key!r} names two things: the module {literal!r} and {str(other)!r}; write "
                    f"{escape_name(literal)!r} for the module (a '#' or ':' in a name is escaped with a backslash), "
                    f"{str(other)!r} for the other",
                    key=key,
                    candidates=(escape_name(literal), str(other)),
                )
        return self._resolve_parts(key, literal, None, None, None, whole=whole)

    def _resolve_parts(
        self, key: str, module: str, call: str | None, what: str | None, path: str | None, *, whole: bool = False
    ) -> Site:
        kept = sorted({w for (m, w, op) in self._index if m == module and not op})
        if not kept:
            ops = self._ops_of(module)
            if ops:
                shown = ", ".join(repr(f"{escape_name(module)}:{op_text(op)}") for op in ops[:8])
                raise SiteNotFoundError(
                    f"{key!r}: only op sites of {module!r} were {self._verb}, not its own values; name one: {shown}",
                    key=key,
                    candidates=tuple(f"{escape_name(module)}:{op_text(op)}" for op in ops),
                )
            if module in self._notes:
                raise SiteNotFoundError(f"nothing was {self._verb} for {module!r}: {self._notes[module]}", key=key)
            hint, close = self.module_hint(module)
            raise SiteNotFoundError(f"nothing was {self._verb} for {module!r}; {hint}", key=key, candidates=close)
        chosen_what = what or ("output" if "output" in kept else kept[0])
        if chosen_what not in kept:
            raise SiteNotFoundError(
                f"{key!r}: {chosen_what!r} of {module!r} was not kept; kept: {', '.join(kept)}",
                key=key,
                candidates=tuple(f"{escape_name(module)}:{w}" for w in kept),
            )
        return self._leaf(key, module, self._index[(module, chosen_what, "")], call, chosen_what, path, whole=whole)

    def _ops_of(self, module: str) -> list[str]:
        """The ops (``softmax#0``) of ``module`` whose values are held, in the order held."""
        return list(dict.fromkeys(op for (m, _, op) in self._index if m == module and op))

    def _resolve_op(
        self, key: str, module: str, call: str | None, op: str, index: int | None, what: str, path: str, *, whole: bool
    ) -> Site:
        """A key naming an op's value: ``h.0.attn#1:op[softmax#0][1]``; without the index when
        one index of that op is held."""
        ops = self._ops_of(module)
        if not ops:
            if not any(m == module for m, _, _ in self._index):
                return self._resolve_parts(key, module, call, what, path, whole=whole)  # names the usual miss
            raise SiteNotFoundError(
                f"{key!r}: no op site of {module!r} was {self._verb}, only its own values; capture one with a "
                f"selector such as '{escape_name(module)}:op[{op}]' (hs.layers(model, x, ops=True) lists them)",
                key=key,
            )
        label = f"{op}#{index}" if index is not None else None
        if label is None:
            same = [held for held in ops if held.rsplit("#", 1)[0] == op]
            if len(same) == 1:
                label = same[0]
            elif same:
                raise SiteNotFoundError(
                    f"{key!r} names {len(same)} op calls of {module!r}; name one with its index: "
                    + ", ".join(repr(f"{escape_name(module)}:{op_text(held)}") for held in same[:8]),
                    key=key,
                    candidates=tuple(f"{escape_name(module)}:{op_text(held)}" for held in same),
                )
        if label is None or label not in ops:
            close = difflib.get_close_matches(label or op, ops, n=3, cutoff=0.4) or ops[:8]
            shown = " or ".join(repr(f"{escape_name(module)}:{op_text(held)}") for held in close)
            raise SiteNotFoundError(
                f"{key!r}: op {label or op!r} of {module!r} was not {self._verb}; did you mean {shown}?",
                key=key,
                candidates=tuple(f"{escape_name(module)}:{op_text(held)}" for held in close),
            )
        by_call = self._index.get((module, what, label))
        if by_call is None:
            kept = sorted(w for (m, w, held) in self._index if m == module and held == label)
            raise SiteNotFoundError(
                f"{key!r}: the {what} of op {label!r} of {module!r} was not kept; kept: {', '.join(kept)} "
                "(capture with keep='both' to keep an op's inputs too)",
                key=key,
            )
        value = op_text(label) + (":input" if what == "input" else "")
        return self._leaf(key, module, by_call, call, value, path, whole=whole)

    def _leaf(
        self,
        key: str,
        module: str,
        by_call: dict[int, dict[str, Site]],
        call: str | None,
        chosen_what: str,
        path: str | None,
        *,
        whole: bool,
    ) -> Site:
        """The site of one call and leaf among those of one value (``chosen_what``, as written:
        ``output``, ``op[softmax#0]``)."""
        chosen_call = int(call) if call is not None else self._pick(by_call)
        if chosen_call not in by_call:
            raise SiteNotFoundError(
                f"{key!r}: call {chosen_call} was not {self._verb}; calls kept: {sorted(by_call)}",
                key=key,
                candidates=tuple(f"{escape_name(module)}#{c}:{chosen_what}" for c in sorted(by_call)),
            )
        leaves = by_call[chosen_call]
        if path:
            if path not in leaves:
                hint, names = _leaf_hint(leaves)
                raise SiteNotFoundError(f"{key!r} names no tensor; {hint}", key=key, candidates=names)
            return leaves[path]
        if "" in leaves:
            return leaves[""]
        if len(leaves) == 1 or whole:
            return next(iter(leaves.values()))
        hint, names = _leaf_hint(leaves)
        raise SiteNotFoundError(f"{key!r} holds {len(leaves)} tensors; {hint}", key=key, candidates=names)


def _leaf_hint(leaves: Mapping[str, Site]) -> tuple[str, tuple[str, ...]]:
    """The hint for a value of several tensors, and their full site names."""
    names = [f"'{escape_name(site.module)}:{site.label}'" for site in leaves.values()]
    hint = f"name one of: {', '.join(names[:8])}" + (", ..." if len(names) > 8 else "")
    return hint, tuple(str(site) for site in leaves.values())

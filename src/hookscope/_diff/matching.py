"""Which module of model b stands for which module of model a.

By name (the default), by a mapping of name patterns, by a function of a's names, by
execution order (``"order"``, resolved while b runs: its k-th module call is a's k-th), or by
canonical name (``"std"``: the modules that carry ``blocks.3.attn`` in each architecture).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

from hookscope.errors import SpecError

__all__ = ["Match", "name_pairs", "translate"]

Match = Literal["name", "order", "std"] | Mapping[str, str] | Callable[[str], str | None]


def translate(patterns: Mapping[str, str]) -> Callable[[str], str]:
    """A function from a's names to b's for ``{"model.layers.*": "transformer.h.*"}``.

    Each ``*`` matches any text, dots included, and lands in the same place on the other side,
    so a pattern renames a whole subtree; the first pattern that matches wins, and a name that
    matches none keeps its name. Patterns never match the root (``""``), which pairs with b's
    root unless the mapping names it.

    >>> rename = translate({"model.layers.*": "transformer.h.*", "model.norm": "transformer.ln_f"})
    >>> rename("model.layers.3.mlp"), rename("model.norm"), rename("lm_head")
    ('transformer.h.3.mlp', 'transformer.ln_f', 'lm_head')
    """
    compiled = []
    for source, target in patterns.items():
        if not isinstance(source, str) or not isinstance(target, str):
            raise SpecError(f"map entry {source!r}: {target!r}: both sides must be name patterns (strings)")
        if source.count("*") != target.count("*"):
            raise SpecError(
                f"map entry {source!r} -> {target!r} has {source.count('*')} '*' on the left and "
                f"{target.count('*')} on the right; each '*' must land somewhere"
            )
        regex = re.compile("^" + "(.*)".join(re.escape(part) for part in source.split("*")) + "$")
        compiled.append((regex, target.split("*")))

    def rename(name: str) -> str:
        if name == "" and "" not in patterns:
            return ""  # patterns never match the root, as with selectors: the models' roots pair up
        for regex, pieces in compiled:
            found = regex.match(name)
            if found:
                groups = found.groups()
                return pieces[0] + "".join(group + piece for group, piece in zip(groups, pieces[1:], strict=True))
        return name

    return rename


def name_pairs(names_a: Sequence[str], names_b: Sequence[str], match: Match) -> dict[str, str]:
    """``{name in b: name in a}`` for ``match`` by name, mapping or function (not ``"order"``)."""
    if match == "name":
        rename: Callable[[str], str | None] = lambda name: name  # noqa: E731
    elif isinstance(match, Mapping):
        rename = translate(match)
    elif callable(match):
        rename = match
    else:
        raise SpecError(
            f"match={match!r}; expected 'name', 'order', a mapping of name patterns "
            "({'model.layers.*': 'transformer.h.*'}) or a function from a's names to b's"
        )
    known_b = set(names_b)
    pairs: dict[str, str] = {}
    for name in names_a:
        target = rename(name)
        if target is not None and target in known_b and target not in pairs:
            pairs[target] = name
    return pairs

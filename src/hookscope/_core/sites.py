"""Sites: the address of one value seen by a hook, written and read in one grammar.

A module can run several times in one forward pass; each call is its own site, numbered 0, 1,
2, ... in the order the calls start (the numbering is the call tracker's,
:mod:`~hookscope._core.tracker`).

A :class:`Site` is written ``name#call:what`` followed by the tree path of the leaf, e.g.
``transformer.h.0.attn#0:output[0]``; a ``#`` or ``:`` in a module's name is written ``\\#``,
``\\:`` there (:func:`~hookscope._core.names.escape_name`), so every site's text reads back as
it. ``what`` is one of ``input``, ``output``, ``grad_input`` and ``grad_output``; the path is
relative to that value (``""``, ``"[0]"``, ``"['mask']"``), and
``what`` and path are joined and split by :mod:`~hookscope._core.names`' leaf functions.

A value of an op called inside the module (:mod:`~hookscope._core.op_sites`) is a site too,
with ``op`` naming the op within the module call (``"softmax#0"``): its output is written
``h.0.attn#0:op[softmax#0]`` (a leaf: ``:op[split#0][1]``), its inputs
``h.0.attn#0:op[add#0]:input[1]``. An attention sub-site is one too, with ``op`` naming the
sub-site and the module call's kernel call (``"attn.pattern#0"``), written without ``#0``:
``h.0.attn#0:attn.pattern``, ``h.0.attn#0:attn.z#1``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from hookscope._core.names import MODULE_TEXT, escape_name, leaf_label, split_leaf, unescape_name
from hookscope._core.op_sites import op_leaf_label, split_op_leaf
from hookscope.errors import SpecError

__all__ = [
    "Calls",
    "Keep",
    "Site",
    "SiteKind",
    "call_filter",
    "canonical_calls",
    "keep_word",
    "parse_keep",
    "short_names",
]

SiteKind = Literal["input", "output", "grad_input", "grad_output"]  # names.LEAF_KINDS, for the type checker
#: Which calls of a module a feature acts on: every one, the first, the last (where the
#: feature can know it: capture, extract), one index, or a list of indices.
Calls = Literal["all", "first", "last"] | int | Sequence[int]
#: What a capture keeps of a call: what it returns, what it takes, or both.
Keep = Literal["output", "input", "both"] | tuple[str, ...] | list[str]
_KEEP_CHOICES = {"output": ("output",), "input": ("input",), "both": ("input", "output")}
_KEEP_WORDS = {sides: word for word, sides in _KEEP_CHOICES.items()}
_SITE_KINDS: tuple[str, ...] = get_args(SiteKind)
_SITE_TEXT = re.compile(rf"^(?P<module>{MODULE_TEXT})(?:#(?P<call>\d+))?:(?P<leaf>.*)$", re.DOTALL)


@dataclass(frozen=True, order=True)
class Site:
    """Where a value was seen: module name, call index within the pass, which value, leaf path.

    >>> site = Site("layer1.conv2", 1, "output", "[0]")
    >>> str(site)
    'layer1.conv2#1:output[0]'
    >>> Site.parse(str(site)) == site
    True
    >>> op = Site("h.0.attn", 0, "output", "[1]", op="split#0")
    >>> str(op), Site.parse(str(op)) == op
    ('h.0.attn#0:op[split#0][1]', True)
    """

    module: str
    call: int = 0
    what: SiteKind = "output"
    path: str = ""
    #: The op within the module call whose value this is (``"softmax#0"``), or ``""`` for the
    #: module's own input or output.
    op: str = ""

    def __post_init__(self) -> None:
        if self.what not in _SITE_KINDS:
            raise SpecError(f"site kind {self.what!r} is unknown; expected one of {', '.join(_SITE_KINDS)}")
        if self.call < 0:
            raise SpecError(f"call index {self.call} is negative; calls are numbered from 0 in each pass")
        if self.op:
            op_leaf_label(self.op, self.what, self.path)  # checks the op's label and that what is a forward value

    def __str__(self) -> str:
        return f"{escape_name(self.module)}#{self.call}:{self.label}"

    def __repr__(self) -> str:
        op = f", op={self.op!r}" if self.op else ""  # a module's own value reads as it always did
        return f"Site(module={self.module!r}, call={self.call!r}, what={self.what!r}, path={self.path!r}{op})"

    @property
    def label(self) -> str:
        """The leaf as shown: ``what`` and path joined (``output[0]``, ``input['mask']``); for an
        op's value, the op first (``op[softmax#0]``, ``op[add#0]:input[1]``)."""
        if self.op:
            return op_leaf_label(self.op, self.what, self.path)
        return leaf_label(self.what, self.path)

    @classmethod
    def parse(cls, text: str) -> Site:
        """Read a site written as ``name[#call]:what[path]``; the call defaults to 0."""
        form = f"site {text!r} is not of the form 'name#call:what[path]', e.g. 'layer1.conv2#0:output[0]'"
        match = _SITE_TEXT.match(text)
        if match is None:
            raise SpecError(form)
        op_leaf = split_op_leaf(match["leaf"], shown=f"site {text!r}")
        if op_leaf is not None:
            op, index, side, inner = op_leaf
            if index is None:
                example = f"{op}#0" if op.startswith(("expert.", "ssm.")) else f"op[{op}#0]"
                raise SpecError(f"site {text!r} names no op index; a site names one, e.g. ':{example}'")
            module = unescape_name(match["module"])
            return cls(module, int(match["call"] or 0), side, inner, op=f"{op}#{index}")  # type: ignore[arg-type]
        what, path = split_leaf(match["leaf"], shown=f"site {text!r}")
        if what is None:
            raise SpecError(form)
        return cls(unescape_name(match["module"]), int(match["call"] or 0), what, path)  # type: ignore[arg-type]


def short_names(sites: Sequence[Site]) -> dict[Site, str]:
    """The shortest name that says each site: the module's name where the site is the only one
    of its module (``"fc"``), else the full site text (``"h.0#1:output"``); an op's value
    always by its full text (``"h#0:op[softmax#0]"``). Cache keys, saved files and store arrays
    all use it.

    >>> list(short_names([Site("fc"), Site("h", 0), Site("h", 1), Site("fc", op="relu#0")]).values())
    ['fc', 'h#0:output', 'h#1:output', 'fc#0:op[relu#0]']
    """
    per_module: dict[str, int] = {}
    for site in sites:
        if not site.op:
            per_module[site.module] = per_module.get(site.module, 0) + 1
    return {
        site: escape_name(site.module) if not site.op and per_module[site.module] == 1 and site.module else str(site)
        for site in sites
    }


def parse_keep(keep: object) -> tuple[str, ...]:
    """The sides ``keep=`` asks for, inputs before outputs.

    >>> parse_keep("both"), parse_keep(["output"])
    (('input', 'output'), ('output',))
    """
    if isinstance(keep, str) and keep in _KEEP_CHOICES:
        return _KEEP_CHOICES[keep]
    if isinstance(keep, (tuple, list)) and keep and set(keep) <= {"input", "output"}:
        return tuple(w for w in ("input", "output") if w in keep)
    raise SpecError(f"keep={keep!r} is not one of 'output' (default), 'input', 'both', ('input', 'output')")


def keep_word(keep: object) -> str:
    """The one spelling of ``keep=``: ``"output"``, ``"input"`` or ``"both"``.

    >>> keep_word(("input", "output")), keep_word(["output"])
    ('both', 'output')
    """
    return _KEEP_WORDS[parse_keep(keep)]


def canonical_calls(calls: Any, *, also: tuple[str, ...] = ()) -> Any:
    """``calls=`` checked (see :func:`call_filter`) and in one spelling: a list or set of
    indices becomes a sorted tuple, so that equal choices compare, hash and store alike.

    >>> canonical_calls([2, 0]), canonical_calls("first")
    ((0, 2), 'first')
    """
    call_filter(calls, also=also)
    return tuple(sorted(set(calls))) if isinstance(calls, (list, tuple, set)) else calls


def call_filter(calls: object, *, also: tuple[str, ...] = ()) -> Callable[[int], bool]:
    """Which call indices of a module to act on: ``"all"``, ``"first"``, an index, or a list of
    indices; a feature accepting more words (a capture's ``"last"``) names them in ``also``, and
    they pass every index here.

    >>> keep = call_filter([0, 2])
    >>> [keep(i) for i in range(3)]
    [True, False, True]
    """
    if calls == "all" or calls in also:
        return lambda index: True
    if calls == "first":
        return lambda index: index == 0
    if isinstance(calls, int) and not isinstance(calls, bool) and calls >= 0:
        return lambda index: index == calls
    if isinstance(calls, (list, tuple, set)) and calls and all(isinstance(c, int) and c >= 0 for c in calls):
        chosen = set(calls)
        return lambda index: index in chosen
    words = ", ".join(repr(w) for w in ("first", *also))
    hint = "; for the last call of a module use calls='last'" if "last" in also else ""
    raise SpecError(f"calls={calls!r} is not 'all' (default), {words}, a call index >= 0, or a list of them{hint}")

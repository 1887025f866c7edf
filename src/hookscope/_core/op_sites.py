"""Op sites: the names of torch ops called inside a module, and the text that addresses them.

Module hooks see what crosses a module's boundary; the softmax inside an attention module, the
residual ``+=`` inside a block never do. An *op site* is one torch function call made by a
module's own code: ``h.0.attn:op[softmax#0]`` is the first ``softmax`` that ``h.0.attn``'s
forward calls, ``layer1.0#1:op[add_#0]`` the first in-place add of the second call of
``layer1.0``. The grammar, printed and parsed here only::

    MODULE[#CALL]:op[NAME[#INDEX]]

- ``MODULE`` is the module's name, escaped as :func:`~hookscope._core.names.escape_name` writes
  it (the root's name is empty); ``#CALL`` its call in the pass (0 when left out);
- ``NAME`` is the op as users write it (:func:`op_name`): ``torch.softmax``, ``Tensor.softmax``
  and ``F.softmax`` are all ``softmax``; ``a + b`` is ``add``, ``a += b`` is ``add_``;
- ``#INDEX`` numbers the calls of one op name within one call of the module, from 0.

A selector (:class:`OpPattern`) may glob the module (``h.*.attn``), the name (``add*``) and the
index (``softmax#*``); a selector without an index names every index, one without ``#CALL``
every call.

**Attention sub-sites** name values of a module's ``scaled_dot_product_attention`` calls::

    MODULE[#CALL]:attn.KIND[#INDEX]      KIND: q, k, v, scores, pattern, z

``INDEX`` numbers the module call's kernel calls (``scaled_dot_product_attention#INDEX``). As a
site (``Site.op == "attn.pattern#0"``) the text leaves ``#0`` out: ``h.0.attn#0:attn.pattern``,
and a key without an index names kernel call 0; as a selector an index left out names every
kernel call, as for op selectors. ``q``, ``k``, ``v`` are the kernel's arguments, ``z`` its
output (per head, before the heads are merged), ``scores`` and ``pattern`` are computed from the
arguments (:mod:`~hookscope._arch.attention`) only when selected.

**Expert sub-sites** name the values of one expert inside a fused mixture-of-experts module
(transformers' ``@use_experts_implementation`` classes: one 3-D weight for all experts)::

    MODULE[#CALL]:expert.KIND[#EXPERT]    KIND: in, pre, up, post, out, tokens, weights

``EXPERT`` is the expert's number (always written in a site: ``experts:expert.post#3``; left out
of a selector it names every expert). The values are the expert's rows, in token order: ``in``
the hidden states routed to it, ``pre`` the activation's argument (the gate projection of a gated
expert), ``up`` a gated expert's linear projection, ``post`` the activation's output (what the
down projection takes), ``out`` the expert's output before its routing weight, ``tokens`` the
token (row of the module's input) of each row and ``weights`` its routing weight
(:mod:`~hookscope._arch.experts`). To every feature they are op values of the module call.

**State-space sub-sites** name the values inside a Mamba or Mamba-2 mixer, computed from its
input and weights (:mod:`~hookscope._arch.ssm`)::

    MODULE[#CALL]:ssm.KIND[#POSITION]     KIND: z, conv, x, B, C, dt, decay, pattern, state, y, out

``POSITION`` is used by ``ssm.state`` alone (the recurrent state after that token; every
position when left out of a selector); the other kinds are one tensor per mixer call, written
``#0`` in a site like an expert's number.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hookscope._core.names import ROOT_LABEL, escape_name, unescape_name
from hookscope.errors import SpecError

__all__ = [
    "ATTN_KINDS",
    "EXPERT_KINDS",
    "INDEXED_SUBS",
    "SDPA",
    "SSM_KINDS",
    "OpPattern",
    "OpSite",
    "heads_first",
    "indexed_family",
    "op_leaf_label",
    "op_name",
    "op_pattern",
    "op_text",
    "split_op_label",
    "split_op_leaf",
]

#: The op whose calls attention sub-sites read.
SDPA = "scaled_dot_product_attention"
#: The attention sub-sites of one kernel call, in the order they are listed.
ATTN_KINDS = ("q", "k", "v", "scores", "pattern", "z")
_ATTN_LIST = ", ".join(f"attn.{kind}" for kind in ATTN_KINDS)
#: The values of one expert of a fused mixture-of-experts module, in the order it computes them.
EXPERT_KINDS = ("in", "pre", "up", "post", "out", "tokens", "weights")
#: The values of a state-space mixer, in the order it computes them.
SSM_KINDS = ("z", "conv", "x", "B", "C", "dt", "decay", "pattern", "state", "y", "out")
#: Sub-sites whose values hookscope hands on from inside a module's computation, by family:
#: each is written ``FAMILY.KIND#INDEX``, the index always written in a site.
INDEXED_SUBS: dict[str, tuple[str, ...]] = {"expert": EXPERT_KINDS, "ssm": SSM_KINDS}
_SUB_LIST = {family: ", ".join(f"{family}.{kind}" for kind in kinds) for family, kinds in INDEXED_SUBS.items()}
_SUB_WORD = {"expert": ("expert", "the expert's number", "'#3'"), "ssm": ("state-space", "its position", "'#0'")}

# What Tensor's operator methods are called as functions: ``a + b`` is an ``add`` wherever
# torch dispatches it as ``Tensor.__add__``, ``1 - a`` a ``sub`` (the operands' order aside),
# ``a += b`` the in-place ``add_``. Any other dunder loses its underscores (``__len__``: ``len``).
_DUNDERS = {
    **dict.fromkeys(("__add__", "__radd__"), "add"),
    "__iadd__": "add_",
    **dict.fromkeys(("__sub__", "__rsub__"), "sub"),
    "__isub__": "sub_",
    **dict.fromkeys(("__mul__", "__rmul__"), "mul"),
    "__imul__": "mul_",
    **dict.fromkeys(("__truediv__", "__rtruediv__", "__div__", "__rdiv__"), "div"),
    **dict.fromkeys(("__itruediv__", "__idiv__"), "div_"),
    **dict.fromkeys(("__floordiv__", "__rfloordiv__"), "floor_divide"),
    "__ifloordiv__": "floor_divide_",
    **dict.fromkeys(("__mod__", "__rmod__"), "remainder"),
    "__imod__": "remainder_",
    **dict.fromkeys(("__pow__", "__rpow__"), "pow"),
    "__ipow__": "pow_",
    **dict.fromkeys(("__matmul__", "__rmatmul__"), "matmul"),
    **dict.fromkeys(("__and__", "__rand__"), "bitwise_and"),
    "__iand__": "bitwise_and_",
    **dict.fromkeys(("__or__", "__ror__"), "bitwise_or"),
    "__ior__": "bitwise_or_",
    **dict.fromkeys(("__xor__", "__rxor__"), "bitwise_xor"),
    "__ixor__": "bitwise_xor_",
    **dict.fromkeys(("__lshift__", "__rlshift__"), "bitwise_left_shift"),
    "__ilshift__": "bitwise_left_shift_",
    **dict.fromkeys(("__rshift__", "__rrshift__"), "bitwise_right_shift"),
    "__irshift__": "bitwise_right_shift_",
    "__invert__": "bitwise_not",
    "__neg__": "neg",
    "__pos__": "positive",
    "__abs__": "abs",
    "__eq__": "eq",
    "__ne__": "ne",
    "__lt__": "lt",
    "__le__": "le",
    "__gt__": "gt",
    "__ge__": "ge",
    "__nonzero__": "bool",
}


def op_name(func: Callable[..., Any]) -> str:
    """The name of a torch function as users write it, for op sites.

    Why one name per op: torch hands the same op to a function mode as ``torch.softmax``,
    ``Tensor.softmax`` or ``F.softmax``, and an operator as ``Tensor.__radd__`` or ``Tensor.add``
    depending on the spelling and the torch version; a site must not change with either.
    A property's getter is named by the property (``x.T`` is ``T``), an op overload by its
    op (``torch.ops.aten.add.Tensor`` is ``add``), an operator by the function it is
    (table above).

    >>> import torch
    >>> import torch.nn.functional as F
    >>> [op_name(f) for f in (torch.softmax, torch.Tensor.softmax, F.softmax, F.scaled_dot_product_attention)]
    ['softmax', 'softmax', 'softmax', 'scaled_dot_product_attention']
    >>> [op_name(f) for f in (torch.Tensor.__add__, torch.Tensor.__radd__, torch.Tensor.__iadd__)]
    ['add', 'add', 'add_']
    >>> [op_name(f) for f in (torch.Tensor.__matmul__, torch.Tensor.__mul__, torch.Tensor.__truediv__)]
    ['matmul', 'mul', 'div']
    >>> op_name(torch.Tensor.__getitem__), op_name(torch.Tensor.T.__get__), op_name(torch.ops.aten.add.Tensor)
    ('getitem', 'T', 'add')
    """
    packet = getattr(func, "overloadpacket", None)  # torch.ops.aten.add.Tensor: the op, not the overload
    name = getattr(packet if packet is not None else func, "__name__", None)
    if name == "__get__":  # a property read (x.T, x.shape): named by the property
        name = getattr(getattr(func, "__self__", None), "__name__", None)
    if not isinstance(name, str) or not name:
        name = type(func).__name__
    if name.startswith("__") and name.endswith("__") and len(name) > 4:
        return _DUNDERS.get(name, name[2:-2])
    if _OP_NAME.match(name):
        return name
    # a function whose name is no identifier ('<lambda>', 'method-wrapper'): one a site can hold
    return re.sub(r"\W+", "_", name).strip("_") or "op"


# Module text: any character but an unescaped "#" (a ":" is allowed for 're:' selectors); then
# the call, then ":op[NAME#INDEX]" at the very end.
_OP_TEXT = re.compile(
    r"^(?P<module>(?:[^#\\]|\\.)*)(?:#(?P<call>\d+))?:op\[(?P<op>[^\[\]#]*)(?:#(?P<index>[^\[\]#]*))?\]$", re.DOTALL
)
_OP_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")
_OP_GLOB = re.compile(r"^[A-Za-z0-9_.*?]+$")
_INDEX_GLOB = re.compile(r"^[0-9*?]+$")
_FORM = (
    "'module[#call]:op[name[#index]]', e.g. 'h.0.attn:op[softmax#0]', 'h.*.attn:op[scaled_dot_product_attention]' "
    "or 'layer1.0:op[add*]'"
)


def _module_text(text: str) -> str:
    """A module part as written back to the name (or pattern) it stands for: escapes undone,
    except in a 're:' regular expression, whose backslashes are its own."""
    return text if text.startswith("re:") else unescape_name(text)


def _written_module(module: str) -> str:
    return module if module.startswith("re:") else escape_name(module)


@dataclass(frozen=True, order=True)
class OpSite:
    """One op call inside one module call: module name, module call, op name, op index.

    Why its own text: a value that never crosses a module boundary still needs an address that
    reads back to itself, in the same escaped form as a :class:`~hookscope._core.sites.Site`.
    ``str()`` writes every part (as ``Site`` does); :attr:`short` leaves out call 0.

    >>> site = OpSite("h.0.attn", 0, "softmax", 0)
    >>> str(site), site.short
    ('h.0.attn#0:op[softmax#0]', 'h.0.attn:op[softmax#0]')
    >>> OpSite.parse("h.0.attn#1:op[add_#2]")
    OpSite(module='h.0.attn', call=1, op='add_', index=2)
    >>> OpSite.parse(str(OpSite("fc#1", 0, "mul", 3))) == OpSite("fc#1", 0, "mul", 3)
    True
    """

    module: str
    call: int = 0
    op: str = ""
    index: int = 0

    def __post_init__(self) -> None:
        if self.call < 0 or self.index < 0:
            raise SpecError(
                f"op site {self.module!r} op {self.op!r} has call {self.call} and index {self.index}; "
                "both count from 0 (calls within the pass, ops within the call)"
            )
        if not _OP_NAME.match(self.op):
            raise SpecError(f"op name {self.op!r} is not an op's name; expected one such as 'softmax', 'add_' or 'T'")

    def __str__(self) -> str:
        return f"{escape_name(self.module) or ROOT_LABEL}#{self.call}:op[{self.op}#{self.index}]"

    @property
    def short(self) -> str:
        """The text without the module's call where it is the first: ``h.0.attn:op[softmax#0]``
        (the root reads ``(root)``, as module sites print it)."""
        call = f"#{self.call}" if self.call else ""
        return f"{escape_name(self.module) or ROOT_LABEL}{call}:op[{self.op}#{self.index}]"

    @property
    def op_label(self) -> str:
        """The op within its module call: ``softmax#0``."""
        return f"{self.op}#{self.index}"

    @classmethod
    def parse(cls, text: str) -> OpSite:
        """Read ``name[#call]:op[op#index]``; the call defaults to 0, the index must be given
        (without one, the text names every index: an :class:`OpPattern`)."""
        match = _OP_TEXT.match(text) if isinstance(text, str) else None
        if match is None:
            raise SpecError(f"op site {text!r} is not of the form {_FORM}")
        index = match["index"]
        if index is None or not index.isdigit() or not _OP_NAME.match(match["op"]):
            raise SpecError(
                f"op site {text!r} names a pattern, not one op call; an op site gives the op's name and index, "
                f"e.g. {match['module']}:op[{match['op'] or 'softmax'}#0]"
            )
        module = "" if match["module"] == ROOT_LABEL else unescape_name(match["module"])
        return cls(module, int(match["call"] or 0), match["op"], int(index))


@dataclass(frozen=True)
class OpPattern:
    """A selector of op sites: a module selector, an optional call, a glob over op names, and
    an optional glob over the index (None: every index).

    Why globs here and not in the module selector alone: "every softmax" or "every residual add
    of every block" are what users ask for, and the k-th op is a counter they cannot guess.

    >>> pattern = OpPattern.parse("h.*.attn:op[softmax#*]")
    >>> pattern.module, pattern.call, pattern.matches("softmax", 3), pattern.matches("add", 0)
    ('h.*.attn', None, True, False)
    >>> every = OpPattern.parse("layer1.0#1:op[add*]")
    >>> every.call, every.index, every.matches("add_", 1), every.matches("addmm", 0), str(every)
    (1, None, True, True, 'layer1.0#1:op[add*]')
    """

    module: str
    call: int | None = None
    op: str = "*"
    index: str | None = None
    #: An attention sub-site (``"pattern"``) of the module's ``scaled_dot_product_attention``
    #: calls, or ``""`` for the op's own values.
    sub: str = ""

    def __post_init__(self) -> None:
        if self.sub and (self.sub not in ATTN_KINDS or self.op != SDPA):
            raise SpecError(f"attention sub-site {self.sub!r} is not one of {_ATTN_LIST}")
        if not _OP_GLOB.match(self.op):
            raise SpecError(f"op selector name {self.op!r} is not an op name or a glob over names (* and ?)")
        if self.index is not None and not _INDEX_GLOB.match(self.index):
            raise SpecError(f"op selector index {self.index!r} is not an index or a glob over indices, such as 0 or *")

    def __str__(self) -> str:
        call = "" if self.call is None else f"#{self.call}"
        index = "" if self.index is None else f"#{self.index}"
        if self.sub:
            return f"{_written_module(self.module)}{call}:attn.{self.sub}{index}"
        if indexed_family(self.op):
            return f"{_written_module(self.module)}{call}:{self.op}{index}"
        return f"{_written_module(self.module)}{call}:op[{self.op}{index}]"

    def matches(self, op: str, index: int) -> bool:
        """True for the ``index``-th call of the op named ``op`` (whatever the module and call)."""
        if not fnmatch.fnmatchcase(op, self.op):
            return False
        return self.index is None or fnmatch.fnmatchcase(str(index), self.index)

    def matches_call(self, call: int) -> bool:
        """True for every call when the pattern names none, else for that call."""
        return self.call is None or self.call == call

    @classmethod
    def parse(cls, text: str) -> OpPattern:
        """Read ``module[#call]:op[name[#index]]``, any part but the call a glob; the module part
        may be any module selector text (a name, a glob, ``re:...``); or
        ``module[#call]:attn.kind[#index]``, an attention sub-site."""
        attn = _ATTN_TEXT.match(text) if isinstance(text, str) else None
        if attn is not None:
            if attn["sub"] not in ATTN_KINDS:
                raise SpecError(f"attention sub-site selector {text!r} names {attn['sub']!r}; expected {_ATTN_LIST}")
            call = int(attn["call"]) if attn["call"] is not None else None
            return cls(_module_text(attn["module"]), call, SDPA, attn["index"], attn["sub"])
        sub = _INDEXED_TEXT.match(text) if isinstance(text, str) else None
        if sub is not None:
            family = sub["family"]
            if sub["kind"] not in INDEXED_SUBS[family]:
                word = _SUB_WORD[family][0]
                raise SpecError(
                    f"{word} sub-site selector {text!r} names {sub['kind']!r}; expected {_SUB_LIST[family]}"
                )
            call = int(sub["call"]) if sub["call"] is not None else None
            return cls(_module_text(sub["module"]), call, f"{family}.{sub['kind']}", sub["index"])
        match = _OP_TEXT.match(text) if isinstance(text, str) else None
        if match is None or not match["op"] or match["index"] == "":
            raise SpecError(f"op selector {text!r} is not of the form {_FORM}")
        call = int(match["call"]) if match["call"] is not None else None
        return cls(_module_text(match["module"]), call, match["op"], match["index"])


def op_pattern(selector: object) -> OpPattern | None:
    """The :class:`OpPattern` a selector writes, or None for a selector of whole modules.

    Text holding ``:op[`` is meant as an op selector, so a malformed one is refused
    (:class:`~hookscope.errors.SpecError`) rather than taken for a module name.

    >>> op_pattern("h.0.attn:op[softmax]").op, op_pattern("h.0.attn"), op_pattern(int)
    ('softmax', None, None)
    >>> op_pattern("h.*.attn:attn.pattern").sub
    'pattern'
    >>> str(op_pattern("layers.0.mlp.experts:expert.post#3"))
    'layers.0.mlp.experts:expert.post#3'
    """
    if not isinstance(selector, str) or not any(mark in selector for mark in (":op[", ":attn.", ":expert.", ":ssm.")):
        return None
    return OpPattern.parse(selector)


# The leaf of a site of an op's value, after the module's "name#call:": the op, then its input
# (":input") or output (the default), then the path inside it.
_OP_LEAF = re.compile(
    r"^op\[(?P<op>[A-Za-z_][A-Za-z0-9_.]*)(?:#(?P<index>\d+))?\](?::(?P<what>input|output))?(?P<path>[\[.].*)?$",
    re.DOTALL,
)
_OP_LABEL = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*#\d+$")
# An attention sub-site's selector text, and its leaf in a site ("attn.pattern", "attn.z#1").
_ATTN_TEXT = re.compile(
    r"^(?P<module>(?:[^#\\]|\\.)*)(?:#(?P<call>\d+))?:attn\.(?P<sub>[A-Za-z_]*)(?:#(?P<index>[0-9*?]+))?$", re.DOTALL
)
_ATTN_LEAF = re.compile(r"^attn\.(?P<sub>[A-Za-z_]*)(?:#(?P<index>\d+))?$")
# An indexed sub-site's selector text ("experts:expert.post", "experts#0:expert.out#3",
# "mixer:ssm.state#5") and leaf.
_INDEXED_TEXT = re.compile(
    r"^(?P<module>(?:[^#\\]|\\.)*)(?:#(?P<call>\d+))?:(?P<family>expert|ssm)\.(?P<kind>[A-Za-z_]*)"
    r"(?:#(?P<index>[0-9*?]+))?$",
    re.DOTALL,
)
_INDEXED_LEAF = re.compile(r"^(?P<family>expert|ssm)\.(?P<kind>[A-Za-z_]*)(?:#(?P<index>\d+))?$")


def indexed_family(op: str) -> str:
    """The family of an indexed sub-site's op (``"expert"`` for ``"expert.post#3"``), or ``""``.

    >>> indexed_family("expert.post#3"), indexed_family("ssm.pattern"), indexed_family("softmax#0")
    ('expert', 'ssm', '')
    """
    family = op.partition(".")[0]
    return family if family in INDEXED_SUBS and "." in op else ""


_OP_LEAF_EXAMPLES = "e.g. 'op[softmax#0]', 'op[split#0][1]' or 'op[add#0]:input[1]'"


def op_leaf_label(op: str, what: str, path: str) -> str:
    """The leaf of an op's value as written after ``module#call:``: the op (``softmax#0``), its
    input (``:input``) or output (said by nothing), then the path.

    >>> op_leaf_label("softmax#0", "output", ""), op_leaf_label("add#1", "input", "[0]")
    ('op[softmax#0]', 'op[add#1]:input[0]')
    """
    if not _OP_LABEL.match(op):
        raise SpecError(f"op {op!r} is not an op's name and index within its module call, such as 'softmax#0'")
    if op.startswith("attn."):
        if what != "output" or path or op.split("#")[0][5:] not in ATTN_KINDS:
            raise SpecError(
                f"attention sub-site {op!r} is one tensor, one of {_ATTN_LIST} with its kernel call's index"
            )
        return op_text(op)
    family = indexed_family(op)
    if family:
        if what != "output" or path or op.split("#")[0][len(family) + 1 :] not in INDEXED_SUBS[family]:
            word, index, _ = _SUB_WORD[family]
            raise SpecError(f"{word} sub-site {op!r} is one tensor, one of {_SUB_LIST[family]} with {index}")
        return op
    if what not in ("input", "output"):
        raise SpecError(f"an op's value is its 'input' or 'output', not {what!r}")
    return f"op[{op}]{':input' if what == 'input' else ''}{path}"


def split_op_label(label: str) -> tuple[str, int]:
    """The op's name and index of a label (``Site.op``): ``("softmax", 0)``, ``("attn.pattern", 1)``.

    >>> split_op_label("softmax#0"), split_op_label("attn.pattern#1")
    (('softmax', 0), ('attn.pattern', 1))
    """
    name, _, index = label.rpartition("#")
    return name, int(index)


def heads_first(label: str) -> bool:
    """Whether an op's value is an attention kernel's, laid out ``(batch, heads, ...)``: an attention
    sub-site or the kernel's own output. Its dimension 1 is never the tokens a padding mask marks.

    >>> heads_first("attn.pattern#0"), heads_first(f"{SDPA}#1"), heads_first("add#0"), heads_first("")
    (True, True, False, False)
    """
    return label.startswith(("attn.", f"{SDPA}#"))


def op_text(label: str) -> str:
    """An op's output as written after ``module#call:``: ``op[softmax#0]``; an attention
    sub-site without its index where it is 0: ``attn.pattern``, ``attn.z#1``.

    >>> op_text("softmax#0"), op_text("attn.pattern#0"), op_text("attn.z#1"), op_text("expert.out#0")
    ('op[softmax#0]', 'attn.pattern', 'attn.z#1', 'expert.out#0')
    """
    if label.startswith("attn."):
        return label[:-2] if label.endswith("#0") else label
    if indexed_family(label):
        return label  # the index is always written: expert 0 is one expert of many
    return f"op[{label}]"


def split_op_leaf(text: str, *, shown: str | None = None) -> tuple[str, int | None, str, str] | None:
    """``(op name, index or None, what, path)`` of a leaf written by :func:`op_leaf_label`
    (the index may be left out: a key naming the only index held); None for a leaf of the
    module's own values (text not starting ``op[``); a :class:`~hookscope.errors.SpecError`
    naming ``shown`` for anything else.

    >>> split_op_leaf("op[split#0][1]"), split_op_leaf("op[add]:input[0]"), split_op_leaf("output[0]")
    (('split', 0, 'output', '[1]'), ('add', None, 'input', '[0]'), None)
    """
    if text.startswith("attn."):
        attn = _ATTN_LEAF.match(text)
        if attn is None or attn["sub"] not in ATTN_KINDS:
            raise SpecError(f"{shown or repr(text)} names no attention sub-site; expected {_ATTN_LIST} (then '#1' ...)")
        return f"attn.{attn['sub']}", int(attn["index"] or 0), "output", ""
    if indexed_family(text):
        sub = _INDEXED_LEAF.match(text)
        family = text.partition(".")[0]
        if sub is None or sub["kind"] not in INDEXED_SUBS[family]:
            word, _, example = _SUB_WORD[family]
            raise SpecError(
                f"{shown or repr(text)} names no {word} sub-site; expected {_SUB_LIST[family]} (then {example})"
            )
        return f"{family}.{sub['kind']}", int(sub["index"]) if sub["index"] else None, "output", ""
    if not text.startswith("op["):
        return None
    match = _OP_LEAF.match(text)
    if match is None:
        raise SpecError(f"{shown or repr(text)} is not the leaf of an op site; {_OP_LEAF_EXAMPLES}")
    index = int(match["index"]) if match["index"] is not None else None
    return match["op"], index, match["what"] or "output", match["path"] or ""

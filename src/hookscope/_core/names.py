"""Module names as the user thinks of them: without the attribute segments of wrappers.

``DistributedDataParallel`` and ``DataParallel`` keep the model as ``.module``, and
``torch.compile`` keeps it as ``._orig_mod``, so ``named_modules()`` of a wrapped model spells
every layer ``module.encoder.layer.0`` or ``_orig_mod.encoder.layer.0``. The same layer of the
same model would then have one name on rank 0 in a notebook and another in the training job.
Here every module below a wrapper is named as in the bare model (``encoder.layer.0``); the
wrapped module itself keeps the attribute's name (``module``, ``_orig_mod``), since the root's
name ``""`` belongs to the wrapper, the object that is called. Selectors match either spelling
(:func:`~hookscope._core.select.select`), so code written against ``ddp.module`` keeps working.

Wrappers are recognised by class, looked up lazily, so that a process that never imports
``torch.distributed`` or ``torch._dynamo`` does not import them here either.

>>> import torch
>>> from torch import nn
>>> ddp_like = torch.nn.DataParallel(nn.Sequential(nn.Linear(2, 2)))
>>> [name for name, _ in named_modules(ddp_like)]
['', 'module', '0']

Leaves are named here too. A tensor inside what a module takes or returns is addressed by which
value it sits in (``what``: ``input``, ``output``, ``grad_input``, ``grad_output``) and a path
relative to that value, reading like the Python that fetches it: ``""`` (the value is the
tensor), ``"[0]"``, ``"['mask']"``, ``".logits"``. Records keep the two apart, as
:class:`~hookscope._core.sites.Site` does; a person is shown them joined by :func:`leaf_label`
(``output[0]``, ``input['mask']``, ``output``), and what a person writes is read back by
:func:`split_leaf` and :func:`parse_leaf`, which take that full form or the relative path alone.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator

from torch import nn

from hookscope._core.compat.internals import COMPILED_MODEL_ATTRIBUTE, child_slots
from hookscope._core.compat.private import optimized_module_class
from hookscope.errors import SpecError

__all__ = [
    "LEAF_KINDS",
    "MODULE_TEXT",
    "ROOT_LABEL",
    "WRAPPER_CLASS_NAMES",
    "NamedModule",
    "call_label",
    "escape_name",
    "leaf_label",
    "module_label",
    "named_modules",
    "named_parameters",
    "parse_leaf",
    "short_spelling",
    "split_leaf",
    "split_leaf_selector",
    "unescape_name",
    "unwrapped_modules",
]

#: How the model itself is shown wherever a module is named: its own name is the empty string,
#: which would print as nothing (``'#0'``). Lookups accept it as well as ``""``.
ROOT_LABEL = "(root)"


#: A module name inside a site's text: any character but ``#`` and ``:``, which a name that
#: holds them (legal in PyTorch: ``add_module("fc#1", ...)``) writes as ``\\#`` and ``\\:``.
MODULE_TEXT = r"(?:[^#:\\]|\\.)*"


def escape_name(name: str) -> str:
    """A module name as a site's text writes it: ``#``, ``:`` and ``\\`` escaped by a backslash,
    so ``fc#1`` (a module so named) cannot read as call 1 of ``fc``.

    >>> escape_name("fc#1"), escape_name("h.0.mlp")
    ('fc\\\\#1', 'h.0.mlp')
    """
    if "#" not in name and ":" not in name and "\\" not in name:
        return name
    return name.replace("\\", "\\\\").replace("#", "\\#").replace(":", "\\:")


def unescape_name(text: str) -> str:
    """The module name that :func:`escape_name` wrote as ``text``.

    >>> unescape_name(escape_name("a:b#2")) == "a:b#2"
    True
    """
    return re.sub(r"\\(.)", r"\1", text, flags=re.DOTALL) if "\\" in text else text


_LEAF_SELECTOR = re.compile(rf"^(?P<module>{MODULE_TEXT}):(?P<leaf>(?:input|output)(?:[\[.].*)?)$", re.DOTALL)


def split_leaf_selector(selector: object) -> tuple[str, str, str] | None:
    """``(module selector, what, path)`` of a selector that names one value of a module, such
    as ``"block.0:output[0]"`` or ``"layers.*:input['hidden_states']"``; None for any other
    selector (a name, a glob, ``"re:..."``, a class, ...), which names whole modules.

    >>> split_leaf_selector("block.0:output[0]"), split_leaf_selector("h.*"), split_leaf_selector(r"fc\\#1:input")
    (('block.0', 'output', '[0]'), None, ('fc#1', 'input', ''))
    """
    if not isinstance(selector, str) or selector.startswith("re:"):
        return None
    match = _LEAF_SELECTOR.match(selector)
    if match is None:
        return None
    what, path = split_leaf(match["leaf"], shown=repr(selector))
    return unescape_name(match["module"]), str(what), path


def module_label(name: str) -> str:
    """A module's name as shown: ``(root)`` for the model itself.

    >>> module_label("h.0.mlp"), module_label("")
    ('h.0.mlp', '(root)')
    """
    return name or ROOT_LABEL


def call_label(name: str, call: int) -> str:
    """One call of a module as tables and messages show it: ``name#call``, ``(root)#0`` for the model.

    A :class:`~hookscope._core.sites.Site` adds which value and its path (``str(site)`` keeps
    the empty name, so that it parses back).

    >>> call_label("h.0.mlp", 1), call_label("", 0)
    ('h.0.mlp#1', '(root)#0')
    """
    return f"{name or ROOT_LABEL}#{call}"


#: The values of a module call a leaf can sit in (a :class:`~hookscope._core.sites.Site`'s ``what``).
LEAF_KINDS = ("input", "output", "grad_input", "grad_output")

# An optional value name, then the relative path: empty, or from the first "[" or "." on.
_LEAF_TEXT = re.compile(r"(?P<what>[A-Za-z_][A-Za-z0-9_]*)?(?P<path>[\[.].*)?", re.DOTALL)
_LEAF_EXAMPLES = "e.g. 'output[0]', \"input['mask']\", 'output' or the relative '[0]', '.logits'"


def leaf_label(what: str, path: str) -> str:
    """A leaf as a person is shown it: the value it sits in, then its relative path.

    The one spelling of a leaf in tables, messages and plots; :func:`split_leaf` reads it back.

    >>> leaf_label("output", "[0]"), leaf_label("input", "['mask']"), leaf_label("output", "")
    ('output[0]', "input['mask']", 'output')
    """
    return f"{what}{path}"


def split_leaf(text: str, *, shown: str | None = None) -> tuple[str | None, str]:
    """``(what, relative path)`` of a leaf as written: ``what`` is None when only the path is.

    Takes the full form (``"output[0]"``, ``"input['mask']"``, ``"output"``) and the relative
    one (``"[0]"``, ``".logits"``, ``""``); anything else is a :class:`~hookscope.errors.SpecError`
    naming ``shown`` (by default the text itself).

    >>> split_leaf("output[0]"), split_leaf("[0]"), split_leaf("input"), split_leaf("")
    (('output', '[0]'), (None, '[0]'), ('input', ''), (None, ''))
    """
    if not isinstance(text, str):
        raise SpecError(f"leaf path {text!r} is not text; {_LEAF_EXAMPLES}")
    where = shown or repr(text)
    match = _LEAF_TEXT.fullmatch(text)
    if match is None:
        raise SpecError(f"{where} is not a leaf path; {_LEAF_EXAMPLES}")
    what, path = match["what"], match["path"] or ""
    if what is not None and what not in LEAF_KINDS:
        kinds = ", ".join(LEAF_KINDS)
        raise SpecError(f"{where} names {what!r}; expected one of {kinds}, or a relative path; {_LEAF_EXAMPLES}")
    return what, path


def parse_leaf(text: str, side: str, *, shown: str | None = None, hint: str = "") -> str:
    """The path relative to ``side`` of a leaf written in full (``"output[0]"``) or relative (``"[0]"``).

    A leaf of another value (``"input[0]"`` where ``side`` is ``"output"``) is refused with a
    :class:`~hookscope.errors.SpecError` naming ``shown`` (by default the text itself), saying
    what was expected, and ``hint`` after it.

    >>> parse_leaf("output[0]", "output"), parse_leaf("[0]", "output"), parse_leaf("input['mask']", "input")
    ('[0]', '[0]', "['mask']")
    """
    what, path = split_leaf(text, shown=shown)
    if what is not None and what != side:
        raise SpecError(
            f"{shown or repr(text)} is a leaf of the {what}, but a leaf of the {side} was expected: {side!r} itself, "
            f"{leaf_label(side, '[0]')!r} and so on, or a path relative to it such as '[0]'{hint}"
        )
    return path


NamedModule = tuple[str, nn.Module]

# (module that defines the class, class name, attribute holding the wrapped model); None: Dynamo's
# private module, read through compat
_WRAPPERS = (
    ("torch.nn.parallel.distributed", "DistributedDataParallel", "module"),
    ("torch.nn.parallel.data_parallel", "DataParallel", "module"),
    (None, "OptimizedModule", COMPILED_MODEL_ATTRIBUTE),
)

#: The wrappers' class names, for records that outlive their model (a trace's root row).
WRAPPER_CLASS_NAMES = frozenset(class_name for _, class_name, _ in _WRAPPERS)


def _wrapper_classes() -> list[tuple[type, str]]:
    """The wrapper classes imported so far, with the attribute each keeps its model in."""
    found = []
    for module_path, class_name, attribute in _WRAPPERS:
        if module_path is None:
            cls: object = optimized_module_class()
        else:
            owner = sys.modules.get(module_path)
            cls = getattr(owner, class_name, None) if owner is not None else None
        if isinstance(cls, type):
            found.append((cls, attribute))
    return found


def short_spelling(name: str) -> str | None:
    """``"0"`` for ``"module.0"`` or ``"_orig_mod.0"``: a name as spelled below a wrapper, for
    records that outlive their model (a trace's rows) and know only the short names."""
    for _, _, attribute in _WRAPPERS:
        if name.startswith(attribute + "."):
            return name[len(attribute) + 1 :]
    return None


def named_modules(model: nn.Module) -> list[NamedModule]:
    """``model.named_modules()`` with wrapper segments dropped from the names below a wrapper.

    Same modules, same order, each module once (as ``named_modules()``); only the names differ.
    """
    return [(name, module) for name, _, module in _walk(model)]


def unwrapped_modules(model: nn.Module) -> list[NamedModule]:
    """:func:`named_modules` without the modules wrappers hold (``module``, ``_orig_mod``): their
    calls are the wrapper's, so a wrapped and a bare model line up name for name (diff)."""
    classes = _wrapper_classes()
    named = named_modules(model)
    held = {id(inner) for _, module in named if (inner := _inner_of(module, classes)) is not None}
    return [(name, module) for name, module in named if id(module) not in held]


def raw_and_named_modules(model: nn.Module) -> list[tuple[str, str, nn.Module]]:
    """``(name, spelling in named_modules(), module)`` for every module: what selectors match."""
    return list(_walk(model))


def named_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``model.named_parameters()`` under the names of :func:`named_modules`, each parameter once."""
    seen: set[int] = set()
    found = []
    for module_name, module in named_modules(model):
        for name, parameter in module.named_parameters(prefix=module_name, recurse=False):
            if id(parameter) not in seen:
                seen.add(id(parameter))
                found.append((name, parameter))
    return found


def _walk(model: nn.Module) -> Iterator[tuple[str, str, nn.Module]]:
    """Depth-first like ``named_modules()``: ``(name, raw name, module)``, each module once.

    Each entry carries the prefix its children are named under: a module's own name, except
    for the module a wrapper holds, whose children are named under the wrapper's prefix.
    """
    classes = _wrapper_classes()  # looked up once per walk, not per module
    seen: set[int] = set()
    used: set[str] = set()
    stack: list[tuple[str, str, nn.Module, str]] = [("", "", model, "")]
    while stack:
        name, raw, module, prefix = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        if name in used:  # a wrapped model's own attribute named like the wrapper's ("module"): keep torch's spelling
            name = prefix = raw
        used.add(name)
        yield name, raw, module
        inner = _inner_of(module, classes) if classes else None
        children = []
        for attribute, child in child_slots(module):
            if child is None:
                continue
            child_name = f"{prefix}.{attribute}" if prefix else attribute
            child_raw = f"{raw}.{attribute}" if raw else attribute
            child_prefix = prefix if child is inner else child_name
            children.append((child_name, child_raw, child, child_prefix))
        stack.extend(reversed(children))


def _inner_of(module: nn.Module, classes: list[tuple[type, str]]) -> nn.Module | None:
    for cls, attribute in classes:
        if isinstance(module, cls):
            return dict(child_slots(module)).get(attribute)
    return None

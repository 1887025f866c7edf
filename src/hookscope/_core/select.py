"""Turn a selector into the ordered list of modules it names.

Every feature that attaches hooks picks its modules here, so a selector means the same thing in
``hooks``, ``capture``, ``edit`` and the rest. One selector is compiled into one predicate
``(name, module) -> bool``; the model's ``named_modules()`` are filtered by it, so a result is
always a subset of the model's modules, in model order.

Selector forms:

==========================  ==============================================================
``"layer1.conv2"``          an exact dotted name from ``named_modules()``; ``""`` (or
                            ``"(root)"``, as sites and tables print it) is the root
``"layer*.conv?"``          a glob (the string holds ``*``, ``?`` or ``[``); ``*`` also
                            crosses dots, so ``"*conv*"`` finds convolutions at any depth
``"re:h\\.[0-9]+\\.mlp"``    a regular expression, matched against the whole name
``nn.Conv2d``               a module class: every module that is an instance of it
``model.fc``                a module object: that very module
``lambda name, m: ...``     a predicate called with each name and module
``["fc", nn.Conv2d]``       a list, tuple or set: the union, in model order
==========================  ==============================================================

Patterns (globs and regular expressions) never match the root module, whose name is empty.
A selector that matches nothing raises :class:`~hookscope.errors.SelectionError` naming the
closest existing names (in its message and as ``.suggestions``), because a typo that silently
hooks nothing is the worst kind of bug.
"""

from __future__ import annotations

import difflib
import fnmatch
import re
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import TypeAlias, cast

import torch
from torch import nn

from hookscope._core.names import ROOT_LABEL, raw_and_named_modules, short_spelling, split_leaf_selector
from hookscope.errors import SelectionError, SpecError, UnsupportedModelError

__all__ = [
    "LeafPaths",
    "Selector",
    "compile_selector",
    "describe_selector",
    "ensure_module",
    "given_selectors",
    "select",
    "select_leaves",
    "select_names",
]

Predicate = Callable[[str, nn.Module], bool]
Selector: TypeAlias = (
    str
    | type[nn.Module]
    | nn.Module
    | Predicate
    | list["Selector"]
    | tuple["Selector", ...]
    | set["Selector"]
    | frozenset["Selector"]
)

_GLOB_CHARS = frozenset("*?[")
_REGEX_PREFIX = "re:"
_FORMS = (
    "a module name, a glob ('layer*.conv?'), a 're:' regular expression, an nn.Module subclass, "
    "a module of the model, a predicate (name, module) -> bool, or a list of these"
)


def ensure_module(model: object) -> nn.Module:
    """Return ``model`` if hooks can be attached to it, else raise ``UnsupportedModelError``.

    Every hookscope call that takes a model checks it so; call it yourself to refuse a model
    where it comes in (a config, a command line) rather than at its first use. TorchScript
    modules are refused: scripted code never calls Python hooks, so anything attached to them
    would silently never run. A class passed instead of an instance is named as such.

    >>> ensure_module(nn.Linear(2, 2))
    Linear(in_features=2, out_features=2, bias=True)
    >>> ensure_module([1, 2])
    Traceback (most recent call last):
    ...
    hookscope.errors.UnsupportedModelError: expected a torch.nn.Module, got list; ...
    """
    if isinstance(model, torch.jit.ScriptModule):
        raise UnsupportedModelError(
            f"{type(model).__name__} (TorchScript) is not supported: scripted code does not run "
            "Python hooks; pass the eager module, the one given to torch.jit.script"
        )
    if not isinstance(model, nn.Module):
        hint = ""
        if isinstance(model, type) and issubclass(model, nn.Module):
            hint = f" (the class {model.__name__} itself was passed; build it first: {model.__name__}(...))"
        raise UnsupportedModelError(
            f"expected a torch.nn.Module, got {type(model).__name__}{hint}; "
            "pass the model object whose modules should be hooked"
        )
    return model


def describe_selector(selector: object) -> str:
    """A short human description of ``selector`` for messages and tables."""
    if isinstance(selector, str):
        return repr(selector)
    if isinstance(selector, type):
        return f"type {selector.__name__}"
    if isinstance(selector, nn.Module):
        return f"module {type(selector).__name__} object"
    if isinstance(selector, (list, tuple, set, frozenset)):
        return "[" + ", ".join(describe_selector(s) for s in selector) + "]"
    if callable(selector):
        return f"predicate {getattr(selector, '__qualname__', type(selector).__name__)}"
    return repr(selector)


def compile_selector(selector: Selector) -> Predicate:
    """Compile ``selector`` into one predicate ``(name, module) -> bool``.

    Malformed selectors (an invalid regular expression, an empty list, an int) raise
    ``SpecError`` here, before any module is looked at.

    >>> is_conv = compile_selector(["fc", "re:conv[0-9]"])
    >>> is_conv("conv1", nn.Identity()), is_conv("conv", nn.Identity())
    (True, False)
    """
    if isinstance(selector, str):
        return _compile_string(selector)
    if isinstance(selector, type):
        if not issubclass(selector, nn.Module):
            raise SpecError(f"selector {selector.__name__} is a class but not an nn.Module subclass; expected {_FORMS}")
        cls = selector
        return lambda _name, module: isinstance(module, cls)
    if isinstance(selector, nn.Module):
        target = selector
        return lambda _name, module: module is target
    if isinstance(selector, (list, tuple, set, frozenset)):
        members = list(selector)
        if not members:
            raise SpecError(f"an empty {type(selector).__name__} selects nothing; expected {_FORMS}")
        predicates = [compile_selector(member) for member in members]
        return lambda name, module: any(p(name, module) for p in predicates)
    if callable(selector):
        return selector
    raise SpecError(f"selector {selector!r} ({type(selector).__name__}) is not usable; expected {_FORMS}")


def select(model: nn.Module, selector: Selector) -> list[tuple[str, nn.Module]]:
    """Return ``[(name, module), ...]`` that ``selector`` names in ``model``, in model order.

    Each member of a list (of a list inside it too) must match at least one module: a typo
    inside a list is still a typo.

    >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> [name for name, _ in select(model, nn.Linear)]
    ['0', '2']
    >>> select(model, "3")
    Traceback (most recent call last):
    ...
    hookscope.errors.SelectionError: selector '3' matched 0 of 4 modules; did you mean '0' ...
    """
    ensure_module(model)
    entries = raw_and_named_modules(model)
    named = [(name, module) for name, _, module in entries]
    compile_selector(selector)  # a malformed selector (an empty list, a bad regex) is refused first
    members = _members(selector)
    predicates = [_spelling_blind(member) for member in members]
    for member, predicate in zip(members, predicates, strict=True):
        if not any(predicate(name, raw, module) for name, raw, module in entries):
            raise _no_match(member, named, within=members if len(members) > 1 else None)
    return [(name, module) for name, raw, module in entries if any(p(name, raw, module) for p in predicates)]


#: Per module given leaf selectors: ``{what: [(path, strict)]}`` (see :func:`select_leaves`).
LeafPaths: TypeAlias = dict[str, list[tuple[str, bool]]]


def select_leaves(
    model: nn.Module, selectors: Sequence[Selector], *, whole_sides: Sequence[str] = ("output",)
) -> tuple[list[tuple[str, nn.Module]], dict[str, LeafPaths]]:
    """The modules the selectors pick, and for those given leaf selectors
    (``"block.0:output[0]"``), the paths to keep of each side: ``{"output": [("[0]", strict)]}``.

    Lists and tuples are opened up (a union either way). A leaf named for one module by its
    exact name must be there (``strict``); one named through a pattern (``"h.*:output[0]"``) is
    kept where a module has it. A module picked whole as well keeps the union: every leaf of
    ``whole_sides`` (what a whole module keeps: the capture's ``keep``, path ``""``) and the
    leaves named of the other side, so ``["h.0", "h.0:input[0]"]`` keeps both.

    >>> model = nn.Sequential(nn.Linear(2, 2))
    >>> select_leaves(model, ["0", "0:input[0]"])[1]
    {'0': {'input': [('[0]', True)], 'output': [('', False)]}}
    """
    whole: list[Selector] = []
    leaves: dict[str, LeafPaths] = {}
    for selector in _flattened(selectors):
        split = split_leaf_selector(selector)
        if split is None:
            whole.append(selector)
            continue
        module_selector, what, path = split
        picked = select(model, module_selector)
        strict = len(picked) == 1 and picked[0][0] == module_selector
        for name, _ in picked:
            leaves.setdefault(name, {}).setdefault(what, []).append((path, strict))
    selected = select(model, whole + list(leaves))  # a union, each module once, in model order
    if whole:
        for name, _ in select(model, whole):
            if name in leaves:  # every tensor of the whole module's sides, and the named leaves besides
                for side in whole_sides:
                    leaves[name].setdefault(side, []).append(("", False))
    return selected, leaves


def _flattened(selectors: Sequence[Selector]) -> list[Selector]:
    flat: list[Selector] = []
    for selector in selectors:
        if isinstance(selector, (list, tuple)):
            flat.extend(_flattened(selector))
        else:
            flat.append(selector)
    return flat


def _members(selector: Selector) -> list[Selector]:
    """The selectors a list holds, nested lists opened: each must match on its own."""
    if isinstance(selector, (list, tuple, set, frozenset)):
        return [leaf for member in selector for leaf in _members(member)]
    return [selector]


def _spelling_blind(selector: Selector) -> Callable[[str, str, nn.Module], bool]:
    """A predicate on ``(name, raw name, module)``: a string selector may use either spelling
    of a name below a wrapper (``fc`` or ``module.fc``); other selectors see the name alone."""
    predicate = compile_selector(selector)
    if isinstance(selector, str):
        return lambda name, raw, module: predicate(name, module) or (raw != name and predicate(raw, module))
    return lambda name, _raw, module: predicate(name, module)


def select_names(names: list[str], selector: str | list[str] | tuple[str, ...]) -> list[str]:
    """The names a name-only selector (exact, glob, ``re:``, or a list of them) picks from ``names``.

    For records that outlive their model (a trace's rows): the same rules and the same
    did-you-mean errors as :func:`select`, without the modules.

    >>> select_names(["", "fc", "conv1"], "conv*")
    ['conv1']
    """
    members = list(selector) if isinstance(selector, (list, tuple)) else [selector]
    if not members:
        raise SpecError(f"an empty {type(selector).__name__} selects nothing; expected {_FORMS}")
    if not all(isinstance(member, str) for member in members):
        raise SpecError(
            f"selector {describe_selector(selector)} needs the model; only names, globs and 're:' work here"
        )
    predicates = [_compile_string(member) for member in members]
    stand_in = nn.Module()
    named = [(name, stand_in) for name in names]
    for member, predicate in zip(members, predicates, strict=True):
        if not any(predicate(name, stand_in) for name in names):
            within = cast(Selector, members) if len(members) > 1 else None
            raise _no_match(member, named, within=within)
    return [name for name in names if any(p(name, stand_in) for p in predicates)]


def _compile_string(text: str) -> Predicate:
    if text.startswith(_REGEX_PREFIX):
        source = text[len(_REGEX_PREFIX) :]
        try:
            regex = re.compile(source)
        except re.error as exc:
            raise SpecError(
                f"selector {text!r} is not a valid regular expression ({exc}); "
                "fix the pattern, or drop the 're:' prefix to use a glob"
            ) from None
        return lambda name, _module: bool(name) and regex.fullmatch(name) is not None
    if _GLOB_CHARS.intersection(text):
        glob = re.compile(fnmatch.translate(text))
        return lambda name, _module: bool(name) and glob.match(name) is not None
    if text == ROOT_LABEL:  # the root as sites and tables print it
        return lambda name, _module: name in ("", ROOT_LABEL)
    return lambda name, _module: name == text


def _no_match(selector: Selector, named: list[tuple[str, nn.Module]], *, within: Selector | None) -> SelectionError:
    """The error for ``selector`` matching none of ``named``: the closest names, in the message and as fields."""
    where = f" (in {describe_selector(within)})" if within is not None else ""
    head = f"selector {describe_selector(selector)}{where} matched 0 of {len(named)} modules"
    names = [name for name, _ in named if name]
    suggestions = _suggest(selector, names) if isinstance(selector, str) else []
    if isinstance(selector, str) and (":op[" in selector or ":attn." in selector):
        module = selector.split(":", 1)[0]
        message = (
            f"{head}; {selector!r} names a value inside a module (an op site), which hs.capture, hs.edit, "
            f"hs.trace(ops=...) and hs.layers(ops=...) take, and this feature does not: use one of those, or "
            f"select the module {module!r}"
        )
    elif isinstance(selector, type):
        present = sorted({type(module).__name__ for _, module in named})
        message = f"{head}; the model holds these types: {_listing(present)}"
    elif isinstance(selector, nn.Module):
        message = f"{head}; that module is not part of this model: pass one of model.modules()"
    elif not isinstance(selector, str):
        message = f"{head}; check the predicate, or list the names with hookscope.layers(model)"
    elif suggestions:
        message = f"{head}; did you mean {' or '.join(repr(s) for s in suggestions)}?"
    else:
        message = f"{head}; the model's top-level names are {_listing(n for n in names if '.' not in n)}"
    return SelectionError(message, selector=selector, suggestions=tuple(suggestions))


def _suggest(selector: str, names: list[str]) -> list[str]:
    """Closest names (or corrected patterns) for a string selector that matched nothing."""
    text = selector[len(_REGEX_PREFIX) :] if selector.startswith(_REGEX_PREFIX) else selector
    dotted = re.sub(r"\[(\w+)\]", r".\1", text).lstrip(".")  # "layers[0].fc" -> "layers.0.fc"
    if dotted != text and dotted in names:
        return [dotted]
    short = short_spelling(dotted)  # spelled as below a DDP or torch.compile wrapper
    if short is not None and short in names:
        return [short]
    # A name from another wrapping level: "transformer.h.0" given to the inner GPT2Model, or the reverse.
    affixed = [n for n in names if dotted.endswith("." + n) or n.endswith("." + dotted)]
    if affixed:
        return sorted(affixed, key=len)[:3]
    regex = selector.startswith(_REGEX_PREFIX)
    if regex or _GLOB_CHARS.intersection(text):
        corrected = _corrected_patterns(selector, names)
        if corrected:
            return corrected
    candidates = set(names)
    if _GLOB_CHARS.intersection(text) and not regex:
        candidates |= _generalised_names(text, names)
    return difflib.get_close_matches(dotted, sorted(candidates), n=3, cutoff=0.6)


_WORD = re.compile(r"(?<![\\\w])[A-Za-z_][A-Za-z0-9_]*")  # a name's word in a pattern, not an escape like \d


def _corrected_patterns(selector: str, names: list[str]) -> list[str]:
    r"""Patterns like ``selector`` that do match some of ``names``, best first (at most 3).

    A misspelt word is replaced by the closest word of the model's names (``h.*.mpl`` ->
    ``h.*.mlp``), and a pattern written for the inner model gets the missing leading names
    (``h.*.mlp`` -> ``transformer.h.*.mlp`` for ``GPT2LMHeadModel``), or loses the extra ones
    (``transformer.h.*`` -> ``h.*`` for ``GPT2Model``); globs and ``re:`` patterns alike.

    >>> _corrected_patterns("h.*.mpl", ["lm", "body", "body.h", "body.h.0", "body.h.0.mlp"])
    ['body.h.*.mlp']
    >>> _corrected_patterns(r"re:h\.\d+", ["lm", "body", "body.h", "body.h.0"])
    ['re:body\\.h\\.\\d+']
    """
    regex = selector.startswith(_REGEX_PREFIX)
    source = selector[len(_REGEX_PREFIX) :] if regex else selector
    words = sorted({segment for name in names for segment in name.split(".")})
    respelt = _WORD.sub(lambda found: _closest_word(found.group(), words), source)
    bases = list(dict.fromkeys([respelt, source]))  # the respelt pattern first: the typo is the likelier cause
    separator = r"\." if regex else "."
    stages: list[list[str]] = [[respelt]]  # tried in turn: the first stage that matches is the answer
    split = [name.split(".") for name in names]
    for depth in range(1, 1 + max((len(parts) - 1 for parts in split), default=0)):
        for base in bases:  # the parents below which the pattern matches what is left of a name
            matches = _predicate(_REGEX_PREFIX + base if regex else base)
            parents = {".".join(parts[:depth]) for parts in split if len(parts) > depth and matches(parts[depth:])}
            stages.append([_prefixed(parent, base, regex) for parent in sorted(parents)])
    for base in bases:  # leading names this model does not have: a pattern for an outer model
        parts = base.split(separator)
        start = 0
        while start < len(parts) - 1 and re.fullmatch(r"\w+", parts[start]) and parts[start] not in words:
            start += 1
            stages.append([separator.join(parts[start:])])
    for stage in stages:
        candidates = [_REGEX_PREFIX + pattern if regex else pattern for pattern in stage]
        found = [c for c in dict.fromkeys(candidates) if c != selector and _matches_any(c, names)]
        if found:
            return found[:3]
    return []


def _closest_word(word: str, words: list[str]) -> str:
    """``word`` itself when the model's names use it (or it is too short to judge), else the closest they do."""
    if len(word) < 3 or word in words:
        return word
    close = difflib.get_close_matches(word, words, n=1, cutoff=0.6)
    return close[0] if close else word


def _prefixed(parent: str, pattern: str, regex: bool) -> str:
    """``pattern`` below the module ``parent``: ``parent.pattern``, escaped for a regex."""
    if not regex:
        return f"{parent}.{pattern}"
    body = pattern[1:] if pattern.startswith("^") else pattern
    body = f"(?:{body})" if "|" in body else body
    return f"{re.escape(parent)}\\.{body}"


def _matches_any(selector: str, names: list[str]) -> bool:
    matches = _predicate(selector)
    return any(matches(name.split(".")) for name in names)


def _predicate(selector: str) -> Callable[[list[str]], bool]:
    """Whether a string selector matches a name given as its dotted parts; never, when it does not compile."""
    try:
        predicate = _compile_string(selector)
    except SpecError:  # a respelt regex that no longer compiles
        return lambda _parts: False
    stand_in = nn.Module()
    return lambda parts: predicate(".".join(parts), stand_in)


def _generalised_names(pattern: str, names: Iterable[str]) -> set[str]:
    """Names rewritten in the pattern's shape: 'blocks.0.mlp' seen through 'blocks.*.mpl' -> 'blocks.*.mlp'."""
    parts = pattern.split(".")
    shaped = set()
    for name in names:
        segments = name.split(".")
        if len(segments) == len(parts):
            shaped.add(".".join(p if fnmatch.fnmatchcase(s, p) else s for s, p in zip(segments, parts, strict=True)))
    return shaped


def _listing(items: Iterable[str], limit: int = 12) -> str:
    shown = list(items)
    more = f", ... ({len(shown) - limit} more)" if len(shown) > limit else ""
    return ", ".join(shown[:limit]) + more if shown else "(none)"


def given_selectors(
    positional: tuple[Selector, ...],
    layers: Selector | Sequence[Selector] | None,
    *,
    feature: str,
    old_form: bool = False,
) -> tuple[Selector, ...]:
    """The selectors a feature was given, positionally (the short form) or as ``layers=``, never both.

    ``old_form``: positional selectors are a form the feature is leaving (``hs.monitor(model,
    layers)``): they still work, with a ``FutureWarning`` naming ``layers=``.

    >>> given_selectors((), ["fc", "conv1"], feature="capture"), given_selectors(("fc",), None, feature="capture")
    (('fc', 'conv1'), ('fc',))
    """
    if positional and layers is not None:
        raise SpecError(f"{feature} got selectors both positionally and as layers=; give them one way")
    if positional and old_form:
        warnings.warn(
            f"{feature}: give the layers as layers=...; layers given positionally will not be taken in a later version",
            FutureWarning,
            stacklevel=3,
        )
    if layers is None:
        return positional
    if isinstance(layers, torch.Tensor):
        raise SpecError(f"layers= is {feature}'s own option (which modules); use model_kwargs={{'layers': ...}}")
    return tuple(layers) if isinstance(layers, (list, tuple)) else (layers,)  # type: ignore[return-value]

"""One options object per feature: declared once, validated once, shared by every way in.

A feature's options (``CaptureOptions``, ``TraceOptions``, ``EditOptions``, ``ExtractConfig``)
are a frozen dataclass deriving from :class:`Options`. Its fields are the one declaration of
the option names, defaults and types; its ``__post_init__`` is the one validation. The scoped
form (``hs.capture(model, ...)``), the one-shot form (``hs.run_with_capture(model, x, ...)``),
the CLI and a stored configuration all build the same object, so an option added to the
dataclass reaches all of them and none can drift.

The functions take the options as keywords (``detach=False``) or whole (``options=``), and
:func:`with_options` writes the fields into their signatures, so ``help()``, ``inspect`` and
notebooks show every option. A one-shot form also passes keywords through to the model: its
keywords are split by name (:meth:`Options.split`), ``model_kwargs`` holding a model's keyword
whose name an option has.

>>> from dataclasses import dataclass
>>> @dataclass(frozen=True)
... class Demo(Options):
...     feature = "demo"
...     size: int = 1
>>> Demo.build(None, {"size": 3})
Demo(size=3)
>>> Demo.from_dict(Demo(size=2).to_dict())
Demo(size=2)
>>> Demo.build(None, {"sise": 3})
Traceback (most recent call last):
...
hookscope.errors.SpecError: demo has no option 'sise'; did you mean 'size'? Its options: size
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import itertools
import sys
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch

from hookscope._shared.dtypes import dtype_name
from hookscope.errors import SpecError

__all__ = ["Options", "renamed", "with_options"]

OptionsT = TypeVar("OptionsT", bound="Options")
F = TypeVar("F", bound=Callable[..., Any])


class Options:
    """Base of a feature's frozen options dataclass (see the module doc)."""

    #: Who the options belong to, as errors name it: ``"capture"``, ``"trace"``, ...
    feature: ClassVar[str] = "options"
    #: Bumped when a field changes meaning, so a stored dict of another version is refused.
    VERSION: ClassVar[int] = 1
    #: Keywords the constructor takes besides the fields: parts of another options object a
    #: field holds (``ExtractConfig`` takes ``keep=`` into its ``capture``). Accepted by
    #: :meth:`build` and shown in signatures, with the dataclass's default for them.
    PART_KEYWORDS: ClassVar[tuple[str, ...]] = ()
    #: The file the class was defined in, whose field docstrings :meth:`field_docs` reads.
    _source_file: ClassVar[str | None] = None
    #: :meth:`field_docs` of this class, once read.
    _field_docs_read: ClassVar[tuple[tuple[str, str], ...] | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        module = sys.modules.get(cls.__module__)
        cls._source_file = getattr(module, "__file__", None)  # where field_docs reads the fields' docstrings

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """The option names, in declaration order (not ``names()``: the monitor has an option
        called ``names``)."""
        return tuple(field.name for field in dataclasses.fields(cls) if field.init)  # type: ignore[arg-type]

    @classmethod
    def build(cls: type[OptionsT], options: OptionsT | None, given: Mapping[str, Any]) -> OptionsT:
        """``options`` (default: all defaults) with the keywords in ``given`` changed, validated once."""
        if options is not None and not isinstance(options, cls):
            raise SpecError(
                f"options= takes {cls.feature}'s options, a {cls.__name__} such as hs.{cls.__name__}(), not a "
                f"{type(options).__name__}; to pass options= to the model, use model_kwargs={{'options': ...}}"
            )
        cls._refuse_unknown(given)
        if options is None:
            return cls(**given)
        return dataclasses.replace(options, **given) if given else options  # type: ignore[type-var]

    @classmethod
    def split(cls, kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(options, rest)``: the keywords that name an option, and the others (the model's).

        A tensor given to an option's name was meant for the model: refused with the way to pass it.
        """
        names = {*cls.option_names(), *cls.PART_KEYWORDS}
        chosen = {key: value for key, value in kwargs.items() if key in names}
        for key, value in chosen.items():
            if isinstance(value, torch.Tensor):
                raise SpecError(
                    f"{key}= is {cls.feature}'s own option, not a tensor for the model; to pass {key}= to the "
                    f"model, use model_kwargs={{{key!r}: ...}}"
                )
        return chosen, {key: value for key, value in kwargs.items() if key not in names}

    @classmethod
    def _refuse_unknown(cls, given: Mapping[str, Any]) -> None:
        names = (*cls.option_names(), *cls.PART_KEYWORDS)
        for key in given:
            if key not in names:
                close = difflib.get_close_matches(key, names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ";"
                raise SpecError(f"{cls.feature} has no option {key!r}{hint} Its options: {', '.join(names)}")

    def to_dict(self) -> dict[str, Any]:
        """Every option as JSON-ready values, with ``"version"``: what a file or store records."""
        values = {name: _jsonable(getattr(self, name)) for name in self.option_names()}
        return {"version": self.VERSION, **values}

    @classmethod
    def from_dict(cls: type[OptionsT], data: Mapping[str, Any]) -> OptionsT:
        """The options a :meth:`to_dict` wrote; another version, or an unknown key, is refused."""
        values = dict(data)
        version = values.pop("version", None)
        if version != cls.VERSION:
            raise SpecError(
                f"{cls.__name__} of version {version!r} cannot be read by this hookscope (version {cls.VERSION}); "
                "write the options again with this version"
            )
        cls._refuse_unknown(values)
        for key, value in values.items():
            if isinstance(value, str) and value.startswith("<") and value.endswith(">"):
                raise SpecError(
                    f"{key}={value} in the stored {cls.__name__} stands for a Python object (a function) that a dict "
                    f"cannot hold; give {key}= again"
                )
        return cls(**values)

    @classmethod
    def field_docs(cls) -> dict[str, str]:
        """Each option's documentation: the docstring written under its field, as written (reST).

        The one place an option is described: the reference docs read it as an attribute
        docstring, and the command line's flags take their help from it.

        >>> from hookscope import EditOptions
        >>> EditOptions.field_docs()["on"].split(",")[0]
        '``"output"`` (default) edits what the module returns'
        """
        docs = cls.__dict__.get("_field_docs_read")
        if docs is None:  # read once per class, when first asked
            docs = _field_docs(cls)
            cls._field_docs_read = docs
        return dict(docs)

    def changes(self) -> dict[str, Any]:
        """The options that differ from their defaults (for a repr or a command line)."""
        defaults = type(self)()
        return {
            name: getattr(self, name) for name in self.option_names() if getattr(self, name) != getattr(defaults, name)
        }


def _field_docs(cls: type) -> tuple[tuple[str, str], ...]:
    """``(field, docstring)`` of every field of ``cls`` and its bases with a string literal under it.

    Read from the file each class was defined in (kept when it was defined: the package rewrites
    its public classes' ``__module__``, which ``inspect.getsource`` would follow to the wrong file),
    once per class: the command line asks for every flag's help when it starts.
    """
    found: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        source = klass.__dict__.get("_source_file")
        if source is None:
            continue
        tree = ast.parse(Path(source).read_text(encoding="utf-8"))
        body = next(
            (node.body for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and node.name == klass.__name__),
            [],
        )
        for field, after in itertools.pairwise(body):
            if (
                isinstance(field, ast.AnnAssign)
                and isinstance(field.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                found[field.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return tuple((name, found[name]) for name in cls.option_names() if name in found)  # type: ignore[attr-defined]


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    if isinstance(value, torch.device):
        return str(value)
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {key if isinstance(key, str) else _jsonable(key): _jsonable(v) for key, v in value.items()}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    name = getattr(value, "__qualname__", None) or type(value).__qualname__
    return f"<{name}>"  # a function (a custom reduction): named, not restorable


def with_options(options: type[Options], *, keep: tuple[str, ...] = ()) -> Callable[[F], F]:
    """Write ``options``' fields into the decorated function's signature.

    The fields replace a ``**opts`` parameter (the scoped forms), or go before the parameters
    named in ``keep`` (``model_kwargs``) and a ``**kwargs`` (a one-shot form's model keywords).
    """

    def decorate(func: F) -> F:
        signature = inspect.signature(func)
        before: list[inspect.Parameter] = []
        after: list[inspect.Parameter] = []
        for parameter in signature.parameters.values():
            if parameter.kind is inspect.Parameter.VAR_KEYWORD and parameter.name == "opts":
                continue
            trailing = parameter.name in keep or parameter.kind is inspect.Parameter.VAR_KEYWORD
            (after if trailing else before).append(parameter)
        fields = [
            inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, default=field.default, annotation=field.type)
            for field in dataclasses.fields(options)  # type: ignore[arg-type]
            if field.init
        ]
        declared = options.__dataclass_fields__  # type: ignore[attr-defined]
        fields += [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=declared[name].default)
            for name in options.PART_KEYWORDS
        ]
        func.__signature__ = signature.replace(parameters=[*before, *fields, *after])  # type: ignore[attr-defined]
        return func

    return decorate


def renamed(new: Any, old: Any, *, new_name: str, old_name: str, where: str) -> Any:
    """The value of an option given by its new name, or by its old one with a ``FutureWarning``.

    >>> renamed(["fc"], None, new_name="layers", old_name="sites", where="hs.report")
    ['fc']
    """
    if old is None:
        return new
    if new is not None:
        raise SpecError(f"{where} got both {new_name}= and {old_name}= (its old name); give {new_name}= alone")
    warnings.warn(f"{where}: {old_name}= is now {new_name}=; the old name will be removed", FutureWarning, stacklevel=3)
    return old

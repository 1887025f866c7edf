"""Turn command-line text into a model and a sample input for it.

A command names its model with one string, so a shell line can reach any model without a
Python script around it::

    package.module:factory        import the module, take the attribute (``pkg.mod:Class.build``)
    path/to/file.py:factory       load the file as a module, take the attribute
    demo:cnn, demo:shapes         a model shipped with hookscope (nothing downloaded; shapes is trained)
    hf-config:gpt2?n_layer=2      a transformers model with random weights from its default config
    hf-config:gpt2/causal-lm?...  the same with a task head (``HF_HEADS``: causal-lm, masked-lm, ...)

``hf-config:<model_type>[/<head>][?key=value&...]``: each key must be a field of the model
type's config (a typo is refused with the closest names); a value is an int, a float, true/false,
null, a quoted string, a ``[...]`` list of those (``hidden_sizes=[16,32]``), or else a string.

An attribute that is an ``nn.Module`` object is used as it is; a class or any other callable is
called with no arguments. Every spec that cannot be turned into a model raises ``SpecError`` with
one line that says what was given, what was expected and how to fix it, because the command line
prints exactly that line.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import itertools
import json
import math
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

import hookscope as hs
from hookscope.errors import MissingDependencyError, SpecError

__all__ = ["COUNT_MAX", "DEMO_MODELS", "HF_HEADS", "load_attribute", "load_model", "make_input", "parse_shape"]

#: Sizes and counts read from a command line (rows, batch sizes, token ids): what an int64 holds,
#: torch's index type; past it torch raises a raw overflow error.
COUNT_MAX = 2**63 - 1

FORMS = (
    "'package.module:factory', 'path/to/file.py:factory', 'demo:<name>' or "
    "'hf-config:<model_type>[/<head>][?key=value&...]'"
)


def _small_cnn() -> nn.Module:
    """The untrained demo CNN, with the same random weights on every run (seed 0, the caller's
    random state untouched): a CLI run on it prints the same numbers each time."""
    from hookscope.demo.models import SmallCNN

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return SmallCNN()


def _shapes_cnn() -> nn.Module:
    from hookscope.demo.models import load_shapes_cnn

    return load_shapes_cnn()


#: ``demo:<name>`` -> a factory; the demo models need nothing downloaded or installed.
DEMO_MODELS: dict[str, Callable[[], nn.Module]] = {"cnn": _small_cnn, "shapes": _shapes_cnn}

# Sample input shapes of classes that do not (yet) say so with an ``example_input_shape``
# class attribute, by qualified class name so nothing is imported to look them up.
_EXAMPLE_SHAPES: dict[str, tuple[int, ...]] = {"hookscope.demo.models.SmallCNN": (1, 3, 32, 32)}

#: ``hf-config:<model_type>/<head>`` -> the transformers auto class that builds the model with that head.
HF_HEADS: dict[str, str] = {
    "base": "AutoModel",
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "seq2seq-lm": "AutoModelForSeq2SeqLM",
    "sequence-classification": "AutoModelForSequenceClassification",
    "token-classification": "AutoModelForTokenClassification",
    "question-answering": "AutoModelForQuestionAnswering",
    "multiple-choice": "AutoModelForMultipleChoice",
    "pretraining": "AutoModelForPreTraining",
    "image-classification": "AutoModelForImageClassification",
    "object-detection": "AutoModelForObjectDetection",
    "semantic-segmentation": "AutoModelForSemanticSegmentation",
    "masked-image-modeling": "AutoModelForMaskedImageModeling",
    "audio-classification": "AutoModelForAudioClassification",
    "ctc": "AutoModelForCTC",
    "speech-seq2seq": "AutoModelForSpeechSeq2Seq",
}

_file_counter = itertools.count()


def load_model(spec: str) -> nn.Module:
    """Build the model ``spec`` names (see the module doc for the forms), in eval mode.

    Eval mode because every command inspects a model rather than trains it: dropout off and
    batch-norm statistics untouched make two runs of a command agree.
    """
    spec = spec.strip()
    if spec.startswith("demo:"):
        model = _demo(spec, spec[len("demo:") :])
    elif spec.startswith("hf-config:"):
        model = _hf_config(spec, spec[len("hf-config:") :])
    else:
        found, attribute = load_attribute(spec)
        model = _build(spec, found, attribute)
    return model.eval()


def load_attribute(spec: str, *, kind: str = "model", forms: str = FORMS) -> tuple[object, str]:
    """What ``package.module:attr`` or ``path/to/file.py:attr`` names, and the attribute's name.

    ``kind`` and ``forms`` word the errors: ``"data"`` specs share this with models.
    """
    target, colon, attribute = spec.rpartition(":")  # rpartition: 'C:\models\net.py:build' works
    if not colon or not target or not attribute:
        raise _error(spec, "it names no factory (the part after ':')", f"expected {forms}", kind)
    is_file = target.endswith(".py") or "/" in target or os.sep in target
    module = _load_file(spec, target, kind) if is_file else _import(spec, target, kind, forms)
    return _attribute(spec, module, target, attribute, kind), attribute


def make_input(
    model: nn.Module, shape: str | None, *, dtype: str | None = None, seed: int = 0
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A random sample input for ``model`` as ``(args, kwargs)``: :func:`hookscope.sample_input`
    of the ``--input-shape`` text, or of the model's default (the demo CNN's is here). A model
    without a default is asked for ``--input-shape``."""
    size = parse_shape(shape) if shape is not None else _example_shape(model) or hs.default_input_shape(model)
    if size is None:
        raise SpecError(
            f"no default input for {type(model).__name__}: it declares no example_input_shape; "
            "pass --input-shape, e.g. 1x3x224x224"
        )
    return hs.sample_input(model, size, seed=seed, dtype=None if dtype is None else hs.parse_dtype(dtype))


def _example_shape(model: nn.Module) -> tuple[int, ...] | None:
    """The shape the command line knows for a model class that declares none (the demo CNN)."""
    for cls in type(model).__mro__:
        if f"{cls.__module__}.{cls.__qualname__}" in _EXAMPLE_SHAPES:
            return _EXAMPLE_SHAPES[f"{cls.__module__}.{cls.__qualname__}"]
    return None


def parse_shape(text: str) -> tuple[int, ...]:
    """Read an input shape written as sizes joined by ``x`` or ``,``.

    >>> parse_shape("1x3x32x32"), parse_shape("1, 16")
    ((1, 3, 32, 32), (1, 16))
    >>> parse_shape("1x0")
    Traceback (most recent call last):
    ...
    hookscope.errors.SpecError: input shape '1x0' is not understood; ...
    >>> parse_shape(f"1x{2**64}")
    Traceback (most recent call last):
    ...
    hookscope.errors.SpecError: input shape '1x18446744073709551616' holds more values than a tensor can index ...
    """
    parts = text.strip().strip("()[]").lower().replace(",", "x").split("x")
    if not all(part.strip().isdecimal() and int(part) > 0 for part in parts):
        raise SpecError(
            f"input shape {text!r} is not understood; expected positive sizes joined by 'x' or ',', "
            "e.g. 1x3x224x224 or 1,16"
        )
    sizes = tuple(int(part) for part in parts)
    if math.prod(sizes) > COUNT_MAX:
        raise SpecError(
            f"input shape {text!r} holds more values than a tensor can index (2**63 - 1); expected the sizes "
            "of a tensor that fits in memory, e.g. 1x3x224x224"
        )
    return sizes


def _error(spec: str, problem: str, fix: str, kind: str = "model") -> SpecError:
    return SpecError(f"{kind} {spec!r}: {problem}; {fix}")


def _close(word: str, names: list[str]) -> str:
    """``"did you mean 'a' or 'b'?"`` for the names closest to ``word``, or a few names to pick from."""
    close = difflib.get_close_matches(word, names, n=3, cutoff=0.5)
    if close:
        return "did you mean " + " or ".join(repr(name) for name in close) + "?"
    return "known: " + ", ".join(sorted(names)[:8]) + (", ..." if len(names) > 8 else "")


def _demo(spec: str, name: str) -> nn.Module:
    if name not in DEMO_MODELS:
        raise _error(spec, f"no demo model {name!r}", f"known demo models: {', '.join(sorted(DEMO_MODELS))}")
    return DEMO_MODELS[name]()


def _import(spec: str, name: str, kind: str = "model", forms: str = FORMS) -> object:
    try:
        return importlib.import_module(name)
    except ImportError as error:
        prefix = difflib.get_close_matches(name, ["demo", "hf-config"], n=1, cutoff=0.7)  # 'hf_config:gpt2'
        fix = f"did you mean '{prefix[0]}:...'?" if prefix else "check the name and that it is installed"
        problem = f"module {name!r} cannot be imported ({type(error).__name__}: {error})"
        raise _error(spec, problem, f"{fix}; expected {forms}", kind) from error
    except Exception as error:  # the module ran and failed: say so, not 'not found'
        problem = f"importing module {name!r} raised {type(error).__name__}: {error}"
        raise _error(spec, problem, "fix it", kind) from error


def _load_file(spec: str, target: str, kind: str = "model") -> object:
    path = Path(target).expanduser().resolve()  # relative paths: against the current directory
    if not path.is_file():
        raise _error(
            spec,
            f"file {target!r} not found (looked at {path})",
            "check the path; it is read relative to the current directory",
            kind,
        )
    name = f"_hookscope_model_file_{next(_file_counter)}_{path.stem}"  # private: never shadows a real module
    loader_spec = importlib.util.spec_from_file_location(name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise _error(spec, f"file {target!r} cannot be loaded as a Python module", "name a '.py' file", kind)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module  # dataclasses and pickling look classes up by their module name
    sys.path.insert(0, str(path.parent))  # like `python file.py`: sibling imports work while it runs
    try:
        loader_spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[name]
        problem = f"running file {target!r} raised {type(error).__name__}: {error}"
        raise _error(spec, problem, "fix the file", kind) from error
    finally:
        sys.path.remove(str(path.parent))
    return module


def _attribute(spec: str, module: object, target: str, dotted: str, kind: str = "model") -> object:
    found, where = module, target  # name the file as given, not its private module name
    for part in dotted.split("."):
        if not hasattr(found, part):
            names = [name for name in dir(found) if not name.startswith("_")]
            raise _error(spec, f"{where!r} has no attribute {part!r}", _close(part, names), kind)
        found, where = getattr(found, part), f"{where}:{part}" if where == target else f"{where}.{part}"
    return found


def _build(spec: str, found: object, attribute: str) -> nn.Module:
    """The model ``found`` is, or makes when called with no arguments; anything else is refused unrun.

    A builtin function (``os:abort``) or a class that is no ``nn.Module`` subclass (``pathlib:Path``)
    cannot make a model, and calling it could do anything, so it is refused before it is called.
    A factory that exits (``builtins:exit`` raises ``SystemExit``) is an error, not a silent exit 0.
    """
    if isinstance(found, nn.Module):
        return hs.ensure_module(found)  # refuses a TorchScript module
    expected = "name an nn.Module, an nn.Module subclass or a factory function that returns one"
    if not callable(found):
        raise _error(spec, f"{attribute!r} is {type(found).__name__}, not a model or a factory", expected)
    if isinstance(found, type) and not issubclass(found, nn.Module):
        private = found.__module__.startswith("_hookscope_model_file_")  # a file's module: name the class alone
        what = found.__qualname__ if private else f"{found.__module__}.{found.__qualname__}"
        raise _error(spec, f"{attribute!r} is the class {what}, which is not a torch.nn.Module subclass", expected)
    if inspect.isbuiltin(found):
        raise _error(spec, f"{attribute!r} is the builtin function {found.__name__}(), not a model factory", expected)
    try:
        made = found()
    except SystemExit as error:  # a factory must not end the command silently, with exit code 0
        problem = f"calling {attribute!r} raised SystemExit({error.code!r}): it ends the program"
        raise _error(spec, problem, expected) from error
    except Exception as error:
        problem = f"factory {attribute!r} raised {type(error).__name__}: {error}"
        raise _error(spec, problem, f"it is called with no arguments; {expected}") from error
    if not isinstance(made, nn.Module):
        raise _error(spec, f"factory returned {type(made).__name__}; expected a torch.nn.Module", expected)
    return hs.ensure_module(made)  # refuses a TorchScript module


def _hf_config(spec: str, text: str) -> nn.Module:
    """``hf-config:<model_type>[/<head>][?key=value&...]``: random weights from a checked config.

    Every key must name a field of the model type's config: transformers keeps an unknown keyword
    as a new attribute without a word, so ``n_layers=2`` (for ``n_layer``) would build the full
    model. The head picks the ``AutoModelFor*`` class (``AutoModel`` without one).
    """
    target, _, query = text.partition("?")
    model_type, slash, head = (part.strip() for part in target.partition("/"))
    overrides = _overrides(spec, query)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # random weights from a config: never download
    try:
        import transformers
    except ImportError as error:
        raise MissingDependencyError(
            f"model {spec!r} needs transformers, which is not installed; pip install transformers"
        ) from error
    known = list(transformers.CONFIG_MAPPING.keys())
    if model_type not in known:
        raise _error(spec, f"transformers knows no model_type {model_type!r}", _close(model_type, known))
    auto_class = _head_class(spec, transformers, model_type, head) if slash else transformers.AutoModel
    config_class = transformers.CONFIG_MAPPING[model_type]
    fields = _config_fields(config_class)
    for key in overrides:
        if fields and key not in fields:
            raise _error(
                spec,
                f"{config_class.__name__} has no field {key!r} (transformers would keep it unused)",
                _close(key, sorted(name for name in fields if not name.startswith("_"))),
            )
    try:
        config = transformers.AutoConfig.for_model(model_type, **overrides)
        from_config: Callable[..., Any] = auto_class.from_config  # untyped in some versions
        model = from_config(config)
    except Exception as error:
        raise _error(
            spec, f"building {model_type!r} raised {type(error).__name__}: {error}", "check the overrides"
        ) from error
    return hs.ensure_module(model)


def _head_class(spec: str, transformers: Any, model_type: str, head: str) -> Any:
    """The ``AutoModelFor*`` class of ``head``; refused when unknown or when ``model_type`` has none."""
    if head not in HF_HEADS:
        raise _error(spec, f"no head {head!r}", f"heads: {', '.join(HF_HEADS)}")
    auto_class = getattr(transformers, HF_HEADS[head], None)
    if auto_class is None:
        raise _error(spec, f"this transformers has no {HF_HEADS[head]}", "choose another head, or upgrade transformers")
    if model_type not in _types_with(auto_class, model_type):
        has = [
            name
            for name, cls in HF_HEADS.items()
            if model_type in _types_with(getattr(transformers, cls, None), model_type)
        ]
        raise _error(
            spec, f"{model_type!r} has no {head!r} head ({HF_HEADS[head]})", f"its heads: {', '.join(has) or 'none'}"
        )
    return auto_class


def _types_with(auto_class: Any, model_type: str) -> Any:
    """The model types ``auto_class`` can build; everything (``model_type``) when transformers does not say."""
    if auto_class is None:
        return ()
    mapping = getattr(getattr(auto_class, "_model_mapping", None), "_model_mapping", None)  # model_type -> class name
    return mapping if isinstance(mapping, Mapping) else (model_type,)


def _config_fields(config_class: Any) -> set[str]:
    """The keys a config of ``config_class`` reads: its fields, aliases and ``__init__`` keywords.

    Empty (nothing is checked) when a default config cannot be made to list its fields.
    """
    try:
        fields = set(config_class().to_dict()) | set(getattr(config_class, "attribute_map", {}) or {})
        parameters = list(inspect.signature(config_class.__init__).parameters.values())
    except Exception:  # not a config this code can read: leave the check to transformers
        return set()
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return fields | {parameter.name for parameter in parameters if parameter.kind in named and parameter.name != "self"}


def _overrides(spec: str, query: str) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for item in filter(None, query.split("&")):
        key, equals, value = item.partition("=")
        if not equals or not key.strip():
            raise _error(spec, f"override {item!r} is not key=value", "write e.g. 'hf-config:gpt2?n_layer=2&n_embd=64'")
        overrides[key.strip()] = _value(value.strip())
    return overrides


def _value(text: str) -> Any:
    """An override's value: a number, a boolean, null, a ``[...]`` list of them, else a string.

    >>> _value("2"), _value("0.1"), _value("true"), _value("null"), _value("relu"), _value("'2'")
    (2, 0.1, True, None, 'relu', '2')
    >>> _value("[16,32]"), _value("[1, 1]"), _value("[a, 'b c']"), _value("[]")
    ([16, 32], [1, 1], ['a', 'b c'], [])
    """
    if text.startswith("[") and text.endswith("]"):
        try:
            parsed = json.loads(text)  # nested lists too
        except ValueError:
            inner = text[1:-1].strip()
            return [_value(part.strip()) for part in inner.split(",")] if inner else []
        return parsed
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if text.lower() in ("null", "none"):
        return None
    return text

"""What ``dir()`` of a public module offers: what tab completion, ``help()`` and doc tools list.

A module's own ``dir()`` lists every import it made (``torch``, ``Any``, ``annotations``), which
tab completion then offers as if it were hookscope's. A public module's ``__dir__`` lists instead
its ``__all__``, its dunders (``__doc__``, ``__file__``, ``__version__``: what tools read), and
its public submodules, also those not imported yet, which its ``__getattr__`` imports on first
use (``hs.integrations``). Imports nothing of hookscope, so that any module may use it.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from functools import cache
from types import ModuleType

__all__ = ["DEFINED_IN", "own_exports", "public_dir", "public_submodule"]

#: Where each export that :func:`own_exports` renamed is defined, for tools that must find its
#: source module (the test suite's doctest collection reads it; ``inspect.getsourcefile`` still works).
DEFINED_IN: dict[object, str] = {}


def own_exports(name: str) -> None:
    """Name the public module ``name`` as the home of every class and function its ``__all__`` lists.

    Reprs, tracebacks, pickles and documentation then show ``hookscope.Capture`` or
    ``hookscope.io.save_tensors``, the name a user writes, not the private module it happens to
    be defined in (``hookscope._capture...``).
    """
    module = sys.modules[name]
    for attribute in module.__all__:
        exported = getattr(module, attribute)
        home = getattr(exported, "__module__", None)
        if (
            (isinstance(exported, type) or callable(exported))
            and isinstance(home, str)
            and home.startswith("hookscope.")
            and home != name
        ):
            DEFINED_IN[exported] = home
            exported.__module__ = name


def public_dir(name: str) -> list[str]:
    """``dir()`` of the module ``name``: its ``__all__``, dunders and public submodules, sorted.

    >>> names = public_dir("hookscope.errors")
    >>> "SpecError" in names, "__doc__" in names, "Any" in names
    (True, True, False)
    """
    namespace = vars(sys.modules[name])
    dunders = (key for key in namespace if key.startswith("__") and key.endswith("__"))
    return sorted({*namespace.get("__all__", ()), *dunders, *_submodules(name)})


def public_submodule(name: str, attribute: str) -> ModuleType:
    """The public submodule ``attribute`` of the package ``name``, imported: for a module
    ``__getattr__``, which Python calls only for a name the module does not hold."""
    if not attribute.startswith("_") and attribute in _submodules(name):
        return importlib.import_module(f"{name}.{attribute}")
    raise AttributeError(f"module {name!r} has no attribute {attribute!r}")


@cache
def _submodules(name: str) -> frozenset[str]:
    """The public submodules of the package ``name`` (none for a plain module), read once."""
    path = getattr(sys.modules[name], "__path__", None)
    if path is None:
        return frozenset()
    return frozenset(found.name for found in pkgutil.iter_modules(path) if not found.name.startswith("_"))

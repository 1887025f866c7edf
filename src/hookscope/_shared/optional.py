"""Optional packages: imported where a feature needs them, refused with the install line when missing.

``import hookscope`` loads torch and numpy alone; matplotlib, jinja2, pandas, zarr, safetensors,
datasets and tensorboard load on first use through :func:`require`, so every missing package is
reported the same way, with what needed it and the one ``pip install`` that fixes it.

>>> require("math", purpose="this example").sqrt(4.0)
2.0
>>> require("no_such_package", extra="plots", purpose="hs.plots")
Traceback (most recent call last):
...
hookscope.errors.MissingDependencyError: hs.plots needs no_such_package: pip install 'hookscope[plots]'
"""

from __future__ import annotations

import importlib
import re
from types import ModuleType

from hookscope.errors import MissingDependencyError

__all__ = ["require"]


def require(
    module: str,
    *,
    purpose: str,
    extra: str | None = None,
    package: str | None = None,
    hint: str = "",
    minimum: tuple[int, ...] | None = None,
) -> ModuleType:
    """Import ``module`` or raise :class:`MissingDependencyError` naming ``purpose`` and the fix.

    Args:
        module: the module to import, e.g. ``"matplotlib.figure"``.
        purpose: what needs it, the subject of "needs": ``"hs.plots"``, ``"to_pandas()"``.
        extra: the hookscope extra that installs it (``pip install 'hookscope[plots]'``); without
            one the message names the package itself.
        package: the name pip knows it by, when it is not the module's first part.
        hint: said after the install line, e.g. ``" (or save to .npz or .pt)"``.
        minimum: the oldest version that works, checked against ``__version__``.
    """
    name = package or module.split(".")[0]
    wanted = name if minimum is None else f"{name}>={'.'.join(map(str, minimum))}"
    install = f"pip install 'hookscope[{extra}]'" if extra else f"pip install {_quoted(wanted)}"
    try:
        imported = importlib.import_module(module)
    except ImportError as error:
        raise MissingDependencyError(f"{purpose} needs {wanted}: {install}{hint}") from error
    if minimum is not None:
        top = importlib.import_module(module.split(".")[0])
        found = str(getattr(top, "__version__", "0"))
        if _version(found) < minimum:
            raise MissingDependencyError(
                f"{purpose} needs {wanted}, found {found}: pip install -U {_quoted(wanted)}{hint}"
            )
    return imported


def _quoted(requirement: str) -> str:
    """A requirement as a shell reads it: ``numpy``, but ``'zarr>=3.1'`` (``>`` would redirect)."""
    return f"'{requirement}'" if any(c in requirement for c in "<>=[]") else requirement


def _version(text: str) -> tuple[int, ...]:
    """``"3.1.2rc1"`` -> ``(3, 1, 2)``: the leading release numbers."""
    match = re.match(r"\d+(?:\.\d+)*", text)
    return tuple(int(part) for part in match.group(0).split(".")) if match else (0,)

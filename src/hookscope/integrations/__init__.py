"""Integrations with training frameworks; each module imports its framework only when used.

- :mod:`hookscope.integrations.hf`: ``HookscopeCallback`` for the transformers ``Trainer``;
- :mod:`hookscope.integrations.lightning`: ``HookscopeCallback`` for a Lightning ``Trainer``.
"""

from types import ModuleType
from typing import TYPE_CHECKING

from hookscope._shared.names import public_dir, public_submodule

__all__: list[str] = []


def __dir__() -> list[str]:
    """The dunders and the public submodules, imported or not: what tab completion offers."""
    return public_dir(__name__)


if not TYPE_CHECKING:  # hidden from mypy, which would otherwise accept any attribute of this package

    def __getattr__(name: str) -> ModuleType:
        """A submodule not imported yet (``hookscope.integrations.hf``), imported now."""
        return public_submodule(__name__, name)

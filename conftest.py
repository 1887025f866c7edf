"""Test-session set-up shared by the suite in tests/ and the doctests in src/hookscope."""

from __future__ import annotations

import doctest
from typing import Any

import pytest

import hookscope

_from_module = doctest.DocTestFinder._from_module


def _from_defining_module(self: doctest.DocTestFinder, module: Any, candidate: Any) -> bool:
    """Collect an export's doctests in the module that defines it.

    ``hookscope`` names itself as every export's ``__module__`` (``hookscope.Capture``), which
    would make the doctest finder skip each export in its own module and, for a class, every
    method's example with it; the package records where each export really lives.
    """
    try:
        home = hookscope._defined_in.get(candidate)
    except TypeError:  # unhashable: not an export
        home = None
    if module is not None and home is not None:
        return bool(module.__name__ == home)
    return bool(_from_module(self, module, candidate))


doctest.DocTestFinder._from_module = _from_defining_module  # type: ignore[method-assign]


#: Doctests that need the markers a test function would carry; a doctest cannot be decorated.
DOCTEST_MARKS = {
    "hookscope.demo.tour.run_tour": ("slow", "transformers"),  # the whole tour: a GPT-2, a report
    "hookscope.demo.induction.load_induction_model": ("transformers",),  # builds the GPT-2 it loads
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if isinstance(item, pytest.DoctestItem):
            for name in DOCTEST_MARKS.get(item.name, ()):
                item.add_marker(getattr(pytest.mark, name))

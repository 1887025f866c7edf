"""The package as users meet it: the public API, light imports, typing, errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import hookscope as hs
from hookscope import errors


def test_all_is_sorted_and_complete() -> None:
    assert hs.__all__ == sorted(hs.__all__)
    for name in hs.__all__:
        assert hasattr(hs, name), name


def test_import_is_light() -> None:
    heavy = ["typer", "rich", "matplotlib", "zarr", "jinja2", "transformers", "pandas", "tensorboard", "safetensors"]
    code = f"import sys, hookscope; print(sorted(set({heavy!r}) & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert done.stdout.strip() == "[]"


def test_py_typed_is_shipped() -> None:
    assert (Path(hs.__file__).parent / "py.typed").exists()


@pytest.mark.parametrize(
    ("error", "builtin"),
    [(errors.SelectionError, LookupError), (errors.SpecError, ValueError), (errors.UnsupportedModelError, TypeError)],
)
def test_errors_derive_from_base_and_builtin(error: type[Exception], builtin: type[Exception]) -> None:
    assert issubclass(error, errors.HookscopeError)
    assert issubclass(error, builtin)
    assert error.__name__ in (errors.__doc__ or "")

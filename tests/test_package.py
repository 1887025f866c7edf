"""The package as users meet it: the public API, light imports, typing, errors."""

from __future__ import annotations

import doctest
import inspect
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hookscope as hs
from hookscope import errors
from hookscope.tensors import tensor_stats


def test_all_is_sorted_and_complete() -> None:
    assert hs.__all__ == sorted(hs.__all__)
    for name in hs.__all__:
        assert hasattr(hs, name), name


@pytest.mark.slow
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


def test_every_export_names_hookscope_as_its_module() -> None:
    """Reprs, tracebacks and pickles show the name a user writes, never a private path."""
    for name in hs.__all__:
        exported = getattr(hs, name)
        if isinstance(exported, type) or inspect.isfunction(exported):
            assert exported.__module__ == "hookscope", name
    assert repr(hs.Capture).startswith("<class 'hookscope.Capture'")


def test_exports_still_pickle_and_keep_their_source() -> None:
    site = hs.Site("h.0.mlp", 1, "output", "[0]")
    assert pickle.loads(pickle.dumps(site)) == site
    stats = tensor_stats(torch.arange(4.0))
    assert pickle.loads(pickle.dumps(stats)) == stats
    assert inspect.getsourcefile(hs.capture) is not None
    assert Path(inspect.getsourcefile(hs.capture)).parts[-2:] == ("_capture", "api.py")  # type: ignore[arg-type]


def test_doctests_of_exports_are_collected_where_they_are_defined() -> None:
    """The doctest finder is told each export's real module (see conftest.py): a class's
    method examples would otherwise be skipped silently."""
    finder = doctest.DocTestFinder()
    from hookscope._trace import result

    names = {test.name for test in finder.find(result)}
    assert "hookscope._trace.result.Trace.measured_leaves" in names
    assert not any("Trace" in test.name for test in finder.find(hs))


def test_make_demo_installs_every_package_the_tour_imports() -> None:
    import ast
    import re

    import tomllib

    root = Path(__file__).resolve().parents[1]
    tour = root / "src" / "hookscope" / "demo" / "tour.py"
    imported = {
        (node.module or "").split(".")[0]
        for node in ast.walk(ast.parse(tour.read_text()))
        if isinstance(node, ast.ImportFrom)
    } | {
        alias.name.split(".")[0]
        for node in ast.walk(ast.parse(tour.read_text()))
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    installed = {re.split(r"[<>=\[ ]", spec)[0] for spec in project["dependencies"]}
    installed |= {re.split(r"[<>=\[ ]", spec)[0] for spec in project["optional-dependencies"]["demo"]}
    optional = {"transformers", "jinja2", "matplotlib"}  # imported by the steps and the report they write
    third_party = (imported - set(sys.stdlib_module_names) - {"hookscope", "__future__"}) | optional
    assert third_party <= installed | {"torch"}, third_party - installed
    makefile = (root / "Makefile").read_text()
    assert '-e ".[demo]"' in makefile.split("\n$(VENV)/.installed:")[1].split("\n\n")[0]


#: The modules a user imports by name: the package, its public modules and the documented entry points.
PUBLIC_MODULES = [
    "hookscope",
    "hookscope.cli",
    "hookscope.demo",
    "hookscope.demo.shapes",
    "hookscope.edits",
    "hookscope.errors",
    "hookscope.integrations",
    "hookscope.integrations.hf",
    "hookscope.integrations.lightning",
    "hookscope.io",
    "hookscope.methods",
    "hookscope.plots",
    "hookscope.redaction",
    "hookscope.sinks",
    "hookscope.tensors",
]


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_tab_completion_offers_only_public_names(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``dir()`` (what tab completion lists) holds no imported module, typing name or ``annotations``;
    it holds the module's dunders (what ``help()``, doctest and IDEs read) and every public
    submodule, also one not imported yet."""
    import collections.abc
    import importlib
    import types
    import typing

    try:
        module = importlib.import_module(name)
    except hs.MissingDependencyError:
        pytest.skip(f"{name} needs an optional package that is not installed")
    typing_names = [value for space in (typing, collections.abc) for key, value in vars(space).items() if key[0] != "_"]
    public = getattr(module, "__all__", None)
    for shown in dir(module):
        if shown.startswith("_"):
            continue
        value = getattr(module, shown)
        assert shown != "annotations", name
        if isinstance(value, types.ModuleType):  # only the module's own public submodules
            assert value.__name__ == f"{name}.{shown}", f"{name}.{shown} is the imported module {value.__name__}"
        else:
            assert public is None or shown in public, f"{name}.{shown} is not in {name}.__all__"
            assert not any(value is kind for kind in typing_names), f"{name}.{shown} is a typing name"
    for exported in public or []:
        assert exported in dir(module), f"{name}.{exported} is public yet not offered"
    if name == "hookscope":
        assert {"edits", "errors", "methods", "plots", "__version__"} <= set(dir(module))
    dunders = {key for key in vars(module) if key.startswith("__") and key.endswith("__")}
    assert {"__name__", "__doc__", "__file__"} <= dunders <= set(dir(module)), name
    assert public is None or "__all__" in dir(module)
    folder = Path(str(module.__file__)).parent
    on_disk = set()
    if Path(str(module.__file__)).name == "__init__.py" and name != "hookscope.cli":  # cli: main is its API
        assert "__path__" in dir(module)
        on_disk = {
            path.stem
            for path in folder.iterdir()
            if not path.name.startswith("_") and (path.suffix == ".py" or (path / "__init__.py").is_file())
        }
    with monkeypatch.context() as patched:  # as in a fresh interpreter: no submodule imported yet
        for child in on_disk:
            patched.delitem(sys.modules, f"{name}.{child}", raising=False)
            patched.delattr(module, child, raising=False)
        assert on_disk <= set(dir(module)), f"{name}: public submodules missing from dir()"
    for child in on_disk - set(public or []):  # hs.plots.attention is the function, not its module
        assert getattr(module, child).__name__ == f"{name}.{child}"  # offered, so it can be read

"""The layering contract of docs/architecture.md, read from the source: dependencies point down only.

- ``_core`` imports only ``errors`` (and ``_version``) besides itself;
- ``_arch`` (model families: canonical names, sample inputs, attention) imports only ``_core`` and
  ``errors``;
- ``_shared`` imports only ``_arch``, ``_core`` and ``errors``;
- ``_store`` (the on-disk format and its readers, which never touch a model) imports only
  ``_shared``, ``_arch``, ``_core`` and ``errors``;
- a feature (``_capture``, ``_trace``, ...) imports ``_shared``, ``_arch``, ``_core``, ``errors``, its own
  modules, and other features' public faces only: a package's ``__init__`` (``hookscope._capture``,
  never ``hookscope._capture.cache``) and the public feature modules ``hookscope.edits`` and
  ``hookscope.plots``; and the store's package root (``hookscope._store``, never ``hookscope._store.array``);
- the CLI imports only the public API: ``hookscope`` itself, its public modules (``errors``,
  ``edits``, ``plots``, ``methods``, ``redaction``, ``io``, ``sinks``, ``tensors``), the demo models
  and ``hookscope.cli.*``; not even ``hookscope._version``.

Every import counts, also one inside a function. A violation names the file, the line and the rule.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "hookscope"

FOUNDATION = {"hookscope.errors", "hookscope._version"}
#: The layer between the features and ``_shared``: the store's format and its readers.
STORE = "_store"
FEATURES = {
    "_capture",
    "_trace",
    "_edit",
    "_extract",
    "_diff",
    "_report",
    "_hooks",
    "_layers",
    "_methods",
    "_monitor",
    "_verify",
}
#: Public modules a feature may use as any user would (their package roots, not their internals).
PUBLIC_FEATURE_MODULES = {"hookscope.edits", "hookscope.plots"}
#: Public modules besides the package root, which the CLI may import.
PUBLIC_MODULES = {
    "hookscope.errors",
    "hookscope.edits",
    "hookscope.plots",
    "hookscope.methods",
    "hookscope.redaction",
    "hookscope.io",
    "hookscope.sinks",
    "hookscope.tensors",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(dotted: str) -> bool:
    relative = Path(*dotted.split("."))
    return (PACKAGE.parent / relative).with_suffix(".py").is_file() or (PACKAGE.parent / relative).is_dir()


def imports_of(path: Path) -> list[tuple[int, str]]:
    """Every hookscope module ``path`` imports, with the line: ``from a import b`` is ``a.b`` when that is a module.

    Each (line, module) once: ``from a import b, c`` imports the module ``a`` once, not twice.
    """
    found: dict[tuple[int, str], None] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names if alias.name.split(".")[0] == "hookscope"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "hookscope":
            base = node.module or ""
            names = [f"{base}.{alias.name}" if is_module(f"{base}.{alias.name}") else base for alias in node.names]
        else:
            continue
        found.update(dict.fromkeys((node.lineno, name) for name in names))
    return sorted(found)


def top(dotted: str) -> str:
    """The first part below ``hookscope``: ``_core``, ``_capture``, ``cli``, ``errors``, or ``""`` for the root."""
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else ""


def violation(importer: str, target: str) -> str | None:
    """Why ``importer`` may not import ``target``, or None when it may."""
    layer, wanted = top(importer), top(target)
    if layer == wanted:
        return None
    if layer == "cli":  # before the foundation: hookscope._version is private too, hs.__version__ is not
        public = target == "hookscope" or target in PUBLIC_MODULES or wanted == "demo"
        return None if public else "the CLI imports only the public API (import hookscope as hs, hookscope.cli.*)"
    if target in FOUNDATION:
        return None
    if layer == "_core":
        return "_core imports only errors"
    if layer == "_arch":
        return None if wanted == "_core" else "_arch imports only _core and errors"
    if layer == "_shared":
        return None if wanted in {"_arch", "_core"} else "_shared imports only _arch, _core and errors"
    if layer == STORE:
        allowed = wanted in {"_arch", "_core", "_shared"}
        return None if allowed else "_store imports only _shared, _arch, _core and errors"
    if layer in FEATURES:
        if wanted in {"_arch", "_core", "_shared"} or target == f"hookscope.{STORE}":
            return None
        if wanted in FEATURES and target == f"hookscope.{wanted}":
            return None  # another feature's public face
        if target in PUBLIC_FEATURE_MODULES:
            return None
        return "a feature imports _shared, _arch, _core, errors, the _store root and other features' roots only"
    return None  # the public layer (hookscope, edits, plots, demo) may use anything below it


def all_violations() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = module_name(path)
        for line, target in imports_of(path):
            reason = violation(importer, target)
            if reason is not None:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {importer} imports {target}: {reason}")
    return found


def test_dependencies_point_down_only() -> None:
    found = all_violations()
    assert not found, "imports against the layers of docs/architecture.md:\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("importer", "target"),
    [
        ("hookscope._core.sites", "hookscope._shared.stats"),
        ("hookscope._core.ops", "hookscope._arch.attention"),
        ("hookscope._arch.std.registry", "hookscope._shared.stats"),
        ("hookscope._arch.samples", "hookscope._capture"),
        ("hookscope._shared.stats", "hookscope._trace"),
        ("hookscope._diff.api", "hookscope._capture.cache"),
        ("hookscope._report.api", "hookscope.plots.depth"),
        ("hookscope.cli.app", "hookscope._capture"),
        ("hookscope.cli.app", "hookscope._version"),
        ("hookscope._store.store", "hookscope._extract"),
        ("hookscope._store.array", "hookscope._capture"),
        ("hookscope._extract.api", "hookscope._store.array"),
        ("hookscope._shared.reduce", "hookscope._store"),
    ],
)
def test_the_contract_refuses_upward_and_private_imports(importer: str, target: str) -> None:
    assert violation(importer, target) is not None


@pytest.mark.parametrize(
    ("importer", "target"),
    [
        ("hookscope._core.sites", "hookscope.errors"),
        ("hookscope._shared.stats", "hookscope._core.compat.compiled"),
        ("hookscope._arch.std.observe", "hookscope._core.attach"),
        ("hookscope._shared.call_recorder", "hookscope._arch.std"),
        ("hookscope._capture.recorder", "hookscope._arch.plan"),
        ("hookscope._extract.pipeline", "hookscope._capture"),
        ("hookscope._report.api", "hookscope.plots"),
        ("hookscope.cli.app", "hookscope"),
        ("hookscope.cli.parse.specs", "hookscope.demo.models"),
        ("hookscope.plots.grads", "hookscope._monitor"),
        ("hookscope._extract.api", "hookscope._store"),
        ("hookscope._store.array", "hookscope._shared.bits"),
        ("hookscope._store.layout", "hookscope._core.sites"),
    ],
)
def test_the_contract_allows_what_the_layers_allow(importer: str, target: str) -> None:
    assert violation(importer, target) is None


def test_imports_are_read_inside_functions_and_from_forms(tmp_path: Path) -> None:
    source = tmp_path / "example.py"
    source.write_text(
        "from hookscope import errors\nfrom hookscope._capture import capture\n"
        "def f():\n    import hookscope._trace.rows\n"
    )
    assert imports_of(source) == [(1, "hookscope.errors"), (2, "hookscope._capture"), (4, "hookscope._trace.rows")]


def test_one_statement_naming_a_module_twice_is_one_import(tmp_path: Path) -> None:
    source = tmp_path / "example.py"
    source.write_text(
        "from hookscope._trace import TraceRow, tracing\n"
        "from hookscope import errors, plots, select\n"
        "import hookscope._core.tree, hookscope._core.tree\n"
    )
    assert imports_of(source) == [
        (1, "hookscope._trace"),
        (2, "hookscope"),
        (2, "hookscope.errors"),
        (2, "hookscope.plots"),
        (3, "hookscope._core.tree"),
    ]


def test_a_violation_is_reported_once_with_file_line_and_rule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "hookscope"
    (package / "cli").mkdir(parents=True)
    (package / "_capture").mkdir()
    (package / "cli" / "app.py").write_text("import hookscope\nfrom hookscope._capture.cache import Cache, load\n")
    (package / "_capture" / "cache.py").write_text("from hookscope.errors import SpecError\n")
    (package / "errors.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    assert all_violations() == [
        "hookscope/cli/app.py:2: hookscope.cli.app imports hookscope._capture.cache: the CLI imports only the "
        "public API (import hookscope as hs, hookscope.cli.*)"
    ]


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or round a loop (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if target not in graph:
                continue
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return cycles


def test_no_module_imports_itself_round_a_loop() -> None:
    """A cycle hidden behind an import inside a function or under TYPE_CHECKING is still a cycle:
    the two modules are one unit that pretends to be two."""
    graph = {
        module_name(path): {target for _, target in imports_of(path)} - {module_name(path)}
        for path in PACKAGE.rglob("*.py")
    }
    assert import_cycles(graph) == []


def test_import_cycles_are_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_cycles(graph) == [["a", "b", "c"]]


#: The store's writing side (making a store, its manifest, checksums, statistics parts, the writer
#: record) and its readers (``open_store``, arrays, the loader, the export).
STORE_WRITERS = ("zarr_io", "manifest", "checksums", "running_stats", "writer_record", "object_record", "layout")
STORE_READERS = ("store", "array", "loader", "export", "attributes", "statistics", "window", "loader_options")


def test_the_store_writer_imports_none_of_its_readers() -> None:
    """Writing a store needs none of the code that reads one back, directly or through another module."""
    graph = {module_name(path): {target for _, target in imports_of(path)} for path in PACKAGE.rglob("*.py")}
    readers = {f"hookscope._store.{name}" for name in STORE_READERS}
    for writer in STORE_WRITERS:
        seen: set[str] = set()
        todo = [f"hookscope._store.{writer}"]
        while todo:
            module = todo.pop()
            for target in graph.get(module, set()) - seen:
                seen.add(target)
                todo.append(target)
        assert not seen & readers, f"hookscope._store.{writer} imports the reader(s) {sorted(seen & readers)}"

"""The package's import graph has no cycle, between modules or between packages: every module imports only modules
below it, `kernels` below `targets` and `models`; and the core package imports nothing of the packages built on it
(`lattice_testing`, `lattice_reference`).

Imports are read from the source with `ast` (module-level and function-level ones alike, since a lazy import
closes a circle too). Those under ``if TYPE_CHECKING:`` do not run, but a circle through them still knots the
modules' design, so the graph is checked with and without them. ``from pkg import name``
counts as an import of ``pkg.name`` where that is a module, else of ``pkg``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lattice_inference

PACKAGE = Path(lattice_inference.__file__).parent
ROOT = PACKAGE.name


def _modules() -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, whether it is a package's ``__init__``)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(name: str, path: Path, is_package: bool, modules: set[str], type_only: bool) -> set[str]:
    """The package's modules that ``name`` imports (``type_only``: those under ``if TYPE_CHECKING:`` too)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child) and not type_only:
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    here = name.split(".") if is_package else name.split(".")[:-1]
                    here = here[: len(here) - (child.level - 1)]
                    base = ".".join([*here, base] if base else here)
                found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in child.names)
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return {m for m in found if m in modules and m != name}


def import_graph(type_only: bool = False) -> dict[str, set[str]]:
    """Each module of the package and the package modules it imports (``type_only``: counting type-only ones)."""
    modules = _modules()
    return {
        name: _imports(name, path, is_package, set(modules), type_only) for name, (path, is_package) in modules.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing itself): the cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_the_graph_is_read():
    graph = import_graph()
    assert f"{ROOT}.engines.compare" in graph[f"{ROOT}.cli"]
    assert f"{ROOT}.options" in graph[f"{ROOT}.flags"]


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_type_only_imports_are_read_where_asked():
    graph, typed = import_graph(), import_graph(type_only=True)
    assert f"{ROOT}.sampling" not in graph[f"{ROOT}.drafters.base"]  # under `if TYPE_CHECKING:` there
    assert f"{ROOT}.sampling" in typed[f"{ROOT}.drafters.base"]


@pytest.mark.parametrize("type_only", [False, True])
def test_no_import_cycle(type_only: bool):
    found = cycles(import_graph(type_only))
    assert found == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


OUTSIDE_THE_CORE = ("lattice_testing", "lattice_reference")
"""Packages beside the core that build on it (test helpers; the seed's API): the core never imports them."""


def _absolute_imports(path: Path) -> set[str]:
    """Every absolute module name ``path`` imports, at any depth of its code (relative imports stay in the core)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_the_core_imports_nothing_built_on_it():
    wrong = {
        f"{path.relative_to(PACKAGE.parent)} imports {name}"
        for path in PACKAGE.rglob("*.py")
        for name in _absolute_imports(path)
        if name.split(".")[0] in OUTSIDE_THE_CORE
    }
    assert not wrong, "; ".join(sorted(wrong))
    assert not (PACKAGE / "testing").exists() and not (PACKAGE / "reference.py").exists()


LONGEST_FUNCTION = 80
"""Lines a function of the source may run to (its signature and docstring included): past that it does several
things, and is split where they part."""


def test_no_function_runs_over_80_lines():
    long = [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for package in (ROOT, *OUTSIDE_THE_CORE)
        for path in (PACKAGE.parent / package).rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (node.end_lineno or node.lineno) - node.lineno + 1 > LONGEST_FUNCTION
    ]
    assert not long, "; ".join(long)


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph between the core's packages and top-level modules (``lattice_inference.targets.lean`` ->
    ``targets``; ``lattice_inference.options`` -> ``options``): an edge where any module of one imports the other."""

    def part(name: str) -> str:
        return name.split(".")[1] if "." in name else name

    out: dict[str, set[str]] = {part(m): set() for m in graph}
    for module, imported in graph.items():
        out[part(module)] |= {part(i) for i in imported if part(i) != part(module)}
    return out


@pytest.mark.parametrize("type_only", [False, True])
def test_no_package_cycle(type_only: bool):
    found = cycles(package_graph(import_graph(type_only)))
    assert found == [], "package cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_kernels_sit_below_targets_models_and_options():
    """`kernels` (the products and native ops) imports no package above it: the layers run one way."""
    above = {"targets", "models", "mtp", "options", "drafters", "serve", "engines", "api", "decode", "batching"}
    assert not package_graph(import_graph(type_only=True))["kernels"] & above

"""The house plan holds: no import cycle inside `planner`, `executor` or `schemas`, and imports at
the top of each module.

A static check (ast over the package's files): every import counts, at any level, so a cycle hidden
by an import inside a function is still a cycle. Imports inside functions are allowed only where
they are deliberately lazy, each listed below with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import REPO

PACKAGES = ("planner", "executor", "schemas")

# (importing module, imported top-level name or module) -> why it is imported inside a function
LAZY_IMPORTS: dict[tuple[str, str], str] = {
    ("planner.plot", "matplotlib"): "drawing only: matplotlib takes ~1 s to import and only `plot` needs it",
    ("planner.plot", "matplotlib.pyplot"): "drawing only, after the backend is chosen (matplotlib.use)",
    ("executor", "executor.runtime"): "`import executor` and `python -m executor` stay light; torch loads on first use",
    ("executor", "executor.recorder"): "`import executor` stays light; torch loads when `executor.record` is first used",
    ("executor.models", "transformers"): "HF models only: transformers takes seconds to import",
    ("executor.record_cli", "rich.console"): "progress is drawn only when stderr is a terminal",
    ("executor.tide", "rich.console"): "`tide --help` and a quiet run never load rich",
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources(package: str) -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((REPO / package).rglob("*.py"))}


def _target(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    """The absolute module name an ImportFrom names (relative imports resolved)."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str, path: Path, modules: set[str]) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module level) for every import in the file; `modules` are the
    package's own, to tell `from pkg import submodule` from `from pkg import name`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top_level = {id(n) for n in tree.body}
    # imports under a module-level `if`/`try` (TYPE_CHECKING, optional dependencies) are module level
    for stmt in tree.body:
        if isinstance(stmt, (ast.If, ast.Try)):
            top_level |= {id(n) for n in ast.walk(stmt) if isinstance(n, (ast.Import, ast.ImportFrom))}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno, id(node) in top_level) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _target(module, node, path.name == "__init__.py")
            for alias in node.names:  # `from pkg import sub` imports the submodule pkg.sub when there is one
                name = f"{base}.{alias.name}"
                out.append((name if name in modules else base, node.lineno, id(node) in top_level))
    return out


def _graph(package: str) -> dict[str, set[str]]:
    sources = _sources(package)
    graph: dict[str, set[str]] = {name: set() for name in sources}
    for name, path in sources.items():
        for target, _, _ in _imports(name, path, set(sources)):
            if target in sources and target != name:
                graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
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
            visit(v)
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_import_graph_is_acyclic(package: str) -> None:
    cycles = _cycles(_graph(package))
    assert not cycles, f"{package}: modules that import each other (directly or around a loop): {cycles}"


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_sit_at_the_top(package: str) -> None:
    sources = _sources(package)
    inside = []
    for name, path in sources.items():
        for target, line, top in _imports(name, path, set(sources)):
            if not top and (name, target) not in LAZY_IMPORTS:
                inside.append(f"{path.relative_to(REPO)}:{line} imports {target}")
    assert not inside, "imports inside functions (move them to the top, or list them in LAZY_IMPORTS with why):\n" + \
        "\n".join(sorted(set(inside)))


def test_the_checks_see_a_cycle_and_a_lazy_import() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    path = REPO / "planner" / "cli.py"
    assert all(top for _, _, top in _imports("planner.cli", path, set(_sources("planner"))))

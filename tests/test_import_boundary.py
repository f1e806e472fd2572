"""One-way dependencies (DESIGN.md §1, §8.3): `planner` never imports torch, `executor` never imports planner.

Checked twice: dynamically (a fresh interpreter imports every module of the package and looks at
sys.modules, which also catches imports done indirectly through other modules) and statically (an
AST scan of the sources, which also catches imports inside functions that never ran).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

# run in a fresh interpreter: import every module of PACKAGE, report which first pulled in FORBIDDEN
_PROBE = r"""
import importlib, json, pkgutil, sys
package, forbidden = sys.argv[1], sys.argv[2]
def loaded():
    return sorted(m for m in sys.modules if m == forbidden or m.startswith(forbidden + "."))
root = importlib.import_module(package)
report = {"modules": [package], "culprit": package if loaded() else None, "errors": {}}
for info in pkgutil.walk_packages(root.__path__, package + "."):
    if info.name.rsplit(".", 1)[-1] == "__main__":
        continue  # running it would start the CLI
    try:
        importlib.import_module(info.name)
    except Exception as exc:
        report["errors"][info.name] = f"{type(exc).__name__}: {exc}"
        continue
    report["modules"].append(info.name)
    if loaded() and report["culprit"] is None:
        report["culprit"] = info.name
report["loaded"] = loaded()
print(json.dumps(report))
"""


def _probe(package: str, forbidden: str, *, extra_path: Path | None = None) -> dict:
    env = dict(os.environ)
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(extra_path), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", _PROBE, package, forbidden], cwd=REPO, capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_planner_never_imports_torch() -> None:
    report = _probe("planner", "torch")
    assert "planner.cli" in report["modules"]
    assert report["culprit"] is None, f"{report['culprit']} imports torch (directly or through {report['loaded'][:3]})"
    assert not report["errors"], f"planner modules that fail to import: {report['errors']}"


def test_schemas_never_import_torch() -> None:
    report = _probe("schemas", "torch")
    assert report["culprit"] is None, f"{report['culprit']} imports torch"


def test_executor_never_imports_planner() -> None:
    pytest.importorskip("torch")  # the executor needs torch; a planner-only install has nothing to check
    report = _probe("executor", "planner")
    assert report["culprit"] is None, f"{report['culprit']} imports planner (through {report['loaded'][:3]})"
    # modules still being written may fail for their own reasons; the boundary holds for the rest
    assert all("planner" not in err for err in report["errors"].values()), report["errors"]


def test_probe_catches_a_forbidden_import(tmp_path: Path) -> None:
    """The checker itself: a package whose second module imports the forbidden one is caught and named."""
    pkg = tmp_path / "fakepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "clean.py").write_text("import math\n")
    (pkg / "dirty.py").write_text("def f():\n    return 1\nimport wave\n")
    report = _probe("fakepkg", "wave", extra_path=tmp_path)
    assert report["culprit"] == "fakepkg.dirty"


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in ("import_module", "__import__"):
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return found


def _violations(package: str, forbidden: str) -> list[str]:
    out = []
    for path in sorted((REPO / package).rglob("*.py")):
        for line, module in _imports(path):
            if module == forbidden or module.startswith(forbidden + "."):
                out.append(f"{path.relative_to(REPO)}:{line}: import {module}")
    return out


@pytest.mark.parametrize("package, forbidden", [("planner", "torch"), ("schemas", "torch"), ("executor", "planner")])
def test_sources_have_no_forbidden_import(package: str, forbidden: str) -> None:
    assert _violations(package, forbidden) == []


def test_static_scan_catches_imports(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("def f():\n    import torch.nn as nn\n    from planner.show import register\n"
                   "    importlib.import_module('torch')\n")
    modules = [m for _, m in _imports(src)]
    assert modules == ["torch.nn", "planner.show", "torch"]

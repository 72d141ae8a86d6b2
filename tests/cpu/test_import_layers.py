"""kvcupy's modules form layers: each imports alone, and no two import each other.

Every module under kvcupy/ is imported by itself in a fresh interpreter (an
import that only works after some other module was imported first is a hidden
dependency). And the graph of kvcupy's imports, read from the source with
`ast` (module-level and function-level `import` / `from` statements alike),
has no cycle: a lazy import inside a function still makes its module depend
on the other one.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "kvcupy"
ROOT = PACKAGE_DIR.parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE_DIR.rglob("*.py"))}


def _cupy_missing() -> bool:
    try:
        return importlib.util.find_spec("cupy") is None
    except ValueError:
        return True


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_imports_alone(module):
    result = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT, capture_output=True, text=True)
    if result.returncode and "No module named 'cupy'" in result.stderr and _cupy_missing():
        pytest.skip(f"{module} needs CuPy, which is not installed")
    assert result.returncode == 0, f"import {module} failed alone:\n{result.stderr}"


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name of a (possibly relative) import's target, seen from `module`."""
    if level == 0:
        return target or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _known(name: str) -> str | None:
    """The longest prefix of `name` that is one of kvcupy's modules."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in MODULES:
            return candidate
        parts.pop()
    return None


def import_graph() -> dict[str, set[str]]:
    """kvcupy module -> the kvcupy modules it imports anywhere in its source.

    `from package import name` is an edge to package.name where that is a
    module, else to the package. A package's __init__ re-exporting its own
    submodules counts (those are real imports). The parent package that
    Python runs before any submodule is no edge: no statement imports it, and
    it cannot import its submodule back without a statement of its own."""
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        is_package = path.name == "__init__.py"
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                source = _resolve(module, is_package, node.level, node.module)
                targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in MODULES else source
                           for alias in node.names]
            else:
                continue
            edges.update(found for found in map(_known, targets) if found is not None and found != module)
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path that ends where it starts, or None."""
    done, path, on_path = set(), [], set()

    def visit(node: str) -> list[str] | None:
        path.append(node)
        on_path.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt in on_path:
                return path[path.index(nxt):] + [nxt]
            if nxt not in done:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        on_path.discard(node)
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done:
            found = visit(start)
            if found:
                return found
    return None


def test_the_import_graph_is_acyclic():
    cycle = find_cycle(import_graph())
    assert cycle is None, "kvcupy's modules import each other: " + " -> ".join(cycle)


def test_the_cycle_check_sees_function_level_and_relative_imports(tmp_path):
    """The graph reads lazy and relative imports: a module that imports its importer
    inside a function is a cycle."""
    graph = {"kvcupy.backends.cuda.planner": set(), "kvcupy.backends.cuda.attention": set()}
    source = "def f():\n    from .attention import paged_attention\n"
    tree = ast.parse(source)
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom))
    target = _resolve("kvcupy.backends.cuda.planner", False, node.level, node.module)
    assert _known(target) == "kvcupy.backends.cuda.attention"
    graph["kvcupy.backends.cuda.planner"].add(target)
    graph["kvcupy.backends.cuda.attention"].add("kvcupy.backends.cuda.planner")
    assert find_cycle(graph) == ["kvcupy.backends.cuda.attention", "kvcupy.backends.cuda.planner",
                                 "kvcupy.backends.cuda.attention"]

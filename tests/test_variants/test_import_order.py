"""The modules of ``variants/`` import one another without a circle, and none imports the harness
(docs/DESIGN walls): each module's imports of the package, read from its source, form a DAG."""

from __future__ import annotations

import ast
from pathlib import Path

import variants

ROOT = Path(variants.__file__).parent


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The modules of the package that ``path`` imports, anywhere in it (a lazy import inside a function counts)."""
    name = _module(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            source = f"{base}.{node.module}" if node.level and node.module else (base if node.level else node.module)
            found.update(f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source for alias in node.names)
    return {module for module in found if module in modules or module.split(".")[0] == "harness"} - {name}


def _graph() -> dict[str, set[str]]:
    paths = sorted(ROOT.rglob("*.py"))
    modules = {_module(path) for path in paths}
    return {_module(path): _imports(path, modules) for path in paths}


def test_variants_import_no_harness_module():
    offenders = {module: sorted(m for m in targets if m.startswith("harness")) for module, targets in _graph().items()}
    assert not {module: found for module, found in offenders.items() if found}


def test_the_modules_of_variants_form_no_import_circle():
    graph = {module: {target for target in targets if target.startswith("variants")} for module, targets in _graph().items()}
    done, stack = set(), []

    def visit(module):
        if module in stack:
            raise AssertionError("import circle: " + " -> ".join([*stack[stack.index(module) :], module]))
        if module in done:
            return
        stack.append(module)
        for target in sorted(graph[module]):
            visit(target)
        stack.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)

"""The walls of the house (docs/map.md): the modules of ``variants/`` and ``harness/`` import one
another without a circle, ``variants`` imports no harness module, and the report, which reads
results files only, reaches neither the run loop, the scenario loader, the models nor the variants.

The import graph is read from the sources (an import inside a function counts; one under
``if TYPE_CHECKING:`` does not); the report's wall is also checked in a fresh interpreter, since the
task registry imports its modules by name (``harness.tasks.BUILTIN``)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("variants", "harness")
#: What the report may not reach: the run loop and its workers, the scenario loader, models, variants.
OUTSIDE_THE_REPORT = (
    "harness.runner", "harness.worker", "harness.scenario", "harness.schema", "harness.scenario_files", "harness.expansion",
    "harness.models", "harness.builders", "variants",
)


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _nodes(tree: ast.AST):
    """Every node of ``tree`` outside ``if TYPE_CHECKING:`` blocks."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            continue
        yield node
        yield from _nodes(node)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The project modules ``path`` imports (the innermost module each import names)."""
    name = _module(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            source = f"{base}.{node.module}" if node.level and node.module else (base if node.level else node.module)
            found.update(f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source for alias in node.names)
    inside = set()
    for module in found:
        while module and module not in modules:
            module = module.rpartition(".")[0]
        inside.add(module)
    return inside - {"", name}


def _graph() -> dict[str, set[str]]:
    paths = sorted(path for package in PACKAGES for path in (ROOT / package).rglob("*.py"))
    modules = {_module(path) for path in paths}
    return {_module(path): _imports(path, modules) for path in paths}


def _outside(module: str) -> bool:
    return any(module == wall or module.startswith(wall + ".") for wall in OUTSIDE_THE_REPORT)


def test_variants_import_no_harness_module():
    offenders = {module: sorted(t for t in targets if t.startswith("harness")) for module, targets in _graph().items() if module.startswith("variants")}
    assert not {module: found for module, found in offenders.items() if found}


def test_no_import_circle():
    graph = _graph()
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


def test_the_report_reaches_neither_runner_scenario_models_nor_variants():
    graph = _graph()
    reached, todo = set(), [module for module in graph if module.startswith("harness.report")]
    while todo:
        for target in graph[todo.pop()] - reached:
            reached.add(target)
            todo.append(target)
    assert not sorted(filter(_outside, reached))
    # The task registry imports its modules by name: load every task as the report does, then look.
    code = "import sys, harness.report, harness.tasks; harness.tasks.tasks(); print(' '.join(sorted(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout.split()
    assert not sorted(filter(_outside, loaded))

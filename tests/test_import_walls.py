"""The walls of the house (docs/map.md): harness/ is grouped by role, and which group may import
which is written once, in ``WALLS``; every import edge of the source keeps to it. The modules of
``variants/`` and ``harness/`` import one another without a circle, ``variants`` imports no harness
module, and the report, which reads results files only, reaches neither the run loop, the scenario
loader, the models nor the variants.

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
#: The groups of harness/ (its subpackages; ``cli`` is the top floor: harness/cli.py, demo.py, options.py)
#: and ``variants``, each with the groups it may import. Two pairs import each other, and only so: the
#: report reads the task registry (``harness.tasks``), whose shipped tasks draw their report sections
#: with the report's figures (``report.figures``, ``report.seeds``); the translation model pads with its
#: vocabulary's id (``tasks.parallel_text.PAD``).
WALLS = {
    "variants": set(),
    "common": set(),
    "models": {"tasks", "variants"},
    "measuring": {"common", "models", "variants"},
    "tasks": {"common", "measuring", "models", "report", "variants"},
    "scenarios": {"common", "measuring", "models", "tasks", "variants"},
    "results": {"common", "measuring", "scenarios"},
    "report": {"common", "results", "scenarios", "tasks"},
    "running": {"common", "measuring", "results", "scenarios", "tasks", "variants"},
    "kernels": {"common", "variants"},
    "revisions": {"common", "kernels", "measuring", "results", "running", "scenarios", "variants"},
    "gpu": {"common", "measuring", "report", "results", "running", "scenarios", "tasks"},
    "history": {"common", "report", "results"},
    "cli": {"common", "gpu", "history", "kernels", "measuring", "report", "results", "revisions", "running", "scenarios", "tasks", "variants"},
}
#: What the report may not reach: the run loop and its workers, the scenario loader, models, variants.
OUTSIDE_THE_REPORT = (
    "harness.running",
    "harness.scenarios.scenario",
    "harness.scenarios.schema",
    "harness.scenarios.scenario_files",
    "harness.scenarios.expansion",
    "harness.models",
    "harness.measuring.builders",
    "variants",
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


def _group(module: str) -> str:
    """The group of a module: ``variants``, a subpackage of harness/, or ``cli`` for harness/'s own modules."""
    parts = module.split(".")
    if parts[0] == "variants":
        return "variants"
    return parts[1] if len(parts) > 1 and (ROOT / "harness" / parts[1]).is_dir() else "cli"


def _groups() -> set[str]:
    return {path.name for path in (ROOT / "harness").iterdir() if (path / "__init__.py").is_file()}


def test_every_group_of_harness_has_a_row_of_walls():
    assert not _groups() - set(WALLS)


def test_every_import_keeps_to_the_walls():
    crossings = sorted(
        f"{module} -> {target}"
        for module, targets in _graph().items()
        for target in targets
        if _group(target) != _group(module) and _group(target) not in WALLS[_group(module)]
    )
    assert not crossings, "imports across a wall (tests/test_import_walls.py, WALLS):\n" + "\n".join(crossings)


def test_each_group_says_what_it_owns_and_may_import():
    for group in sorted(_groups()):
        doc = ast.get_docstring(ast.parse((ROOT / "harness" / group / "__init__.py").read_text())) or ""
        assert doc, f"harness/{group}/__init__.py has no docstring"
        if group != "history":
            assert "May import" in doc or "Imports no other" in doc, f"harness/{group}/__init__.py does not say what it may import"


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


def test_a_worker_that_measures_every_variant_eagerly_never_imports_torchdynamo():
    """TorchDynamo costs a worker about 1 s of its start: only backend 'compile' may load it (variants/chunked.py's
    ``outside_compiled_graphs`` leaves the chunk loops out of compiled graphs without importing it)."""
    code = (
        "import sys, torch, variants, harness.running.worker, harness.running.workloads\n"
        "for name in variants.names():\n"
        "    core = variants.create(name, d_key=16)\n"
        "    core(**core.example_inputs(1, 2, 40, 16, requires_grad=True)).sum().backward()\n"
        "print('torch._dynamo' in sys.modules)"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.split() == ["False"]

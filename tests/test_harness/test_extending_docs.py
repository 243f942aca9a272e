"""docs/extending.md's worked example, run from the page itself (issue 56, item 4): the ``python`` blocks of "A
variant, end to end", joined, are a plugin file; its variant is listed with its parameters, its forms agree with
its reference, ``attnbench check`` passes it as the page shows, and a run measures it. Without ``PARAMS`` its
parameters are refused when given and ``check`` fails naming them."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from helpers import attnbench, attnbench_here

import variants
import variants.backends  # noqa: F401 - the shipped variants registered before a test copies the registry
from harness.scenarios.plugins import load_plugins, module_name
from variants import base, params
from variants.checking import compare_forms, make_inputs

DOC = Path(__file__).resolve().parents[2] / "docs" / "extending.md"
SECTION = "## A variant, end to end"
#: The declaration the example's class makes, which a copy leaves out.
DECLARATION = '    PARAMS = {"chunk_size": integer(), "horizon": integer()}\n'


def section() -> str:
    text = DOC.read_text()
    start = text.index(SECTION)
    return text[start : text.index("\n## ", start + len(SECTION))]


def example() -> str:
    """The section's python blocks, joined in order: the plugin file."""
    return "".join(re.findall(r"```python\n(.*?)```", section(), flags=re.S))


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """Write the example (``edit`` it first) as ``name``; its registrations are gone after the test."""
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    written = []

    def write(edit=lambda code: code, name="cosformer.py") -> str:
        path = tmp_path / name
        path.write_text(edit(example()))
        written.append(str(path))
        return str(path)

    yield write
    for path in written:
        sys.modules.pop(module_name(path), None)


def test_the_example_is_listed_and_its_forms_agree_with_its_reference(plugin):
    path = plugin()
    done = attnbench_here("list", "--plugin", path)
    assert done.returncode == 0, done.stderr
    assert f"  cosformer (from {path}): parameters: chunk_size (a positive int), horizon (a positive int)" in done.stdout.splitlines()
    core = variants.create("cosformer", 8, chunk_size=4).double()
    inputs = make_inputs(core, 2, 2, 19, 6, dtype=torch.float64, seed=0)
    checks = compare_forms(core, core, inputs, torch.float64)
    assert [check.ok for check in checks] == [True, True], [check.line() for check in checks]
    with pytest.raises(variants.VariantError, match=r"^cosformer: horizon must be a positive int, got 0$"):
        variants.create("cosformer", 8, horizon=0)
    with pytest.raises(variants.VariantError, match=r"^cosformer: position 4 is past horizon=4; raise horizon$"):
        variants.create("cosformer", 8, horizon=4)(*(torch.randn(1, 1, 5, 8),) * 3)


def test_an_undeclared_parameter_is_refused_naming_it(plugin):
    assert DECLARATION in example()
    load_plugins([plugin(lambda code: code.replace(DECLARATION, ""))])
    assert params.undeclared(base.registered("cosformer")) == ["chunk_size", "horizon"]
    with pytest.raises(variants.VariantError) as info:
        variants.create("cosformer", 8, horizon=100)
    assert str(info.value).startswith("cosformer: horizon is a keyword of its constructor that its PARAMS do not declare, so its value would go unchecked")
    with pytest.raises(variants.VariantError, match="unexpected keyword argument 'horizn'"):  # not a keyword of it: the constructor's refusal
        variants.create("cosformer", 8, horizn=100)
    assert variants.create("cosformer", 8).horizon == 4096  # its defaults still build


@pytest.mark.slow  # attnbench check (a few seconds) and a run of one cell (a worker process)
def test_the_docs_commands_check_and_measure_the_example(plugin, tmp_path):
    path = plugin()
    done = attnbench_here("check", "cosformer", "--plugin", path)
    assert done.returncode == 0, done.stdout
    shown = section().split("$ attnbench check cosformer --plugin cosformer.py\n")[1].split("\n$ ")[0].splitlines()
    lines = done.stdout.splitlines()
    assert lines[0] == shown[0]
    assert all(line in lines for line in shown[1:-1] if line != "...")
    assert re.sub(r"\d+ checks", "N checks", lines[-1]) == re.sub(r"\d+ checks", "N checks", shown[-1]) == "cosformer: N checks, all ok"
    renamed = lambda code: code.replace(DECLARATION, "").replace('register("cosformer")', 'register("undeclared")')  # noqa: E731
    undeclared = attnbench_here("check", "undeclared", "--plugin", plugin(renamed, "undeclared.py"))
    assert undeclared.returncode == 1
    assert [line for line in undeclared.stdout.splitlines() if line.startswith("FAIL")] == [
        "FAIL  interface: PARAMS: chunk_size, horizon: its constructor takes chunk_size, horizon, which PARAMS do not declare: "
        "create refuses a value for it; " + params.declare("chunk_size")
    ]
    scenario = tmp_path / "cos.yaml"
    scenario.write_text(
        "name: cos\nvariants: {cosformer: {chunk_size: 16}}\naxes: {seq_len: 64, batch: 1, heads: 2, d_key: 8}\n"
        "modes: [forward, train]\nmeasure: {warmup: 1, repeats: 3, target_rel_ci: null, timeout_s: 120}\n"
    )
    run = attnbench("run", str(scenario), "--plugin", path, "--out", str(tmp_path / "out"), "--no-progress")
    assert run.returncode == 0, run.stderr
    (results,) = (tmp_path / "out").glob("cos-*.jsonl")
    cells = [json.loads(line) for line in results.read_text().splitlines() if '"kind": "cell"' in line]
    assert sorted((cell["variant"], cell["mode"], cell["status"]) for cell in cells) == [("cosformer", "forward", "ok"), ("cosformer", "train", "ok")]
    assert all(cell["metrics"]["rel_error"] < 1e-4 for cell in cells)
    base._REGISTRY.pop("cosformer")  # registered by check in this process: demo loads the file again
    demo = attnbench_here("demo", "--plugin", path, "--batch", "1", "--heads", "1", "--seq-len", "8", "--d-key", "4", "--repeats", "1")
    assert demo.returncode == 0 and "cosformer" in {line.split()[0] for line in demo.stdout.splitlines()[2:-1]}, demo.stderr

"""Extending attnbench from one plugin file (tests/test_harness/toy_plugin.py, the recipe of docs/extending.md):
a variant with a per-token input of its own and a task, run and reported with no harness file changed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import attnbench

from harness.results import load

PLUGIN = str(Path(__file__).with_name("toy_plugin.py"))
HARNESS = Path(__file__).resolve().parents[2] / "harness"


def _write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return str(path)


AGREEMENT = """
import torch
import variants
from harness.scenarios.plugins import load_plugins

load_plugins([PLUGIN])
core = variants.create("toy_tempered", 8)
inputs = core.example_inputs(2, 3, 12, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
assert 0.5 <= inputs["temperature"].min() and inputs["temperature"].max() <= 2.0
reference = core.reference(**inputs)
torch.testing.assert_close(core(**inputs), reference)
torch.testing.assert_close(core.step_loop(inputs)[0], reference)
untempered = dict(inputs, temperature=torch.ones_like(inputs["temperature"]))
assert not torch.allclose(core(**untempered), reference), "the temperature changed nothing"
try:
    core(**dict(inputs, temperature=None))
except variants.VariantError as exc:
    assert "temperature" in str(exc)
else:
    raise AssertionError("a missing temperature was accepted")
"""


@pytest.mark.slow
def test_a_plugin_variant_with_its_own_token_input_agrees_with_its_reference():
    """In a subprocess, so that the toy variant does not join this session's registry."""
    done = subprocess.run([sys.executable, "-c", AGREEMENT.replace("PLUGIN", repr(PLUGIN))], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
def test_a_plugin_variant_and_task_run_and_report_with_no_harness_change(tmp_path):
    speed = _write(
        tmp_path,
        "toy-speed",
        (
            "name: toy-speed\nvariants: {toy_tempered: {}, softmax: {}}\naxes: {seq_len: [8, 16], batch: 1, heads: 2, d_key: 8}\n"
            "modes: [forward, train, decode]\ndecode: {new_tokens: 4}\nmeasure: {warmup: 0, repeats: 2, fresh_worker: false}\n"
        ),
    )
    quality = _write(
        tmp_path,
        "toy-quality",
        (
            "name: toy-quality\nvariants: {toy_tempered: {}, linear: {}}\ntask: {name: toy_spread, scale: 2.0}\ntarget: toy_spread\n"
            "modes: [quality]\naxes: {width: [4, 8]}\n"
        ),
    )
    out = tmp_path / "results"
    for scenario in (speed, quality):
        done = attnbench("run", scenario, "--plugin", PLUGIN, "--out", str(out), "--no-progress")
        assert done.returncode == 0, done.stderr
    cells = load([out])
    assert (cells["status"] == "ok").all(), cells[["variant", "mode", "status", "error"]]
    tempered = cells[(cells["variant"] == "toy_tempered") & (cells["scenario"] == "toy-speed")]
    assert sorted(tempered["mode"].unique()) == ["decode", "forward", "train"] and (tempered["metrics.tokens_per_s"] > 0).all()
    spread = cells[cells["scenario"] == "toy-quality"]
    assert len(spread) == 4 and set(spread["axes.width"]) == {4, 8} and (spread["metrics.spread"] > 0).all()

    report = attnbench("report", str(out), "-o", str(tmp_path / "report"), "--plugin", PLUGIN)
    assert report.returncode == 0, report.stderr
    page = (tmp_path / "report" / "index.html").read_text()
    assert "Toy spread" in page and "toy_tempered" in page and "toy-speed" in page


def test_the_generic_harness_names_no_task():
    files = [HARNESS / "scenarios" / "scenario.py", HARNESS / "running" / "workloads.py", *sorted((HARNESS / "report").glob("*.py"))]
    text = "".join(path.read_text() for path in files)
    for word in ("mqar", "retrieval", "wikitext", "multi30k"):
        assert word not in text.lower(), word

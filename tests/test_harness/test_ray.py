"""The Ray executor (``attnbench run --executor ray``, harness.executors.ray) on a local Ray
instance started by the run: the same cells as the local executor, a Ray worker killed mid-cell,
the driver killed and resumed; without Ray, the install hint."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import attnbench, attnbench_here

from harness.results import ResultsFileError, read_records

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray is not installed (pip install 'attnbench[ray]')")
FAULTS = Path(__file__).with_name("fault_plugin.py")
#: A plugin adding ``fault_kill_ray_worker`` (fault_plugin's variants with one more): its cell
#: SIGKILLs the Ray worker that runs the cell's task (the measuring process's parent).
KILL_RAY_WORKER = f"""
import os, signal, sys, time
sys.path.insert(0, {str(FAULTS.parent)!r})
from fault_plugin import _fault

def _kill_ray_worker(v):
    os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(600)

_fault("fault_kill_ray_worker", _kill_ray_worker)
"""


def _records(out) -> tuple[list[dict], list[dict]]:
    """(run lines, cell lines) of the one results file in ``out``."""
    (path,) = Path(out).glob("*.jsonl")
    records = read_records(path)
    return [r for r in records if r["kind"] == "run"], [r for r in records if r["kind"] == "cell"]


def _finished_cells(out) -> int:
    """The cells in the results file in ``out`` so far (0 while it is absent or half-written)."""
    try:
        return len(_records(out)[1])
    except (ValueError, ResultsFileError):
        return 0


def _scenario(tmp_path, variants: str, seq_len: str) -> str:
    path = tmp_path / "faults.yaml"
    path.write_text(
        f"name: faults\nvariants: {{{variants}}}\naxes: {{seq_len: {seq_len}, batch: 1, heads: 1, d_key: 8}}\n"
        "measure: {warmup: 0, repeats: 2, timeout_s: 120, fresh_worker: false}\n"
    )
    return str(path)


@needs_ray
@pytest.mark.slow
@pytest.mark.parametrize("scenario, options", [
    ("smoke-cpu", ["--set", "measure.repeats=2", "--set", "measure.target_rel_ci=null"]),  # exactly 2 samples a cell
    ("quality/mqar", []),
])
def test_ray_measures_the_same_cells_as_the_local_executor(tmp_path, scenario, options):
    """Every cell of the ci preset, ok, under both executors; the Ray cells name their node, whose
    run line carries this machine's fingerprint (with its calibration for the timed cells)."""
    for executor in ("local", "ray"):
        done = attnbench("run", scenario, "--preset", "ci", *options, "--executor", executor, "--out", str(tmp_path / executor), "--no-progress")
        assert done.returncode == 0, done.stderr
    (local_run,), local = _records(tmp_path / "local")
    (ray_run,), cells = _records(tmp_path / "ray")
    assert {cell["status"] for cell in local + cells} == {"ok"}, [(c["variant"], c["mode"], c["error"]) for c in local + cells]
    assert sorted(cell["cell_id"] for cell in cells) == sorted(cell["cell_id"] for cell in local)
    assert len(cells) == len({cell["cell_id"] for cell in cells}), "a cell was measured twice"
    assert ray_run["executor"] == "ray" and ray_run["node_id"] and "executor" not in local_run
    assert {cell["node_id"] for cell in cells} == {ray_run["node_id"]} and all("node_id" not in cell for cell in local)
    assert ray_run["machine"]["machine_id"] == local_run["machine"]["machine_id"] == cells[0]["machine_id"]
    if scenario == "smoke-cpu":
        assert ray_run["machine"]["calibration"] is not None
        assert all(0 < cell["metrics"]["roofline_fraction"] <= 1 for cell in cells)
    else:
        assert all(cell["metrics"]["steps"] == 20 and 0 <= cell["metrics"]["accuracy"] <= 1 for cell in cells)


@needs_ray
@pytest.mark.slow
def test_a_killed_ray_worker_and_a_killed_cell_process_are_crashed_and_the_sweep_goes_on(tmp_path):
    plugin = tmp_path / "kill_ray_worker.py"
    plugin.write_text(KILL_RAY_WORKER)
    scenario = _scenario(tmp_path, "fault_kill_ray_worker: {}, fault_kill: {}, softmax: {}", "[16]")
    done = attnbench("run", scenario, "--plugin", str(plugin), "--executor", "ray", "--out", str(tmp_path / "out"), "--no-progress",
                     env={"ATTNBENCH_CALIBRATE": "0"})
    assert done.returncode == 1 and "2 cells failed" in done.stderr, done.stderr
    _, cells = _records(tmp_path / "out")
    status = {cell["variant"]: (cell["status"], cell["error"]) for cell in cells}
    assert status.keys() == {"fault_kill_ray_worker", "fault_kill", "softmax"}
    assert status["fault_kill_ray_worker"][0] == "crashed" and "Ray worker" in status["fault_kill_ray_worker"][1], status
    assert status["fault_kill"][0] == "crashed" and "SIGKILL" in status["fault_kill"][1], status
    assert status["softmax"][0] == "ok", status


@needs_ray
@pytest.mark.slow
def test_a_killed_driver_loses_no_finished_cell_and_resume_measures_only_the_missing_ones(tmp_path):
    out, scenario = tmp_path / "out", _scenario(tmp_path, "fault_slow: {}", "[16, 24, 32, 40]")
    env = {**os.environ, "FAULT_SLOW_S": "1.0", "ATTNBENCH_CALIBRATE": "0"}
    command = [sys.executable, "-m", "harness.cli", "run", scenario, "--plugin", str(FAULTS), "--executor", "ray", "--out", str(out), "--no-progress"]
    driver = subprocess.Popen(command, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not _finished_cells(out):
            assert driver.poll() is None, driver.stderr.read()
            assert time.monotonic() < deadline, "no cell finished within 240 s"
            time.sleep(0.1)
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(10)
    finally:  # what is left of the Ray instance the driver started (its agents), the driver itself if an assert failed
        with contextlib.suppress(ProcessLookupError):
            os.killpg(driver.pid, signal.SIGKILL)
    _, before = _records(out)
    assert 1 <= len(before) < 4
    done = attnbench("run", scenario, "--plugin", str(FAULTS), "--executor", "ray", "--resume", "--out", str(out), "--no-progress", env=env)
    assert done.returncode == 0, done.stderr
    runs, cells = _records(out)
    resumed = [cell for cell in cells if cell["run_id"] == runs[-1]["run_id"]]
    assert runs[-1]["resumed_from"] == runs[0]["run_id"]
    assert cells[: len(before)] == before and len(cells) == 4 and len({cell["cell_id"] for cell in cells}) == 4
    assert {cell["cell_id"] for cell in resumed} == {cell["cell_id"] for cell in cells} - {cell["cell_id"] for cell in before}
    assert {cell["status"] for cell in cells} == {"ok"}


def test_without_ray_the_ray_executor_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError, as where it is not installed
    done = attnbench_here("run", "smoke-cpu", "--preset", "ci", "--executor", "ray", "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("error: ") and "pip install 'attnbench[ray]'" in done.stderr, done.stderr
    assert not list((tmp_path / "out").glob("*.jsonl"))


@pytest.mark.parametrize("options, expected", [
    (["--address", "auto"], "--address and --cells-per-node are options of --executor ray"),
    (["--cells-per-node", "2"], "--address and --cells-per-node are options of --executor ray"),
])
def test_ray_options_without_the_ray_executor_are_refused(tmp_path, options, expected):
    done = attnbench("run", "smoke-cpu", "--preset", "ci", *options, "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and done.stderr.startswith("error: ") and expected in done.stderr, done.stderr


@needs_ray
def test_cells_per_node_below_one_is_refused(tmp_path):
    done = attnbench("run", "smoke-cpu", "--preset", "ci", "--executor", "ray", "--cells-per-node", "0", "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and "--cells-per-node must be at least 1, got 0" in done.stderr, done.stderr

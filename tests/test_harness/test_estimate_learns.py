"""Estimates that learn (issue 56, item 5): where the directory a run writes to holds results of its scenarios
measured on this machine, ``--dry-run`` (and ``--budget``) estimate from those cells as ``--estimate-from`` does (a
quality cell from its own recorded duration) and say which cells came from measurements and which from the model;
another machine's results, and a file that cannot be read, are passed over."""

from __future__ import annotations

import pytest
from helpers import attnbench_here

from harness.measuring import machine
from harness.results import ResultsWriter
from harness.running.estimate import COSTS, Estimator, Measured
from harness.running.planning import this_machines_results
from harness.scenarios.scenario import load_scenario

#: This machine's id, as the run records it.
HERE = machine.fingerprint("cpu")["machine_id"]


@pytest.fixture(scope="module")
def mqar():
    """quality/mqar's ci preset: two quality cells (softmax, linear)."""
    return load_scenario("quality/mqar", preset="ci")


def _results(path, cells, *, machine_id=HERE, seconds=(42.0,)):
    """A results file of ``cells`` measured on ``machine_id``, each cell ok after the next of ``seconds``."""
    writer = ResultsWriter(path)
    writer.write_run({"run_id": "r", "started_at": "now", "scenario": "mqar", "machine": {"machine_id": machine_id}})
    for cell, took in zip(cells, seconds, strict=True):
        writer.write_cell({**cell.record(), "run_id": "r", "status": "ok", "metrics": {"loss": 0.5}, "machine_id": machine_id, "duration_s": took})
    writer.close()
    return path


def test_a_quality_cell_takes_its_own_recorded_duration_and_the_others_the_model(tmp_path, mqar):
    softmax, linear = mqar.cells()
    _results(tmp_path / "mqar-20261206T000000Z.jsonl", [softmax], seconds=[42.0])
    _results(tmp_path / "mqar-20261206T000001Z.jsonl", [linear], machine_id="another machine", seconds=[7.0])
    measured, unread = this_machines_results([mqar], tmp_path)
    assert unread is None and measured.durations == {softmax.cell_id: 42.0}  # the other machine's cell passed over
    estimator = Estimator({}, measured=measured)
    assert (estimator.cell(softmax).seconds, estimator.cell(softmax).measured) == (42.0, True)
    assert (estimator.cell(linear).seconds, estimator.cell(linear).measured) == (COSTS.quality_cell_s, False)
    assert Measured(tmp_path).durations == {softmax.cell_id: 42.0, linear.cell_id: 7.0}  # --estimate-from: every machine's


def test_the_dry_run_learns_from_the_directory_it_would_write_to(tmp_path, mqar):
    softmax, linear = mqar.cells()
    before = attnbench_here("run", "quality/mqar", "--preset", "ci", "--dry-run", "--out", str(tmp_path))
    assert before.returncode == 0, before.stderr
    assert "estimated 32 s" in before.stdout and "(measured)" not in before.stdout and "(model)" not in before.stdout
    assert before.stdout.splitlines()[-1].startswith("2 cells from the model: no measured cells to learn from")
    _results(tmp_path / "mqar-20261206T000000Z.jsonl", [softmax, linear], seconds=[40.0, 20.0])
    _results(tmp_path / "mqar-20261206T000001Z.jsonl", [linear], seconds=[30.0])  # the latest record of a cell counts
    _results(tmp_path / "copy-20261206T000000Z.jsonl", [softmax], seconds=[1000.0])  # another scenario's file: not read
    after = attnbench_here("run", "quality/mqar", "--preset", "ci", "--dry-run", "--out", str(tmp_path))
    assert after.returncode == 0, after.stderr
    assert f"  {softmax.cell_id}  softmax[torch] quality/mqar T=16 d_model=16 float32 cpu  ~40.0 s (measured)" in after.stdout
    assert f"  {linear.cell_id}  linear[torch] quality/mqar T=16 d_model=16 float32 cpu  ~30.0 s (measured)" in after.stdout
    assert "mqar: estimated 1 min 22 s (cells 1 min 10 s, run start 12 s" in after.stdout
    assert after.stdout.splitlines()[-1] == f"2 quality cells from their own durations measured in {tmp_path} (this machine's results of 2 files)"


def test_cells_not_measured_here_are_marked_as_the_models(tmp_path, mqar):
    softmax, _ = mqar.cells()
    _results(tmp_path / "mqar-20261206T000000Z.jsonl", [softmax], seconds=[40.0])
    done = attnbench_here("run", "quality/mqar", "--preset", "ci", "--dry-run", "--out", str(tmp_path))
    assert done.stdout.count(" s (measured)") == 1 and done.stdout.count(" s (model)") == 1
    assert done.stdout.splitlines()[-1].endswith("(this machine's results of 1 file); 1 cell from the model (marked (model))")


def test_an_unreadable_results_file_is_named_and_the_model_estimates(tmp_path, mqar):
    broken = tmp_path / "mqar-20261206T000000Z.jsonl"
    broken.write_text('{"not": "a results record"}\n')
    done = attnbench_here("run", "quality/mqar", "--preset", "ci", "--dry-run", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    last = done.stdout.splitlines()[-1]
    assert last.startswith(f"measured cells in {tmp_path} not used: {broken}, line 1 is not a results record"), last
    assert "estimated 32 s" in done.stdout and "(measured)" not in done.stdout

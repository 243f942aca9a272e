"""Hostile cells (issue 46, item 8): a worker that freezes before it answers costs its cell within
the cell's timeout, and the sweep goes on; a checkpoint copied from another cell's folder is refused
wherever the cell is measured (in a worker or not), never continued."""

from __future__ import annotations

import shutil

import pytest

from harness.runner import with_checkpoint_dir
from harness.scenario import load_scenario
from harness.tasks.training import CheckpointError
from harness.workloads import measure_cell

# --- a checkpoint of another cell is never continued ---------------------------------------------


def test_a_checkpoint_copied_from_another_variants_folder_is_refused_outside_a_worker(tmp_path):
    cells = load_scenario("scenarios/quality/mqar.yaml", preset="ci", overrides=["task.steps=4", "task.eval_every=2"]).cells()
    softmax, linear = (with_checkpoint_dir(cell, tmp_path / "r.jsonl") for cell in cells)
    assert (softmax.variant, linear.variant) == ("softmax", "linear")
    assert measure_cell(softmax)["status"] == "ok"
    shutil.copytree(softmax.checkpoint_dir, linear.checkpoint_dir)
    with pytest.raises(CheckpointError, match=r"a checkpoint of another cell: .*variant 'softmax' \(this cell: 'linear'\)"):
        measure_cell(linear)
    shutil.rmtree(linear.checkpoint_dir)
    result = measure_cell(linear)
    assert result["status"] == "ok" and result["metrics"]["resumed_from"] is None

"""A cell (harness/scenarios/cell.py): what crosses the worker pipe and Ray is the same cell, its id is what
it measures (not where its checkpoints or profile go), and its part of a results record keeps the
record's format (docs/results.md)."""

from __future__ import annotations

import pickle

from helpers import make_cell

from harness.scenarios.cell import cell_id


def test_a_cell_pickles_whole_and_keeps_its_id_when_told_where_things_go():
    cell = make_cell(task={"name": "mqar", "seed": 1}, lengths=[3, 5])
    assert pickle.loads(pickle.dumps(cell)) == cell
    moved = cell.replace(checkpoint_dir="/tmp/c", profile={"tool": "torch"})
    assert moved.cell_id == cell.cell_id == cell_id(moved) and moved.checkpoint_dir == "/tmp/c"
    assert make_cell(params={"nu": 2}).cell_id != make_cell().cell_id
    assert make_cell(backend_options={}).cell_id == make_cell().cell_id, "empty options are no part of the id"


def test_its_record_holds_the_results_lines_cell_fields_in_order():
    quality = make_cell(mode="quality", task={"name": "mqar", "seed": 1})
    fields = ["cell_id", "scenario", "variant", "backend", "params", "axes"]
    assert list(quality.record()) == [*fields, "task", "mode", "target"] and quality.record()["task"] == quality.task
    assert list(make_cell().record()) == [*fields, "mode", "target"]

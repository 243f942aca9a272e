"""Hostile cells (issue 46, item 8): a worker that freezes before it answers costs its cell within
the cell's timeout, and the sweep goes on; a checkpoint copied from another cell's folder is refused
wherever the cell is measured (in a worker or not), never continued."""

from __future__ import annotations

import multiprocessing
import shutil
import time
from pathlib import Path

import pytest

from harness.results import read_records
from harness.running import runner
from harness.running import worker as workers
from harness.running.runner import with_checkpoint_dir
from harness.running.workloads import measure_cell
from harness.scenarios.scenario import load_scenario

PLUGIN = Path(__file__).with_name("frozen_plugin.py")

# --- a checkpoint of another cell is never continued ---------------------------------------------


def test_a_checkpoint_copied_from_another_variants_folder_is_set_aside_outside_a_worker(tmp_path, capsys):
    """Never continued, never failing the cell: set aside as foreign-step-….pt with a note naming what differs, and the
    cell trains from scratch (issue 55, item 9d)."""
    cells = load_scenario("scenarios/quality/mqar.yaml", preset="ci", overrides=["task.steps=4", "task.eval_every=2"]).cells()
    softmax, linear = (with_checkpoint_dir(cell, tmp_path / "r.jsonl") for cell in cells)
    assert (softmax.variant, linear.variant) == ("softmax", "linear")
    assert measure_cell(softmax)["status"] == "ok"
    shutil.copytree(softmax.checkpoint_dir, linear.checkpoint_dir)
    result = measure_cell(linear)
    assert result["status"] == "ok" and result["metrics"]["resumed_from"] is None
    assert "variant 'softmax' (this cell: 'linear')" in capsys.readouterr().err


# --- a worker frozen before its first answer costs its cell within the cell's timeout --------------


@pytest.mark.slow  # about 50 s on a busy 2-core machine: it waits out the frozen start, then a worker starts
def test_a_worker_frozen_while_starting_costs_its_cell_within_its_timeout_and_the_next_cell_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(workers, "START_MARGIN_S", 25, raising=False)  # a sound start takes 10-20 s here
    (tmp_path / "frozen").touch()
    monkeypatch.setenv("FROZEN_MARKER", str(tmp_path / "frozen"))
    path = tmp_path / "tiny.yaml"
    path.write_text(
        "name: tiny\nvariants: {softmax: {}}\naxes: {seq_len: [16, 32], batch: 1, heads: 1, d_key: 8}\n"
        "measure: {warmup: 0, repeats: 2, timeout_s: 3, fresh_worker: false}\n"
    )
    started = time.monotonic()
    runner.run(load_scenario(str(path)), tmp_path / "out", plugins=[str(PLUGIN)], progress=False)
    elapsed = time.monotonic() - started
    frozen, after = [record for record in read_records(next((tmp_path / "out").glob("tiny-*.jsonl"))) if record["kind"] == "cell"]
    assert frozen["status"] == "crashed" and "did not start within 28 s" in frozen["error"], frozen
    assert after["status"] == "ok", after
    assert not (tmp_path / "frozen").exists()  # the frozen worker was the one that took the marker
    assert elapsed < 28 + 60, elapsed  # its allowance (timeout_s + START_MARGIN_S), then a worker that starts and two cells
    assert multiprocessing.active_children() == []

"""Cells of one run timed on the same terms (issue 53, item 4): the torch threads of every timed CPU
cell are chosen once, at the run's start, written in its run line and shown in the report's machine
table; a CPU timing that another process disturbed is flagged unstable; the report's timing column
names what timed a cell (on the CPU, perf_counter's wall time, not "events"). No verdict here
depends on the machine's load: the load is injected wherever a rule reads it."""

from __future__ import annotations

import json
import os
import time

import pytest
from helpers import LocalTestExecutor, make_cell

import harness.measuring.busyness as busyness
from harness.measuring.busyness import disturbed, run_threads
from harness.measuring.measure import Timing, clock_name
from harness.results import load, read_records

#: Three tiny cells of one variant: forward, train and decode.
TINY = (
    "name: tiny\nvariants: {linear: {}}\naxes: {seq_len: [16], batch: 1, heads: 1, d_key: 8}\nmodes: [forward, train, decode]\n"
    "decode: {new_tokens: 2}\nmeasure: {warmup: 1, repeats: 3, max_time_s: 0.1, timeout_s: 60}\n"
)


class _Recorder(LocalTestExecutor):
    """An executor that measures nothing: each cell it is given is recorded as ok, timed on the threads
    the run gave it (``measure.threads``) by perf_counter; ``given`` keeps the cells."""

    def __init__(self):
        self.given = []

    def measure(self, todo, starting):
        for cell in todo:
            starting(cell)
            self.given.append(cell)
            metrics = {"median_s": 1e-3, "samples_s": [1e-3] * 3, "rel_ci": 0.0, "unstable": False, "target_rel_ci": 0.05, "disturbed": False}
            metrics.update(timing="events", clock="wall (perf_counter)", tokens=16, tokens_per_s=16e3, torch_threads=cell.measure.get("threads"))
            result = {"status": "ok", "error": None, "metrics": metrics}
            yield (
                cell,
                {
                    "result": result,
                    "throttle_before": None,
                    "throttle_after": None,
                    "started_at": "2026-12-06T00:00:00+00:00",
                    "duration_s": 0.0,
                    "machine": self.machine,
                    "node_id": None,
                },
            )

    def run_fields(self, node_id):
        return {}

    def close(self):
        pass


@pytest.fixture
def measured(tmp_path, monkeypatch):
    """TINY run in this process by a ``_Recorder`` with a busy machine injected (other processes on all
    cores but 0.4: one thread left), then resumed, its last cell cut, with a quiet machine injected:
    (the results file, the loads read, the cells each run handed its executor)."""
    from harness.running import runner
    from harness.scenarios.scenario import load_scenario

    (tmp_path / "tiny.yaml").write_text(TINY)
    loaded, asked, given = load_scenario(str(tmp_path / "tiny.yaml")), [], []
    monkeypatch.setattr(runner, "other_cores_now", lambda: asked.append("busy") or os.cpu_count() - 0.4)
    given.append(_Recorder())
    path = runner.run(loaded, tmp_path / "out", progress=False, executor=given[-1]).path
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:-1]))  # the decode cell, measured again by the resumed run
    monkeypatch.setattr(runner, "other_cores_now", lambda: asked.append("quiet") or 0.0)
    given.append(_Recorder())
    runner.run(loaded, tmp_path / "out", resume=str(path), progress=False, executor=given[-1])
    return path, asked, [recorder.given for recorder in given]


def test_the_threads_are_chosen_once_and_every_cpu_cell_of_the_run_gets_them(measured):
    """The load is read once per run; the busy one leaves 1 thread, which the run line records and every
    cell is handed; the resumed run keeps the file's count although the machine it found was quiet."""
    path, asked, given = measured
    records = read_records(path)
    runs = [record for record in records if record["kind"] == "run"]
    assert asked == ["busy", "quiet"] and [run["torch_threads"] for run in runs] == [1, 1], (asked, runs)
    assert [[(cell.mode, cell.measure["threads"]) for cell in cells] for cells in given] == [[("forward", 1), ("train", 1), ("decode", 1)], [("decode", 1)]]
    assert [cell["metrics"]["torch_threads"] for cell in records if cell["kind"] == "cell"] == [1, 1, 1]


def test_the_reports_machine_table_and_timing_column_show_them(measured, tmp_path):
    """The machine table says the threads of the timed CPU cells; the timing column what timed each cell
    (a record written before metrics.clock: its measure.timing); a disturbed cell is marked so."""
    from harness.report.cells import prepare
    from harness.report.header import machine_sections, runs_of
    from harness.report.tables import timing_table

    path, _, _ = measured
    (section,) = machine_sections(prepare(load(path)), runs_of([path]))
    facts = dict(section.facts)
    assert facts["torch threads"] == "timed CPU cells: 1, chosen once at the start of its run", facts

    records = read_records(path)
    older, disturbed_cell = (record for record in records if record["kind"] == "cell" and record["mode"] != "train")
    del older["metrics"]["clock"]
    older["metrics"]["torch_threads"] = 2
    disturbed_cell["metrics"].update(disturbed=True, unstable=True)
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("".join(json.dumps(record) + "\n" for record in records))
    cells = prepare(load(mixed))
    (section,) = machine_sections(cells, runs_of([mixed]))
    assert dict(section.facts)["torch threads"].startswith("timed CPU cells: 1 or 2 (not the same for every cell")
    shown = timing_table(cells)
    rows = {row[shown.headers.index("mode")]: row for row in shown.rows}
    timing, stability = shown.headers.index("timing"), shown.headers.index("stability")
    assert [rows[mode][timing] for mode in ("forward", "train", "decode")] == ["events", "wall (perf_counter)", "wall (perf_counter)"]
    assert [rows[mode][stability] for mode in ("forward", "decode")] == ["", "unstable (disturbed)"] and "perf_counter" in shown.caption


def test_quality_cells_keep_their_tasks_threads_and_the_machine_table_says_so():
    """A quality cell is handed no run count (``with_threads``); its threads are listed apart, as its task's."""
    import pandas as pd

    from harness.report.header import _threads_fact

    cells = pd.DataFrame({"mode": ["forward", "train", "quality"], "axes.device": ["cpu"] * 3, "metrics.torch_threads": [1.0, 1.0, 4.0]})
    runs = [{"torch_threads": 1}]
    assert _threads_fact(runs, cells) == [("torch threads", "timed CPU cells: 1, chosen once at the start of its run; quality cells: 4, their task's threads")]
    assert _threads_fact([{}], cells.iloc[2:]) == [("torch threads", "quality cells: 4, their task's threads")]
    assert _threads_fact([{}], cells.drop(columns="metrics.torch_threads")) == []


def test_a_ray_nodes_run_line_carries_its_cpu_share():
    """Each node's CPU speed cells run on its share of CPUs (OMP_NUM_THREADS), which its run line records."""
    from types import SimpleNamespace

    from harness.running.executors.ray import RayExecutor

    executor = RayExecutor.__new__(RayExecutor)
    executor.ray = SimpleNamespace(nodes=lambda: [{"NodeID": "n1", "Alive": True, "Resources": {"CPU": 8.0}}])
    executor.cells_per_node, executor.cpu_cells = 2, True
    assert executor.run_fields("n1") == {"executor": "ray", "node_id": "n1", "torch_threads": 4}
    assert executor.run_fields(None)["torch_threads"] is None
    executor.cpu_cells = False
    assert executor.run_fields("n1")["torch_threads"] is None


def test_what_times_a_cell():
    """On the CPU a sample is perf_counter's wall time (events and wall alike); the profiler times operators; a GPU has events."""
    assert [clock_name(timing, "cpu") for timing in ("events", "wall", "profiler")] == ["wall (perf_counter)"] * 2 + ["profiler (operators' self CPU time)"]
    assert clock_name("events", "cuda:1") == "CUDA events" and clock_name("cudagraph", "cuda") == "CUDA events, graph replays"


@pytest.mark.slow  # about 30 s on the loaded 2-core VM: a worker process per cell
def test_every_worker_of_a_run_measures_on_its_threads(tmp_path, monkeypatch):
    """Through real workers (a fresh one per CPU cell): each cell ran on the run's one thread, though a
    worker starts with all its cores', and names its clock."""
    from harness.running import runner
    from harness.scenarios.scenario import load_scenario

    monkeypatch.setenv("ATTNBENCH_CALIBRATE", "0")
    monkeypatch.setattr(runner, "other_cores_now", lambda: os.cpu_count() - 0.4)
    (tmp_path / "tiny.yaml").write_text(TINY.replace("modes: [forward, train, decode]", "modes: [forward, decode]"))
    path = runner.run(load_scenario(str(tmp_path / "tiny.yaml")), tmp_path / "out", progress=False).path
    records = read_records(path)
    (run,), cells = [r for r in records if r["kind"] == "run"], [r for r in records if r["kind"] == "cell"]
    assert run["torch_threads"] == 1 and len(cells) == 2 and all(cell["status"] == "ok" for cell in cells), cells
    assert [(cell["metrics"]["torch_threads"], cell["metrics"]["timed_load"]["threads"], cell["metrics"]["clock"]) for cell in cells] == [
        (1, 1, "wall (perf_counter)")
    ] * 2
    assert all(isinstance(cell["metrics"]["disturbed"], bool) for cell in cells)


def test_the_run_threads_follow_the_load_at_the_start_and_only_cpu_speed_cells_take_them():
    """Torch's threads bounded by the usable cores left free (half a core of load takes one); none without a timed CPU cell."""
    from harness.running.runner import with_threads

    cpu, speed = {"torch_threads": 8, "usable_cores": 8, "logical_cores": 16}, [make_cell()]
    assert [run_threads(speed, cpu, load) for load in (None, 0.2, 0.6, 2.5, 12.0)] == [8, 8, 7, 5, 1]
    assert run_threads(speed, {**cpu, "torch_threads": 2}, 3.0) == 2
    others = [make_cell(mode="quality", task={"name": "lm"}), make_cell(axes={"device": "cuda", "dtype": "float32"}), make_cell(skip="no")]
    assert run_threads(others, cpu, 0.0) is None
    stamped = [with_threads(cell, 3) for cell in speed + others]
    assert [cell.measure.get("threads") for cell in stamped] == [3, None, None, None] and stamped[0].cell_id == speed[0].cell_id
    assert with_threads(speed[0], None) is speed[0]


def test_measure_cpus_still_bounds_the_run_threads():
    """A worker on the run's threads, at most one per CPU it is pinned to; back as it started after."""
    import torch

    from harness.running.workloads import _UNPINNED, pin

    usable = len(_UNPINNED[0]) if _UNPINNED[0] is not None else None
    if usable is None:
        pytest.skip("no CPU affinity here")
    try:
        pin([sorted(_UNPINNED[0])[0]], 4)
        assert torch.get_num_threads() == 1
        pin(None, 4)
        assert torch.get_num_threads() == min(4, usable)
    finally:
        pin(None)
    assert torch.get_num_threads() == _UNPINNED[1] and os.sched_getaffinity(0) == _UNPINNED[0]


# --- a disturbed timing -------------------------------------------------------------------------

QUIET = {"wall_s": 1.0, "own_cpu_s": 1.0, "other_cores": 0.1, "cores": 2, "threads": 2}


@pytest.mark.parametrize(
    "change, expected",
    [
        ({}, False),
        ({"other_cores": 0.6}, True),  # half a core of other work takes one of the two cores its two threads needed
        ({"other_cores": 0.6, "threads": 1}, False),  # ... which a one-thread timing left free
        ({"other_cores": 1.6, "threads": 1}, True),
        ({"wall_s": 0.05, "own_cpu_s": 0.05, "other_cores": 2.0}, False),  # 5 ticks: too short to judge the others' load
        ({"own_cpu_s": 0.3, "other_cores": 0.0}, True),  # on a core 30 % of the time: it waited for one
        ({"own_cpu_s": 0.3, "other_cores": None}, True),  # no /proc/stat: the CPU time still tells
        ({"own_cpu_s": 0.01, "other_cores": 0.9, "threads": 1}, False),  # on a core 1 % of the time: it sleeps (a fault plugin), computes nothing
        ({"own_cpu_s": 0.01, "other_cores": 1.6, "threads": 1}, True),  # ... but the others took the core its thread needed
        ({"wall_s": 0.0}, None),
    ],
)
def test_the_disturbed_rule(change, expected):
    assert disturbed({**QUIET, **change}) is expected


def test_a_disturbed_timing_is_unstable_however_close_its_samples():
    assert Timing((1.0,) * 5, 0.05, disturbed=True).unstable is True and Timing((1.0,) * 5, 0.05, disturbed=False).unstable is False
    assert Timing((1.0,) * 5, None, disturbed=True).unstable is None and Timing((1.0,) * 5, None, disturbed=True).summary()["disturbed"] is True


@pytest.mark.parametrize("share, expected", [(1.0, False), (0.25, True)])
def test_a_cpu_cell_that_waited_for_its_core_is_measured_unstable(monkeypatch, share, expected):
    """A cell measured in this process while its CPU time is made to run at ``share`` of the wall clock
    (0.25: descheduled three quarters of the time) and no other process is busy."""
    from harness.running import workloads

    monkeypatch.setattr(busyness, "own_cpu_s", lambda: share * time.perf_counter())
    monkeypatch.setattr(busyness, "busy_cpu_s", busyness.own_cpu_s)
    cell = make_cell(axes={"device": "cpu", "dtype": "float32", "seq_len": 16, "batch": 1, "heads": 1, "d_key": 8, "d_value": 8})
    cell = cell.replace(measure={**cell.measure, "warmup": 1, "repeats": 3, "target_rel_ci": 0.05, "max_time_s": 0.0, "flush_l2": False, "threads": 1})
    try:
        metrics = workloads.measure_cell(cell)["metrics"]
    finally:
        workloads.pin(None)
    assert metrics["torch_threads"] == 1 and metrics["clock"] == "wall (perf_counter)"
    assert metrics["disturbed"] is expected and metrics["timed_load"]["own_cpu_s"] == pytest.approx(share * metrics["timed_load"]["wall_s"], rel=0.01)
    if expected:
        assert metrics["unstable"] is True

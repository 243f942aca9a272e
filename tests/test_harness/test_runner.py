"""The runner end to end, through the command line in subprocesses: failures are recorded
and the sweep goes on; a killed or interrupted run keeps every finished cell and
``--resume`` measures only what is missing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import attnbench, make_cell

import variants
from harness.results import load, read_records
from harness.scenarios.cell import Cell
from variants.base import registered

PLUGIN = str(Path(__file__).with_name("fault_plugin.py"))


def write_scenario(tmp_path, variants_yaml: str, *, seq_len="[32]", modes="[forward]", extra="", shared_worker=False) -> Path:
    """A scenario file of ``variants_yaml``; ``shared_worker``: its cells in one worker (fresh_worker: false)."""
    path = tmp_path / "faults.yaml"
    lines = ["name: faults", "variants:", textwrap.indent(variants_yaml, "  ")]
    lines += [f"axes: {{seq_len: {seq_len}, batch: 1, heads: 2, d_key: 8}}", f"modes: {modes}"]
    lines += [f"measure: {{warmup: 1, repeats: 2, timeout_s: 60{', fresh_worker: false' if shared_worker else ''}}}", extra]
    path.write_text("\n".join(lines) + "\n")
    return path


def cells_of(out_dir: Path) -> list[dict]:
    (path,) = out_dir.glob("*.jsonl")
    return [r for r in read_records(path) if r["kind"] == "cell"]


@pytest.mark.slow
def test_failures_are_recorded_and_the_sweep_goes_on(tmp_path):
    scenario = write_scenario(tmp_path, "fault_oom: {}\nfault_error: {}\nfault_crash: {}\nfault_nan: {}\nsoftmax: {}")
    done = attnbench("run", str(scenario), "--plugin", PLUGIN, "--out", str(tmp_path / "out"), "--no-progress")
    assert done.returncode == 1, done.stderr
    assert "faults: 3 cells failed: fault_error[torch] forward/core" in done.stderr and "(error: RuntimeError: injected failure" in done.stderr
    by_variant = {cell["variant"]: cell for cell in cells_of(tmp_path / "out")}
    assert by_variant["fault_oom"]["status"] == "oom" and "out of memory" in by_variant["fault_oom"]["error"]
    assert by_variant["fault_error"]["status"] == "error" and "injected failure" in by_variant["fault_error"]["error"]
    assert by_variant["fault_crash"]["status"] == "crashed" and "exited with code 3" in by_variant["fault_crash"]["error"]
    assert by_variant["fault_nan"]["status"] == "nan" and by_variant["fault_nan"]["metrics"]["median_s"] > 0
    assert by_variant["softmax"]["status"] == "ok", "the cell after a crashed worker was not measured"
    assert by_variant["softmax"]["metrics"]["tokens_per_s"] > 0
    assert "5 cells" in done.stdout


@pytest.mark.slow
def test_a_hanging_cell_times_out_and_the_sweep_goes_on(tmp_path):
    scenario = write_scenario(tmp_path, "fault_slow: {}\nsoftmax: {}", extra="")
    text = scenario.read_text().replace("timeout_s: 60", "timeout_s: 3")
    scenario.write_text(text)
    done = attnbench("run", str(scenario), "--plugin", PLUGIN, "--out", str(tmp_path / "out"), "--no-progress", env={"FAULT_SLOW_S": "30"})
    assert done.returncode == 1 and "timed out" in done.stderr, done.stderr
    by_variant = {cell["variant"]: cell for cell in cells_of(tmp_path / "out")}
    assert by_variant["fault_slow"]["status"] == "error" and "timed out" in by_variant["fault_slow"]["error"]
    assert by_variant["softmax"]["status"] == "ok"


def _run_until(tmp_path, scenario, finished: int, sig) -> tuple[subprocess.Popen, list[dict]]:
    """Start a run, wait until ``finished`` cells are recorded, then send ``sig`` to it."""
    out = tmp_path / "out"
    command = [sys.executable, "-m", "harness.cli", "run", str(scenario), "--plugin", PLUGIN, "--out", str(out), "--no-progress"]
    # A suite started in the background inherits SIGINT ignored; the run must see Ctrl-C as a terminal would.
    process = subprocess.Popen(
        command,
        env={**os.environ, "FAULT_SLOW_S": "0.3"},
        start_new_session=True,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        files = list(out.glob("*.jsonl"))
        if files and sum('"kind": "cell"' in line for line in files[0].read_text().splitlines()) >= finished:
            break
        time.sleep(0.05)
    else:
        process.kill()
        pytest.fail("the run never recorded enough cells")
    os.killpg(process.pid, sig) if sig == signal.SIGKILL else process.send_signal(sig)
    process.wait(60)
    return process, cells_of(out)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["killed", "ctrl-c"])
@pytest.mark.slow
def test_resume_after_a_crash_loses_and_repeats_nothing(tmp_path, sig):
    # one worker for the cells (a fresh one a CPU cell is for peak memory, read by no check here: 2-3 s a cell)
    scenario = write_scenario(tmp_path, "fault_slow: {}", seq_len="[16, 24, 32, 40, 48, 56]", shared_worker=True)
    process, before = _run_until(tmp_path, scenario, finished=2, sig=sig)
    if sig == signal.SIGINT:
        assert process.returncode == 130, process.stderr.read()
        assert "--resume" in process.stderr.read()
    assert 2 <= len(before) < 6
    resumed = attnbench("run", str(scenario), "--plugin", PLUGIN, "--out", str(tmp_path / "out"), "--no-progress", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    after = cells_of(tmp_path / "out")
    ids = [cell["cell_id"] for cell in after]
    assert len(ids) == len(set(ids)) == 6, "a cell was lost or measured twice"
    assert after[: len(before)] == before, "finished cells changed on resume"
    assert {cell["axes"]["seq_len"] for cell in after} == {16, 24, 32, 40, 48, 56}
    assert f"{len(before)} already done" in resumed.stdout
    runs = [r for r in read_records(next((tmp_path / "out").glob("*.jsonl"))) if r["kind"] == "run"]
    assert len(runs) == 2 and runs[1]["resumed_from"] == runs[0]["run_id"]


@pytest.mark.slow
def test_a_training_cell_killed_midway_continues_from_its_checkpoint(tmp_path):
    """A retrieval cell whose worker dies at training step 5 is recorded as crashed, with its
    checkpoint of step 4 kept beside the results file; ``--resume --retry-failed`` continues it
    from there to the result of an uninterrupted run and removes the checkpoints."""
    scenario = tmp_path / "killed.yaml"
    scenario.write_text(
        textwrap.dedent("""\
        name: killed
        variants: {fault_kill_once: {}}
        task: {name: retrieval, setting: 1, max_steps: 10, eval_every: 2, patience: 50, target_loss: 1.0e-9}
        target: retrieval
        modes: [quality]
        axes: {S: 6, d_key: 8}
    """)
    )
    marker = tmp_path / "kill-once"
    marker.touch()
    # the parallel form runs once per training step (evaluations read through prefill and step):
    # killed at step 5, after the checkpoints of the evaluations at steps 2 and 4
    env = {"FAULT_KILL_MARKER": str(marker), "FAULT_KILL_AT": "5"}
    run = ["run", str(scenario), "--plugin", PLUGIN, "--out", str(tmp_path / "out"), "--no-progress"]
    first = attnbench(*run, env=env)
    assert first.returncode == 1, first.stderr  # a crashed cell fails the run (exit code 1)
    (crashed,) = cells_of(tmp_path / "out")
    assert crashed["status"] == "crashed" and not marker.exists()
    (results,) = (tmp_path / "out").glob("*.jsonl")
    checkpoints = results.with_suffix(".checkpoints")
    assert [p.name for p in (checkpoints / crashed["cell_id"]).iterdir()] == ["step-000000004.pt"]
    resumed = attnbench(*run, "--resume", "--retry-failed", env=env)
    assert resumed.returncode == 0, resumed.stderr
    cell = cells_of(tmp_path / "out")[-1]
    assert cell["status"] == "ok" and cell["metrics"]["resumed_from"] == 4 and cell["metrics"]["steps"] == 10
    assert not checkpoints.exists(), "the checkpoints of a recorded cell were left behind"
    whole = attnbench("run", str(scenario), "--plugin", PLUGIN, "--out", str(tmp_path / "whole"), "--no-progress")
    assert whole.returncode == 0, whole.stderr
    (uninterrupted,) = cells_of(tmp_path / "whole")
    assert uninterrupted["metrics"]["resumed_from"] is None
    assert cell["metrics"]["evaluations"] == uninterrupted["metrics"]["evaluations"]


@pytest.mark.slow
def test_dry_run_lists_cells_and_measures_nothing(tmp_path):
    scenario = write_scenario(tmp_path, "softmax: {}\ndpfp: {nu: [1, 2]}", seq_len="[16, 32]", modes="[forward, train]")
    done = attnbench("run", str(scenario), "--dry-run", "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    cell_lines = [line for line in done.stdout.splitlines() if "/core " in line]  # not the groups' lines
    assert "12 cells" in done.stdout and sum("dpfp(nu=2)" in line for line in cell_lines) == 4
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_bad_scenario_exits_2_with_the_file_and_field(tmp_path):
    scenario = write_scenario(tmp_path, "softmax: {}", seq_len="[-4]")
    done = attnbench("run", str(scenario), "--out", str(tmp_path / "out"))
    assert done.returncode == 2
    assert str(scenario) in done.stderr and "axes.seq_len" in done.stderr and "-4" in done.stderr


@pytest.mark.slow
def test_malloc_tuning_is_for_speed_workers_only():
    """Speed cells get the exact-RSS malloc settings; quality cells (training runs) glibc's defaults."""
    from harness.running.worker import WORKER_ENV, Worker

    speed, quality = Worker(), Worker(tune_malloc=False)
    try:
        assert WORKER_ENV.items() <= speed.env.items() and not set(WORKER_ENV) & set(quality.env)
    finally:
        speed.close()
        quality.close()


def every_shipped_variant_in_every_mode() -> set[tuple[str, str]]:
    """(variant, mode) of each variant attnbench registers itself (a plugin's, a test's own, left out) in each mode."""
    shipped = [name for name in variants.names() if registered(name).__module__.startswith("variants.")]
    return {(name, mode) for name in shipped for mode in ("forward", "train", "decode")}


def test_the_main_job_measures_every_shipped_variant_in_every_mode():
    """smoke-cpu, the main job on a CPU machine (README), and its ci preset, which the test below runs end to end."""
    from harness.scenarios.scenario import load_scenario

    for preset in (None, "ci"):
        assert {(cell.variant, cell.mode) for cell in load_scenario("smoke-cpu", preset=preset).cells()} == every_shipped_variant_in_every_mode(), preset


@pytest.mark.slow
@pytest.mark.serial  # roofline fractions: a roof calibrated while a test beside it ran is too low
def test_smoke_ci_preset_runs_and_loads(smoke_ci):
    """The shipped smoke scenario end to end (ci preset, 2 samples a cell: tests/test_harness/conftest.py): every cell
    ok and accurate, loadable, with metrics; every registered variant in every mode, as the main job measures them."""
    table = load([smoke_ci.out])
    assert len(table) == 36 and set(table["status"]) == {"ok"}, table[["variant", "mode", "status", "error"]]
    assert not table["metrics.inaccurate"].any(), table[["variant", "mode", "metrics.rel_error", "metrics.rel_error_tolerance"]]
    assert set(zip(table["variant"], table["mode"])) == every_shipped_variant_in_every_mode()
    assert (table["metrics.tokens_per_s"] > 0).all() and (table["metrics.flops"] > 0).all()
    decode = table[table["mode"] == "decode"]
    assert all(len(latency) == 16 for latency in decode["metrics.step_latency_s"])
    assert table["machine.machine_id"].nunique() == 1
    fractions = table["metrics.roofline_fraction"]
    assert ((fractions > 0) & (fractions <= 1)).all(), "a fraction of the roofline above 1 is a counting error"
    json.dumps(table.drop(columns=["metrics.samples_s", "metrics.step_latency_s"]).to_dict())


@pytest.mark.slow
def test_retrieval_task_runs_through_the_runner(tmp_path):
    """A quality cell trains the retrieval model and records its loss, steps and d_dot."""
    done = attnbench("run", "quality/retrieval-capacity", "--preset", "ci", "--out", str(tmp_path / "out"), "--no-progress")
    assert done.returncode == 0, done.stderr
    table = load([tmp_path / "out"])
    assert len(table) == 4 and set(table["status"]) == {"ok"}, table[["variant", "status", "error"]]
    assert set(table["axes.S"]) == {4, 8} and (table["metrics.steps"] > 0).all()
    assert (table["metrics.loss"] >= 0).all() and (table["metrics.loss"] <= table["metrics.final_loss"] + 1e-12).all()
    d_dots = dict(zip(table["variant"], table["metrics.d_dot"]))
    assert d_dots["linear"] == 16 and d_dots["softmax"] != d_dots["softmax"], "softmax has no d_dot (NaN in the table)"
    from harness.report import build_report

    build_report([tmp_path / "out"], tmp_path / "report")
    assert (tmp_path / "report" / "plots" / "retrieval-capacity-capacity.png").stat().st_size > 0


@pytest.mark.slow
def test_update_rules_get_their_own_table_and_stay_out_of_the_capacity_plot(tmp_path):
    """Setting 2 cells record their task, show as one row per rule in the report, and are not capacity points."""
    done = attnbench("run", "quality/retrieval-update-rules", "--preset", "ci", "--out", str(tmp_path / "out"), "--no-progress")
    assert done.returncode == 0, done.stderr
    table = load([tmp_path / "out"])
    assert set(table["task.setting"]) == {2} and set(table["task.max_steps"]) == {50}
    from harness.report import build_report

    page = build_report([tmp_path / "out"], tmp_path / "report").read_text()
    section = page[page.index("Retrieval: update rules") :]
    section = section[: section.index("</table>")]
    assert section.count("<tr>") == 1 + 3 and "S = 4" in section and "steps)" in section
    assert not (tmp_path / "report" / "plots" / "retrieval-update-rules-capacity.png").exists()


@pytest.mark.slow
def test_mqar_task_runs_through_the_runner(tmp_path):
    done = attnbench("run", "quality/mqar", "--preset", "ci", "--out", str(tmp_path / "out"), "--no-progress")
    assert done.returncode == 0, done.stderr
    table = load([tmp_path / "out"])
    assert len(table) == 2 and set(table["status"]) == {"ok"}, table[["variant", "status", "error"]]
    assert table["metrics.accuracy"].between(0, 1).all() and (table["metrics.steps"] == 20).all()
    assert set(table["axes.seq_len"]) == {16} and set(table["axes.d_model"]) == {16}
    from harness.report import build_report

    build_report([tmp_path / "out"], tmp_path / "report")
    assert (tmp_path / "report" / "plots" / "mqar-mqar.png").stat().st_size > 0


@pytest.mark.slow
def test_cpu_peak_memory_does_not_depend_on_the_cells_before(tmp_path):
    """Each CPU speed cell gets a new worker (measure.fresh_worker's default). In a worker shared
    with earlier cells glibc serves a cell from heap pages they left: the same delta-rule forward
    read 15-25 MiB after other cells (its q, k, v and output alone hold 32 MiB), or, with the
    freed pages trimmed first, 53-61 MiB against 46-49 MiB as a worker's first cell."""
    variants_yaml = "delta: [{}, {chunk_size: 64}]\nlinear: {}\ndpfp: {nu: 1}"  # the first two are the same computation
    text = write_scenario(tmp_path, variants_yaml, seq_len="[512]").read_text()
    scenario = tmp_path / "memory.yaml"
    scenario.write_text(text.replace("batch: 1, heads: 2, d_key: 8", "batch: 8, heads: 8, d_key: 64"))
    attnbench("run", str(scenario), "--out", str(tmp_path / "out"), "--no-progress")
    cells = cells_of(tmp_path / "out")
    peaks = {(c["variant"], c["params"].get("chunk_size")): c["metrics"]["peak_mem_bytes"] for c in cells}
    assert {c["metrics"]["memory_kind"] for c in cells} == {"rss_peak_delta"}
    assert min(peaks.values()) >= 4 * 8 * 2**20, peaks
    first, again = peaks["delta", None], peaks["delta", 64]
    assert abs(again - first) <= 0.05 * first, peaks


# --- a fresh worker after a failed cell ---------------------------------------------------


class _ScriptedWorker:
    """A worker whose cells end with the status their variant names; it counts its starts, and
    restarts itself after a crash or a timeout as ``worker.Worker`` does."""

    def __init__(self, *args, **kwargs):
        self.starts, self.measured, self.log = 1, 0, []

    def measure(self, cell, timeout_s):
        self.measured += 1
        self.log.append((cell.variant, self.starts))
        status = cell.variant
        if status in ("crashed", "timeout"):
            self.restart()
        return {"status": "error" if status == "timeout" else status, "error": status, "metrics": {}}

    def restart(self):
        self.starts, self.measured = self.starts + 1, 0

    def close(self):
        pass


def _cuda_cell(status: str) -> Cell:
    return make_cell(variant=status, axes={"device": "cuda:0", "dtype": "float32"}, measure={"fresh_worker": None, "timeout_s": 60}, cell_id=status)


def test_a_failed_cuda_cell_gets_a_fresh_worker_and_an_ok_or_oom_one_keeps_it(monkeypatch):
    from harness.measuring import machine
    from harness.running.executors import local

    monkeypatch.setattr(local, "Worker", _ScriptedWorker)
    monkeypatch.setattr(machine, "fingerprint", lambda device: {"machine_id": device, "gpu": None})
    monkeypatch.setenv("ATTNBENCH_CALIBRATE", "0")
    statuses = ["ok", "error", "ok", "oom", "ok", "nan", "ok", "crashed", "ok", "timeout", "ok", "skipped", "ok"]
    cells = [_cuda_cell(status) for status in statuses]
    executor = local.LocalExecutor()
    executor.start(cells, {"machine_id": "cuda:0"})
    recorded = [observation["result"]["status"] for _, observation in executor.measure(cells, lambda cell: None)]
    assert recorded == [{"timeout": "error"}.get(status, status) for status in statuses]
    # one worker for ok, oom and skipped cells; a new one after each error, nan, crash and timeout (once: a crash or a timeout restarts it itself)
    assert [start for _, start in executor.worker.log] == [1, 1, 2, 2, 2, 2, 3, 3, 4, 4, 5, 5, 5]
    assert executor.worker.starts == 5


@pytest.mark.parametrize(
    "status, device, mode, fresh_worker, expected, backend",
    [
        ("error", "cuda", "forward", None, True, "torch"),
        ("nan", "cuda:1", "forward", False, True, "torch"),  # a failed cell's worker goes, whatever the setting
        ("crashed", "cpu", "quality", None, True, "torch"),
        ("oom", "cuda", "forward", None, False, "torch"),
        ("ok", "cuda", "forward", None, False, "torch"),
        ("ok", "cuda", "forward", True, True, "torch"),
        ("ok", "cuda", "train", None, True, "compile"),  # the next compile cell's compile_s: a compilation, not a cache hit
        ("ok", "cuda", "train", False, False, "compile"),
        ("ok", "cpu", "forward", None, True, "torch"),  # exact CPU peak memory
        ("ok", "cpu", "quality", None, False, "torch"),
        ("skipped", "cuda", "forward", None, False, "torch"),
    ],
)
def test_which_cells_need_a_fresh_worker(status, device, mode, fresh_worker, expected, backend):
    from harness.running.worker import needs_fresh_worker

    cell = make_cell(axes={"device": device}, mode=mode, backend=backend, measure={"fresh_worker": fresh_worker})
    assert needs_fresh_worker(cell, status) is expected


@pytest.mark.slow
def test_one_sticky_error_costs_one_cell_and_the_run_exits_1(tmp_path):
    """fault_sticky's T=16 cell leaves its process unusable (as an illegal address leaves a CUDA
    context); the cells after it, in a shared worker (fresh_worker: false), run in a new one.
    Then the exit code: 1 while the file holds the failed cell, also under --resume and --report."""
    sticky = str(Path(__file__).with_name("sticky_plugin.py"))
    scenario = write_scenario(tmp_path, "fault_sticky: {}", seq_len="[16, 24, 32]", shared_worker=True)
    out, env = tmp_path / "out", {"ATTNBENCH_CALIBRATE": "0"}
    done = attnbench("run", str(scenario), "--plugin", sticky, "--out", str(out), "--no-progress", env=env)
    status = {cell["axes"]["seq_len"]: (cell["status"], cell["error"]) for cell in cells_of(out)}
    assert status[16][0] == "error" and "(injected)" in status[16][1]
    assert status[24][0] == status[32][0] == "ok", status
    assert done.returncode == 1, done.stderr
    named = "faults: 1 cell failed: fault_sticky[torch] forward/core T=16 B=1 H=2 Dk=8 Dv=8 float32 cpu (error: RuntimeError: CUDA error: an illegal"
    assert named in done.stderr, done.stderr
    again = attnbench("run", str(scenario), "--plugin", sticky, "--out", str(out), "--no-progress", "--resume", "--report", str(tmp_path / "report"), env=env)
    assert again.returncode == 1 and "1 cell failed in an earlier run (--retry-failed runs them again): fault_sticky" in again.stderr, again.stderr
    assert (tmp_path / "report" / "index.html").is_file()


@pytest.mark.slow
def test_a_run_of_oom_and_skipped_cells_exits_0(tmp_path):
    scenario = write_scenario(tmp_path, "fault_oom: {}")
    scenario.write_text(scenario.read_text().replace("d_key: 8}", "d_key: 8, device: [cpu, cuda]}"))
    done = attnbench("run", str(scenario), "--plugin", PLUGIN, "--out", str(tmp_path / "out"), "--no-progress", env={"ATTNBENCH_CALIBRATE": "0"})
    assert sorted(cell["status"] for cell in cells_of(tmp_path / "out")) == ["oom", "skipped"]
    assert done.returncode == 0 and "failed" not in done.stderr, done.stderr

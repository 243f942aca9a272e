"""Hostile files (issue 36, classes 1 and 3): attnbench writes only its own files, never through a
planted link; one writer per results file, whatever its name; a checkpoint is its cell's only;
a worker frozen while starting costs its cell, not the sweep; a cell over its memory limit is oom.
Every test here takes seconds but the memory-limit one (slow: a real worker)."""

from __future__ import annotations

import fcntl
import json
import multiprocessing
import os
import resource
import stat
import tempfile
import time

import pytest
import torch
from helpers import make_cell

from harness.common.files import UnsafeFileError
from harness.results import ResultsChangedError, ResultsWriter, read_records, run_header
from harness.results.locking import LOCK_NAME, LockedError, MachineRuns, ResultsDirectoryLock, machine_runs_dir
from harness.running import runner
from harness.running import worker as workers
from harness.scenarios.scenario import load_scenario
from harness.tasks.training import CHECKPOINT_FIELDS, CheckpointError, cell_checkpoints, latest_checkpoint, load_checkpoint, save_checkpoint

HOLDER = {"pid": 1, "scenario": "s", "started_at": "2026-12-03T00:00:00+00:00", "out": "o"}
RUN = {"run_id": "r", "started_at": "2026-12-03T00:00:00+00:00", "scenario": "s", "machine": {"machine_id": "m"}}
CELL = {"run_id": "r", "cell_id": "c", "scenario": "s", "variant": "softmax", "mode": "forward", "status": "skipped", "error": None}
FINGERPRINT = {"machine_id": "m", "git": {"commit": "c0ffee", "dirty": False}}


def _victim(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("someone else's data\n")
    return victim


# --- 1. nothing outside attnbench's own files is written ----------------------------------------


def test_a_link_planted_as_the_directory_lock_is_not_followed(tmp_path):
    victim, out = _victim(tmp_path), tmp_path / "out"
    out.mkdir()
    (out / LOCK_NAME).symlink_to(victim)
    with pytest.raises(LockedError, match="symbolic link"):
        ResultsDirectoryLock(out, HOLDER).__enter__()
    assert victim.read_text() == "someone else's data\n"


def test_a_lock_file_attnbench_did_not_write_is_not_truncated(tmp_path):
    (tmp_path / LOCK_NAME).write_text("notes of the user\n")
    with pytest.raises(LockedError, match="not an attnbench lock file"):
        ResultsDirectoryLock(tmp_path, HOLDER).__enter__()
    assert (tmp_path / LOCK_NAME).read_text() == "notes of the user\n"
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": 2}))  # an earlier run's lock is taken over
    with ResultsDirectoryLock(tmp_path, HOLDER):
        assert json.loads((tmp_path / LOCK_NAME).read_text()) == HOLDER


def test_probing_other_runs_opens_their_locks_read_only(tmp_path, monkeypatch):
    victim, runs = _victim(tmp_path), tmp_path / "runs"
    monkeypatch.setenv("ATTNBENCH_RUNS_DIR", str(runs))
    runs.mkdir(mode=0o700)
    (runs / "planted.lock").symlink_to(victim)
    held = runs / "7.lock"
    held.write_text(json.dumps({**HOLDER, "pid": 7}))
    held.chmod(0o444)  # a lock of someone who lets us read it, not write it
    with open(held, "rb") as other:
        fcntl.flock(other, fcntl.LOCK_EX)
        with MachineRuns(HOLDER) as machine_runs:
            assert [holder["pid"] for holder in machine_runs.others()] == [7]
    assert victim.read_text() == "someone else's data\n"
    assert json.loads(held.read_text())["pid"] == 7


def test_the_default_runs_directory_is_the_users_own_and_private(tmp_path, monkeypatch):
    monkeypatch.delenv("ATTNBENCH_RUNS_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    directory = machine_runs_dir()
    assert directory == tmp_path / f"attnbench-runs-{os.geteuid()}"
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    directory.chmod(0o777)
    with pytest.raises(UnsafeFileError, match="private"):
        machine_runs_dir()
    with MachineRuns(HOLDER) as machine_runs:  # a run that cannot announce itself still measures
        assert machine_runs.others() == []
    assert list(directory.iterdir()) == []


def test_a_results_file_is_never_written_through_a_link(tmp_path):
    victim = _victim(tmp_path)
    (tmp_path / "r.jsonl").symlink_to(victim)
    with pytest.raises(UnsafeFileError, match="symbolic link"):
        ResultsWriter(tmp_path / "r.jsonl").write_run(RUN)
    assert victim.read_text() == "someone else's data\n"


def _tiny(tmp_path, *overrides):
    path = tmp_path / "tiny.yaml"
    path.write_text(
        "name: tiny\nvariants: {softmax: {}}\naxes: {seq_len: [16], batch: 1, heads: 1, d_key: 8}\nmeasure: {warmup: 0, repeats: 2, fresh_worker: false}\n"
    )
    return load_scenario(str(path), overrides=list(overrides))


@pytest.mark.parametrize("kind", ["fifo", "not results", "other scenario"])
def test_resume_checks_the_file_before_creating_anything_beside_it(tmp_path, kind):
    folder = tmp_path / "theirs"
    folder.mkdir()
    target = folder / "r.jsonl"
    if kind == "fifo":
        os.mkfifo(target)
    else:
        target.write_text("a line of text\n" if kind == "not results" else json.dumps({"kind": "run", "schema": 2, **RUN}) + "\n")
    with pytest.raises((runner.RunError, ValueError), match="r.jsonl"):
        runner.run(_tiny(tmp_path), tmp_path / "out", resume=str(target), progress=False)
    assert sorted(path.name for path in folder.iterdir()) == ["r.jsonl"]


# --- 2. one writer per results file ---------------------------------------------------------------


def test_one_writer_per_results_file_whatever_its_name(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = ResultsWriter(tmp_path / "a" / "r.jsonl")
    first.write_run(RUN)
    os.link(tmp_path / "a" / "r.jsonl", tmp_path / "b" / "hard.jsonl")
    (tmp_path / "b" / "soft.jsonl").symlink_to(tmp_path / "a" / "r.jsonl")
    with pytest.raises(LockedError, match="another attnbench run"):
        ResultsWriter(tmp_path / "b" / "hard.jsonl", create=False)
    with pytest.raises(LockedError, match="another attnbench run"):
        ResultsWriter((tmp_path / "b" / "soft.jsonl").resolve(), create=False)
    first.close()
    ResultsWriter(tmp_path / "b" / "hard.jsonl", create=False).write_cell(CELL)
    assert [record["kind"] for record in read_records(tmp_path / "a" / "r.jsonl")] == ["run", "cell"]


@pytest.mark.parametrize(("change", "says"), [("delete", "deleted"), ("truncate", "changed by someone else"), ("replace", "replaced")])
def test_a_results_file_changed_under_the_writer_stops_the_run(tmp_path, change, says):
    path = tmp_path / "r.jsonl"
    writer = ResultsWriter(path)
    writer.write_run(RUN)
    if change == "delete":
        path.unlink()
    elif change == "truncate":
        os.truncate(path, 0)
    else:
        os.replace(_copy(path, tmp_path / "copy.jsonl"), path)
    with pytest.raises(ResultsChangedError, match=f"{path} was {says}"):
        writer.write_cell(CELL)
    assert not path.exists() if change == "delete" else path.read_bytes().count(b"\n") == (0 if change == "truncate" else 1)


def _copy(source, target):
    target.write_bytes(source.read_bytes())
    return target


# --- 3. --resume keeps one configuration per file -------------------------------------------------


def test_resume_refuses_other_set_overrides_naming_them(tmp_path):
    path = tmp_path / "tiny.jsonl"
    measured = _tiny(tmp_path, "measure.repeats=3")
    ResultsWriter(path).write_run(run_header(measured, "r", "attnbench run", FINGERPRINT))
    with pytest.raises(runner.RunError, match=r"without --set measure.repeats=3 .*with --set measure.repeats=4"):
        runner._resume_state(ResultsWriter(path, create=False), _tiny(tmp_path, "measure.repeats=4"), FINGERPRINT, False)
    with pytest.raises(runner.RunError, match="without --set measure.repeats=3"):
        runner._resume_state(ResultsWriter(path, create=False), _tiny(tmp_path), FINGERPRINT, False)
    assert runner._resume_state(ResultsWriter(path, create=False), _tiny(tmp_path, "measure.repeats=3"), FINGERPRINT, False) == ("r", set())


# --- 4. a checkpoint is its cell's only ------------------------------------------------------------


def _cell(cell_id, variant="delta", **params):
    return make_cell(cell_id=cell_id, variant=variant, params=params, axes={"seq_len": 16}, task={"name": "mqar", "steps": 10})


def _payload(step: int) -> dict:
    """A checkpoint payload with every field the trainer writes (empty values of their types)."""
    return {name: (kind[0] if isinstance(kind, tuple) else kind)() for name, kind in CHECKPOINT_FIELDS.items()} | {"step": step}


def test_a_checkpoint_of_another_cell_is_refused_naming_file_and_difference(tmp_path):
    with cell_checkpoints(_cell("a", "delta", beta=1.0)):
        save_checkpoint(tmp_path, 5, _payload(5) | {"model": {"weights": torch.ones(2)}})
    path = latest_checkpoint(tmp_path)
    with cell_checkpoints(_cell("a", "delta", beta=1.0)):
        assert load_checkpoint(path, "cpu")["step"] == 5
    with cell_checkpoints(_cell("b", "linear")), pytest.raises(CheckpointError, match=rf"{path}: a checkpoint of another cell: cell_id 'a'.*variant"):
        load_checkpoint(path, "cpu")
    with cell_checkpoints(_cell("a", "delta", beta=2.0)), pytest.raises(CheckpointError, match="params"):
        load_checkpoint(path, "cpu")
    torch.save(_payload(5), tmp_path / "step-000000009.pt")  # one that names no cell
    with cell_checkpoints(_cell("a")), pytest.raises(CheckpointError, match="names no cell"):
        load_checkpoint(tmp_path / "step-000000009.pt", "cpu")


def test_a_checkpoint_is_never_written_through_a_planted_link(tmp_path):
    victim = _victim(tmp_path)
    (tmp_path / "ckpt").mkdir()
    for name in ("step-000000003.pt.tmp", ".step-000000003.pt.tmp"):
        (tmp_path / "ckpt" / name).symlink_to(victim)
    save_checkpoint(tmp_path / "ckpt", 3, _payload(3))
    assert victim.read_text() == "someone else's data\n"
    assert load_checkpoint(latest_checkpoint(tmp_path / "ckpt"), "cpu")["step"] == 3


# --- 5. a worker frozen while starting costs its cell ----------------------------------------------


def _frozen_start(self, context, child):
    """A worker that never says it is ready."""
    self.process = context.Process(target=time.sleep, args=(60,), daemon=True)
    self.process.start()


def test_a_worker_that_does_not_start_in_time_costs_its_cell_and_the_sweep_goes_on(monkeypatch):
    monkeypatch.setattr(workers, "WORKER_START_TIMEOUT_S", 0.5)
    monkeypatch.setattr(workers.Worker, "_start_spawned", _frozen_start)
    started = time.monotonic()
    worker = workers.Worker()
    try:
        for _ in range(2):  # each cell tries a fresh worker once, and goes on
            result = worker.measure({"cell_id": "c"}, 10)
            assert result["status"] == "crashed" and "did not start within 0.5 s" in result["error"]
            assert not worker.process.is_alive()
    finally:
        worker.close()
    assert time.monotonic() - started < 30
    assert multiprocessing.active_children() == []


# --- a worker's memory is capped: a cell over measure.max_memory is oom, not the machine's ----------


@pytest.mark.slow  # about 15 s alone, 30 s on a busy 2-core machine: a worker starts and imports torch
def test_a_cell_over_its_memory_limit_is_oom_and_the_worker_goes_on(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text(
        "name: big\nvariants: {softmax: {}}\naxes: {seq_len: [16, 65536], batch: 4, heads: 4, d_key: 64}\n"
        "measure: {warmup: 0, repeats: 1, target_rel_ci: null, max_memory: 500000000, fresh_worker: false}\n"
    )
    small, big = load_scenario(str(path)).cells()
    assert big.axes["seq_len"] == 65536  # q, k and v take 268 MB each
    worker = workers.Worker()
    try:
        result = worker.measure(big, 60)
        assert result["status"] == "oom", result
        assert worker.measure(small, 120)["status"] == "ok"
    finally:
        worker.close()


def test_the_memory_limit_is_max_memory_else_a_share_of_ram_on_the_cpu():
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    cell = make_cell(measure={"max_memory": None})
    assert workers.memory_limit(cell) == int(workers.MEMORY_SHARE * ram)
    assert workers.memory_limit(cell.replace(axes={"device": "cuda:1"})) is None
    assert workers.memory_limit(make_cell(measure={"max_memory": 1 << 30}, axes={"device": "cuda:0"})) == 1 << 30
    before = resource.getrlimit(resource.RLIMIT_DATA)
    try:
        workers.limit_memory(1 << 40)
        assert resource.getrlimit(resource.RLIMIT_DATA)[0] == (1 << 40 if before[1] == resource.RLIM_INFINITY else min(1 << 40, before[1]))
        workers.limit_memory(None)  # a later cell without a limit gets the whole hard limit back
        assert resource.getrlimit(resource.RLIMIT_DATA) == (before[1], before[1])
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, before)

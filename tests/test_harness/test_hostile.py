"""Hostile input and faults (issue 16): files are data, never code; errors name what is wrong."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import attnbench, attnbench_here
from torch import nn

from harness.results import ResultsFileError, ResultsWriter, read_records
from harness.tasks.training import CheckpointError, TrainConfig, load_checkpoint, train


class _CreatesFile:
    """An object whose unpickling calls ``open(path, "w")``: what a crafted checkpoint does."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


class _Stream:
    def __init__(self):
        self.generator = torch.Generator().manual_seed(0)

    def next(self):
        x = torch.randn(4, 3, generator=self.generator)
        return x, x.sum(-1, keepdim=True)

    def state_dict(self):
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state):
        self.generator.set_state(state["generator"])


def _mse(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y), len(x)


def test_a_crafted_checkpoint_runs_no_code_and_is_refused(tmp_path):
    """Resuming from a checkpoint whose unpickling would create a file creates nothing and
    raises a CheckpointError that names the file."""
    marker = tmp_path / "pwned"
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    crafted = checkpoints / "step-000000001.pt"
    torch.save({"step": 1, "world_size": 1, "payload": _CreatesFile(marker)}, crafted)
    config = TrainConfig(steps=2, lr=1e-2, checkpoint_dir=str(checkpoints), checkpoint_every=1)
    with pytest.raises(CheckpointError, match=str(crafted)):
        train(nn.Linear(3, 1), _mse, _Stream(), config, progress=False)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"", "not a checkpoint"),
        (b"\x00garbage" * 10, "not a checkpoint"),
        ({"step": 1}, "field 'world_size': expected int, got nothing"),
        ([1, 2, 3], "expected a checkpoint"),
    ],
)
def test_foreign_or_corrupt_checkpoints_are_refused_with_path_and_reason(tmp_path, content, expected):
    path = tmp_path / "step-000000001.pt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save(content, path)
    with pytest.raises(CheckpointError, match=expected) as caught:
        load_checkpoint(path, "cpu")
    assert str(path) in str(caught.value)


def test_a_checkpoint_the_engine_wrote_loads_as_data(tmp_path):
    """The engine's own checkpoints (tensors, optimiser state, RNG states, losses) pass the
    weights-only loader (test_training's resume tests rely on it)."""
    config = TrainConfig(steps=2, lr=1e-2, checkpoint_dir=str(tmp_path), checkpoint_every=2)
    train(nn.Linear(3, 1), _mse, _Stream(), config, progress=False)
    saved = load_checkpoint(tmp_path / "step-000000002.pt", "cpu")
    assert saved["step"] == 2 and saved["world_size"] == 1 and len(saved["losses"]) == 1


# --- the runner and its files, through the command line ------------------------------------

PLUGIN = str(Path(__file__).with_name("fault_plugin.py"))


def _scenario(tmp_path, name: str, variants: str = "softmax: {}", seq_len: str = "[16]", timeout_s: int = 120) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        f"name: {name}\nvariants: {{{variants}}}\naxes: {{seq_len: {seq_len}, batch: 1, heads: 1, d_key: 8}}\n"
        f"measure: {{warmup: 0, repeats: 2, timeout_s: {timeout_s}, fresh_worker: false}}\n"
    )
    return str(path)


def _refused(done, *expected: str, measured: bool = False) -> None:
    """Exit code 2, a one-line error naming what is expected, and no traceback (after a run that
    ``measured`` cells, after the warning of a busy machine it may have printed first)."""
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    stderr = done.stderr.split("\n", 1)[1] if measured and done.stderr.startswith("warning: the machine is busy") else done.stderr
    assert "Traceback" not in done.stderr and stderr.startswith("error: "), done.stderr
    for text in expected:
        assert text in done.stderr, done.stderr


def _start(tmp_path, scenario: str, out, *, slow_s: float, env=None) -> subprocess.Popen:
    """A run in its own process group, as a terminal starts it (SIGINT not ignored)."""
    command = [sys.executable, "-m", "harness.cli", "run", scenario, "--plugin", PLUGIN, "--out", str(out), "--no-progress"]
    return subprocess.Popen(
        command,
        env={**os.environ, "FAULT_SLOW_S": str(slow_s), **(env or {})},
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _wait_for(condition, what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def _cells(out) -> list[dict]:
    (path,) = Path(out).glob("*.jsonl")
    return [record for record in read_records(path) if record["kind"] == "cell"]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
def test_resume_never_picks_or_appends_to_another_scenarios_file(tmp_path):
    out = tmp_path / "out"
    assert attnbench("run", _scenario(tmp_path, "tiny-big"), "--out", str(out), "--no-progress").returncode == 0
    (other,) = out.glob("*.jsonl")
    before = other.read_bytes()
    tiny = _scenario(tmp_path, "tiny")
    _refused(attnbench_here("run", tiny, "--out", str(out), "--resume", "--no-progress"), "no results of scenario 'tiny'")
    _refused(attnbench_here("run", tiny, "--out", str(out), "--resume", str(other), "--no-progress"), "another scenario", "'tiny-big'")
    assert other.read_bytes() == before


@pytest.mark.slow
def test_resume_refuses_an_edited_scenario_file(tmp_path):
    out, tiny = tmp_path / "out", _scenario(tmp_path, "tiny")
    assert attnbench("run", tiny, "--out", str(out), "--no-progress").returncode == 0
    Path(tiny).write_text(Path(tiny).read_text().replace("seq_len: [16]", "seq_len: [16, 24]"))
    _refused(attnbench_here("run", tiny, "--out", str(out), "--resume", "--no-progress"), "scenario_sha256")


@pytest.mark.parametrize(
    ("assignment", "field"),
    [
        ("variants.softmax.scale=.nan", "variants.softmax.scale"),
        ("variants.softmax.scale=-.inf", "variants.softmax.scale"),
        ("measure.timeout_s=.inf", "measure.timeout_s"),
    ],
)
def test_non_finite_numbers_are_refused_before_anything_runs(tmp_path, assignment, field):
    out = tmp_path / "out"
    _refused(attnbench_here("run", _scenario(tmp_path, "tiny"), "--set", assignment, "--out", str(out), "--no-progress"), field, "finite")
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.serial  # the second run must start while the first still runs
def test_a_second_run_into_one_directory_is_refused_and_nothing_interleaves(tmp_path):
    out, slow = tmp_path / "out", _scenario(tmp_path, "slow", "fault_slow: {}", "[16, 24, 32]")
    first = _start(tmp_path, slow, out, slow_s=1.0)
    try:
        _wait_for(lambda: list(out.glob("*.jsonl")), "the first run's results file")
        _refused(attnbench("run", slow, "--plugin", PLUGIN, "--out", str(out), "--no-progress"), "in use by another attnbench run", f"pid {first.pid}")
        assert first.wait(120) == 0, first.stderr.read()
    finally:
        first.kill()
    (path,) = out.glob("*.jsonl")
    kinds = [record["kind"] for record in read_records(path)]
    assert kinds == ["run", "cell", "cell", "cell"]


@pytest.mark.slow
@pytest.mark.serial  # the second run must end while the first still runs, and a busy machine's warning replaces the line it reads
def test_runs_measuring_side_by_side_on_one_machine_are_recorded(tmp_path):
    env = {"ATTNBENCH_RUNS_DIR": str(tmp_path / "runs")}
    first = _start(tmp_path, _scenario(tmp_path, "slow", "fault_slow: {}", "[16, 24, 32]"), tmp_path / "one", slow_s=2.0, env=env)
    try:
        _wait_for(lambda: list((tmp_path / "one").glob("*.jsonl")), "the first run's results file")
        second = attnbench("run", _scenario(tmp_path, "tiny"), "--out", str(tmp_path / "two"), "--no-progress", env=env)
    finally:
        first.kill()
        first.wait()
    assert second.returncode == 0, second.stderr
    assert "other attnbench runs are measuring on this machine" in second.stderr
    (cell,) = _cells(tmp_path / "two")
    assert [run["pid"] for run in cell["concurrent_runs"]] == [first.pid]


@pytest.mark.slow
def test_a_worker_dies_with_its_killed_runner(tmp_path):
    runner = _start(tmp_path, _scenario(tmp_path, "slow", "fault_slow: {}"), tmp_path / "out", slow_s=120)
    try:
        _wait_for(lambda: _children(runner.pid), "the worker process")
        workers = _children(runner.pid)
        _wait_for(lambda: list((tmp_path / "out").glob("*.jsonl")), "the run line")
        os.kill(runner.pid, signal.SIGKILL)
        runner.wait(10)
        deadline = time.monotonic() + 5
        while any(map(_alive, workers)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(_alive, workers)), "a worker outlived its runner by 5 s"
    finally:
        runner.kill()
        for pid in _children(runner.pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("name", ["../../escaped", "/tmp/absolute", "sub/dir", ".hidden"])
def test_a_scenario_name_is_a_file_name(tmp_path, name):
    path = Path(_scenario(tmp_path, "tiny"))
    path.write_text(path.read_text().replace("name: tiny", f"name: {name!r}"))
    _refused(attnbench_here("run", str(path), "--out", str(tmp_path / "out"), "--no-progress"), "name:", "results file")
    assert list(tmp_path.rglob("*.jsonl")) == []


def test_files_that_are_not_scenarios_get_one_line_errors(tmp_path):
    _refused(attnbench_here("run", str(tmp_path), "--dry-run"), str(tmp_path), "directory")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"name: x\n\xff\xfe\x00")
    _refused(attnbench_here("run", str(binary), "--dry-run"), str(binary), "UTF-8")
    cycle = tmp_path / "cycle.yaml"
    cycle.write_text("name: cycle\nvariants: {softmax: {}}\naxes: &a {seq_len: [8, *a]}\n")
    _refused(attnbench_here("run", str(cycle), "--dry-run"), str(cycle), "alias")
    _refused(attnbench_here("run", _scenario(tmp_path, "tiny"), "--set", "seq_len=[1,", "--dry-run"), "--set", "not valid YAML")


@pytest.mark.parametrize(
    ("assignment", "field"),
    [("modes=[]", "modes"), ("backends=[]", "backends"), ("seq_len=true", "axes.seq_len"), ("seq_len=1.5", "axes.seq_len")],
)
def test_empty_sweeps_and_non_integer_axes_are_refused(tmp_path, assignment, field):
    _refused(attnbench_here("run", _scenario(tmp_path, "tiny"), "--set", assignment, "--dry-run"), field)


def test_an_unwritable_out_or_an_unusable_file_to_resume_is_one_line(tmp_path):
    tiny = _scenario(tmp_path, "tiny")
    _refused(attnbench_here("run", tiny, "--out", f"{tiny}/results", "--no-progress"), "cannot write results")
    (tmp_path / "empty.jsonl").write_bytes(b"")
    _refused(attnbench_here("run", tiny, "--resume", str(tmp_path / "empty.jsonl"), "--no-progress"), "empty.jsonl", "empty")
    (tmp_path / "corrupt.jsonl").write_bytes(b"not json\n")
    _refused(attnbench_here("run", tiny, "--resume", str(tmp_path / "corrupt.jsonl"), "--no-progress"), "corrupt.jsonl, line 1")


def _results_file(path, samples) -> Path:
    """A results file of one ok cell whose timing samples are ``samples``."""
    writer = ResultsWriter(path)
    writer.write_run({"run_id": "r", "started_at": "2026-12-01T00:00:00+00:00", "scenario": "s", "machine": {"machine_id": "m"}})
    metrics = {"median_s": samples[len(samples) // 2], "samples_s": samples}
    writer.write_cell(
        {
            "run_id": "r",
            "cell_id": "c",
            "scenario": "s",
            "variant": "softmax",
            "backend": "torch",
            "params": {},
            "axes": {"seq_len": 16},
            "mode": "forward",
            "target": "core",
            "status": "ok",
            "error": None,
            "metrics": metrics,
            "started_at": "2026-12-01T00:00:01+00:00",
        }
    )
    return Path(path)


@pytest.mark.parametrize(
    "samples, expected",
    [([-0.5, 0.1, 0.2], "finite numbers >= 0"), ([0.1, float("nan"), 0.2], "finite numbers >= 0"), ([0.1, "fast", 0.2], "metrics.median_s: expected a number")],
    ids=["negative", "nan", "string"],
)
def test_load_and_compare_refuse_impossible_timings_with_file_and_line(tmp_path, samples, expected):
    good, bad = _results_file(tmp_path / "good.jsonl", [0.1, 0.2, 0.3]), _results_file(tmp_path / "bad.jsonl", samples)
    with pytest.raises(ResultsFileError, match=r"bad\.jsonl, line 2"):
        read_records(bad)
    _refused(attnbench_here("compare", str(good), str(bad)), "bad.jsonl, line 2", expected)


@pytest.mark.slow
def test_a_full_disk_stops_the_run_and_leaves_a_file_that_loads_and_resumes(tmp_path):
    """A file-size limit (as a full disk) hit at the second cell line: the run stops with one
    line, the file holds the run line and the first cell whole, and --resume completes it.
    Fixed sampling, so that the cell lines of the two runs hold equally many samples."""
    tiny = _scenario(tmp_path, "tiny", "softmax: {}", "[16, 24, 32]")
    fixed = ("--set", "measure.target_rel_ci=null")
    assert attnbench("run", tiny, *fixed, "--out", str(tmp_path / "sizes"), "--no-progress").returncode == 0
    lines = next((tmp_path / "sizes").glob("*.jsonl")).read_bytes().splitlines(keepends=True)
    limit = len(lines[0]) + len(lines[1]) + len(lines[2]) // 2

    def limited():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    out = tmp_path / "out"
    command = [sys.executable, "-m", "harness.cli", "run", tiny, *fixed, "--out", str(out), "--no-progress"]
    done = subprocess.run(command, capture_output=True, text=True, preexec_fn=limited, timeout=300)
    _refused(done, "cannot append", "--resume", measured=True)
    assert len(_cells(out)) == 1
    resumed = attnbench("run", tiny, *fixed, "--out", str(out), "--resume", "--no-progress")
    assert resumed.returncode == 0, resumed.stderr
    assert sorted(cell["axes"]["seq_len"] for cell in _cells(out)) == [16, 24, 32]


@pytest.mark.parametrize("after_cells", [0, 1], ids=["while-starting", "mid-sweep"])
@pytest.mark.slow
def test_ctrl_c_to_the_process_group_exits_130_without_a_traceback(tmp_path, after_cells):
    out = tmp_path / "out"
    runner = _start(tmp_path, _scenario(tmp_path, "slow", "fault_slow: {}", "[16, 24, 32]"), out, slow_s=1.0)
    try:
        if after_cells:
            _wait_for(lambda: list(out.glob("*.jsonl")) and len(_cells(out)) >= after_cells, "a finished cell")
        else:  # the runner has started its worker, which is still importing (not a fixed sleep: on a
            # loaded machine the interpreter itself may take a second to start, before any handler)
            _wait_for(lambda: any("spawn_main" in _cmdline(pid) for pid in _children(runner.pid)), "the worker process")
            time.sleep(0.3)
        os.killpg(runner.pid, signal.SIGINT)
        _, stderr = runner.communicate(timeout=60)
    finally:
        runner.kill()
    assert runner.returncode == 130, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr


@pytest.mark.slow
def test_a_killed_worker_is_crashed_not_oom_and_retry_failed_runs_it_again(tmp_path):
    out, faults = tmp_path / "out", _scenario(tmp_path, "faults", "fault_kill: {}, softmax: {}")
    assert attnbench("run", faults, "--plugin", PLUGIN, "--out", str(out), "--no-progress").returncode == 1  # a crashed cell
    status = {cell["variant"]: (cell["status"], cell["error"]) for cell in _cells(out)}
    assert status["fault_kill"][0] == "crashed" and "SIGKILL" in status["fault_kill"][1]
    assert status["softmax"][0] == "ok"
    again = attnbench("run", faults, "--plugin", PLUGIN, "--out", str(out), "--resume", "--no-progress")
    assert "2 already done" in again.stdout and len(_cells(out)) == 2
    retried = attnbench("run", faults, "--plugin", PLUGIN, "--out", str(out), "--resume", "--retry-failed", "--no-progress")
    assert retried.returncode == 1 and "1 already done" in retried.stdout, retried.stdout  # it crashed again
    assert [cell["variant"] for cell in _cells(out)] == ["fault_kill", "softmax", "fault_kill"]

"""The Ray executor (``attnbench run --executor ray``, harness.running.executors.ray) on a local Ray
instance started by the run: the same cells as the local executor, a Ray worker killed mid-cell,
the driver killed and resumed; without Ray, the install hint."""

from __future__ import annotations

import contextlib
import importlib.util
import json
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
@pytest.mark.parametrize("scenario", ["smoke-cpu", "quality/mqar"])
@pytest.mark.serial  # a Ray instance of its own and roofline fractions
def test_ray_measures_the_same_cells_as_the_local_executor(tmp_path, scenario, request):
    """Every cell of the ci preset, ok, under both executors; the Ray cells name their node, whose
    run line carries this machine's fingerprint (with its calibration for the timed cells). smoke-cpu's
    local side is the session's ``smoke_ci`` run (exactly 2 samples a cell: tests/test_harness/conftest.py)."""
    if scenario == "smoke-cpu":
        smoke = request.getfixturevalue("smoke_ci")
        args, local_out = smoke.args, smoke.out
    else:
        args, local_out = (scenario, "--preset", "ci"), tmp_path / "local"
        done = attnbench("run", *args, "--out", str(local_out), "--no-progress")
        assert done.returncode == 0, done.stderr
    done = attnbench("run", *args, "--executor", "ray", "--out", str(tmp_path / "ray"), "--no-progress")
    assert done.returncode == 0, done.stderr
    (local_run,), local = _records(local_out)
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
@pytest.mark.serial  # a Ray instance of its own
def test_a_killed_ray_worker_and_a_killed_cell_process_are_crashed_and_the_sweep_goes_on(tmp_path):
    plugin = tmp_path / "kill_ray_worker.py"
    plugin.write_text(KILL_RAY_WORKER)
    scenario = _scenario(tmp_path, "fault_kill_ray_worker: {}, fault_kill: {}, softmax: {}", "[16]")
    done = attnbench(
        "run", scenario, "--plugin", str(plugin), "--executor", "ray", "--out", str(tmp_path / "out"), "--no-progress", env={"ATTNBENCH_CALIBRATE": "0"}
    )
    assert done.returncode == 1 and "2 cells failed" in done.stderr, done.stderr
    _, cells = _records(tmp_path / "out")
    status = {cell["variant"]: (cell["status"], cell["error"]) for cell in cells}
    assert status.keys() == {"fault_kill_ray_worker", "fault_kill", "softmax"}
    assert status["fault_kill_ray_worker"][0] == "crashed" and "Ray worker" in status["fault_kill_ray_worker"][1], status
    assert status["fault_kill"][0] == "crashed" and "SIGKILL" in status["fault_kill"][1], status
    assert status["softmax"][0] == "ok", status


@needs_ray
@pytest.mark.slow
@pytest.mark.serial  # a Ray instance of its own
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


@pytest.mark.parametrize(
    "options, expected",
    [
        (["--address", "auto"], "--address and --cells-per-node are options of --executor ray"),
        (["--cells-per-node", "2"], "--address and --cells-per-node are options of --executor ray"),
    ],
)
def test_ray_options_without_the_ray_executor_are_refused(tmp_path, options, expected):
    done = attnbench("run", "smoke-cpu", "--preset", "ci", *options, "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and done.stderr.startswith("error: ") and expected in done.stderr, done.stderr


@needs_ray
def test_cells_per_node_below_one_is_refused(tmp_path):
    done = attnbench("run", "smoke-cpu", "--preset", "ci", "--executor", "ray", "--cells-per-node", "0", "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and "--cells-per-node must be at least 1, got 0" in done.stderr, done.stderr


# --- a Ray instance started here listens on loopback only (issue 46, item 7) ----------------------


class _FakeRay:
    """The calls of ``ray`` that starting a local instance makes, recorded; its node on ``node_ip``."""

    def __init__(self, node_ip):
        self.inits, self.shut = [], False
        self.util = type("util", (), {"get_node_ip_address": staticmethod(lambda: node_ip)})

    def is_initialized(self):
        return False

    def init(self, **kwargs):
        self.inits.append(kwargs)

    def shutdown(self):
        self.shut = True


def test_a_local_ray_instance_is_started_on_loopback_and_a_routable_one_refused(monkeypatch):
    from harness.running.executors import ray as ray_executor
    from harness.running.runner import RunError

    for key in ray_executor.LOCAL_ONLY:
        monkeypatch.delenv(key, raising=False)
    fake = _FakeRay("127.0.0.1")
    monkeypatch.setattr(ray_executor, "import_ray", lambda: fake)
    executor = ray_executor.RayExecutor()
    assert all(os.environ[key] == value for key, value in ray_executor.LOCAL_ONLY.items())  # set before ray is imported
    executor.start([], {"machine_id": "m"})
    assert fake.inits[0]["_node_ip_address"] == "127.0.0.1" and fake.inits[0]["include_dashboard"] is False
    fake = _FakeRay("192.0.2.2")  # a Ray that took the routable address anyway
    monkeypatch.setattr(ray_executor, "import_ray", lambda: fake)
    with pytest.raises(RunError, match="would listen on 192.0.2.2, not only on 127.0.0.1"):
        ray_executor.RayExecutor().start([], {"machine_id": "m"})
    assert fake.shut


#: Starts a local Ray instance as ``attnbench run --executor ray`` does, then prints the addresses
#: its processes (this one's descendants) listen on, from /proc.
LISTENING = """
import json, os
from pathlib import Path
from harness.running.executors.ray import RayExecutor

def descendants(root):
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in found]
        found.update(children)
        frontier += children
    return found

def sockets(pids):
    inodes = set()
    for pid in pids:
        try:
            inodes |= {os.readlink(fd)[8:-1] for fd in Path(f"/proc/{pid}/fd").iterdir() if os.readlink(fd).startswith("socket:[")}
        except OSError:
            continue
    return inodes

executor = RayExecutor()
executor.start([], {"machine_id": "m"})
try:
    mine = sockets(descendants(os.getpid()))
    listening = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in mine:
                listening.append(fields[1].rsplit(":", 1)[0])
    print(json.dumps(listening))
finally:
    executor.close()
"""


@needs_ray
@pytest.mark.slow  # about 15 s: a Ray instance starts and stops
@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads the listening sockets from Linux's /proc")
def test_a_local_ray_instance_listens_on_loopback_only(tmp_path):
    env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_")}
    done = subprocess.run([sys.executable, "-c", LISTENING], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    listening = json.loads(done.stdout.strip().splitlines()[-1])
    loopback = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::ffff:127.0.0.1, ::1
    assert listening and set(listening) <= loopback, listening

"""Run a scenario's cells one at a time in a worker process, resumably.

The worker is a separate process, so a crash, a hang or an out-of-memory kill in one cell
costs that cell only: it is recorded with its status and message, the worker is restarted
and the sweep goes on. Each finished cell is appended to the results file at once, so
Ctrl-C or a crash of the runner itself keeps every finished cell, and ``--resume``
measures only what is missing.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime as dt
import gc
import multiprocessing
import os
import re
import resource
import shutil
import signal
import stat
import subprocess
import sys
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from . import machine
from .files import open_regular
from .load import busy_warning, other_cores_now
from .locking import MachineRuns, ResultsDirectoryLock, describe_runs
from .plugins import load_plugins
from .results import FAILED, ResultsWriteError, ResultsWriter, completed_cell_ids, parse_line, read_records
from .roofline import roofline
from .scenario import LoadedScenario, describe

#: glibc maps blocks of 64 KiB and more on their own and trims its heap at once, so freed
#: memory leaves a worker's resident set and the per-cell peak RSS (harness.measure.PeakMemory)
#: follows live memory to about 2 MiB.
WORKER_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0", "MALLOC_TOP_PAD_": "0"}
#: Seconds a worker may take to start (its imports, the plugins); one that takes longer is
#: killed and costs the cell it was started for (``crashed``), and the sweep goes on.
WORKER_START_TIMEOUT_S = 300
PR_SET_PDEATHSIG = 1
#: The cgroup (v2, then v1) counters of out-of-memory kills, read before and after a cell.
OOM_COUNTERS = (Path("/sys/fs/cgroup/memory.events"), Path("/sys/fs/cgroup/memory/memory.oom_control"))
#: The program of a worker that runs another checkout's code (``Worker(code_root=...)``): that
#: checkout's own ``harness.runner._serve``, on the socket the parent passes as its file descriptor.
CHECKOUT_WORKER = (
    "import sys; from multiprocessing.connection import Connection; from harness.runner import _serve; "
    "_serve(Connection(int(sys.argv[1])), sys.argv[2:])"
)
#: The statuses of a cell that make a run fail (exit code 1, ``RunSummary.failures``): every
#: failed status but ``oom``, which a sweep to the memory limit expects.
FAILING = tuple(status for status in FAILED if status != "oom")
#: A worker's host memory limit where ``measure.max_memory`` is null: this share of physical memory.
MEMORY_SHARE = 0.8
#: The most of a results file ``--resume`` reads before taking its lock: its first line (a run line).
FIRST_LINE_BYTES = 1 << 20


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (``prctl(PR_SET_PDEATHSIG)``), so a
    worker never outlives a runner killed with ``kill -9`` and keeps measuring; a no-op elsewhere."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return


def _serve(conn, plugins, parent_pid=None) -> None:
    """The worker's loop: receive a cell, measure it, send back its result; ``None`` stops.
    It starts with SIGINT ignored (``Worker._start``): Ctrl-C is the runner's to handle."""
    from .tasks.training import cell_checkpoints
    from .workloads import is_out_of_memory, measure_cell

    die_with_parent()
    if parent_pid is not None and os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
    load_plugins(plugins)
    conn.send("ready")
    while (cell := conn.recv()) is not None:
        try:
            if "calibrate" in cell:
                result = _calibrate(cell["calibrate"])
            else:
                limit_memory(memory_limit(cell))
                with cell_checkpoints(cell):
                    result = measure_cell(cell)
        except BaseException as exc:  # noqa: BLE001 - every failure of a cell is recorded
            status = "oom" if is_out_of_memory(exc) else "error"
            summary = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
            location = f" (at {where[0].filename}:{where[0].lineno})" if where else ""
            result = {"status": status, "error": summary + location, "metrics": {}}
        conn.send(result)
        gc.collect()
        _empty_cuda_cache()


def memory_limit(cell: dict) -> int | None:
    """The bytes of host memory ``cell``'s worker may take: ``measure.max_memory``, else for a
    CPU cell ``MEMORY_SHARE`` of physical memory, else None (no limit: a GPU cell's host memory
    is its driver's, and how the driver takes to ``RLIMIT_DATA`` is not measured here)."""
    chosen = cell["measure"].get("max_memory")
    if chosen is not None or not str(cell["axes"].get("device", "cpu")).startswith("cpu"):
        return chosen
    return int(MEMORY_SHARE * os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def limit_memory(limit: int | None) -> None:
    """Cap this worker's data (``RLIMIT_DATA``: its heap and private writable mappings, where
    tensors live; not the address space a GPU driver reserves, which ``RLIMIT_AS`` would count)
    at ``limit`` bytes (None: the hard limit), within the hard limit: an allocation over it fails
    as out of memory (``oom``) in this worker instead of the machine's OOM killer taking any process."""
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    soft = hard if limit is None or (hard != resource.RLIM_INFINITY and limit > hard) else limit
    resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def _calibrate(request: dict) -> dict:
    """The worker's side of ``calibration``: pinned as its cells will be, then measured on their device."""
    from .measure import on_device
    from .roofline import calibrate
    from .workloads import pin

    pin(request.pop("cpus"))
    with on_device(request["device"]):
        return {"status": "ok", "error": None, "metrics": calibrate(**request)}


def calibration(worker, cells: list[dict], fingerprint: dict) -> dict | None:
    """``machine.calibration`` for ``cells``, measured in ``worker`` (its threads, the cells'
    ``measure.cpus``) on their device (``cuda:N``: GPU N, with its SM clock): None when no cell
    is timed, when ``ATTNBENCH_CALIBRATE=0``, or when it failed (with a warning)."""
    timed = [cell for cell in cells if cell["mode"] != "quality" and not cell["skip"]]
    if not timed or os.environ.get("ATTNBENCH_CALIBRATE", "1") == "0":
        return None
    device = main_device(timed)
    clock = (machine.throttle_state(device) or {}).get("sm_clock_mhz")
    request = {
        "machine_id": fingerprint["machine_id"], "dtypes": sorted({cell["axes"]["dtype"] for cell in timed}), "device": device,
        "gpu_name": (fingerprint.get("gpu") or {}).get("name"), "sm_clock_mhz": clock, "cpus": timed[0]["measure"].get("cpus"),
    }
    result = worker.measure({"calibrate": request}, WORKER_START_TIMEOUT_S)
    if result["status"] != "ok":
        print(f"warning: calibration failed, no roofline fractions in this run: {result['error']}", file=sys.stderr)
        return None
    return result["metrics"]


def _empty_cuda_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _worker_preexec() -> None:
    """In a checkout worker before it execs: SIGINT ignored, killed when the runner dies."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()


def oom_kills() -> int | None:
    """Out-of-memory kills counted by this process's cgroup so far (None where not readable)."""
    for path in OOM_COUNTERS:
        try:
            counters = dict(line.split() for line in path.read_text().splitlines() if len(line.split()) == 2)
        except OSError:
            continue
        if "oom_kill" in counters:
            return int(counters["oom_kill"])
    return None


class _CheckoutProcess:
    """A worker process of another checkout (a ``subprocess.Popen``) with the methods of
    ``multiprocessing.Process`` that ``Worker`` uses."""

    def __init__(self, popen: subprocess.Popen):
        self.popen = popen

    @property
    def exitcode(self):
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout=None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        self.popen.kill()


class Worker:
    """A child process that measures cells; restarted whenever it dies or hangs.

    By default it runs this attnbench's code. With ``code_root`` (a checkout of another
    revision, see harness.regress) it is a fresh interpreter started in that directory with
    it first on ``PYTHONPATH``, so ``harness`` and ``variants`` are that revision's own.
    ``env`` adds environment variables for the worker (e.g. its own ``TRITON_CACHE_DIR``).
    ``tune_malloc`` sets ``WORKER_ENV`` for exact per-cell peak RSS on the CPU; it costs
    page faults on every large allocation (measured: +50% CPU time in an MQAR training run),
    so the runner turns it off for scenarios of quality cells (whole training runs)."""

    def __init__(self, plugins=(), *, code_root=None, env=None, tune_malloc: bool = True):
        self.plugins = list(plugins)
        self.code_root = code_root
        self.env = {**(WORKER_ENV if tune_malloc else {}), **(env or {})}
        self.process = None
        self._start()

    def _start(self) -> None:
        self.measured = 0  #: cells sent to this process since it started
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        if self.code_root is not None:
            self._start_checkout(child)
        else:
            self._start_spawned(context, child)
        child.close()
        # Wait for the imports, so that a cell's timeout counts its own time only.
        self.start_error = None
        try:
            ready = self.conn.poll(WORKER_START_TIMEOUT_S) and self.conn.recv() == "ready"
        except EOFError:
            ready = False
        if not ready:
            frozen = self.process.is_alive()
            self.kill()
            if not frozen:
                raise RuntimeError(f"the worker process did not start (exit code {self.process.exitcode}); see the messages above")
            self.start_error = f"the worker process did not start within {WORKER_START_TIMEOUT_S:g} s (killed; WORKER_START_TIMEOUT_S)"

    def _start_checkout(self, child) -> None:
        env = {**os.environ, **self.env, "PYTHONPATH": str(self.code_root)}
        command = [sys.executable, "-c", CHECKOUT_WORKER, str(child.fileno()), *self.plugins]
        popen = subprocess.Popen(command, cwd=self.code_root, env=env, pass_fds=[child.fileno()], preexec_fn=_worker_preexec)
        self.process = _CheckoutProcess(popen)

    def _start_spawned(self, context, child) -> None:
        saved = {key: os.environ.get(key) for key in self.env}
        os.environ.update(self.env)
        # A process that starts with SIGINT ignored keeps it ignored (Python installs its
        # KeyboardInterrupt handler only over the default), so Ctrl-C, which the terminal sends
        # to the whole process group, never reaches the worker even while it imports.
        interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            self.process = context.Process(target=_serve, args=(child, self.plugins, os.getpid()), daemon=True)
            self.process.start()
        finally:
            signal.signal(signal.SIGINT, interrupt)
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key)
                else:
                    os.environ[key] = value

    def measure(self, cell: dict, timeout_s: float) -> dict:
        """The result of ``cell`` measured within ``timeout_s``; ``crashed`` when the worker,
        started again after one that did not start in time, does not start either."""
        if self.start_error is not None:
            self._start()
            if self.start_error is not None:
                return {"status": "crashed", "error": self.start_error, "metrics": {}}
        oom_before = oom_kills()
        self.measured += 1
        self.conn.send(cell)
        if not self.conn.poll(timeout_s):
            self.restart()
            return {"status": "error", "error": f"timed out after {timeout_s:g} s (cell stopped; measure.timeout_s)", "metrics": {}}
        try:
            return self.conn.recv()
        except EOFError:
            return self._died(oom_before)

    def _died(self, oom_before: int | None) -> dict:
        """The record of a worker that died in a cell: ``oom`` when the cgroup counted an
        out-of-memory kill meanwhile, else ``crashed`` with its signal or exit code."""
        self.process.join(5)
        code = self.process.exitcode
        self.restart()
        oom_after = oom_kills()
        if oom_before is not None and oom_after is not None and oom_after > oom_before:
            return {"status": "oom", "error": f"the worker was killed by the out-of-memory killer (exit code {code})", "metrics": {}}
        if code is not None and code < 0:
            how = f"killed by signal {signal.Signals(-code).name}"
        else:
            how = f"exited with code {code}"
        return {"status": "crashed", "error": f"the worker process died: {how}", "metrics": {}}

    def restart(self) -> None:
        self.kill()
        self._start()

    def kill(self) -> None:
        if self.process is not None and self.process.is_alive():
            self.process.kill()
            self.process.join()

    def close(self) -> None:
        if self.process is not None and self.process.is_alive():
            try:
                self.conn.send(None)
                self.process.join(10)
            except (BrokenPipeError, OSError):
                pass
        self.kill()


class RunError(RuntimeError):
    """A run that cannot start or go on (an unwritable directory, a file that is not this
    scenario's to resume, another run in the directory); the message says what to do."""


@dataclass
class RunSummary:
    path: Path
    total: int
    skipped_as_done: int
    statuses: dict = field(default_factory=dict)
    seconds: float = 0.0
    interrupted: bool = False
    write_error: str | None = None
    timed: int = 0  #: cells with a stability verdict (metrics.unstable)
    unstable: list = field(default_factory=list)  #: describe() of each unstable cell
    other_cpu_s: float = 0.0  #: CPU seconds other processes used during the cells
    load_wall_s: float = 0.0  #: wall seconds of the cells those were counted over
    cores: int | None = None
    failures: list = field(default_factory=list)  #: (describe(cell), status, message) of each cell measured FAILING
    earlier_failures: list = field(default_factory=list)  #: the same of the cells a resumed file holds FAILING and this run left alone

    def count(self, cell: dict, record: dict) -> None:
        """Add a finished cell: its status, whether it was unstable, the load it saw."""
        self.statuses[record["status"]] = self.statuses.get(record["status"], 0) + 1
        if record["status"] in FAILING:
            self.failures.append((describe(cell), record["status"], record["error"]))
        metrics = record["metrics"]
        if metrics.get("unstable") is not None:
            self.timed += 1
            if metrics["unstable"]:
                self.unstable.append(describe(cell))
        load = metrics.get("load") or {}
        if load.get("other_cpu_s") is not None:
            self.other_cpu_s += load["other_cpu_s"]
            self.load_wall_s += load["wall_s"]
            self.cores = load["cores"]

    def stability(self, names: int = 5) -> str:
        """"3 of 36 timed cells unstable (...); other processes used 1.7 of 2 cores during the run"."""
        listed = "; ".join(self.unstable[:names]) + (f"; and {len(self.unstable) - names} more" if len(self.unstable) > names else "")
        text = f"{len(self.unstable)} of {self.timed} timed cells unstable" + (f" ({listed})" if listed else "") if self.timed else "no timed cells"
        if self.load_wall_s > 0:
            text += f"; other processes used {self.other_cpu_s / self.load_wall_s:.1f} of {self.cores} cores during the run"
        return text

    @property
    def failed(self) -> bool:
        """Whether a cell of the file ends this run ``FAILING``: measured so now, or earlier and not retried."""
        return bool(self.failures or self.earlier_failures)

    def failure_lines(self, names: int = 3) -> list[str]:
        """"2 cells failed: fault_error[torch] forward/core ... (error: RuntimeError: injected failure); ..." and,
        after a resume, the same of the cells failed earlier; empty when none failed."""
        lines = []
        for failures, what in ((self.failures, "failed"), (self.earlier_failures, "failed in an earlier run (--retry-failed runs them again)")):
            if failures:
                listed = "; ".join(f"{name} ({status}: {_first_line(message)})" for name, status, message in failures[:names])
                more = f"; and {len(failures) - names} more" if len(failures) > names else ""
                lines.append(f"{len(failures)} {'cell' if len(failures) == 1 else 'cells'} {what}: {listed}{more}")
        return lines


def _first_line(text: str | None) -> str:
    lines = (text or "").strip().splitlines()
    return lines[0] if lines else "no message"


def utc_now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _results_file_pattern(name: str) -> re.Pattern:
    """The name of a results file of scenario ``name`` and no other: ``NAME-YYYYMMDDTHHMMSSZ.jsonl``."""
    return re.compile(re.escape(name) + r"-\d{8}T\d{6}Z\.jsonl")


def results_path(out_dir: Path, name: str, resume) -> Path:
    """The file to write: a new timestamped one, or with ``resume`` the given file or the
    latest one of this scenario in ``out_dir``."""
    if resume is True:
        pattern = _results_file_pattern(name)
        candidates = sorted(path for path in out_dir.glob("*.jsonl") if pattern.fullmatch(path.name))
        if not candidates:
            raise RunError(f"--resume: no results of scenario {name!r} in {out_dir} to resume")
        return candidates[-1]
    if resume:
        return Path(resume)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return out_dir / f"{name}-{stamp}.jsonl"


def scenario_identity(loaded: LoadedScenario) -> dict:
    """What a resumed file must have been measured for: the scenario's name, the hash of its
    file and the preset (the run line records all three)."""
    return {"scenario": loaded.name, "scenario_sha256": loaded.sha256, "preset": loaded.preset}


def resumable_file(resume, loaded: LoadedScenario) -> Path:
    """The real path of the file ``--resume FILE`` names, checked before anything is created
    beside it: a regular file whose first line is a run line of this scenario (else ``RunError``)."""
    given = Path(resume)
    path = given.resolve()
    if not path.exists():
        raise RunError(f"--resume: {given} does not exist")
    if not stat.S_ISREG(path.stat().st_mode):
        raise RunError(f"--resume: {given} is not a regular file (a results file to continue)")
    with open(open_regular(path, os.O_RDONLY), "rb") as file:
        first = file.readline(FIRST_LINE_BYTES)
    if not first:
        raise RunError(f"--resume: results file {given} is empty")
    if not first.endswith(b"\n"):
        raise RunError(f"--resume: {given} is not a results file (its first line is not a whole run line)")
    record = parse_line(first, given, f"{given}, line 1")
    if record["kind"] != "run":
        raise RunError(f"--resume: {given}, line 1 is a {record['kind']} line; a results file starts with its run line")
    if record["scenario"] != loaded.name:
        raise RunError(f"--resume: {given} was measured for another scenario, {record['scenario']!r} (this run: {loaded.name!r})")
    return path


def _resume_state(writer: ResultsWriter, loaded: LoadedScenario, fingerprint: dict, retry_failed: bool, *,
                  same_machine: bool = True) -> tuple[str, set]:
    """(the run_id resumed, the cell_ids not to measure again) of the results file ``writer``
    holds, when this run may continue it: the same scenario, file, preset and ``--set``
    overrides, measured on this machine (``same_machine``: one of its run lines has this
    machine's id; a run on several devices writes one per device, and a Ray run's cells record
    each its own machine, so any machine may continue it)."""
    path = writer.path
    if writer.repair_tail():
        print(f"warning: {path}: dropped an incomplete last line left by an interrupted write", file=sys.stderr)
    runs = [record for record in read_records(path) if record["kind"] == "run"]
    wanted = scenario_identity(loaded)
    differ = [f"{key} {runs[0].get(key)!r} (this run: {value!r})" for key, value in wanted.items() if runs[0].get(key) != value]
    if differ:
        raise RunError(
            f"--resume: {path} was measured for another scenario: {'; '.join(differ)}. Results of two scenarios (or two "
            "versions of one scenario file) do not mix in one file: start a new run (a report reads several files)"
        )
    recorded = list(runs[0].get("overrides") or [])
    if recorded != list(loaded.overrides):
        gone = [f"--set {o}" for o in recorded if o not in loaded.overrides]
        new = [f"--set {o}" for o in loaded.overrides if o not in recorded]
        difference = "; ".join([*(f"without {o} (the file's run had it)" for o in gone), *(f"with {o} (the file's run had not)" for o in new)])
        raise RunError(
            f"--resume: {path} was measured with other overrides: this run is {difference or 'in another order of --set'}. "
            "Cells of two configurations do not mix in one file: repeat the file's --set options, or start a new run"
        )
    if same_machine and fingerprint["machine_id"] not in {run["machine"]["machine_id"] for run in runs}:
        raise RunError(
            f"--resume: {path} was measured on machine {runs[-1]['machine']['machine_id']} "
            f"({runs[-1]['machine'].get('hostname')}); this is {fingerprint['machine_id']}. "
            "Results of two machines do not mix in one run: start a new run instead."
        )
    return runs[-1]["run_id"], completed_cell_ids(path, retry_failed=retry_failed)


def main_device(cells) -> str:
    """The main device of ``cells``: the first CUDA device they name (``cuda:1`` stays GPU 1), else the CPU."""
    return next((cell["axes"]["device"] for cell in cells if cell["axes"]["device"].startswith("cuda")), "cpu")


def _failures_in(path: Path, cells: list[dict], cell_ids: set) -> list[tuple]:
    """(describe(cell), status, message) of each of ``cells`` in ``cell_ids`` whose latest record in ``path`` is ``FAILING``."""
    latest = {record["cell_id"]: record for record in read_records(path) if record["kind"] == "cell"}
    return [(describe(cell), latest[cell["cell_id"]]["status"], latest[cell["cell_id"]]["error"])
            for cell in cells if cell["cell_id"] in cell_ids and latest[cell["cell_id"]]["status"] in FAILING]


class LocalExecutor:
    """Today's way to measure: one worker process on this machine measures the cells one after
    another (a new one after each CPU speed cell and each failed cell, ``needs_fresh_worker``). An
    executor gives the runner ``(cell, observation)`` pairs as cells finish; the runner alone writes
    the results file. The Ray executor (harness.ray_executor) has the same methods."""

    #: every cell is measured on the runner's machine, so a resumed file must come from this machine
    same_machine = True

    def __init__(self, plugins=()):
        self.plugins = list(plugins)
        self.worker = None
        self.fingerprints = {}  # device -> its fingerprint with its calibration

    def start(self, todo: list[dict], fingerprint: dict) -> list[dict]:
        """Start the worker; fingerprint and calibrate each device the cells run on (``cuda:1``:
        GPU 1), so that each cell is recorded with its own device's machine and roofline; the
        fingerprints to write run lines for now (``fingerprint``, the main device's, when no
        cell is left to measure)."""
        self.worker = Worker(self.plugins, tune_malloc=any(cell["mode"] != "quality" for cell in todo))
        for device in dict.fromkeys(cell["axes"]["device"] for cell in todo):
            fp = machine.fingerprint(device)
            on_device = [cell for cell in todo if cell["axes"]["device"] == device]
            self.fingerprints[device] = {**fp, "calibration": calibration(self.worker, on_device, fp)}
        return list(self.fingerprints.values()) or [{**fingerprint, "calibration": None}]

    def measure(self, todo: list[dict], starting):
        """Measure ``todo`` in order, calling ``starting(cell)`` before each; yield ``(cell, observation)``."""
        for cell in todo:
            starting(cell)
            observation = observe(self.worker, cell)
            yield cell, {**observation, "machine": self.fingerprints[cell["axes"]["device"]], "node_id": None}
            if self.worker.measured and needs_fresh_worker(cell, observation["result"]["status"]):
                self.worker.restart()

    def run_fields(self, node_id) -> dict:
        """What a run line adds for a node of this executor (nothing: the run line is as it always was)."""
        return {}

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


def run(loaded: LoadedScenario, out_dir, *, resume=False, retry_failed: bool = False, plugins=(), command: str = "",
        progress: bool = True, executor=None) -> RunSummary:
    """Measure every cell of ``loaded`` not yet in the results file; return a summary. One run
    at a time writes into a directory (``ResultsDirectoryLock``); other runs measuring on the
    machine meanwhile are warned about and recorded with each cell they overlap. ``executor``
    measures the cells (default: a ``LocalExecutor``; harness.ray_executor spreads them over a
    Ray cluster)."""
    out_dir = Path(out_dir)
    if resume not in (False, True, None):
        resume = resumable_file(resume, loaded)
    directory = resume.parent if isinstance(resume, Path) else out_dir
    holder = {"pid": os.getpid(), "scenario": loaded.name, "started_at": utc_now(), "out": str(directory)}
    executor = executor or LocalExecutor(plugins)
    with ResultsDirectoryLock(directory, holder), MachineRuns(holder) as machine_runs:
        return _run_locked(loaded, out_dir, resume, retry_failed, executor, command, progress, machine_runs)


def _run_locked(loaded, out_dir, resume, retry_failed, executor, command, progress, machine_runs) -> RunSummary:
    cells = loaded.cells()
    path = results_path(out_dir, loaded.name, resume)
    fingerprint = machine.fingerprint(main_device(cells))
    resumed_from, done = None, set()
    writer = ResultsWriter(path, create=not resume)
    if resume:
        try:
            resumed_from, done = _resume_state(writer, loaded, fingerprint, retry_failed, same_machine=executor.same_machine)
        except BaseException:
            writer.close()
            raise
    todo = [with_checkpoint_dir(cell, path) for cell in cells if cell["cell_id"] not in done]
    summary = RunSummary(path=path, total=len(cells), skipped_as_done=len(cells) - len(todo))
    if done:
        summary.earlier_failures = _failures_in(path, cells, done)
    start = time.perf_counter()
    run_ids, overlapping, warned, bar = {}, {}, set(), None

    def run_id_of(fp: dict, node_id) -> str:
        """The run line of the machine (and node) that measured a cell, written before its first cell."""
        key = (node_id, fp["machine_id"])
        if key not in run_ids:
            run_ids[key] = uuid.uuid4().hex
            writer.write_run(run_header(loaded, run_ids[key], command, fp, resumed_from=resumed_from, **executor.run_fields(node_id)))
        return run_ids[key]

    def starting(cell: dict) -> None:
        bar.set_description(describe(cell))
        others = machine_runs.others()
        if others and not warned.issuperset(o.get("pid") for o in others):
            warned.update(o.get("pid") for o in others)
            tqdm.write(f"warning: other attnbench runs are measuring on this machine ({describe_runs(others)}); "
                       "cells measured meanwhile record them in concurrent_runs", file=sys.stderr)
        overlapping[cell["cell_id"]] = others

    if executor.same_machine and (busy := busy_warning(todo, other_cores_now(), os.cpu_count())):
        print(busy, file=sys.stderr)
    try:
        for fp in executor.start(todo, fingerprint):
            run_id_of(fp, None)
        bar = tqdm(total=len(cells), initial=summary.skipped_as_done, unit="cell", disable=not progress, dynamic_ncols=True)
        for cell, observation in executor.measure(todo, starting):
            node_fp = observation["machine"]
            record = cell_record(cell, observation, run_id_of(node_fp, observation["node_id"]), node_fp)
            others = overlapping.pop(cell["cell_id"], None)
            if others and node_fp["machine_id"] == fingerprint["machine_id"]:
                record["concurrent_runs"] = others
            writer.write_cell(record)
            if record["status"] == "ok" and cell.get("checkpoint_dir"):
                remove_checkpoints(Path(cell["checkpoint_dir"]))
            summary.count(cell, record)
            bar.update()
    except KeyboardInterrupt:
        summary.interrupted = True
    except ResultsWriteError as exc:
        summary.write_error = str(exc)
    finally:
        if bar is not None:
            bar.close()
        executor.close()
        writer.close()
        summary.seconds = time.perf_counter() - start
    return summary


def with_checkpoint_dir(cell: dict, results: Path) -> dict:
    """A quality cell with its own ``checkpoint_dir`` beside the results file
    (``<results>.checkpoints/<cell_id>``): its training saves its state there and continues
    from it when the cell is measured again (``--resume``); the runner removes it once the cell
    is recorded as ok. A speed cell as it is."""
    if cell["mode"] != "quality":
        return cell
    return dict(cell, checkpoint_dir=str(results.with_suffix(".checkpoints") / cell["cell_id"]))


def remove_checkpoints(directory: Path) -> None:
    """Remove a recorded cell's checkpoint directory, and the results file's once it is empty."""
    shutil.rmtree(directory, ignore_errors=True)
    with contextlib.suppress(OSError):
        directory.parent.rmdir()


def needs_fresh_worker(cell: dict, status: str) -> bool:
    """Whether the worker that measured ``cell``, which ended ``status``, is replaced before the
    next cell. Always after a ``FAILING`` cell (``error``, a timeout included; ``crashed``; ``nan``):
    a sticky CUDA error (an illegal address, a device-side assert) leaves the process's CUDA
    context unusable, so every later cell in it would fail, and a NaN may come from a kernel that
    wrote out of bounds; a new process costs seconds, once per failed cell. Not after ``oom``:
    PyTorch's allocator raises before the kernel runs, the context stays usable and the worker
    frees its cache after every cell, while a sweep past the memory limit would pay a restart per
    cell. Otherwise ``measure.fresh_worker``, by default true for a CPU speed cell: in a worker
    shared with earlier cells glibc serves the cell's allocations from heap pages they left
    resident, and its peak RSS read 2-3x too low (a delta-rule forward, B=8 H=8 T=512: 15-25 MiB
    against 49 MiB in a fresh worker; its inputs alone are 24 MiB). GPU memory is counted by
    PyTorch's allocator, exact in a shared worker."""
    if status in FAILING:
        return True
    choice = cell["measure"].get("fresh_worker")
    if choice is None:
        return cell["mode"] != "quality" and str(cell["axes"].get("device", "cpu")).startswith("cpu")
    return choice


def run_header(loaded: LoadedScenario, run_id: str, command: str, fingerprint: dict, *, commit=None, dirty=None,
               resumed_from=None, **extra) -> dict:
    """The ``run`` line of a results file: the scenario as loaded, the command, the machine and
    the commit measured (the fingerprint's, unless ``commit``/``dirty`` say otherwise)."""
    return {
        "run_id": run_id,
        "started_at": utc_now(),
        "scenario": loaded.name,
        "scenario_file": str(loaded.path),
        "scenario_sha256": loaded.sha256,
        "preset": loaded.preset,
        "overrides": loaded.overrides,
        "report": loaded.scenario.report.model_dump(),
        "command": command,
        "machine": fingerprint,
        "commit": fingerprint["git"]["commit"] if commit is None else commit,
        "dirty": fingerprint["git"]["dirty"] if dirty is None else dirty,
        "resumed_from": resumed_from,
        **extra,
    }


def observe(worker: Worker | None, cell: dict) -> dict:
    """Measure ``cell`` in ``worker`` (or skip it), where it runs: its result, the GPU's throttle
    state before and after, when it started and how long it took."""
    device = cell["axes"]["device"]
    before = machine.throttle_state(device)
    started, clock = utc_now(), time.perf_counter()
    if cell["skip"]:
        result = {"status": "skipped", "error": cell["skip"], "metrics": {}}
    else:
        result = worker.measure(cell, cell["measure"]["timeout_s"])
    after = machine.throttle_state(device)
    return {"result": result, "throttle_before": before, "throttle_after": after, "started_at": started, "duration_s": time.perf_counter() - clock}


def measure_record(worker: Worker, cell: dict, run_id: str, fingerprint: dict) -> dict:
    """Measure ``cell`` in ``worker`` (or record it as skipped): its results record."""
    return cell_record(cell, observe(worker, cell), run_id, fingerprint)


def cell_record(cell: dict, observation: dict, run_id: str, fingerprint: dict) -> dict:
    """The results record of ``cell`` from its ``observe``-ation: with the GPU's throttle state,
    the roofline fraction and the machine and the commit of ``fingerprint`` (the machine that
    measured it) and, for a Ray executor's cell, the ``node_id`` of the Ray node."""
    result, before, after = observation["result"], observation["throttle_before"], observation["throttle_after"]
    metrics = dict(result["metrics"])
    if cell["mode"] != "quality":
        metrics.update(roofline(metrics, fingerprint.get("calibration"), cell["axes"]["dtype"]))
    if before is not None or after is not None:
        metrics.update(
            throttle_before=before,
            throttle_after=after,
            throttled=bool((before or {}).get("throttled") or (after or {}).get("throttled")),
        )
    task = {"task": cell["task"]} if cell.get("task") else {}
    node = {"node_id": observation["node_id"]} if observation.get("node_id") else {}
    return {
        "run_id": run_id,
        "cell_id": cell["cell_id"],
        "scenario": cell["scenario"],
        "variant": cell["variant"],
        "backend": cell["backend"],
        "params": cell["params"],
        "axes": cell["axes"],
        **task,
        "mode": cell["mode"],
        "target": cell["target"],
        "status": result["status"],
        "error": result["error"],
        "metrics": metrics,
        "machine_id": fingerprint["machine_id"],
        **node,
        "commit": fingerprint["git"]["commit"],
        "started_at": observation["started_at"],
        "duration_s": observation["duration_s"],
    }

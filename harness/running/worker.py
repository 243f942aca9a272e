"""The worker process that measures cells, and its supervision.

A worker is a separate process, so a crash, a hang or an out-of-memory kill in one cell costs
that cell only: ``Worker`` turns each into the cell's status and message and starts a new
process for the next cell. The pipe to the worker carries two kinds of message: a cell (``harness.scenarios.cell.Cell``,
measured by ``harness.running.workloads.measure_cell``) and a ``Calibration`` request; ``None`` stops it.
"""

from __future__ import annotations

import ctypes
import gc
import multiprocessing
import os
import resource
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

from ..common.signals import ignore_stop_signals, ignored_by_children
from ..results import FAILING
from ..scenarios.cell import Cell
from ..scenarios.plugins import load_plugins

#: glibc maps blocks of 64 KiB and more on their own and trims its heap at once, so freed
#: memory leaves a worker's resident set and the per-cell peak RSS (harness.measuring.measure.PeakMemory)
#: follows live memory to about 2 MiB.
WORKER_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0", "MALLOC_TOP_PAD_": "0"}
#: Seconds a worker may take to start (its imports, the plugins), counted from its spawn: a cell's
#: ``timeout_s`` plus ``START_MARGIN_S``, at most ``WORKER_START_TIMEOUT_S`` (``start_allowance``).
#: One that takes longer is killed and costs the cell it was started for (``crashed``) within that
#: allowance, and the sweep goes on (a frozen start once cost 300 s per try, ~1,000 s for one cell).
WORKER_START_TIMEOUT_S = 300
START_MARGIN_S = 60
#: Seconds a calibration (``roofline.calibrate``, a few seconds of matmuls and copies) may take.
CALIBRATION_TIMEOUT_S = 120
#: How the error of a cell begins when the worker stopped it at its timeout, and that of a worker the kernel's
#: out-of-memory killer ended: failures of the moment, which ``run --commits`` measures again (``commits.passing_failure``).
TIMED_OUT = "timed out after"
OOM_KILLED = "the worker was killed by the out-of-memory killer"
PR_SET_PDEATHSIG = 1
#: The cgroup (v2, then v1) counters of out-of-memory kills, read before and after a cell.
OOM_COUNTERS = (Path("/sys/fs/cgroup/memory.events"), Path("/sys/fs/cgroup/memory/memory.oom_control"))
#: The program of a worker that runs another checkout's code (``Worker(code_root=...)``): that
#: checkout's own loop, on the socket the parent passes as its file descriptor:
#: ``harness.running.worker.serve``. A revision from before harness/ was grouped by role serves with ``harness.worker.serve``
#: (before that module, ``harness.runner._serve``), and the cells it is sent, pickled under their new module names, find
#: their classes in its ``harness.cell`` and ``harness.worker``.
CHECKOUT_WORKER = (
    "import sys, importlib, importlib.util; from multiprocessing.connection import Connection\n"
    "if importlib.util.find_spec('harness.running'): from harness.running.worker import serve\n"
    "else:\n"
    "    for new, old in (('harness.scenarios.cell', 'harness.cell'), ('harness.running.worker', 'harness.worker')):\n"
    "        if importlib.util.find_spec(old): sys.modules[new] = importlib.import_module(old)\n"
    "    if importlib.util.find_spec('harness.worker'): from harness.worker import serve\n"
    "    else: from harness.runner import _serve as serve\n"
    "serve(Connection(int(sys.argv[1])), sys.argv[2:])"
)
#: The checkout this module belongs to (a wrapped worker's ``PYTHONPATH``).
CHECKOUT_ROOT = Path(__file__).resolve().parents[2]
#: Seconds a worker under a profiler's wrapper may take to stop: the tool writes its report then.
WRAPPED_CLOSE_TIMEOUT_S = 600
#: A worker's host memory limit where ``measure.max_memory`` is null: this share of physical memory.
MEMORY_SHARE = 0.8


@dataclass(frozen=True)
class Calibration:
    """A request to a worker for ``roofline.calibrate`` of its device: pinned to ``cpus`` and on
    ``threads`` torch threads as its cells will be, measured on ``device`` (harness.running.executors.calibration makes it)."""

    machine_id: str
    dtypes: list
    device: str
    gpu_name: str | None
    sm_clock_mhz: float | None
    cpus: list | None = None
    threads: int | None = None


def start_allowance(timeout_s: float) -> float:
    """The seconds from its spawn within which the worker of a cell of ``timeout_s`` must have started."""
    return min(WORKER_START_TIMEOUT_S, timeout_s + START_MARGIN_S)


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (``prctl(PR_SET_PDEATHSIG)``), so a
    worker never outlives a runner killed with ``kill -9`` and keeps measuring; a no-op elsewhere."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return


def serve(conn, plugins, parent_pid=None) -> None:
    """The worker's loop: receive a cell (or a ``Calibration``), measure it, send back its result;
    ``None`` stops. It starts with the stop signals ignored (``Worker._start_spawned``): Ctrl-C, SIGTERM and SIGHUP are the runner's to handle."""
    from .workloads import is_out_of_memory, measure_cell

    die_with_parent()
    if parent_pid is not None and os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
    load_plugins(plugins)
    conn.send("ready")
    while (cell := conn.recv()) is not None:
        try:
            if isinstance(cell, Calibration):
                result = calibrated(cell)
            else:
                limit_memory(memory_limit(cell))
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


def memory_limit(cell: Cell) -> int | None:
    """The bytes of host memory ``cell``'s worker may take: ``measure.max_memory``, else for a
    CPU cell ``MEMORY_SHARE`` of physical memory, else None (no limit: a GPU cell's host memory
    is its driver's, and how the driver takes to ``RLIMIT_DATA`` is not measured here)."""
    chosen = cell.measure.get("max_memory")
    if chosen is not None or not cell.device.startswith("cpu"):
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


def calibrated(request: Calibration) -> dict:
    """The worker's side of a ``Calibration``: pinned as its cells will be, then measured on their device."""
    from ..measuring.measure import on_device
    from ..measuring.roofline import calibrate
    from .workloads import pin

    pin(request.cpus, request.threads)
    arguments = {key: value for key, value in asdict(request).items() if key not in ("cpus", "threads")}
    with on_device(request.device):
        return {"status": "ok", "error": None, "metrics": calibrate(**arguments)}


def _empty_cuda_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _worker_preexec() -> None:
    """In a checkout worker before it execs: the stop signals ignored (``common.signals``), killed when the runner dies."""
    ignore_stop_signals()
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
    revision, see harness.revisions.regress) it is a fresh interpreter started in that directory with
    it first on ``PYTHONPATH``, so ``harness`` and ``variants`` are that revision's own.
    ``env`` adds environment variables for the worker (e.g. its own ``TRITON_CACHE_DIR``).
    ``tune_malloc`` sets ``WORKER_ENV`` for exact per-cell peak RSS on the CPU; it costs
    page faults on every large allocation (measured: +50% CPU time in an MQAR training run),
    so the runner turns it off for scenarios of quality cells (whole training runs).
    ``wrapper`` starts the worker under a command (``nsys profile ... -o REPORT``,
    harness.measuring.profiling.wrapper) as a fresh interpreter too, with this checkout first on
    ``PYTHONPATH``; closing it waits for the command to finish (the tool writes its report)."""

    def __init__(self, plugins=(), *, code_root=None, env=None, tune_malloc: bool = True, wrapper: list[str] | None = None):
        self.plugins = list(plugins)
        self.code_root = code_root
        self.wrapper = list(wrapper or [])
        self.env = {**(WORKER_ENV if tune_malloc else {}), **(env or {})}
        self.process = None
        self._start()

    def _start(self) -> None:
        """Spawn the process; its ``"ready"`` is awaited before the first message (``_started``), so that
        the runner goes on meanwhile and a cell's timeout counts its own time only."""
        self.measured = 0  #: cells (and calibrations) sent to this process since it started
        self.ready, self.start_error = False, None
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.spawned = time.monotonic()
        if self.code_root is not None or self.wrapper:
            self._start_command(child)
        else:
            self._start_spawned(context, child)
        child.close()

    def _started(self, start_s: float) -> str | None:
        """None once the worker has said it is ready, waiting for it until ``start_s`` after its spawn
        (a fresh one where the last never started); else why not, the process left as it is. A worker
        that exits while starting (a plugin that fails to import) is a RuntimeError: no cell can run."""
        if self.start_error is not None:
            self._start()
        if not self.ready:
            try:
                self.ready = self.conn.poll(max(0.0, self.spawned + start_s - time.monotonic())) and self.conn.recv() == "ready"
            except EOFError:  # its end of the pipe closed: exited, or about to
                self.process.join(1)
                if not self.process.is_alive():
                    raise RuntimeError(f"the worker process did not start (exit code {self.process.exitcode}); see the messages above") from None
        if self.ready:
            return None
        return f"the worker process did not start within {start_s:g} s"

    def _start_command(self, child) -> None:
        """A fresh interpreter running ``CHECKOUT_WORKER``: another checkout's (in its directory, only it on
        ``PYTHONPATH``) or, under a ``wrapper``, this checkout's (here, first on ``PYTHONPATH``)."""
        if self.code_root is not None:
            cwd, path = self.code_root, str(self.code_root)
        else:
            cwd, path = None, os.pathsep.join(filter(None, [str(CHECKOUT_ROOT), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, **self.env, "PYTHONPATH": path}
        command = [*self.wrapper, sys.executable, "-c", CHECKOUT_WORKER, str(child.fileno()), *self.plugins]
        popen = subprocess.Popen(command, cwd=cwd, env=env, pass_fds=[child.fileno()], preexec_fn=_worker_preexec)
        self.process = _CheckoutProcess(popen)

    def _start_spawned(self, context, child) -> None:
        saved = {key: os.environ.get(key) for key in self.env}
        os.environ.update(self.env)
        # Ctrl-C, which the terminal sends to the whole process group (``timeout`` sends SIGTERM so), never reaches the
        # worker, even while it imports: the runner ends it. A stop signal to the runner while its worker starts is
        # held and interrupts it once the worker is started (an ignored one was lost, and the run went on).
        try:
            with ignored_by_children():
                self.process = context.Process(target=serve, args=(child, self.plugins, os.getpid()), daemon=True)
                self.process.start()
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key)
                else:
                    os.environ[key] = value

    def measure(self, cell: Cell, timeout_s: float) -> dict:
        """The result of ``cell`` measured within ``timeout_s``; ``crashed`` (the worker killed, a fresh
        one for the next message) when the worker does not start within ``start_allowance(timeout_s)``."""
        if (error := self._started(start_allowance(timeout_s))) is not None:
            self.kill()
            self.start_error = f"{error} (killed; the cell's timeout_s + START_MARGIN_S, at most WORKER_START_TIMEOUT_S)"
            return {"status": "crashed", "error": self.start_error, "metrics": {}}
        return self._ask(cell, timeout_s)

    def calibrate(self, request: Calibration, start_s: float = WORKER_START_TIMEOUT_S) -> dict:
        """The result of ``request`` (its ``metrics``: the calibration), as a cell's is. A worker not
        started within ``start_s`` is left starting (no calibration): the first cell waits for it
        within its own allowance, counted from the same spawn, so a frozen start costs one wait."""
        if (error := self._started(start_s)) is not None:
            return {"status": "crashed", "error": error, "metrics": {}}
        return self._ask(request, CALIBRATION_TIMEOUT_S)

    def _ask(self, message, timeout_s: float) -> dict:
        oom_before = oom_kills()
        self.measured += 1
        self.conn.send(message)
        if not self.conn.poll(timeout_s):
            self.restart()
            return {"status": "error", "error": f"{TIMED_OUT} {timeout_s:g} s (cell stopped; measure.timeout_s)", "metrics": {}}
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
            return {"status": "oom", "error": f"{OOM_KILLED} (exit code {code})", "metrics": {}}
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
                self.process.join(WRAPPED_CLOSE_TIMEOUT_S if self.wrapper else 10)
            except (BrokenPipeError, OSError):
                pass
        self.kill()


def needs_fresh_worker(cell: Cell, status: str, shared: bool = False) -> bool:
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
    PyTorch's allocator, exact in a shared worker. And by default true for a ``compile`` cell on any
    device: the frames TorchDynamo compiled stay in the process, so the next compile cell's
    ``metrics.compile_s`` would be a recompilation or a cache hit (on an H200, 2026-12-04: linear's
    training at T 4096 read 0.004 s after T 1024's 17 s). ``shared``: null means false (``attnbench
    regress``, which compares time and starts a worker per revision and round)."""
    if status in FAILING:
        return True
    choice = cell.measure.get("fresh_worker")
    if choice is None:
        return not shared and not cell.quality and (cell.device.startswith("cpu") or cell.backend == "compile")
    return choice

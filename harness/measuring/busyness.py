"""How busy the machine was around a measurement: load average, the CPU time other processes
used (all CPU time from /proc/stat minus this process's own, ``time.process_time``), and on a
GPU its utilisation and the other processes on it (NVML). A timing taken while other work ran
is a shared-machine timing; ``with LoadMeter(device) as meter: ...`` then ``meter.record``.
What follows from it: the threads of a run's CPU cells (``run_threads``, once per run) and
whether a CPU timing was disturbed (``disturbed``: it is then unstable).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..common.formatting import counted

if TYPE_CHECKING:
    from ..scenarios.cell import Cell

#: Fields of /proc/stat's "cpu" line that count busy time: user, nice, system, irq, softirq,
#: steal (time the hypervisor gave to other virtual machines); not idle and iowait.
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)


def _ticks_per_s() -> int:
    return os.sysconf("SC_CLK_TCK")


def busy_cpu_s() -> float | None:
    """CPU seconds every process on the machine has used since boot (None where /proc/stat is missing)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except (OSError, IndexError):
        return None
    return sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields)) / _ticks_per_s()


def own_cpu_s() -> float:
    """CPU seconds this process (all its threads) has used, user and system (``time.process_time``:
    the scheduler's count, to the nanosecond, where ``os.times`` counts whole 10 ms ticks)."""
    return time.process_time()


def _loadavg() -> list[float] | None:
    try:
        return [round(value, 2) for value in os.getloadavg()]
    except OSError:
        return None


def gpu_load(device) -> dict | None:
    """The GPU's utilisation (percent of the last sample period with a kernel running) and the
    pids of the other processes holding a context on it; None without a CUDA device or NVML."""
    from .machine import _cuda_index, _nvml_device, _query

    index = _cuda_index(device)
    found = _nvml_device(index) if index is not None else None
    if found is None:
        return None
    nvml, handle = found
    processes = _query(nvml, "nvmlDeviceGetComputeRunningProcesses", handle) or []
    return {
        "utilization_percent": _query(nvml, "nvmlDeviceGetUtilizationRates", handle, convert=lambda rates: rates.gpu),
        "other_pids": sorted(p.pid for p in processes if p.pid != os.getpid()),
    }


class LoadMeter:
    """The machine's load around a block; ``record`` after it (``other_cores``: the cores other
    processes kept busy on average, of ``cores``; ``own_cpu_s``: the CPU seconds this process used)."""

    def __init__(self, device="cpu"):
        self.device = device
        self.record: dict = {}

    def __enter__(self):
        self._start = (time.perf_counter(), busy_cpu_s(), own_cpu_s())
        self._loadavg, self._gpu = _loadavg(), gpu_load(self.device)
        return self

    def __exit__(self, *exc):
        wall, busy, own = time.perf_counter(), busy_cpu_s(), own_cpu_s()
        wall_s = wall - self._start[0]
        other = None if busy is None or self._start[1] is None else max(0.0, (busy - self._start[1]) - (own - self._start[2]))
        self.record = {
            "wall_s": wall_s,
            "cores": os.cpu_count(),
            "own_cpu_s": own - self._start[2],
            "other_cpu_s": other,
            "other_cores": None if other is None or wall_s <= 0 else other / wall_s,
            "loadavg_before": self._loadavg,
            "loadavg_after": _loadavg(),
        }
        if self._gpu is not None:
            self.record.update(gpu_before=self._gpu, gpu_after=gpu_load(self.device))
        return False


#: Other processes keeping this many cores busy on average take a core from a measurement (and
#: make it a shared-machine timing: compare notes such a side).
BUSY_CORES = 0.5
#: How long ``other_cores_now`` watches the machine.
SNAPSHOT_S = 0.2


def other_cores_now(window_s: float = SNAPSHOT_S) -> float | None:
    """The cores other processes keep busy now, on average over ``window_s`` (None without /proc/stat)."""
    with LoadMeter() as meter:
        time.sleep(window_s)
    return meter.record["other_cores"]


def busy_cores(other_cores: float | None) -> int:
    """Whole cores taken by ``other_cores`` of load: each ``BUSY_CORES`` beyond a whole core counts as one."""
    return 0 if other_cores is None else int(other_cores + 1 - BUSY_CORES)


def spare_threads(threads: int, cores: int, other_cores: float | None) -> int:
    """``threads`` for a CPU measurement, at most the ``cores`` other processes leave free, at least 1:
    OpenMP threads that wait on a core another process holds make a cell many times slower."""
    return max(1, min(threads, cores - busy_cores(other_cores)))


def timed_on_cpu(cell: Cell) -> bool:
    """Whether ``cell`` is a CPU speed cell that is measured (the cells a run's thread count is for)."""
    return cell.device.startswith("cpu") and not cell.quality and not cell.skip


def run_threads(cells: list[Cell], cpu: dict, other_cores: float | None) -> int | None:
    """The torch threads of every timed CPU cell of a run (None: it has none), chosen once at its start
    by the rule each cell used to apply at its own start: torch's threads (``cpu``: the fingerprint's
    ``torch_threads``, what a worker starts with) bounded by the usable cores other processes leave
    free (``spare_threads``). Once, so that the cells of a run are timed on the same terms (a cell
    that chose 2 threads while its neighbours had 1 timed 30x slower on a busy machine); by the load,
    so that a busy machine does not make every cell wait for the core another process holds. A load
    that comes later is caught cell by cell (``disturbed``). A cell's ``measure.cpus`` still bounds it."""
    if not any(timed_on_cpu(cell) for cell in cells):
        return None
    cores = cpu.get("usable_cores") or cpu.get("logical_cores") or 1
    return spare_threads(cpu.get("torch_threads") or cores, cores, other_cores)


#: A CPU timing whose process ran on a core less than this share of the wall time of its warm-up and
#: samples waited for one (descheduled: another process, or the hypervisor, held it): ``disturbed``.
MIN_CPU_SHARE = 0.8
#: ... unless its share is below this one: such a process does not compute on the CPU (it sleeps, or waits for
#: a device or a file, by design), and its share says nothing of other processes.
MIN_COMPUTING_SHARE = 0.2
#: The load of other processes is judged over at least this many seconds: /proc/stat counts in 10 ms
#: ticks per core, so over a shorter window one stray tick reads as a busy core.
MIN_LOAD_WINDOW_S = 0.2


def disturbed(load: dict) -> bool | None:
    """Whether a CPU timing was disturbed, from the load over its warm-up and samples (a ``LoadMeter``
    record with the ``threads`` it ran on): other processes kept busy more of the machine's ``cores``
    than its threads left free (``busy_cores(other_cores) > cores - threads``, judged over
    ``MIN_LOAD_WINDOW_S`` or more), or the process ran on a core less than ``MIN_CPU_SHARE`` of the
    wall time (``own_cpu_s / wall_s``: a process that computes is always on a core unless it waits
    for one) but no less than ``MIN_COMPUTING_SHARE`` (below it, the timed work does not compute: a
    sleep). None when neither could be judged (no wall time)."""
    wall_s = load.get("wall_s") or 0.0
    if wall_s <= 0:
        return None
    taken = load.get("other_cores") is not None and wall_s >= MIN_LOAD_WINDOW_S and busy_cores(load["other_cores"]) > load["cores"] - load["threads"]
    return taken or MIN_COMPUTING_SHARE <= load["own_cpu_s"] / wall_s < MIN_CPU_SHARE


def busy_warning(cells: list[Cell], other_cores: float | None, cores: int, threads: int | None) -> str | None:
    """One line saying the machine is busy, when ``cells`` time something on the CPU and other
    processes keep a core or more of ``cores`` busy (``busy_cores``), with the ``threads`` the run
    chose for them (``run_threads``); None otherwise."""
    timed = sum(map(timed_on_cpu, cells))
    busy = busy_cores(other_cores)
    if not timed or not busy:
        return None
    return (
        f"warning: the machine is busy: other processes keep {other_cores:.1f} of {cores} cores busy, {max(0, cores - busy)} free; "
        f"the CPU timings of {counted(timed, 'cell')} will be unreliable (each runs on at most "
        f"{counted(threads, 'thread')}); measure on a quiet machine"
    )

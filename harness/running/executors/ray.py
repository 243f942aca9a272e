"""Measure a sweep's cells as Ray tasks on the nodes of a Ray cluster (``attnbench run --executor ray``).

Each cell is one Ray task, which measures it in a ``harness.running.worker.Worker`` process on its node
(a fresh one where the local executor would start one, ``needs_fresh_worker``: after a CPU speed
cell or a failed cell), so a timeout, an out-of-memory kill or a crash maps to the same status
as locally. The task asks Ray for what
the cell needs: one GPU for a CUDA cell; for a CPU speed cell a share of its node's CPUs (all of
them, or 1/``cells_per_node``), pinned to that node, so no other cell runs beside it; for a CPU
quality cell its task's ``threads`` (default 1). The cell's torch threads equal the CPUs it
holds (``OMP_NUM_THREADS``): every CPU speed cell of a node runs on the same threads, its share,
fixed for the run and written in the node's run line (``torch_threads``), as the local
executor's run chooses one count for all its cells. A Ray worker or node that dies marks its
cell ``crashed``; the sweep goes on.

The runner stays the only writer of the results file: this executor yields each cell as it
finishes (``ray.wait``), with the fingerprint of the node that measured it and its node id;
the runner writes one run line per node (docs/results.md), so the report tells the machines apart.

A Ray instance started here (no ``address``) is this machine's alone: its node's address is
loopback, so every server Ray starts listens on 127.0.0.1 only (``LOCAL_ONLY``), and a start that
would listen elsewhere is refused. A cluster's safety is its own (docs/scale-out.md, "Security").
"""

from __future__ import annotations

import os
import sys

from ...measuring import machine
from ...measuring.busyness import timed_on_cpu
from ...scenarios.cell import Cell
from ..runner import RunError
from ..worker import Worker, needs_fresh_worker
from . import calibration, observe, unmeasured

INSTALL = "--executor ray needs Ray, which is not installed: pip install 'attnbench[ray]'"
#: The node address of a Ray instance started here, and so the one address its servers listen on.
LOOPBACK = "127.0.0.1"
#: Ray (2.x, Linux) resolves a node address of 127.0.0.1 to the machine's routable one, where its
#: gRPC servers then listen, unless multi-node clusters are off: this variable, read when ``ray`` is
#: first imported (ray._private.ray_constants.ENABLE_RAY_CLUSTER), turns them off for the local instance.
LOCAL_ONLY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
#: Seconds between checks for Ctrl-C while waiting for cells.
WAIT_S = 1.0


def import_ray():
    """The ``ray`` module, or a RunError that says how to install it."""
    try:
        import ray
    except ImportError:
        raise RunError(INSTALL) from None
    return ray


def _is_cuda(cell: Cell) -> bool:
    return cell.device.startswith("cuda")


def _on_task_device(cell: Cell) -> Cell:
    """``cell`` as its Ray task measures it: a CUDA cell on ``cuda``, the one GPU Ray made visible
    to the task (CUDA_VISIBLE_DEVICES), whatever GPU index the scenario named."""
    return cell.replace(axes={**cell.axes, "device": "cuda" if _is_cuda(cell) else "cpu"})


def _cpus(cell: Cell) -> int:
    """The CPUs (and torch threads) of a quality or CUDA cell: its task's ``threads``, else 1."""
    return (cell.task or {}).get("threads") or 1


#: The workers a Ray worker process keeps between its tasks, as the local executor keeps its
#: worker between cells that need no fresh one (``worker.needs_fresh_worker``): by plugins,
#: threads, malloc tuning and the GPU Ray gave the task. They die with the Ray worker process.
_KEPT: dict[tuple, Worker] = {}


def _worker(plugins: list[str], threads: int, tune_malloc: bool) -> tuple[tuple, Worker]:
    """(its key, a worker with ``threads`` torch threads): the one this process kept, or a new one."""
    key = (tuple(plugins), threads, tune_malloc, os.environ.get("CUDA_VISIBLE_DEVICES"))
    worker = _KEPT.pop(key, None)
    if worker is None or not worker.process.is_alive():
        worker = Worker(plugins, tune_malloc=tune_malloc, env={"OMP_NUM_THREADS": str(threads)})
    return key, worker


def _on_node(cell: Cell, plugins: list[str], threads: int, calibrate: list[Cell] | None) -> dict:
    """The body of a Ray task, on its node: a worker measures ``cell`` with ``threads`` torch
    threads (or, given ``calibrate``, calibrates the node for those cells); the observation,
    with the node's fingerprint and id. A CUDA cell runs on the GPU Ray gave the task
    (CUDA_VISIBLE_DEVICES), device index 0. The worker is kept for the next task unless the
    cell needs a fresh one."""
    import ray

    node = {"node_id": ray.get_runtime_context().get_node_id(), "machine": machine.fingerprint(_on_task_device(cell).device)}
    key, worker = _worker(plugins, threads, not cell.quality)
    keep = False
    try:
        if calibrate is not None:
            return {**node, "calibration": calibration(worker, [_on_task_device(timed) for timed in calibrate], node["machine"])}
        observation = {**observe(worker, _on_task_device(cell)), **node}
        keep = not (worker.measured and needs_fresh_worker(cell, observation["result"]["status"]))
        return observation
    finally:
        if keep:
            _KEPT[key] = worker
        else:
            worker.close()


class RayExecutor:
    """Cells as Ray tasks on a Ray cluster: at ``address`` (``auto``, ``HOST:PORT``, ``ray://...``),
    or on a Ray instance started here, sized to this machine. ``cells_per_node``: how many CPU
    speed cells may run side by side on one node (default 1: each has its node to itself)."""

    #: cells record the machine of their node, so any machine may resume the file
    same_machine = False

    def __init__(self, plugins=(), *, address: str | None = None, cells_per_node: int = 1):
        if cells_per_node < 1:
            raise RunError(f"--cells-per-node must be at least 1, got {cells_per_node}")
        if address is None:
            os.environ.update(LOCAL_ONLY)
        self.ray = import_ray()
        self.plugins = list(plugins)
        self.address = address
        self.cells_per_node = cells_per_node
        self.connected = False  # whether this executor called ray.init (and so ray.shutdown)
        self.pending = {}  # ObjectRef -> (cell, the node it was pinned to or None)
        self.calibrations = {}  # node id -> calibration
        self.driver = None
        self.cpu_cells = False  # whether the run has CPU speed cells to measure
        self.remote = None  # _on_node as a Ray remote function

    # --- the cluster -----------------------------------------------------------------------

    def start(self, todo: list[Cell], fingerprint: dict) -> list[Cell]:
        """Connect to (or start) Ray and calibrate each node for the timed cells; no run line yet
        (each node's is written with its first cell)."""
        ray = self.ray
        if not ray.is_initialized():
            if self.address:
                ray.init(address=self.address, logging_level="WARNING")
            else:
                import torch

                cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
                ray.init(num_cpus=cores, num_gpus=torch.cuda.device_count(), include_dashboard=False, logging_level="WARNING", _node_ip_address=LOOPBACK)
            self.connected = True
            if not self.address and (address := ray.util.get_node_ip_address()) != LOOPBACK:
                self.close()
                raise RunError(
                    f"the Ray instance started here would listen on {address}, not only on {LOOPBACK} (ray was imported "
                    f"before attnbench could set {', '.join(f'{k}={v}' for k, v in LOCAL_ONLY.items())}); set it, "
                    "or start Ray yourself and pass --address"
                )
        self.driver = {**fingerprint, "calibration": None}
        self.cpu_cells = any(map(timed_on_cpu, todo))
        self._calibrate([cell for cell in todo if not cell.quality and not cell.skip])
        return []

    def _nodes(self) -> list[dict]:
        """The alive nodes with CPUs, as ``ray.nodes()`` lists them."""
        return [node for node in self.ray.nodes() if node["Alive"] and node["Resources"].get("CPU", 0) >= 1]

    def _cpu_share(self, node: dict) -> int:
        """The CPUs a CPU speed cell holds on ``node``: its CPUs over ``cells_per_node``."""
        return max(1, int(node["Resources"]["CPU"]) // self.cells_per_node)

    def _calibrate(self, timed: list[Cell]) -> None:
        """``machine.calibration`` of every node, measured on it by one task holding what its timed
        cells will (a GPU, or the CPU share of a speed cell), all nodes at once."""
        if not timed or os.environ.get("ATTNBENCH_CALIBRATE", "1") == "0":
            return
        cuda = any(_is_cuda(cell) for cell in timed)
        nodes = [node for node in self._nodes() if not cuda or node["Resources"].get("GPU", 0) >= 1]
        refs = []
        for node in nodes:
            share = self._cpu_share(node)
            task = self._task("calibration", share, node["NodeID"], num_gpus=1 if cuda else 0)
            refs.append(task.remote(timed[0], self.plugins, share, timed))
        for ref in refs:
            try:
                probe = self.ray.get(ref)
            except self.ray.exceptions.RayError as exc:
                print(f"warning: the calibration of a Ray node failed, no roofline fractions for its cells: {_first_line(exc)}", file=sys.stderr)
                continue
            self.calibrations[probe["node_id"]] = probe["calibration"]

    def _task(self, name: str, num_cpus: int, node_id: str | None = None, *, num_gpus: int = 0):
        """``_on_node`` as a Ray task holding ``num_cpus`` and ``num_gpus``, on ``node_id`` if given;
        never retried (a cell that killed its worker is recorded, not run again)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options = {"num_cpus": num_cpus, "num_gpus": num_gpus, "max_retries": 0, "name": f"attnbench {name}"}
        if node_id is not None:
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
        if self.remote is None:
            self.remote = self.ray.remote(_on_node)
        return self.remote.options(**options)

    # --- the cells -------------------------------------------------------------------------

    def measure(self, todo: list[Cell], starting):
        """Submit the cells (CPU speed cells as their nodes' shares free up), calling ``starting``
        for each; yield ``(cell, observation)`` as cells finish, in the order they finish."""
        timing = [cell for cell in todo if timed_on_cpu(cell)]
        held = {}  # node id -> CPU speed cells running there
        for cell in todo:
            if not timed_on_cpu(cell):
                refused = self._refusal(cell)
                if refused is not None:
                    yield cell, refused
                    continue
                self._submit(cell, _cpus(cell), None, starting)
        while timing or self.pending:
            for node in self._nodes():
                while timing and held.get(node["NodeID"], 0) < self.cells_per_node:
                    self._submit(timing.pop(0), self._cpu_share(node), node["NodeID"], starting)
                    held[node["NodeID"]] = held.get(node["NodeID"], 0) + 1
            if not self.pending:  # speed cells left, and no node alive to measure them
                for cell in timing:
                    yield cell, self._here(cell, "crashed", "no node of the Ray cluster was alive to measure the cell")
                return
            ready, _ = self.ray.wait(list(self.pending), num_returns=1, timeout=WAIT_S)
            for ref in ready:
                cell, node_id = self.pending.pop(ref)
                if node_id is not None:
                    held[node_id] -= 1
                yield cell, self._result(ref, cell)

    def _submit(self, cell: Cell, num_cpus: int, node_id: str | None, starting) -> None:
        """Start ``cell``'s task: ``num_cpus`` CPUs and threads (on ``node_id``, for a CPU speed
        cell), and a GPU for a CUDA cell."""
        starting(cell)
        task = self._task(f"cell {cell.cell_id}", num_cpus, node_id, num_gpus=1 if _is_cuda(cell) else 0)
        self.pending[task.remote(cell, self.plugins, num_cpus, None)] = (cell, node_id)

    def _refusal(self, cell: Cell) -> dict | None:
        """The observation of a cell measured without a task: a skipped cell, or a CUDA cell on a
        cluster without GPUs (skipped, as a CUDA cell on a machine without CUDA)."""
        if cell.skip:
            return self._here(cell, "skipped", cell.skip)
        if _is_cuda(cell) and not any(node["Resources"].get("GPU", 0) >= 1 for node in self._nodes()):
            return self._here(cell, "skipped", "no node of the Ray cluster has a GPU")
        return None

    def _here(self, cell: Cell, status: str, error: str) -> dict:
        return {**unmeasured(status, error), "machine": self.driver, "node_id": None}

    def _result(self, ref, cell: Cell) -> dict:
        """The observation of a finished task, with its node's calibration: one Ray killed for
        memory is an ``oom`` cell, one whose code raised (a worker that did not start) an ``error``
        one, any other failure (its Ray worker or node died) a ``crashed`` one."""
        ray = self.ray
        try:
            observation = ray.get(ref)
        except ray.exceptions.OutOfMemoryError as exc:
            return self._here(cell, "oom", f"Ray's memory monitor killed the cell's task: {_first_line(exc)}")
        except ray.exceptions.RayTaskError as exc:
            return self._here(cell, "error", f"the cell's Ray task failed: {_first_line(exc)}")
        except ray.exceptions.RayError as exc:
            return self._here(cell, "crashed", f"the Ray worker or node of the cell died: {_first_line(exc)}")
        machine_fp = {**observation["machine"], "calibration": self.calibrations.get(observation["node_id"])}
        return {**observation, "machine": machine_fp}

    def run_fields(self, node_id) -> dict:
        """What the run line of a node says beyond the fingerprint: the executor, the Ray node id and
        the torch threads of the node's CPU speed cells (its CPU share; None without such cells)."""
        node = next((node for node in self._nodes() if node["NodeID"] == node_id), None) if self.cpu_cells else None
        return {"executor": "ray", "node_id": node_id, "torch_threads": None if node is None else self._cpu_share(node)}

    def close(self) -> None:
        """Cancel the cells still running (Ctrl-C); disconnect from the cluster (a Ray instance
        started here stops)."""
        for ref in self.pending:
            self.ray.cancel(ref, force=True)
        self.pending.clear()
        if self.connected:
            self.ray.shutdown()


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__

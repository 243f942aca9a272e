"""The local executor: one worker process on this machine measures the cells one after another."""

from __future__ import annotations

from ...measuring import machine, profiling
from ...scenarios.cell import Cell
from ..worker import Worker, needs_fresh_worker
from . import calibration, observe


class LocalExecutor:
    """One worker process measures the cells in order, a new one for the cell after each CPU speed
    cell and each failed cell (``needs_fresh_worker``; ``shared``: only after a failed cell or where
    ``measure.fresh_worker`` asks; none is started after the last cell). ``code_root`` and ``env`` go to the ``Worker`` (another
    checkout's code, harness.revisions.regress). ``fingerprint``: record every cell with this machine,
    uncalibrated, instead of fingerprinting and calibrating each device the cells run on."""

    #: every cell is measured on the runner's machine, so a resumed file must come from this machine
    same_machine = True

    def __init__(self, plugins=(), *, code_root=None, env=None, shared: bool = False, fingerprint: dict | None = None):
        self.plugins = list(plugins)
        self.code_root, self.env, self.shared, self.fingerprint = code_root, env, shared, fingerprint
        self.worker = None
        self.fingerprints = {}  # device -> its fingerprint with its calibration

    def start(self, todo: list[Cell], fingerprint: dict) -> list[Cell]:
        """Start the worker; fingerprint and calibrate each device the cells run on (``cuda:1``:
        GPU 1), so that each cell is recorded with its own device's machine and roofline; the
        fingerprints to write run lines for now (``fingerprint``, the main device's, when no
        cell is left to measure)."""
        self.tune_malloc = any(not cell.quality for cell in todo)
        self.worker = self._worker()
        if self.fingerprint is not None:
            self.fingerprints = {cell.device: self.fingerprint for cell in todo}
            return [self.fingerprint]
        for device in dict.fromkeys(cell.device for cell in todo):
            fp = machine.fingerprint(device)
            on_device = [cell for cell in todo if cell.device == device]
            self.fingerprints[device] = {**fp, "calibration": calibration(self.worker, on_device, fp)}
        return list(self.fingerprints.values()) or [{**fingerprint, "calibration": None}]

    def _worker(self, wrapper=None) -> Worker:
        return Worker(self.plugins, code_root=self.code_root, env=self.env, tune_malloc=self.tune_malloc, wrapper=wrapper)

    def measure(self, todo: list[Cell], starting):
        """Measure ``todo`` in order, calling ``starting(cell)`` before each; yield ``(cell, observation)``.
        A cell profiled with ncu or nsys (``profiling.wrapper``) gets a worker of its own under the
        tool, closed after it so that the tool writes its report."""
        stale = False  # whether the worker must be replaced before the next cell (none after the last)
        for cell in todo:
            starting(cell)
            wrapper = profiling.wrapper(cell.profile)
            if wrapper:
                self.worker.close()
                self.worker = self._worker(wrapper)
            elif stale:
                self.worker.restart()
            observation = observe(self.worker, cell)
            yield cell, {**observation, "machine": self.fingerprints[cell.device], "node_id": None}
            if wrapper:
                self.worker.close()
                self.worker = self._worker()
            stale = not wrapper and self.worker.measured and needs_fresh_worker(cell, observation["result"]["status"], self.shared)

    def run_fields(self, node_id) -> dict:
        """What a run line adds for a node of this executor (nothing: the run line is as it always was)."""
        return {}

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()

"""Executors: how the run loop (harness.running.runner) gets its cells measured.

An executor has ``start(todo, fingerprint)`` (start its workers, calibrate; the fingerprints of
the run lines to write now), ``measure(todo, starting)`` (yield ``(cell, observation)`` as cells
finish, calling ``starting(cell)`` before each), ``run_fields(node_id)`` (what a run line adds
for a node), ``close()`` and ``same_machine`` (whether every cell is measured on the runner's
machine). The run loop alone writes the results file. Two exist: ``local`` (a worker process on
this machine) and ``ray`` (cells as Ray tasks on a cluster).
"""

from __future__ import annotations

import os
import sys
import time

from ...measuring import machine
from ...results import utc_now
from ...scenarios.cell import Cell
from ..worker import Calibration, Worker, start_allowance


def main_device(cells) -> str:
    """The main device of ``cells``: the first CUDA device they name (``cuda:1`` stays GPU 1), else the CPU."""
    return next((cell.device for cell in cells if cell.device.startswith("cuda")), "cpu")


def observe(worker: Worker | None, cell: Cell) -> dict:
    """Measure ``cell`` in ``worker`` (or skip it), where it runs: its result, the GPU's throttle
    state before and after, when it started and how long it took."""
    device = cell.device
    before = machine.throttle_state(device)
    started, clock = utc_now(), time.perf_counter()
    if cell.skip:
        result = {"status": "skipped", "error": cell.skip, "metrics": {}}
    else:
        result = worker.measure(cell, cell.measure["timeout_s"])
    after = machine.throttle_state(device)
    return {"result": result, "throttle_before": before, "throttle_after": after, "started_at": started, "duration_s": time.perf_counter() - clock}


def unmeasured(status: str, error: str) -> dict:
    """The observation of a cell no worker measured (skipped, refused, lost with its node)."""
    return {
        "result": {"status": status, "error": error, "metrics": {}},
        "throttle_before": None,
        "throttle_after": None,
        "started_at": utc_now(),
        "duration_s": 0.0,
    }


def calibration(worker: Worker, cells: list[Cell], fingerprint: dict) -> dict | None:
    """``machine.calibration`` for ``cells``, measured in ``worker`` on the threads and CPUs of the first
    timed cell (``measure.threads``, ``measure.cpus``), on their device (``cuda:N``: GPU N, with its SM
    clock): None when no cell is timed, when ``ATTNBENCH_CALIBRATE=0``, or when it failed (with a warning;
    a worker not started within the cells' longest ``start_allowance`` is left to the first cell, which
    waits no longer)."""
    timed = [cell for cell in cells if not cell.quality and not cell.skip]
    if not timed or os.environ.get("ATTNBENCH_CALIBRATE", "1") == "0":
        return None
    device = main_device(timed)
    request = Calibration(
        machine_id=fingerprint["machine_id"],
        dtypes=sorted({cell.axes["dtype"] for cell in timed}),
        device=device,
        gpu_name=(fingerprint.get("gpu") or {}).get("name"),
        sm_clock_mhz=(machine.throttle_state(device) or {}).get("sm_clock_mhz"),
        cpus=timed[0].measure.get("cpus"),
        threads=timed[0].measure.get("threads"),
    )
    result = worker.calibrate(request, max(start_allowance(cell.measure["timeout_s"]) for cell in timed))
    if result["status"] != "ok":
        print(f"warning: calibration failed, no roofline fractions in this run: {result['error']}", file=sys.stderr)
        return None
    return result["metrics"]

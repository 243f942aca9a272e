"""Profiles of cells, ``attnbench run --profile [torch|ncu|nsys]`` (docs/profiling.md).

The runner asks (``request``): each speed cell gets ``cell.profile``, the tool and, for ncu
and nsys, the report to write, or the reason it is not profiled (a tool not on PATH, a CPU cell
under a CUDA tool, a quality cell). The worker profiles one more call of the cell after its
timed ones, never a timed call (``profile``): torch.profiler's trace (Chrome/Perfetto JSON)
and the top operators by self time go back in the cell's result; under ncu or nsys, which
wrap the whole worker (``wrapper``), the call is marked with ``cudaProfilerStart/Stop`` and an
NVTX range so that only it is captured. The runner alone writes the trace file
(``write_trace``), beside the results file.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..common.files import write_json_atomic
from .measure import quiet_profiler, synchronize

if TYPE_CHECKING:
    from ..scenarios.cell import Cell

#: What ``--profile`` takes (a bare ``--profile`` is torch).
TOOLS = ("torch", "ncu", "nsys")
#: The operators (CPU) or kernels (GPU) a profiled cell records, by self time.
TOP_OPERATORS = 10
#: The NVTX range around the profiled call (ncu's ``--nvtx-include``).
NVTX_RANGE = "attnbench-profile"
#: The suffix ncu and nsys give the report they write.
REPORT_SUFFIX = {"ncu": ".ncu-rep", "nsys": ".nsys-rep"}


class OperationCount(TorchDispatchMode):
    """Counts the aten operations dispatched inside the block."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def profiles_dir(results: Path) -> Path:
    """Where a results file's profiles go: ``<results file without .jsonl>.profiles/``."""
    return results.with_suffix(".profiles")


def missing_tool(tool: str) -> str | None:
    """Why ``tool`` cannot run here (ncu and nsys: not on PATH), or None."""
    if tool != "torch" and shutil.which(tool) is None:
        return f"{tool} is not on PATH"
    return None


def request(cell: Cell, tool: str | None, results: Path) -> Cell:
    """``cell`` with its ``profile`` request for ``tool`` (None: as it is): ``{"tool"}`` and for
    ncu and nsys the ``report`` path their wrapper writes (without its suffix) and the name the
    record keeps (``recorded``, relative to the results file's directory), or ``{"tool", "skipped": reason}``."""
    if tool is None:
        return cell
    if cell.quality:
        return cell.replace(profile={"tool": tool, "skipped": "a quality cell (a whole training run) is not profiled"})
    if reason := missing_tool(tool):
        return cell.replace(profile={"tool": tool, "skipped": reason})
    if tool == "torch":
        return cell.replace(profile={"tool": tool})
    if not cell.device.startswith("cuda"):
        return cell.replace(profile={"tool": tool, "skipped": f"{tool} profiles CUDA kernels; this cell runs on the CPU (--profile torch profiles it)"})
    directory = profiles_dir(results)
    report = {"report": str(directory.resolve() / cell.cell_id), "recorded": f"{directory.name}/{cell.cell_id}{REPORT_SUFFIX[tool]}"}
    return cell.replace(profile={"tool": tool, **report})


def wrapper(profile: dict | None) -> list[str] | None:
    """The command that wraps the worker of a cell with ``profile`` (ncu, nsys; None otherwise),
    capturing only the profiled call (``cudaProfilerStart/Stop``), its report at ``profile["report"]``."""
    if profile is None or profile["tool"] == "torch" or "skipped" in profile:
        return None
    Path(profile["report"]).parent.mkdir(exist_ok=True)
    if profile["tool"] == "nsys":
        return ["nsys", "profile", "--capture-range=cudaProfilerApi", "--capture-range-end=stop", "--force-overwrite=true", "-o", profile["report"]]
    return ["ncu", "--profile-from-start", "off", "--nvtx", "--nvtx-include", f"{NVTX_RANGE}/", "--force-overwrite", "-o", profile["report"]]


def profile(cell: Cell, call, device: torch.device) -> tuple[dict | None, dict | None]:
    """``(metrics.profile, trace)`` of one more ``call()`` of ``cell``, after its timing: None
    without a request; the request's reason when skipped; torch: the trace (Chrome JSON with
    ``traceEvents``) and the top operators; ncu and nsys: the report their wrapper writes."""
    asked = cell.profile
    if asked is None or "skipped" in asked:
        return asked, None
    if asked["tool"] != "torch":
        with torch.cuda.profiler.profile(), torch.cuda.nvtx.range(NVTX_RANGE):
            call()
            synchronize(device)
        return {"tool": asked["tool"], "report": asked["recorded"]}, None
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with quiet_profiler(activities):  # Kineto's one-time start-up (seconds) outside the profiled call
        torch.ones(1).add_(1)
    with quiet_profiler(activities) as profiled:
        call()
        synchronize(device)
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "trace.json"
        profiled.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    return {"tool": "torch", **top_operators(profiled.key_averages(), device)}, trace


def top_operators(averages, device: torch.device, count: int = TOP_OPERATORS) -> dict:
    """``{"sort_by", "self_s", "top"}``: the total self time of the profiled call (GPU: of its
    kernels, copies and fills; CPU: of its operators) and its ``count`` largest entries by self
    time, each ``{"name", "calls", "self_s", "share"}`` (share: of that total)."""
    gpu = device.type == "cuda"

    def self_us(entry) -> float:
        return entry.self_device_time_total if gpu else entry.self_cpu_time_total

    # On a GPU the kernels, copies and fills are entries of their own, and an operator's self device time is
    # that of its kernels again: the device's entries alone are summed (as torch's own table totals them).
    entries = [
        entry for entry in averages if not entry.is_user_annotation and self_us(entry) > 0 and (not gpu or entry.device_type == torch.autograd.DeviceType.CUDA)
    ]
    total = sum(self_us(entry) for entry in entries)
    chosen = sorted(entries, key=self_us, reverse=True)[:count]
    top = [{"name": entry.key, "calls": entry.count, "self_s": self_us(entry) / 1e6, "share": self_us(entry) / total} for entry in chosen]
    return {"sort_by": "self_device_time" if gpu else "self_cpu_time", "self_s": total / 1e6, "top": top}


def write_trace(results: Path, cell_id: str, trace: dict) -> str:
    """Write a cell's trace beside the results file (``profiles_dir``/<cell_id>.json, atomically);
    return its path relative to the results file's directory, as the record keeps it."""
    directory = profiles_dir(results)
    directory.mkdir(exist_ok=True)
    path = directory / f"{cell_id}.json"
    write_json_atomic(path, trace)
    return str(path.relative_to(results.parent))

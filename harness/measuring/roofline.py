"""How far a cell is from the machine's limit: the machine's calibrated peaks (matmul FLOP/s per
dtype at the worker's thread count, copy bandwidth), a GPU's datasheet peaks, and per cell the
fraction of the roofline its time reaches.

The limit of a cell is the larger of ``flops / peak FLOP/s`` and ``min_bytes / bandwidth`` (the
traffic no implementation can avoid, counted in harness.running.workloads); the fraction is that limit
over the measured median. Calibrated figures are the best rate of repeated calls, and the best
ever measured on this machine and setting is kept in a cache file, so that a run calibrated on
a busy machine does not lower the roof. ``ATTNBENCH_CALIBRATE=0`` skips calibration (no
fractions are recorded then). The cache is keyed by what its figures were measured on and how
(``cache_key``); one that does not validate (``CalibrationCache``) is ignored with a warning and
rebuilt (harness.common.caches).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from ..common.caches import ignored, validated
from ..common.files import write_atomic

#: Seconds each figure is measured for: the first time on a machine and setting, then (with
#: the cache's best to fall back on) each later run.
FIRST_CALIBRATION_S = 1.0
CACHED_CALIBRATION_S = 0.2
#: Matrix side of the matmul (on the CPU small enough that a call of a few ms often runs without
#: being preempted on a busy machine: side 1024 gave 77 GFLOP/s where 512 gave 206, 2 threads) and
#: bytes of the copy buffer (far beyond the last-level cache).
MATMUL_SIDE = {"cpu": 512, "cuda": 8192}
COPY_BYTES = {"cpu": 64 * 2**20, "cuda": 2 * 2**30}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}

_T = 1e12
#: Datasheet peaks of dense math (no sparsity), FLOP/s per dtype ("float32": the CUDA cores;
#: "tf32", "float16", "bfloat16": the tensor cores, FP32 accumulation), and memory bandwidth in
#: bytes/s. Matched by substring of the GPU's name, first match wins (so PCIe before SXM).
DATASHEETS = [
    ("H200", {"float32": 67 * _T, "tf32": 495 * _T, "float16": 989 * _T, "bfloat16": 989 * _T, "bandwidth_bytes_per_s": 4.8e12}),
    ("H100 PCIe", {"float32": 51 * _T, "tf32": 378 * _T, "float16": 756 * _T, "bfloat16": 756 * _T, "bandwidth_bytes_per_s": 2.0e12}),
    ("H100 NVL", {"float32": 60 * _T, "tf32": 418 * _T, "float16": 835 * _T, "bfloat16": 835 * _T, "bandwidth_bytes_per_s": 3.9e12}),
    ("H100", {"float32": 67 * _T, "tf32": 495 * _T, "float16": 989 * _T, "bfloat16": 989 * _T, "bandwidth_bytes_per_s": 3.35e12}),
    ("A100-SXM4-40GB", {"float32": 19.5 * _T, "tf32": 156 * _T, "float16": 312 * _T, "bfloat16": 312 * _T, "bandwidth_bytes_per_s": 1.555e12}),
    ("A100-PCIE-40GB", {"float32": 19.5 * _T, "tf32": 156 * _T, "float16": 312 * _T, "bfloat16": 312 * _T, "bandwidth_bytes_per_s": 1.555e12}),
    ("A100 80GB PCIe", {"float32": 19.5 * _T, "tf32": 156 * _T, "float16": 312 * _T, "bfloat16": 312 * _T, "bandwidth_bytes_per_s": 1.935e12}),
    ("A100", {"float32": 19.5 * _T, "tf32": 156 * _T, "float16": 312 * _T, "bfloat16": 312 * _T, "bandwidth_bytes_per_s": 2.039e12}),
    ("V100", {"float32": 15.7 * _T, "float16": 125 * _T, "bandwidth_bytes_per_s": 0.9e12}),
    ("L40S", {"float32": 91.6 * _T, "tf32": 183 * _T, "float16": 362 * _T, "bfloat16": 362 * _T, "bandwidth_bytes_per_s": 0.864e12}),
    ("L4", {"float32": 30.3 * _T, "tf32": 60 * _T, "float16": 121 * _T, "bfloat16": 121 * _T, "bandwidth_bytes_per_s": 0.3e12}),
    ("A10G", {"float32": 31.2 * _T, "tf32": 35 * _T, "float16": 70 * _T, "bfloat16": 70 * _T, "bandwidth_bytes_per_s": 0.6e12}),
    ("A10", {"float32": 31.2 * _T, "tf32": 62.5 * _T, "float16": 125 * _T, "bfloat16": 125 * _T, "bandwidth_bytes_per_s": 0.6e12}),
    ("A40", {"float32": 37.4 * _T, "tf32": 74.8 * _T, "float16": 149.7 * _T, "bfloat16": 149.7 * _T, "bandwidth_bytes_per_s": 0.696e12}),
    ("RTX 4090", {"float32": 82.6 * _T, "tf32": 82.6 * _T, "float16": 165.2 * _T, "bfloat16": 165.2 * _T, "bandwidth_bytes_per_s": 1.008e12}),
    ("RTX 3090", {"float32": 35.6 * _T, "tf32": 35.6 * _T, "float16": 71 * _T, "bfloat16": 71 * _T, "bandwidth_bytes_per_s": 0.936e12}),
    ("T4", {"float32": 8.1 * _T, "float16": 65 * _T, "bandwidth_bytes_per_s": 0.32e12}),
]


def datasheet(gpu_name: str | None) -> dict | None:
    """The datasheet peaks of a GPU by name (``{"name": matched, ...}``); None for an unknown GPU."""
    for name, peaks in DATASHEETS:
        if gpu_name and name.lower() in gpu_name.lower():
            return {"name": name, **peaks}
    return None


def _best_rate(call, amount: float, seconds: float, device: torch.device) -> float:
    """The best ``amount / time`` of repeated ``call()``s over about ``seconds`` (after one untimed call)."""
    call()
    best, start = 0.0, time.perf_counter()
    while True:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        begin = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = max(best, amount / (time.perf_counter() - begin))
        if time.perf_counter() - start >= seconds:
            return best


def matmul_flops_per_s(dtype: str, device: torch.device, seconds: float) -> float:
    """The best FLOP/s of a square matmul of ``MATMUL_SIDE`` in ``dtype`` on ``device``."""
    side = MATMUL_SIDE[device.type]
    a = torch.randn(side, side, device=device).to(DTYPES[dtype])
    b = torch.randn(side, side, device=device).to(DTYPES[dtype])
    return _best_rate(lambda: torch.mm(a, b), 2 * side**3, seconds, device)


def copy_bytes_per_s(device: torch.device, seconds: float) -> float:
    """The best bandwidth of copying a ``COPY_BYTES`` buffer: bytes read plus bytes written per second."""
    source = torch.ones(COPY_BYTES[device.type] // 4, device=device)
    target = torch.empty_like(source)
    return _best_rate(lambda: target.copy_(source), 2 * COPY_BYTES[device.type], seconds, device)


#: The layout of ``calibration.json`` (a file of another version is rebuilt).
CACHE_VERSION = 2
Rate = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class CalibrationCache(BaseModel):
    """``calibration.json``: per ``cache_key`` the best rate ever measured of each figure
    (``matmul_flops_per_s.<dtype>``, ``bandwidth_bytes_per_s``), each a positive finite number."""

    model_config = ConfigDict(extra="forbid", strict=True)
    version: Literal[CACHE_VERSION]
    entries: dict[str, dict[str, Rate]] = {}


def cache_key(machine_id: str, device: torch.device, threads: int, cpus) -> str:
    """What a cached figure was measured on and how: the machine (``machine.machine_id``: host, CPU,
    GPU and its driver, torch, triton and CUDA versions), the device type, the torch threads, the
    CPUs the process may run on, and the sizes of the matmul and the copy."""
    return (
        f"{machine_id}/{device.type}/{threads} threads/cpus {','.join(map(str, cpus or []))}/"
        f"matmul {MATMUL_SIDE[device.type]}/copy {COPY_BYTES[device.type]} bytes"
    )


def _cache_path() -> Path:
    return Path(os.environ.get("ATTNBENCH_CACHE") or Path.home() / ".cache" / "attnbench") / "calibration.json"


def _read_cache() -> CalibrationCache:
    """The cache, or an empty one where there is none or it does not validate (with a warning)."""
    path, empty = _cache_path(), CalibrationCache(version=CACHE_VERSION)
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return empty
    except OSError as exc:
        ignored(path, exc.strerror or type(exc).__name__)
        return empty
    return validated(path, CalibrationCache, text, json=True) or empty


def _write_cache(cache: CalibrationCache) -> None:
    path = _cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, cache.model_dump_json(indent=1))
    except OSError:
        return


def _measure(dtypes: list[str], device: torch.device, seconds: float) -> dict:
    figures = {f"matmul_flops_per_s.{dtype}": matmul_flops_per_s(dtype, device, seconds) for dtype in dtypes}
    return {**figures, "bandwidth_bytes_per_s": copy_bytes_per_s(device, seconds)}


def _single_thread(dtypes: list[str], device: torch.device, seconds: float) -> dict:
    """The figures at one thread: on a busy machine all of a worker's threads rarely run at
    once, and a many-thread matmul waits for its slowest thread (2 threads, load average 4:
    11 GFLOP/s, where one thread reached 104 and two 206 on a quieter moment)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure(dtypes, device, seconds)
    finally:
        torch.set_num_threads(threads)


def calibrate(machine_id: str, dtypes: list[str], device: str = "cpu", gpu_name: str | None = None, sm_clock_mhz=None) -> dict:
    """``machine.calibration`` of a run, measured in this process (the worker, with its threads
    and pinning): per dtype the matmul FLOP/s, the copy bandwidth, the best of this measurement
    and of every earlier one of the same machine, device and thread count (the cache). On a CPU
    with several threads the matmul figure is at least threads × the one-thread figure and the
    bandwidth at least the one-thread bandwidth (``_single_thread``)."""
    device = torch.device(device)
    threads = torch.get_num_threads()
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    cache = _read_cache()
    key = cache_key(machine_id, device, threads, cpus)
    known = cache.entries.get(key, {})
    seconds = CACHED_CALIBRATION_S if known else FIRST_CALIBRATION_S
    measured = _measure(dtypes, device, seconds)
    single = _single_thread(dtypes, device, seconds) if device.type == "cpu" and threads > 1 else None
    if single is not None:
        measured = {name: max(value, single[name] * (threads if name.startswith("matmul") else 1)) for name, value in measured.items()}
    best = {name: max(value, known.get(name, 0.0)) for name, value in measured.items()}
    cache.entries[key] = {**known, **best}
    _write_cache(cache)
    return {
        "device": str(device),
        "torch_threads": threads,
        "cpus": cpus,
        "matmul_flops_per_s": {dtype: best[f"matmul_flops_per_s.{dtype}"] for dtype in dtypes},
        "bandwidth_bytes_per_s": best["bandwidth_bytes_per_s"],
        "this_run": {
            "matmul_flops_per_s": {dtype: measured[f"matmul_flops_per_s.{dtype}"] for dtype in dtypes},
            "bandwidth_bytes_per_s": measured["bandwidth_bytes_per_s"],
            "seconds_each": seconds,
            "single_thread": single,
        },
        "datasheet": datasheet(gpu_name) if device.type == "cuda" else None,
        "sm_clock_mhz": sm_clock_mhz,
    }


def roofline(metrics: dict, calibration: dict | None, dtype: str) -> dict:
    """``roofline_s`` (the time the limit allows: the larger of the compute time at the calibrated
    matmul FLOP/s and the memory time at the calibrated bandwidth), ``roofline_fraction`` (that
    over ``median_s``) and ``bound`` ("compute" or "memory"); empty without what it needs. A CPU cell
    timed on fewer threads than the calibration's (``busyness.spare_threads`` on a busy machine) is held
    to the matmul figure scaled to its ``torch_threads``, as ``calibrate`` scales one thread's to several
    (the bandwidth is left whole: a roof too high, never too low)."""
    peak = ((calibration or {}).get("matmul_flops_per_s") or {}).get(dtype)
    needed = ("flops", "min_bytes", "median_s")
    if not peak or any(metrics.get(key) is None for key in needed) or metrics["median_s"] <= 0:
        return {}
    threads, calibrated = metrics.get("torch_threads"), calibration.get("torch_threads")
    if calibration.get("device") == "cpu" and threads and calibrated and threads < calibrated:
        peak = peak * threads / calibrated
    compute_s, memory_s = metrics["flops"] / peak, metrics["min_bytes"] / calibration["bandwidth_bytes_per_s"]
    limit_s = max(compute_s, memory_s)
    return {"roofline_s": limit_s, "roofline_fraction": limit_s / metrics["median_s"], "bound": "compute" if compute_s >= memory_s else "memory"}

"""The machine fingerprint recorded with every run: host, CPU, memory, versions, commit, GPU.

``fingerprint(device)`` says what a number was measured on; ``throttle_state(device)`` says
whether the GPU was slowing itself down (power, heat) at a given moment. GPU details come from
``torch.cuda`` and, when the NVIDIA driver's NVML library can be loaded, from ``pynvml``; any
NVML query the GPU does not support is recorded as None.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import platform
import socket
import subprocess
from pathlib import Path

import torch

#: The repository that holds ``harness/``: where ``git`` is asked for the commit.
_REPO_ROOT = Path(__file__).resolve().parents[2]

#: NVML's clock event ("throttle") reason bits, named as in pynvml's nvmlClocksEventReason*.
_CLOCK_REASONS = {
    "GpuIdle": 0x1,
    "ApplicationsClocksSetting": 0x2,
    "SwPowerCap": 0x4,
    "HwSlowdown": 0x8,
    "SyncBoost": 0x10,
    "SwThermalSlowdown": 0x20,
    "HwThermalSlowdown": 0x40,
    "HwPowerBrakeSlowdown": 0x80,
    "DisplayClockSetting": 0x100,
}

#: The reasons that mean the GPU runs slower than it was asked to (power or heat).
_THROTTLING_MASK = sum(_CLOCK_REASONS[name] for name in ("SwPowerCap", "HwSlowdown", "SwThermalSlowdown", "HwThermalSlowdown", "HwPowerBrakeSlowdown"))

#: The keys of ``fingerprint()["gpu"]`` that come from NVML (None when NVML is unavailable).
_NVML_FIELDS = (
    "driver_version",
    "cuda_driver_version",
    "uuid",
    "pci_bus_id",
    "power_limit_w",
    "enforced_power_limit_w",
    "clocks_mhz",
    "ecc_enabled",
    "persistence_mode",
    "temperature_c",
)


def fingerprint(device: str | torch.device = "cpu") -> dict:
    """Everything that identifies the setup a measurement on ``device`` ran on, as plain JSON data."""
    fp = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu(),
        "memory_bytes": _memory_bytes(),
        "versions": _versions(),
        "git": _git_state(),
        "gpu": _gpu(device),
    }
    fp["machine_id"] = _machine_id(fp)
    return fp


def throttle_state(device: str | torch.device = "cpu") -> dict | None:
    """The GPU's current clock event reasons, SM clock, temperature and power draw.

    None on the CPU, without CUDA or without NVML. ``throttled`` is True when a power or
    thermal limit is holding the clocks down (idling or application clocks are not throttling).
    """
    index = _cuda_index(device)
    found = _nvml_device(index) if index is not None else None
    if found is None:
        return None
    nvml, handle = found
    bitmask = _query(nvml, "nvmlDeviceGetCurrentClocksEventReasons", handle)
    if bitmask is None:  # pynvml or driver older than the "event reasons" name
        bitmask = _query(nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", handle)
    return {
        "reasons_bitmask": bitmask,
        "reasons": None if bitmask is None else [name for name, bit in _CLOCK_REASONS.items() if bitmask & bit],
        "throttled": None if bitmask is None else bool(bitmask & _THROTTLING_MASK),
        "sm_clock_mhz": _query(nvml, "nvmlDeviceGetClockInfo", handle, nvml.NVML_CLOCK_SM),
        "temperature_c": _query(nvml, "nvmlDeviceGetTemperature", handle, nvml.NVML_TEMPERATURE_GPU),
        "power_w": _query(nvml, "nvmlDeviceGetPowerUsage", handle, convert=_watts),
    }


def format_fingerprint(fp: dict) -> str:
    """A few readable lines (for ``attnbench env``)."""
    cpu, versions = fp["cpu"], fp["versions"]
    lines = [
        f"host: {fp['hostname']} ({fp['platform']}), python {fp['python']}",
        f"cpu: {_dash(cpu['model'])}, {_dash(cpu['usable_cores'])} usable of {_dash(cpu['logical_cores'])} logical cores, {cpu['torch_threads']} torch threads",
        f"memory: {_gib(fp['memory_bytes'])}",
        *_format_gpu(fp["gpu"]),
        f"torch {versions['torch']}, triton {_dash(versions['triton'])}, cuda {_dash(versions['cuda'])}, "
        f"cudnn {_dash(versions['cudnn'])}, numpy {_dash(versions['numpy'])}, attnbench {_dash(versions['attnbench'])}",
        _format_git(fp["git"]),
        f"machine id: {fp['machine_id']}",
    ]
    return "\n".join(lines)


# --- host ---------------------------------------------------------------------------------


def _cpu() -> dict:
    affinity = getattr(os, "sched_getaffinity", None)
    return {
        "model": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "usable_cores": len(affinity(0)) if affinity else None,
        "torch_threads": torch.get_num_threads(),
    }


def _cpu_model() -> str | None:
    """The "model name" of /proc/cpuinfo (x86 Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or None


def _memory_bytes() -> int | None:
    """Total RAM: MemTotal of /proc/meminfo, else physical pages times page size."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024  # the value is in kB
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _versions() -> dict:
    return {
        "torch": str(torch.__version__),
        "triton": _dist_version("triton") or _dist_version("pytorch-triton"),  # nightlies ship the latter
        "cuda": torch.version.cuda,
        "cudnn": _cudnn_version(),
        "numpy": _dist_version("numpy"),
        "attnbench": _dist_version("attnbench"),
    }


def _cudnn_version() -> int | None:
    """The version of the cuDNN library torch loaded (None in a build without one, the CPU build), read from the library.
    Not ``torch.backends.cudnn.version()``: that also judges the cuDNN against the GPUs torch sees and raises where it
    refuses one (compute capability below 7.5 under cuDNN 9.11+), and a fingerprint records what is installed, GPU or not."""
    library = getattr(torch._C, "_cudnn", None)
    return None if library is None else library.getVersionInt()


def _dist_version(name: str) -> str | None:
    """The installed version of distribution ``name`` (without importing it), or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    """``git args`` run in the repository root; its output, or None when git fails or is missing."""
    try:
        done = subprocess.run(["git", "--no-optional-locks", *args], cwd=_REPO_ROOT, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def _git_state() -> dict:
    """Commit, dirtiness (untracked files count) and short sha of the checkout holding ``harness/``."""
    top = _git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != _REPO_ROOT:  # not a checkout (an installed copy)
        return {"commit": None, "dirty": None, "describe": None}
    status = _git("status", "--porcelain")
    return {
        "commit": _git("rev-parse", "HEAD"),
        "dirty": None if status is None else bool(status),
        "describe": _git("rev-parse", "--short", "HEAD"),
    }


def _machine_id(fp: dict) -> str:
    """16 hex digits of a hash over what identifies the hardware and software stack (not the commit)."""
    gpu = fp["gpu"] or {}
    versions = fp["versions"]
    identity = [
        fp["hostname"],
        fp["cpu"]["model"],
        gpu.get("name"),
        gpu.get("uuid"),
        gpu.get("driver_version"),
        versions["torch"],
        versions["triton"],
        versions["cuda"],
    ]
    return hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:16]


# --- GPU ----------------------------------------------------------------------------------

#: The lowest CUDA compute capability with tensor cores for each 16-bit dtype: float16 from
#: Volta (7.0), bfloat16 from Ampere (8.0). Below it the dtype runs emulated or on the CUDA
#: cores (bfloat16 on a V100), so a timing describes neither the dtype's fast path nor float32.
TENSOR_CORE_CAPABILITY = {"float16": (7, 0), "bfloat16": (8, 0)}


def missing_tensor_cores(device: str | torch.device, dtype: str) -> str | None:
    """Why a cell in ``dtype`` is not measured on CUDA ``device``: a GPU without tensor cores for
    that dtype (``TENSOR_CORE_CAPABILITY``); None when it has them, for other dtypes and devices."""
    needed = TENSOR_CORE_CAPABILITY.get(dtype)
    index = _cuda_index(device)
    if needed is None or index is None:
        return None
    props = torch.cuda.get_device_properties(index)
    if (props.major, props.minor) >= needed:
        return None
    return (
        f"{dtype} needs tensor cores of compute capability {needed[0]}.{needed[1]} or newer; "
        f"cuda:{index} ({props.name}) is {props.major}.{props.minor} and would run it emulated"
    )


def _cuda_index(device: str | torch.device) -> int | None:
    """The CUDA device index ``device`` names; None for other devices or when CUDA is unavailable."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def _gpu(device: str | torch.device) -> dict | None:
    index = _cuda_index(device)
    if index is None:
        return None
    props = torch.cuda.get_device_properties(index)
    return {
        "name": props.name,
        "memory_bytes": props.total_memory,
        "compute_capability": f"{props.major}.{props.minor}",
        "multiprocessor_count": props.multi_processor_count,
        **_nvml_fields(index),
    }


@functools.cache
def _nvml():
    """The pynvml module, initialised once per process; None (remembered) when NVML cannot load."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    return pynvml


def _nvml_device(index: int) -> tuple | None:
    """(pynvml, handle) for CUDA device ``index``, or None.

    The handle is found by PCI bus id, since CUDA's numbering (CUDA_VISIBLE_DEVICES,
    CUDA_DEVICE_ORDER) need not be NVML's; by index only when torch does not report the bus id.
    """
    nvml = _nvml()
    if nvml is None:
        return None
    bus_id = _pci_bus_id(torch.cuda.get_device_properties(index))
    try:
        handle = nvml.nvmlDeviceGetHandleByPciBusId(bus_id) if bus_id else nvml.nvmlDeviceGetHandleByIndex(index)
    except nvml.NVMLError:
        return None
    return nvml, handle


def _pci_bus_id(props) -> str | None:
    """NVML's form of the device's PCI address ("00000000:3B:00.0"), if torch reports it (torch >= 2.5)."""
    try:
        return f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
    except AttributeError:
        return None


def _nvml_fields(index: int) -> dict:
    found = _nvml_device(index)
    if found is None:
        return dict.fromkeys(_NVML_FIELDS)
    nvml, handle = found
    query = functools.partial(_query, nvml)
    return {
        "driver_version": query("nvmlSystemGetDriverVersion", convert=_text),
        "cuda_driver_version": query("nvmlSystemGetCudaDriverVersion", convert=_cuda_version),
        "uuid": query("nvmlDeviceGetUUID", handle, convert=_text),
        "pci_bus_id": query("nvmlDeviceGetPciInfo", handle, convert=lambda info: _text(info.busId)),
        "power_limit_w": query("nvmlDeviceGetPowerManagementLimit", handle, convert=_watts),
        "enforced_power_limit_w": query("nvmlDeviceGetEnforcedPowerLimit", handle, convert=_watts),
        "clocks_mhz": _clocks(nvml, handle),
        "ecc_enabled": query("nvmlDeviceGetEccMode", handle, convert=lambda modes: bool(modes[0])),  # [current, pending]
        "persistence_mode": query("nvmlDeviceGetPersistenceMode", handle, convert=bool),
        "temperature_c": query("nvmlDeviceGetTemperature", handle, nvml.NVML_TEMPERATURE_GPU),
    }


def _clocks(nvml, handle) -> dict:
    """Maximum, current and application clocks (MHz) of the SMs and the memory."""
    clocks = {}
    for unit, clock_type in (("sm", nvml.NVML_CLOCK_SM), ("mem", nvml.NVML_CLOCK_MEM)):
        clocks[f"{unit}_max"] = _query(nvml, "nvmlDeviceGetMaxClockInfo", handle, clock_type)
        clocks[f"{unit}_current"] = _query(nvml, "nvmlDeviceGetClockInfo", handle, clock_type)
        clocks[f"{unit}_app"] = _query(nvml, "nvmlDeviceGetApplicationsClock", handle, clock_type)
    return clocks


def _query(nvml, function: str, *args, convert=None):
    """``nvml.function(*args)``, converted; None when pynvml lacks it or the GPU does not support it."""
    query = getattr(nvml, function, None)
    if query is None:
        return None
    try:
        value = query(*args)
    except nvml.NVMLError:
        return None
    return value if convert is None else convert(value)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _watts(milliwatts: int) -> float:
    return milliwatts / 1000


def _cuda_version(number: int) -> str:
    """NVML's CUDA version number as text: 12040 -> "12.4"."""
    return f"{number // 1000}.{number % 1000 // 10}"


# --- text ---------------------------------------------------------------------------------


def _dash(value) -> str:
    return "-" if value is None else str(value)


def _gib(num_bytes: int | None) -> str:
    return "-" if num_bytes is None else f"{num_bytes / 2**30:.1f} GiB"


def _format_gpu(gpu: dict | None) -> list[str]:
    if gpu is None:
        return ["gpu: none"]
    power = "-" if gpu["power_limit_w"] is None else f"{gpu['power_limit_w']:.0f} W"
    ecc = {True: "on", False: "off", None: "-"}[gpu["ecc_enabled"]]
    lines = [
        f"gpu: {gpu['name']} (sm {gpu['compute_capability']}, {_gib(gpu['memory_bytes'])}, "
        f"{gpu['multiprocessor_count']} SMs), driver {_dash(gpu['driver_version'])}, "
        f"power limit {power}, ECC {ecc}"
    ]
    clocks = gpu["clocks_mhz"]
    if clocks is not None:
        lines.append(
            "gpu clocks (MHz): "
            + "; ".join(
                f"{unit} max {_dash(clocks[unit + '_max'])}, application {_dash(clocks[unit + '_app'])}, now {_dash(clocks[unit + '_current'])}"
                for unit in ("sm", "mem")
            )
        )
    return lines


def _format_git(git: dict) -> str:
    if git["commit"] is None:
        return "commit -"
    return f"commit {git['describe']}" + (" (dirty)" if git["dirty"] else "")

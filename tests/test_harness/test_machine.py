"""The machine fingerprint: the real CPU path here, the GPU path against a fake pynvml and a
patched torch.cuda, and the real GPU path where CUDA is available."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy
import pytest
import torch

from harness.measuring import machine
from harness.measuring.machine import fingerprint, format_fingerprint, throttle_state

REPO_ROOT = Path(__file__).resolve().parents[2]
TOP_KEYS = {"hostname", "platform", "python", "cpu", "memory_bytes", "versions", "git", "gpu", "machine_id"}
NVML_KEYS = {
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
}


@pytest.fixture(autouse=True)
def fresh_nvml():
    """Each test starts, and leaves, with NVML not yet initialised in this process."""
    machine._nvml.cache_clear()
    yield
    machine._nvml.cache_clear()


# --- the real machine (CPU) ---------------------------------------------------------------


def test_cpu_fingerprint_has_every_field_and_is_plain_json():
    fp = fingerprint("cpu")
    assert set(fp) == TOP_KEYS
    assert json.loads(json.dumps(fp)) == fp
    assert fp["gpu"] is None
    assert set(fp["cpu"]) == {"model", "logical_cores", "usable_cores", "torch_threads"}
    assert isinstance(fp["cpu"]["model"], str) and fp["cpu"]["model"]
    assert 1 <= fp["cpu"]["usable_cores"] <= fp["cpu"]["logical_cores"]
    assert fp["cpu"]["torch_threads"] == torch.get_num_threads()
    assert fp["memory_bytes"] > 2**20
    assert fp["versions"]["torch"] == torch.__version__
    assert fp["versions"]["numpy"] == numpy.__version__
    assert fp["versions"]["cuda"] == torch.version.cuda
    assert set(fp["versions"]) == {"torch", "triton", "cuda", "cudnn", "numpy", "attnbench"}
    # the CPU build has no cuDNN; the CUDA build brings its own, GPU or not
    assert fp["versions"]["cudnn"] is None if torch.version.cuda is None else isinstance(fp["versions"]["cudnn"], int)


def test_machine_id_is_stable_and_short():
    first, second = fingerprint(), fingerprint()
    assert first["machine_id"] == second["machine_id"]
    assert re.fullmatch(r"[0-9a-f]{16}", first["machine_id"])


def test_machine_id_follows_the_software_stack_but_not_the_commit(monkeypatch):
    base = fingerprint()["machine_id"]
    monkeypatch.setattr(machine, "_git_state", lambda: {"commit": "0" * 40, "dirty": False, "describe": "0000000"})
    assert fingerprint()["machine_id"] == base
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    assert fingerprint()["machine_id"] != base


def test_git_state_names_this_checkout():
    git = fingerprint()["git"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert re.fullmatch(r"[0-9a-f]{40}", git["commit"])
    assert git["commit"] == head.stdout.strip()
    assert isinstance(git["dirty"], bool)
    assert git["describe"] and git["commit"].startswith(git["describe"])


def test_git_state_is_none_without_git(monkeypatch):
    monkeypatch.setenv("PATH", "")
    assert fingerprint()["git"] == {"commit": None, "dirty": None, "describe": None}


def test_git_state_is_none_outside_a_checkout(monkeypatch, tmp_path):
    monkeypatch.setattr(machine, "_REPO_ROOT", tmp_path)
    assert fingerprint()["git"] == {"commit": None, "dirty": None, "describe": None}


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_git_state_ignores_an_enclosing_repository(monkeypatch, tmp_path):
    """An installed copy (site-packages) inside some other checkout reports no commit, not that one's."""
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@example.com"]
    subprocess.run([*git, "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "other"], cwd=tmp_path, check=True)
    (tmp_path / "site-packages").mkdir()
    monkeypatch.setattr(machine, "_REPO_ROOT", tmp_path / "site-packages")
    assert fingerprint()["git"] == {"commit": None, "dirty": None, "describe": None}


def test_format_names_the_cpu_and_no_gpu():
    fp = fingerprint()
    text = format_fingerprint(fp)
    assert fp["cpu"]["model"] in text
    assert "gpu: none" in text.splitlines()
    assert f"commit {fp['git']['describe']}" in text
    assert f"{fp['cpu']['usable_cores']} usable of {fp['cpu']['logical_cores']} logical cores" in text


def test_no_gpu_means_no_gpu_fields_and_no_throttle_state(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert throttle_state("cpu") is None
    assert throttle_state("cuda:0") is None
    assert fingerprint("cuda:0")["gpu"] is None


def test_a_build_without_cudnn_records_none(monkeypatch):
    monkeypatch.delattr(torch._C, "_cudnn", raising=False)  # as in the CPU build
    assert fingerprint("cpu")["versions"]["cudnn"] is None


# --- the GPU path, against a fake pynvml ---------------------------------------------------


class FakeNVMLError(Exception):
    pass


#: Two GPUs in NVML's order; CUDA's device 0 is the second of them (CUDA_VISIBLE_DEVICES=1).
NVML_BUS_IDS = {"gpu-a": "00000000:3B:00.0", "gpu-b": "00000000:86:00.0"}


def make_fake_nvml() -> types.ModuleType:
    nvml = types.ModuleType("pynvml")
    nvml.NVMLError = FakeNVMLError
    nvml.NVML_TEMPERATURE_GPU, nvml.NVML_CLOCK_SM, nvml.NVML_CLOCK_MEM = 0, 1, 2
    nvml.init_calls = 0
    nvml.reasons = 0x1

    def init():
        nvml.init_calls += 1

    def handle_by_bus_id(bus_id):
        for handle, known in NVML_BUS_IDS.items():
            if known == bus_id:
                return handle
        raise FakeNVMLError("not found")

    def temperature(handle, sensor):
        assert sensor == nvml.NVML_TEMPERATURE_GPU
        return 41

    nvml.nvmlInit = init
    nvml.nvmlDeviceGetHandleByPciBusId = handle_by_bus_id
    nvml.nvmlDeviceGetHandleByIndex = lambda index: list(NVML_BUS_IDS)[index]
    nvml.nvmlSystemGetDriverVersion = lambda: "550.54.15"
    nvml.nvmlSystemGetCudaDriverVersion = lambda: 12040
    nvml.nvmlDeviceGetUUID = lambda handle: f"GPU-{handle}"
    nvml.nvmlDeviceGetPciInfo = lambda handle: types.SimpleNamespace(busId=NVML_BUS_IDS[handle].encode())
    nvml.nvmlDeviceGetPowerManagementLimit = lambda handle: 700_000
    nvml.nvmlDeviceGetEnforcedPowerLimit = lambda handle: 650_000
    nvml.nvmlDeviceGetMaxClockInfo = lambda handle, kind: {1: 1980, 2: 2619}[kind]
    nvml.nvmlDeviceGetClockInfo = lambda handle, kind: {1: 345, 2: 2600}[kind]
    nvml.nvmlDeviceGetApplicationsClock = lambda handle, kind: {1: 1755, 2: 2619}[kind]
    nvml.nvmlDeviceGetEccMode = lambda handle: [1, 0]
    nvml.nvmlDeviceGetPersistenceMode = lambda handle: 1
    nvml.nvmlDeviceGetTemperature = temperature
    nvml.nvmlDeviceGetPowerUsage = lambda handle: 123_456
    nvml.nvmlDeviceGetCurrentClocksEventReasons = lambda handle: nvml.reasons
    return nvml


def fake_props(**overrides):
    props = dict(
        name="NVIDIA H100 80GB HBM3",
        total_memory=85_520_809_984,
        major=9,
        minor=0,
        multi_processor_count=132,
        pci_domain_id=0,
        pci_bus_id=0x86,
        pci_device_id=0,
    )
    props.update(overrides)
    return types.SimpleNamespace(**props)


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch.cuda reporting one H100 (on NVML's second bus id) and an importable fake pynvml."""
    nvml = make_fake_nvml()
    props = fake_props()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: {0: props}[index])
    return types.SimpleNamespace(nvml=nvml, props=props)


def raise_nvml_error(*args):
    raise FakeNVMLError("Not Supported")


def test_fake_gpu_fills_every_field(fake_gpu):
    fp = fingerprint("cuda:0")
    assert json.loads(json.dumps(fp)) == fp
    assert fp["gpu"] == {
        "name": "NVIDIA H100 80GB HBM3",
        "memory_bytes": 85_520_809_984,
        "compute_capability": "9.0",
        "multiprocessor_count": 132,
        "driver_version": "550.54.15",
        "cuda_driver_version": "12.4",
        "uuid": "GPU-gpu-b",  # found by PCI bus id, not by CUDA's index 0
        "pci_bus_id": "00000000:86:00.0",
        "power_limit_w": 700.0,
        "enforced_power_limit_w": 650.0,
        "clocks_mhz": {
            "sm_max": 1980,
            "mem_max": 2619,
            "sm_current": 345,
            "mem_current": 2600,
            "sm_app": 1755,
            "mem_app": 2619,
        },
        "ecc_enabled": True,
        "persistence_mode": True,
        "temperature_c": 41,
    }
    assert fingerprint("cuda")["gpu"] == fp["gpu"]  # the current device


def test_gpu_without_pci_ids_is_found_by_index(fake_gpu, monkeypatch):
    props = fake_props()
    del props.pci_domain_id, props.pci_bus_id, props.pci_device_id
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    assert fingerprint("cuda:0")["gpu"]["uuid"] == "GPU-gpu-a"


def test_gpu_identity_changes_the_machine_id(fake_gpu, monkeypatch):
    gpu_id = fingerprint("cuda:0")["machine_id"]
    assert gpu_id != fingerprint("cpu")["machine_id"]
    monkeypatch.setattr(fake_gpu.nvml, "nvmlSystemGetDriverVersion", lambda: "560.28.03")
    assert fingerprint("cuda:0")["machine_id"] != gpu_id
    monkeypatch.setattr(fake_gpu.nvml, "nvmlSystemGetDriverVersion", lambda: "550.54.15")
    monkeypatch.setattr(fake_gpu.nvml, "nvmlDeviceGetTemperature", lambda handle, sensor: 80)
    assert fingerprint("cuda:0")["machine_id"] == gpu_id


@pytest.mark.parametrize(
    "query, field",
    [
        ("nvmlDeviceGetEccMode", "ecc_enabled"),
        ("nvmlDeviceGetPowerManagementLimit", "power_limit_w"),
        ("nvmlSystemGetCudaDriverVersion", "cuda_driver_version"),
        ("nvmlDeviceGetTemperature", "temperature_c"),
    ],
)
def test_an_unsupported_query_blanks_only_its_field(fake_gpu, monkeypatch, query, field):
    complete = fingerprint("cuda:0")["gpu"]
    monkeypatch.setattr(fake_gpu.nvml, query, raise_nvml_error)
    gpu = fingerprint("cuda:0")["gpu"]
    assert gpu[field] is None and complete[field] is not None
    assert {k: v for k, v in gpu.items() if k != field} == {k: v for k, v in complete.items() if k != field}


def test_unsupported_application_clocks_blank_only_those_clocks(fake_gpu, monkeypatch):
    monkeypatch.setattr(fake_gpu.nvml, "nvmlDeviceGetApplicationsClock", raise_nvml_error)
    clocks = fingerprint("cuda:0")["gpu"]["clocks_mhz"]
    assert clocks == {"sm_max": 1980, "mem_max": 2619, "sm_current": 345, "mem_current": 2600, "sm_app": None, "mem_app": None}


def test_nvml_that_cannot_start_leaves_torch_fields_and_is_tried_once(fake_gpu, monkeypatch):
    def failing_init():
        fake_gpu.nvml.init_calls += 1
        raise FakeNVMLError("Driver Not Loaded")

    monkeypatch.setattr(fake_gpu.nvml, "nvmlInit", failing_init)
    gpu = fingerprint("cuda:0")["gpu"]
    assert set(gpu) == {"name", "memory_bytes", "compute_capability", "multiprocessor_count"} | NVML_KEYS
    assert gpu["name"] == "NVIDIA H100 80GB HBM3" and gpu["compute_capability"] == "9.0"
    assert all(gpu[key] is None for key in NVML_KEYS)
    assert throttle_state("cuda:0") is None
    assert fake_gpu.nvml.init_calls == 1


def test_nvml_is_initialised_once(fake_gpu):
    fingerprint("cuda:0")
    fingerprint("cuda:0")
    throttle_state("cuda:0")
    assert fake_gpu.nvml.init_calls == 1


def test_missing_pynvml_leaves_torch_fields(fake_gpu, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes ``import pynvml`` raise ImportError
    gpu = fingerprint("cuda:0")["gpu"]
    assert gpu["multiprocessor_count"] == 132
    assert all(gpu[key] is None for key in NVML_KEYS)


def test_format_describes_the_gpu(fake_gpu):
    text = format_fingerprint(fingerprint("cuda:0"))
    assert "gpu: NVIDIA H100 80GB HBM3 (sm 9.0, 79.6 GiB, 132 SMs), driver 550.54.15, power limit 700 W, ECC on" in text
    assert "sm max 1980, application 1755, now 345" in text
    assert "gpu: none" not in text


def test_the_cudnn_version_is_the_librarys_even_where_torch_refuses_the_gpu(fake_gpu, monkeypatch):
    """A V100 (7.0) under cuDNN 9.11: torch.backends.cudnn.version() raises; the fingerprint still records the version,
    in either build of torch (the library faked as the CUDA build loads it)."""

    def refuses():
        raise RuntimeError("cuDNN version 91100 is not compatible with devices with SM < 7.5.")

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: fake_props(name="Tesla V100-SXM2-16GB", major=7, minor=0))
    monkeypatch.setattr(torch._C, "_cudnn", types.SimpleNamespace(getVersionInt=lambda: 91100), raising=False)
    monkeypatch.setattr(torch.backends.cudnn, "version", refuses)
    fp = fingerprint("cuda:0")
    assert (fp["versions"]["cudnn"], fp["gpu"]["compute_capability"]) == (91100, "7.0")


@pytest.mark.parametrize(
    "bitmask, reasons, throttled",
    [
        (0x4 | 0x1, ["GpuIdle", "SwPowerCap"], True),
        (0x1, ["GpuIdle"], False),
        (0x0, [], False),
        (0x2 | 0x10 | 0x100, ["ApplicationsClocksSetting", "SyncBoost", "DisplayClockSetting"], False),
        (0x40, ["HwThermalSlowdown"], True),
        (0x8 | 0x20 | 0x80, ["HwSlowdown", "SwThermalSlowdown", "HwPowerBrakeSlowdown"], True),
    ],
)
def test_throttle_state_decodes_the_reasons(fake_gpu, bitmask, reasons, throttled):
    fake_gpu.nvml.reasons = bitmask
    assert throttle_state("cuda:0") == {
        "reasons_bitmask": bitmask,
        "reasons": reasons,
        "throttled": throttled,
        "sm_clock_mhz": 345,
        "temperature_c": 41,
        "power_w": 123.456,
    }


def test_throttle_state_falls_back_to_the_older_query(fake_gpu, monkeypatch):
    monkeypatch.setattr(fake_gpu.nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", lambda handle: 0x20, raising=False)
    monkeypatch.delattr(fake_gpu.nvml, "nvmlDeviceGetCurrentClocksEventReasons")  # an older pynvml
    assert throttle_state("cuda:0")["reasons"] == ["SwThermalSlowdown"]
    monkeypatch.setattr(fake_gpu.nvml, "nvmlDeviceGetCurrentClocksEventReasons", raise_nvml_error, raising=False)
    assert throttle_state("cuda:0")["reasons"] == ["SwThermalSlowdown"]  # an older driver


def test_reason_bits_match_pynvml():
    pynvml = pytest.importorskip("pynvml")
    for name, bit in machine._CLOCK_REASONS.items():
        assert getattr(pynvml, f"nvmlClocksThrottleReason{name}") == bit
        assert getattr(pynvml, f"nvmlClocksEventReason{name}", bit) == bit


# --- a real GPU ---------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
def test_real_gpu_fingerprint():
    fp = fingerprint("cuda:0")
    gpu, props = fp["gpu"], torch.cuda.get_device_properties(0)
    assert json.loads(json.dumps(fp)) == fp
    assert gpu["name"] == torch.cuda.get_device_name(0)
    assert gpu["memory_bytes"] == props.total_memory > 0
    assert gpu["compute_capability"] == "{}.{}".format(*torch.cuda.get_device_capability(0))
    assert gpu["multiprocessor_count"] > 0
    assert fp["versions"]["cuda"] == torch.version.cuda


@needs_cuda
def test_real_gpu_nvml_fields():
    if machine._nvml() is None:
        pytest.skip("NVML cannot be loaded here")
    gpu, props = fingerprint("cuda:0")["gpu"], torch.cuda.get_device_properties(0)
    assert re.fullmatch(r"\d+\.\d+(\.\d+)?", gpu["driver_version"])
    assert re.fullmatch(r"\d+\.\d+", gpu["cuda_driver_version"])
    assert gpu["uuid"].startswith(("GPU-", "MIG-"))
    if hasattr(props, "uuid") and not gpu["uuid"].startswith("MIG-"):
        assert gpu["uuid"].endswith(str(props.uuid))  # NVML's handle is the device torch uses
    if hasattr(props, "pci_bus_id"):
        assert gpu["pci_bus_id"].upper() == machine._pci_bus_id(props)
    assert gpu["clocks_mhz"]["sm_max"] > 0 and gpu["clocks_mhz"]["mem_max"] > 0
    assert 0 < gpu["temperature_c"] < 120
    state = throttle_state("cuda:0")
    assert isinstance(state["reasons_bitmask"], int) and isinstance(state["throttled"], bool)
    assert state["sm_clock_mhz"] > 0

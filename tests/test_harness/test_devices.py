"""``cuda:N`` is GPU N for everything the harness does with a cell (timing, the current device
of its work, calibration, fingerprint, throttle state), and a 16-bit cell on a GPU without
tensor cores for its dtype is skipped before anything is built. Without a GPU: torch.cuda and
pynvml are replaced by fakes that record the device index they are asked about."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import types

import pytest
import torch

from harness.measuring import machine, measure, roofline
from harness.running import executors, worker, workloads
from harness.running.executors import local
from harness.scenarios.cell import Cell
from harness.scenarios.scenario import load_scenario


@pytest.fixture
def current_device(monkeypatch):
    """``torch.cuda.device(d)`` replaced by one that records the index it makes current: the
    returned list holds the current device index while a block is inside it."""
    current = []

    @contextlib.contextmanager
    def device(which):
        current.append(torch.device(which).index)
        try:
            yield
        finally:
            current.pop()

    monkeypatch.setattr(torch.cuda, "device", device)
    return current


@pytest.fixture
def two_gpus(monkeypatch):
    """torch.cuda reporting GPU 0 an A100 (8.0) and GPU 1 a V100 (7.0); no NVML."""
    gpus = {0: types.SimpleNamespace(name="NVIDIA A100-SXM4-40GB", major=8, minor=0), 1: types.SimpleNamespace(name="Tesla V100-SXM2-16GB", major=7, minor=0)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: gpus[index])
    monkeypatch.setattr(machine, "_nvml", lambda: None)
    return gpus


def _cell(device: str, dtype: str = "float32") -> Cell:
    (cell,) = load_scenario("seq-sweep", overrides=["seq_len=16", "heads=1", "d_key=8", "measure.repeats=1", f"dtype={dtype}", f"device={device}"]).cells()[:1]
    return cell


# --- timing ------------------------------------------------------------------------------


def test_the_clock_records_its_events_on_its_own_gpu(monkeypatch):
    recorded = []

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self, stream=None):
            recorded.append(stream)

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return 2.0

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: ("stream of GPU", torch.device(device).index))
    result, seconds = measure.Clock("cuda:1", flush_l2=False)(lambda: "out")
    assert (result, seconds) == ("out", 0.002)
    assert recorded == [("stream of GPU", 1)] * 2, "the start and end events must go on GPU 1's stream, not the current device's"


def test_peak_memory_is_that_of_its_own_gpu(monkeypatch):
    asked = []
    for name, value in [("synchronize", None), ("reset_peak_memory_stats", None), ("memory_allocated", 100), ("max_memory_allocated", 300)]:
        monkeypatch.setattr(torch.cuda, name, lambda device, name=name, value=value: asked.append((name, torch.device(device).index)) or value)
    with measure.PeakMemory("cuda:1") as peak:
        pass
    assert (peak.bytes, peak.kind) == (200, "cuda_max_allocated")
    assert {index for _, index in asked} == {1} and len(asked) == 5


def test_a_cell_runs_with_its_gpu_as_the_current_device(monkeypatch, current_device, two_gpus):
    seen = []
    monkeypatch.setattr(
        workloads, "_measure", lambda cell, device, dtype: seen.append((device, list(current_device))) or {"status": "ok", "error": None, "metrics": {}}
    )
    result = workloads.measure_cell(_cell("cuda:1"))
    assert result["status"] == "ok" and seen == [(torch.device("cuda:1"), [1])]
    assert current_device == [], "the device is current only while the cell runs"


def test_the_cpu_makes_no_device_current(current_device):
    with measure.on_device("cpu"):
        assert current_device == []


# --- calibration and fingerprint ----------------------------------------------------------


class _CalibratingWorker:
    """A worker that answers a calibration request with the request itself."""

    def __init__(self, *args, **kwargs):
        self.measured = 0

    def calibrate(self, request, start_s=None):
        return {"status": "ok", "error": None, "metrics": dataclasses.asdict(request)}


def test_each_device_is_fingerprinted_and_calibrated_as_itself(monkeypatch):
    fingerprinted, throttles = [], []
    monkeypatch.setattr(local, "Worker", _CalibratingWorker)
    monkeypatch.setattr(machine, "fingerprint", lambda device: fingerprinted.append(device) or {"machine_id": f"id of {device}", "gpu": None})
    monkeypatch.setattr(machine, "throttle_state", lambda device: throttles.append(device) or {"sm_clock_mhz": 1000})
    monkeypatch.setenv("ATTNBENCH_CALIBRATE", "1")
    cells = [_cell("cuda:1"), _cell("cpu")]
    lines = local.LocalExecutor().start(cells, {"machine_id": "the runner's"})
    assert fingerprinted == ["cuda:1", "cpu"] and throttles == ["cuda:1", "cpu"]
    assert [(line["machine_id"], line["calibration"]["device"]) for line in lines] == [("id of cuda:1", "cuda:1"), ("id of cpu", "cpu")]


def test_the_worker_calibrates_on_the_gpu_named(monkeypatch, current_device, tmp_path):
    devices = []
    monkeypatch.setenv("ATTNBENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(roofline, "matmul_flops_per_s", lambda dtype, device, seconds: devices.append((device, list(current_device))) or 1.0)
    monkeypatch.setattr(roofline, "copy_bytes_per_s", lambda device, seconds: devices.append((device, list(current_device))) or 1.0)
    monkeypatch.setattr(roofline, "datasheet", lambda name: None)
    request = worker.Calibration(machine_id="m", dtypes=["float32"], device="cuda:1", gpu_name="x", sm_clock_mhz=None, cpus=None)
    result = worker.calibrated(request)
    assert result["metrics"]["device"] == "cuda:1"
    assert devices == [(torch.device("cuda:1"), [1])] * 2


def test_the_fingerprint_and_throttle_state_of_cuda_1_describe_gpu_1(monkeypatch):
    """Two GPUs on NVML's bus ids; CUDA's 1 is the second."""
    from test_machine import NVML_BUS_IDS, fake_props, make_fake_nvml

    nvml = make_fake_nvml()
    nvml.nvmlDeviceGetClockInfo = lambda handle, kind: {"gpu-a": 100, "gpu-b": 200}[handle]
    props = {0: fake_props(name="GPU zero", pci_bus_id=0x3B), 1: fake_props(name="GPU one", pci_bus_id=0x86)}
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props[index])
    machine._nvml.cache_clear()
    try:
        gpu = machine.fingerprint("cuda:1")["gpu"]
        assert (gpu["name"], gpu["uuid"], gpu["pci_bus_id"]) == ("GPU one", "GPU-gpu-b", NVML_BUS_IDS["gpu-b"])
        assert machine.throttle_state("cuda:1")["sm_clock_mhz"] == 200 and machine.throttle_state("cuda:0")["sm_clock_mhz"] == 100
        assert executors.main_device([_cell("cpu"), _cell("cuda:1")]) == "cuda:1"
    finally:
        machine._nvml.cache_clear()


# --- 16-bit cells on GPUs without tensor cores for them ------------------------------------


@pytest.mark.parametrize(
    "device, dtype, refused",
    [
        ("cuda:1", "bfloat16", True),  # a V100: fp16 tensor cores, no bf16 ones
        ("cuda:1", "float16", False),
        ("cuda:1", "float32", False),
        ("cuda:0", "bfloat16", False),  # an A100
        ("cpu", "bfloat16", False),
    ],
)
def test_16_bit_needs_the_tensor_cores_of_its_dtype(two_gpus, device, dtype, refused):
    reason = machine.missing_tensor_cores(device, dtype)
    assert (reason is not None) == refused
    if refused:
        assert reason == "bfloat16 needs tensor cores of compute capability 8.0 or newer; cuda:1 (Tesla V100-SXM2-16GB) is 7.0 and would run it emulated"


def test_fp16_below_volta_is_refused(two_gpus):
    two_gpus[1].major, two_gpus[1].minor = 6, 1
    assert "float16 needs tensor cores of compute capability 7.0" in machine.missing_tensor_cores("cuda:1", "float16")


def test_a_bf16_cell_on_a_v100_is_skipped_before_anything_runs(monkeypatch, two_gpus, current_device):
    def timed(*args):
        raise AssertionError("the cell was built or timed")

    monkeypatch.setattr(workloads, "_measure", timed)
    monkeypatch.setattr(workloads, "pin", timed)
    result = workloads.measure_cell(_cell("cuda:1", "bfloat16"))
    assert result["status"] == "skipped" and "would run it emulated" in result["error"]

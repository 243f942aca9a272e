"""Calibration, the bytes a cell must move and its fraction of the roofline."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import make_cell

from harness.measuring import roofline
from harness.measuring.builders import BUILDERS, build_decoder
from harness.results import load, read_records
from harness.running.workloads import _state_traffic

CALIBRATION = {"matmul_flops_per_s": {"float32": 1e11}, "bandwidth_bytes_per_s": 1e10}


def test_the_roofline_takes_the_slower_of_compute_and_memory():
    compute = roofline.roofline({"flops": 1e9, "min_bytes": 1e6, "median_s": 0.04}, CALIBRATION, "float32")
    assert compute == {"roofline_s": pytest.approx(0.01), "roofline_fraction": pytest.approx(0.25), "bound": "compute"}
    memory = roofline.roofline({"flops": 1e6, "min_bytes": 1e8, "median_s": 0.02}, CALIBRATION, "float32")
    assert memory == {"roofline_s": pytest.approx(0.01), "roofline_fraction": pytest.approx(0.5), "bound": "memory"}
    assert roofline.roofline({"flops": 1e6, "min_bytes": 1e8, "median_s": 0.02}, CALIBRATION, "bfloat16") == {}, "no peak for that dtype"
    assert roofline.roofline({"flops": 1e6, "median_s": 0.02}, None, "float32") == {}


def test_a_cpu_cell_on_fewer_threads_than_the_calibration_has_their_share_of_the_matmul_roof():
    two_threads = {**CALIBRATION, "device": "cpu", "torch_threads": 2}
    cell = {"flops": 1e9, "min_bytes": 1e6, "median_s": 0.04}
    assert roofline.roofline({**cell, "torch_threads": 1}, two_threads, "float32")["roofline_fraction"] == pytest.approx(0.5)
    assert roofline.roofline({**cell, "torch_threads": 2}, two_threads, "float32")["roofline_fraction"] == pytest.approx(0.25)
    on_gpu = {**two_threads, "device": "cuda:0"}
    assert roofline.roofline({**cell, "torch_threads": 1}, on_gpu, "float32")["roofline_fraction"] == pytest.approx(0.25)


@pytest.mark.parametrize(
    ("name", "matched", "bandwidth"),
    [
        ("NVIDIA H100 80GB HBM3", "H100", 3.35e12),
        ("NVIDIA H100 PCIe", "H100 PCIe", 2.0e12),
        ("NVIDIA H200", "H200", 4.8e12),
        ("NVIDIA A100-SXM4-80GB", "A100", 2.039e12),
        ("NVIDIA A100-SXM4-40GB", "A100-SXM4-40GB", 1.555e12),
        ("NVIDIA L4", "L4", 0.3e12),
        ("NVIDIA L40S", "L40S", 0.864e12),
        ("NVIDIA A10", "A10", 0.6e12),
        ("NVIDIA GeForce RTX 4090", "RTX 4090", 1.008e12),
        ("Tesla V100-SXM2-16GB", "V100", 0.9e12),
    ],
)
def test_datasheets_are_found_by_name(name, matched, bandwidth):
    sheet = roofline.datasheet(name)
    assert sheet["name"] == matched and sheet["bandwidth_bytes_per_s"] == bandwidth and sheet["float32"] > 1e12


def test_an_unknown_gpu_has_no_datasheet():
    assert roofline.datasheet("Some Future GPU") is None and roofline.datasheet(None) is None


def test_calibration_keeps_the_best_figures_of_a_machine(tmp_path, monkeypatch):
    """The first calibration measures longer; a later one measures briefly and never lowers the roof."""
    monkeypatch.setenv("ATTNBENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(roofline, "FIRST_CALIBRATION_S", 0.05)
    monkeypatch.setattr(roofline, "CACHED_CALIBRATION_S", 0.01)
    monkeypatch.setitem(roofline.MATMUL_SIDE, "cpu", 128)
    monkeypatch.setitem(roofline.COPY_BYTES, "cpu", 2**20)
    first = roofline.calibrate("m", ["float32"])
    assert first["this_run"]["seconds_each"] == 0.05 and first["matmul_flops_per_s"]["float32"] > 0 and first["bandwidth_bytes_per_s"] > 0
    assert first["torch_threads"] == torch.get_num_threads() and first["datasheet"] is None
    second = roofline.calibrate("m", ["float32"])
    assert second["this_run"]["seconds_each"] == 0.01
    assert second["matmul_flops_per_s"]["float32"] >= first["matmul_flops_per_s"]["float32"]
    assert second["bandwidth_bytes_per_s"] == max(first["bandwidth_bytes_per_s"], second["this_run"]["bandwidth_bytes_per_s"])


def _cell(variant, mode, target="core", **axes):
    return make_cell(
        variant=variant,
        mode=mode,
        target=target,
        axes={"seq_len": 16, "batch": 2, "heads": 3, "d_key": 4, "d_value": 5, "dtype": "float32", "device": "cpu", **axes},
    )


def test_min_bytes_of_the_core():
    """softmax at B=2 H=3 T=16 d=4/5: q, k (4 wide) and v (5 wide) read, the output (5 wide) written, 4 bytes each."""
    read, output = 2 * 3 * 16 * (4 + 4 + 5) * 4, 2 * 3 * 16 * 5 * 4
    assert BUILDERS["core"](_cell("softmax", "forward"), torch.device("cpu"), torch.float32).min_bytes == read + output
    assert BUILDERS["core"](_cell("softmax", "train"), torch.device("cpu"), torch.float32).min_bytes == 2 * (read + output)


def test_min_bytes_of_the_layer_counts_its_weights():
    cell = _cell("linear", "forward", "layer")
    workload = BUILDERS["layer"](cell, torch.device("cpu"), torch.float32)
    x = 2 * 16 * 3 * 5 * 4
    assert workload.min_bytes > 2 * x and (workload.min_bytes - 2 * x) % 4 == 0


def test_decode_state_traffic():
    """A KV cache is read whole and grows by one token; a fixed state is read and written whole."""
    cell = _cell("softmax", "decode")
    core, *_ = build_decoder(cell, torch.device("cpu"), torch.float32, 16, 1)
    assert _state_traffic(core, 2, 3, 5, 16, {}) == 2 * 3 * (16 + 1) * (4 + 5)
    assert _state_traffic(core, 2, 3, 5, 16, {"heads_k": 1, "heads_v": 1}) == 2 * 1 * (16 + 1) * (4 + 5), "GQA: the key/value heads' cache"
    cell = _cell("linear", "decode")
    core, *_ = build_decoder(cell, torch.device("cpu"), torch.float32, 16, 1)
    state = core.state_numel(2, 3, 5, 16)
    assert _state_traffic(core, 2, 3, 5, 16, {}) == 2 * state


def _fractions_in_range(out) -> None:
    cells = load(out)
    ok = cells[cells["status"] == "ok"]
    assert len(ok) > 0
    fractions = ok["metrics.roofline_fraction"]
    assert ((fractions > 0) & (fractions <= 1)).all(), ok[["variant", "mode", "axes.seq_len", "metrics.roofline_fraction", "metrics.bound"]]
    assert ok["metrics.bound"].isin(["compute", "memory"]).all() and (ok["metrics.min_bytes"] > 0).all()
    calibration = read_records(next(out.glob("*.jsonl")))[0]["machine"]["calibration"]
    assert calibration["matmul_flops_per_s"]["float32"] > 0 and calibration["bandwidth_bytes_per_s"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["seq-sweep", "decode", "varlen"])
@pytest.mark.serial  # a roof calibrated while a test beside it ran is too low
def test_every_ok_cell_of_a_ci_preset_is_within_the_roofline(scenario, tmp_path):
    """A fraction above 1 is a counting error (FLOPs or bytes counted too high, or a roof too low);
    one sample a cell suffices to show one (a busy machine only lowers the fractions), and one worker for all cells (a
    fresh worker a CPU cell, the default, is for peak memory and costs 2-3 s a cell; a warm one only raises the fractions).
    (smoke-cpu's ci preset: tests/test_harness/test_runner.py::test_smoke_ci_preset_runs_and_loads.)"""
    command = [
        sys.executable,
        "-m",
        "harness.cli",
        "run",
        scenario,
        "--preset",
        "ci",
        "--set",
        "measure.repeats=1",
        "--set",
        "measure.max_time_s=0",
        "--set",
        "measure.fresh_worker=false",
        "--out",
        str(tmp_path),
        "--no-progress",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr
    _fractions_in_range(tmp_path)

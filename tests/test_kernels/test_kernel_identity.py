"""Kernel identity (``variants.kernels.identity``): a Triton cell records the Triton version and, per kernel, its
source hash, the configuration it ran (an autotuned kernel's chosen candidate and how it was chosen) and its
compile and tuning seconds. Through the interpreter (the CPU) nothing compiles or is timed, and the record says so;
natively the compile seconds come from Triton's JIT compile hooks, checked here with the hooks called by hand and
an object with the autotuner's attributes (``ATTNBENCH_TEST_DEVICE=cuda`` runs the cell natively)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
import types

import pytest
import triton
from helpers import slow_when_interpreted

from harness.running import workloads
from harness.scenarios.cell import Cell
from harness.scenarios.scenario import load_scenario
from variants.kernels import delta_rule, identity, sum_rule

DEVICE = os.environ.get("ATTNBENCH_TEST_DEVICE", "cpu")
DELTA_KERNELS = ["ut_transform", "state_pass", "output", "backward_local", "backward_pass", "backward_chunk"]


def _cells(tmp_path, variants: str, backends: str) -> list[Cell]:
    path = tmp_path / "s.yaml"
    path.write_text(
        f"variants: {variants}\nbackends: {backends}\naxes: {{seq_len: 16, batch: 1, heads: 2, d_key: 8, device: {DEVICE}}}\n"
        "modes: [train]\nmeasure: {warmup: 0, repeats: 1}\n"
    )
    return load_scenario(str(path)).cells()


def test_a_triton_cell_records_its_kernels(tmp_path):
    """A delta-rule training cell: its six kernels in launch order, each with the hash of its source, the
    configuration it ran and, under the interpreter, no compile or tuning time and the autotuned passes' first
    candidate, untimed; a torch cell records nothing of the kind. The record is plain JSON."""
    (triton_cell,) = _cells(tmp_path, "{delta: {}}", "[triton]")
    metrics = workloads.measure_cell(triton_cell)["metrics"]
    assert metrics["triton_version"] == triton.__version__
    kernels = {entry["kernel"]: entry for entry in metrics["triton_kernels"]}
    assert list(kernels) == DELTA_KERNELS
    state_pass = kernels["state_pass"]
    assert state_pass["source_hash"] == identity.source_hash(identity.python_function(delta_rule._state_pass_kernel))
    assert state_pass["config"]["BLOCK_V"] in (16, 32) and state_pass["config"]["num_warps"] in (4, 8)
    assert kernels["output"]["autotune"] is None and kernels["output"]["config"]["num_warps"] in (4, 8)
    if DEVICE == "cpu":
        assert state_pass["autotune"] == kernels["backward_pass"]["autotune"] == "interpreter: first candidate, untimed"
        assert all(entry["compile_s"] is None and entry["tune_s"] is None for entry in kernels.values())
    else:
        assert state_pass["autotune"] in ("timing", "only candidate", "earlier call")
        assert all(entry["compile_s"] >= 0 for entry in kernels.values())
    assert json.loads(json.dumps(metrics["triton_kernels"])) == metrics["triton_kernels"]
    assert metrics["compile_s"] > 0  # the untimed warm-up call, first use included
    (torch_cell,) = _cells(tmp_path, "{delta: {}}", "[torch]")
    torch_metrics = workloads.measure_cell(torch_cell)["metrics"]
    assert not [name for name in torch_metrics if name.startswith("triton")] and "compile_s" not in torch_metrics


def test_an_fla_cell_records_its_first_use_apart(tmp_path):
    """An fla cell: its warm-up call (fla's kernels compiled and autotuned there, through the interpreter its
    recurrent kernels) is ``metrics.compile_s``, apart from the timed calls, beside the versions it ran."""
    pytest.importorskip("fla")
    (cell,) = _cells(tmp_path, "{linear: {}}", "[fla]")
    metrics = workloads.measure_cell(cell)["metrics"]
    assert metrics["compile_s"] > 0 and metrics["median_s"] > 0 and metrics["fla_version"]


PROBE = """import triton
import triton.language as tl


@triton.jit
def helper(x):
    return x + 1


@triton.jit
def uses_helper(ptr):
    tl.store(ptr, helper(tl.load(ptr)))


@triton.jit
def alone(ptr):
    tl.store(ptr, tl.load(ptr) * 2)
"""


def test_the_source_hash_follows_the_helpers_a_kernel_calls(tmp_path, monkeypatch):
    """A kernel's hash changes with a @triton.jit helper it calls, not with one it does not call."""
    (tmp_path / "kd_probe.py").write_text(PROBE)
    monkeypatch.syspath_prepend(str(tmp_path))
    probe = importlib.import_module("kd_probe")
    before = {name: identity.source_hash(identity.python_function(getattr(probe, name))) for name in ("uses_helper", "alone")}
    (tmp_path / "kd_probe.py").write_text(PROBE.replace("return x + 1", "return x + 100"))  # another size: no stale .pyc
    probe = importlib.reload(probe)
    after = {name: identity.source_hash(identity.python_function(getattr(probe, name))) for name in ("uses_helper", "alone")}
    assert after["uses_helper"] != before["uses_helper"] and after["alone"] == before["alone"]
    sys.modules.pop("kd_probe")


@slow_when_interpreted  # a second interpreter imports the kernels
def test_the_source_hash_is_the_same_natively_and_interpreted():
    """Triton's own ``cache_key`` exists only for native kernels; this hash is the same either way."""
    code = "from variants.kernels import identity, sum_rule; print(identity.source_hash(identity.python_function(sum_rule._chunk_output_kernel)))"
    env = {**os.environ, "TRITON_INTERPRET": "0" if DEVICE == "cpu" else "1"}
    other = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert other == identity.source_hash(identity.python_function(sum_rule._chunk_output_kernel))


class _Tuner:
    """What ``identity.note`` reads of Triton's Autotuner: ``fn`` (the kernel), ``configs``, ``cache`` (tuning
    key -> config), ``bench_time`` (set when it times candidates) and ``best_config``."""

    def __init__(self, fn):
        self.fn = fn
        self.configs = [triton.Config({"BLOCK_V": block}, num_warps=4) for block in (16, 32)]
        self.cache, self.best_config = {}, self.configs[0]

    def run(self, key, seconds):
        """A launch: compile (Triton's hooks around it) and, for a new key, time the candidates, choosing the second."""
        hooks = triton.knobs.runtime
        assert not hooks.jit_cache_hook(key=key)
        time.sleep(seconds)
        hooks.jit_post_compile_hook(key=key)
        if key not in self.cache:
            self.bench_time, self.cache[key] = 0.25, self.configs[1]
        self.best_config = self.cache[key]


def test_native_compile_and_tune_seconds(monkeypatch):
    """Natively (TRITON_INTERPRET unset): ``compile_s`` sums the seconds between Triton's compile hooks during the
    kernel's launches, ``tune_s`` is the autotuner's timing when it timed, an earlier choice says so; hooks set
    before are called in turn and restored."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    called = []
    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", lambda **kwargs: called.append(kwargs["key"]))
    function = identity.python_function(sum_rule._chunk_output_kernel)
    tuner = _Tuner(function)
    kernel = types.SimpleNamespace(fn=function)
    with identity.recording() as record:
        identity.note("pass", tuner, lambda: tuner.run("k1", 0.05), {"GATED": True}, {}, tuner)
        identity.note("pass", tuner, lambda: tuner.run("k1", 0.0), {"GATED": True}, {}, tuner)
        identity.note("plain", kernel, lambda: None, {"BLOCK_C": 64}, {"num_warps": 4}, None)
    assert triton.knobs.runtime.jit_cache_hook is not None and triton.knobs.runtime.jit_post_compile_hook is None and called == ["k1", "k1"]
    tuned, plain = record["triton_kernels"]
    assert tuned["autotune"] == "timing" and tuned["tune_s"] == 0.25 and 0.05 <= tuned["compile_s"] < 1
    assert tuned["config"] == {"GATED": True, **tuner.configs[1].all_kwargs()} and tuned["source_hash"] == identity.source_hash(function)
    assert plain == {"kernel": "plain", "source_hash": tuned["source_hash"], "config": {"BLOCK_C": 64, "num_warps": 4}, "autotune": None,
                     "compile_s": 0.0, "tune_s": None}  # fmt: skip
    with identity.recording() as record:
        identity.note("pass", tuner, lambda: tuner.run("k1", 0.0), {}, {}, tuner)
    assert record["triton_kernels"][0]["autotune"] == "earlier call" and record["triton_kernels"][0]["tune_s"] is None

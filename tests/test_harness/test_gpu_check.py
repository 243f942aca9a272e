"""``attnbench gpu-check``: what it needs (one line each, exit code 2), its plan within the budget, the
order of its checks (a failed kernel test stops it), its summary and ratios. No GPU here: the checks
themselves run in the slow test on the CPU forms of its scenarios."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import attnbench, attnbench_here, needs_shared

from harness.gpu import gpu_check
from harness.gpu.gpu_check import BUDGET_S, Check
from harness.results import ResultsWriter


def no_gpu_line(cuda: str | None) -> str:
    """What gpu-check says without a GPU under a torch whose ``torch.version.cuda`` is ``cuda``: the CPU build (None),
    which cannot see one, or a CUDA build (what pip installs by default on Linux x86-64) on a machine without a GPU or driver."""
    if cuda is None:
        return f"gpu-check: torch {torch.__version__} is a CPU build and sees no CUDA GPU; install a CUDA build of torch"
    return f"gpu-check: torch {torch.__version__} (CUDA {cuda}) sees no CUDA GPU; check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a CUDA GPU")
def test_without_a_gpu_it_stops_with_one_line_and_exit_code_2(tmp_path):
    """This machine's own torch, whichever build: the command in a process of its own."""
    done = attnbench("gpu-check", str(tmp_path / "check"), env={"TRITON_INTERPRET": "0"})
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [no_gpu_line(torch.version.cuda)]
    assert not (tmp_path / "check").exists()


@pytest.mark.parametrize("cuda", [None, "13.0"], ids=["cpu-build", "cuda-build"])
def test_each_build_without_a_gpu_gets_its_own_line(cuda, monkeypatch, tmp_path):
    """Both builds, whichever is installed here: torch.version.cuda and torch.cuda.is_available faked."""
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    done = attnbench_here("gpu-check", str(tmp_path / "check"), env={"TRITON_INTERPRET": "0"})
    assert (done.returncode, done.stderr.strip().splitlines()) == (2, [no_gpu_line(cuda)])
    assert not (tmp_path / "check").exists()


def test_a_cuda_build_that_sees_a_gpu_lacks_nothing_of_torch(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert gpu_check._missing_torch() == []


@pytest.fixture
def with_a_gpu(monkeypatch):
    """This machine as gpu-check sees a GPU machine: torch's own check passes."""
    monkeypatch.setattr(gpu_check, "_missing_torch", lambda: [])
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@needs_shared
def test_each_missing_thing_is_one_line_saying_how_to_get_it(with_a_gpu, monkeypatch, tmp_path):
    assert gpu_check.missing() == []
    real = gpu_check.installed_version
    monkeypatch.setattr(gpu_check, "installed_version", lambda name: None if name in ("pytest", "pydantic") else real(name))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    lines = gpu_check.missing()
    assert len(lines) == 3
    assert lines[0].startswith("pytest is not installed; install attnbench's test extra")
    assert lines[1].startswith("pydantic is not installed; pip install 'pydantic") and lines[1].endswith("(attnbench kit)")
    assert lines[2].startswith("TRITON_INTERPRET=1 is set")
    assert "pytest" not in " ".join(gpu_check.missing(kernel_tests=False))


def test_missing_data_names_where_it_looked(with_a_gpu, monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNBENCH_DATA", str(tmp_path))
    (line,) = gpu_check.missing()
    assert line.startswith("WikiText-2, the data of its LM cell, is not here: wikitext-2: ")
    assert str(tmp_path / "wikitext-2") in line and "wiki.train.tokens" in line and "attnbench kit" in line


@needs_shared
def test_without_the_kernel_tests_it_says_how_to_go_on(with_a_gpu, monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_check, "kernel_tests_dir", lambda: None)
    (line,) = gpu_check.missing()
    assert "tests/test_kernels" in line and "--no-kernel-tests" in line
    assert gpu_check.missing(kernel_tests=False) == []


@pytest.mark.slow  # it collects the kernel tests in a pytest of its own
def test_the_plan_fits_the_budget_and_follows_the_cells(monkeypatch):
    phases = {phase.name: phase for phase in gpu_check.plan()}
    assert list(phases) == ["preflight", *gpu_check.CHECKS]
    assert sum(phase.seconds for phase in phases.values()) <= BUDGET_S
    assert phases["timing"].units.startswith("34 cells (6 skipped)")  # fla's training cells excluded
    tests = int(phases["kernel-tests"].units.split()[0])
    assert tests > 50  # the non-slow kernel tests, as pytest collects them
    monkeypatch.setattr(gpu_check, "TIMING", ("gpu-check", "full", []))  # the wide sweep does not fit
    assert sum(phase.seconds for phase in gpu_check.plan(kernel_tests=False)) > BUDGET_S


def test_the_plan_times_its_cells_with_the_one_cost_model():
    """The timing and LM phases are harness.running.estimate's sweeps of the two scenarios (one cost model), on the GPU named."""
    from harness.running.estimate import Estimator, gpu_roof
    from harness.scenarios.scenario import load_scenario

    phases = {phase.name: phase.seconds for phase in gpu_check.plan(kernel_tests=False, gpu="a100")}
    estimator = Estimator({"cuda": gpu_roof("a100")})
    assert phases["timing"] == estimator.sweep(load_scenario("gpu-check").cells()).seconds()
    lm = load_scenario(gpu_check.LM[0], preset=gpu_check.LM[1], overrides=gpu_check.LM[2]).cells()
    assert phases["lm"] == gpu_check.COSTS.data_s + estimator.sweep(lm).seconds()
    assert phases["timing"] > gpu_check.plan(kernel_tests=False, gpu="h100")[1].seconds  # a slower roof, longer cells


def test_dry_run_prints_the_plan():
    done = attnbench_here("gpu-check", "--dry-run", "--no-kernel-tests")
    assert done.returncode == 0, done.stderr
    assert "within the budget" in done.stdout and "timing" in done.stdout and "34 cells" in done.stdout


@needs_shared
def test_a_failed_kernel_test_stops_the_check(with_a_gpu, monkeypatch, tmp_path):
    ran = []
    monkeypatch.setattr(gpu_check, "collect_kernel_tests", lambda device="cpu": ["tests/test_kernels/test_a.py::test_b"])
    monkeypatch.setattr(gpu_check, "_kernel_tests", lambda out: Check("kernel-tests", "failed", detail="1 failed"))
    monkeypatch.setattr(gpu_check, "_run_scenario", lambda name, out, progress: ran.append(name))
    assert gpu_check.run_check(tmp_path, progress=False) == gpu_check.EXIT_FAILED
    assert ran == []
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [(c["name"], c["status"]) for c in summary["checks"]] == [
        ("kernel-tests", "failed"),
        ("timing", "skipped"),
        ("lm", "skipped"),
        ("report", "skipped"),
    ]
    assert summary["passed"] is False and summary["exit_code"] == 1
    assert summary["machine"]["versions"]["torch"] == torch.__version__
    assert [phase["name"] for phase in summary["plan"]] == ["preflight", *gpu_check.CHECKS]


@pytest.mark.slow  # 5 s: pytest imports every kernel module
def test_every_kernel_test_module_collects_as_on_a_gpu():
    """With ATTNBENCH_TEST_DEVICE=cuda (torch told it has a GPU: collecting runs no kernel) pytest collects every
    kernel test module, no error, and gpu-check's parser keeps node ids only (not the warnings that quote one).
    The first GPU run collected 3 of the 7 modules: ``slow_interpreted`` gave natively a mark pytest.param refuses."""
    tests = gpu_check.kernel_tests_dir()
    arguments = [str(tests), *gpu_check.PYTEST_ARGS, "--collect-only"]
    code = f"import sys, torch, pytest; torch.cuda.is_available = lambda: True; sys.exit(pytest.main({arguments!r}))"
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"} | {"ATTNBENCH_TEST_DEVICE": "cuda"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tests.parents[1])
    assert done.returncode == 0, done.stdout[-3000:]
    ids = [line for line in done.stdout.splitlines() if gpu_check.NODE_ID.match(line)]
    assert {node.split("::")[0].rsplit("/", 1)[-1] for node in ids} == {path.name for path in tests.glob("test_*.py")}


def test_a_kernel_test_module_that_does_not_collect_fails_the_check(with_a_gpu, monkeypatch, tmp_path):
    """pytest's collection error is the check's failure, with its error lines; nothing runs."""
    line = "ERROR tests/test_kernels/test_a.py - ValueError: pytest.param cannot add pytest.mark.usefixtures\n"
    error = subprocess.CompletedProcess([], 2, stdout=line, stderr="")
    monkeypatch.setattr(gpu_check.subprocess, "run", lambda *args, **kwargs: error)
    check = gpu_check._kernel_tests(tmp_path)
    assert check.status == "failed" and "exit code 2" in check.detail and "pytest.param cannot add" in check.detail
    assert list(tmp_path.iterdir()) == []


@needs_shared
def test_keep_going_runs_every_check_after_a_failed_kernel_test(with_a_gpu, monkeypatch, tmp_path):
    """``--keep-going`` (a GPU lent for minutes): the timing and LM checks run all the same; the exit code says it failed."""
    ran = []
    monkeypatch.setattr(gpu_check, "collect_kernel_tests", lambda device="cpu": ["tests/test_kernels/test_a.py::test_b"])
    monkeypatch.setattr(gpu_check, "_kernel_tests", lambda out: Check("kernel-tests", "failed", detail="1 failed"))
    monkeypatch.setattr(gpu_check, "_run_scenario", lambda name, out, progress: (ran.append(name), (Check(name, "passed"), None))[1])
    assert gpu_check.run_check(tmp_path, progress=False, keep_going=True) == gpu_check.EXIT_FAILED
    assert ran == ["timing", "lm"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [(c["name"], c["status"]) for c in summary["checks"]] == [
        ("kernel-tests", "failed"),
        ("timing", "passed"),
        ("lm", "passed"),
        ("report", "failed"),
    ]  # (no results file written here)


def _cell(variant, backend, mode, seq_len, median_s, status="ok"):
    axes = {"seq_len": seq_len, "batch": 4, "heads": 16, "d_key": 128, "dtype": "bfloat16"}
    return {
        "run_id": "r",
        "cell_id": f"{variant}-{backend}-{mode}-{seq_len}",
        "scenario": "gpu-check",
        "variant": variant,
        "backend": backend,
        "mode": mode,
        "status": status,
        "axes": axes,
        "metrics": {"median_s": median_s},
    }


def test_ratios_at_the_largest_sequence_length(tmp_path):
    path = tmp_path / "gpu-check.jsonl"
    writer = ResultsWriter(path)
    writer.write_run({"run_id": "r", "started_at": "now", "scenario": "gpu-check", "machine": {"machine_id": "m"}})
    for record in [
        _cell("softmax", "torch", "forward", 16384, 0.010),
        _cell("delta", "torch", "forward", 16384, 0.040),
        _cell("delta", "fla", "forward", 16384, 0.005),
        _cell("delta", "triton", "forward", 16384, 0.004),
        _cell("delta", "triton", "forward", 1024, 0.001),  # not the largest T
        _cell("delta", "triton", "train", 16384, 0.020),
        _cell("delta", "fla", "train", 16384, 0.0, status="error"),  # no ratio from a failed cell
    ]:
        writer.write_cell(record)
    found = gpu_check.ratios(path)
    assert found["seq_len"] == 16384
    forward, train = found["rows"]
    assert (forward["variant"], forward["mode"], forward["triton_median_s"]) == ("delta", "forward", 0.004)
    assert forward["triton/torch"] == 0.1 and forward["triton/fla"] == 0.8 and forward["triton/sdpa"] == 0.4
    assert train["mode"] == "train" and train["triton/torch"] is None and train["triton/fla"] is None


@pytest.mark.slow
@needs_shared
def test_the_checks_on_the_cpu_forms_of_its_scenarios(with_a_gpu, monkeypatch, tmp_path):
    """The whole check without the kernel tests, on its scenarios' CPU presets: results, report, summary."""
    monkeypatch.setattr(gpu_check, "TIMING", ("gpu-check", "ci", []))
    monkeypatch.setattr(gpu_check, "LM", ("quality/lm-wikitext", "ci", []))
    assert gpu_check.run_check(tmp_path, kernel_tests=False, progress=False) == gpu_check.EXIT_OK
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [(c["name"], c["status"]) for c in summary["checks"]] == [("kernel-tests", "skipped"), ("timing", "passed"), ("lm", "passed"), ("report", "passed")]
    assert "8 ok" in summary["checks"][1]["detail"] and "2 ok" in summary["checks"][2]["detail"]
    assert Path(summary["results"]["timing"]).parent == tmp_path
    assert (tmp_path / "report" / "index.html").is_file()
    assert summary["ratios"] == {"seq_len": 64, "rows": []}  # no triton cells on the CPU

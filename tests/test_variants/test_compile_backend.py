"""``backend='compile'`` (variants/compiled.py): every variant's PyTorch forms through torch.compile
compute the float64 reference's function (the parallel form forward and backward, a prefill then
the recurrent step); in the harness the compilation happens in the untimed warm-up and is recorded
as ``metrics.compile_s``, a recompilation after it and a compilation failure are cell errors, and
a scenario's ``backend_options`` reach the compiled cells (and their ids) only.

Compiling costs tens of seconds per form on 2 CPU cores: the tests that compile are ``slow``, one
per variant, each compiling one core's forms once and checking everything through them."""

from __future__ import annotations

import hashlib

import pandas as pd
import pytest
import torch
import torch._dynamo
from helpers import CONFIGS, assert_close, attnbench, build, config_id, make_inputs, to
from torch._dynamo.utils import counters

import variants
from harness.report import baseline_backend, build_report, prepare
from harness.report.header import runs_of
from harness.report.tables import backend_ratios
from harness.results import load
from harness.running import workloads
from harness.scenarios.cell import Cell
from harness.scenarios.scenario import ScenarioError, load_scenario
from variants.compiled import compiled_frames

#: The first configuration of every registered variant in tests/helpers.py.
ONE_PER_VARIANT = list({name: (name, params) for name, params in reversed(CONFIGS)}.values())[::-1]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from nothing (no compiled code of an earlier test is reused)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.parametrize("config", ONE_PER_VARIANT, ids=config_id)
def test_compiled_forms_match_the_float64_reference(config, seed):
    """float32 through torch.compile against the float64 reference: the parallel form's output and
    every gradient (inputs and parameters), then a prefill of 11 tokens and steps over the rest."""
    name, params = config
    core = variants.create(name, 6, backend="compile", **params)
    assert core.backend == "compile" and core.compile_options == {"mode": "default", "dynamic": None}
    reference = build(config, 6)
    inputs = make_inputs(reference, 2, 2, 19, 5, dtype=torch.float64, seed=seed)
    exact = to(inputs, torch.float64, requires_grad=True)
    expected = reference.reference(**exact)
    cotangent = torch.randn(expected.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    exact_parameters = [p for p in reference.parameters() if p.requires_grad]
    want = torch.autograd.grad((expected * cotangent).sum(), [*exact.values(), *exact_parameters], materialize_grads=True)

    low = to(inputs, torch.float32, requires_grad=True)
    out = core(**low)
    assert_close(out, expected, torch.float32, f"{name}[compile] parallel", seed)
    leaves = [*low.values(), *(p for p in core.parameters() if p.requires_grad)]
    got = torch.autograd.grad((out * cotangent.float()).sum(), leaves, materialize_grads=True)
    names = [*inputs, *(n for n, p in reference.named_parameters() if p.requires_grad)]
    for label, grad, target in zip(names, got, want, strict=True):
        assert target.abs().max() > 0, f"the reference's d/d{label} is zero: the check says nothing"
        assert_close(grad, target, torch.float32, f"{name}[compile] parallel d/d{label}", seed)

    with torch.no_grad():
        low = to(inputs, torch.float32)
        head, state = core.prefill(**variants.time_slice(low, 0, 11))
        tail, _ = core.step_loop(variants.time_slice(low, 11), state)
    assert_close(torch.cat([head, tail], 2), expected.detach(), torch.float32, f"{name}[compile] prefill then steps", seed)
    assert compiled_frames() > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["linear", "delta"])
def test_the_compiled_graph_does_not_grow_with_the_length(name, seed):
    """On the CPU backend 'compile' compiles one chunk's step and loops over the chunks in Python
    (``compiled.chunk_form``): 3 chunks or 10 (chunk 4, the last one partial), TorchDynamo captures
    the same frames and operations, and training through it matches the float64 reference."""
    captured = []
    for length in (9, 37):
        torch._dynamo.reset()
        counters.clear()
        core = variants.create(name, 4, backend="compile", chunk_size=4)
        inputs = make_inputs(core, 1, 2, length, 3, dtype=torch.float64, seed=seed)
        expected = core.reference(**to(inputs, torch.float64))
        low = to(inputs, torch.float32, requires_grad=True)
        out = core(**low)
        out.sum().backward()
        assert_close(out, expected, torch.float32, f"{name}[compile] T={length}", seed)
        exact = to(inputs, torch.float64, requires_grad=True)
        core.reference(**exact).sum().backward()
        assert_close(low["q"].grad, exact["q"].grad, torch.float32, f"{name}[compile] T={length} d/dq", seed)
        captured.append((compiled_frames(), counters["stats"]["calls_captured"]))
    assert captured[0][0] > 0 and captured[0] == captured[1], f"{name}: (frames, operations) captured at T = 9, 37: {captured}"


def _cells(tmp_path, text: str, **kwargs) -> list[Cell]:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return load_scenario(str(path), **kwargs).cells()


BASE = "variants: {linear: {}}\naxes: {seq_len: 32, batch: 1, heads: 2, d_key: 8}\n"


def test_backend_options_reach_the_compiled_cells_and_their_ids(tmp_path):
    plain = {c.backend: c for c in _cells(tmp_path, BASE + "backends: [torch, compile]\n")}
    tuned = {c.backend: c for c in _cells(tmp_path, BASE + "backends: [torch, compile]\nbackend_options: {mode: max-autotune, dynamic: false}\n")}
    assert tuned["compile"].backend_options == {"mode": "max-autotune", "dynamic": False}
    assert tuned["torch"].backend_options == {} and plain["compile"].backend_options == {}
    assert tuned["torch"].cell_id == plain["torch"].cell_id, "options of another backend changed a torch cell's id"
    assert tuned["compile"].cell_id != plain["compile"].cell_id, "a compile cell's id must say how it was compiled"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("backends: [torch, compile]\nbackend_options: {mode: fastest}\n", "backend_options.mode: backend 'compile': option mode must be one of default"),
        (
            "backends: [torch, compile]\nbackend_options: {fullgraph: true}\n",
            "backend_options.fullgraph: unknown option; backend options: sdpa (torch/compile), mode (compile), dynamic (compile)",
        ),
        ("backends: [torch, compile]\nbackend_options: {dynamic: maybe}\n", "option dynamic must be one of true, false or null"),
        (
            "backends: [torch, compile]\nreport: {baseline_backend: triton}\n",
            'report.baseline_backend: expected one of the scenario\'s backends (torch, compile), got "triton"',
        ),
        ("backends: [torch, jit]\n", 'expected backends among torch, triton, compile, fla, got "jit"'),
    ],
)
def test_scenario_errors_name_the_field(tmp_path, extra, message):
    with pytest.raises(ScenarioError) as info:
        _cells(tmp_path, BASE + extra)
    assert message in str(info.value), str(info.value)


def test_create_checks_the_compile_options():
    with pytest.raises(variants.VariantError, match="backend 'compile' takes the options mode, dynamic, got 'backend'"):
        variants.create("linear", 8, backend="compile", backend_options={"backend": "eager"})
    with pytest.raises(variants.VariantError, match="backend 'torch' takes no options, got mode"):
        variants.create("linear", 8, backend_options={"mode": "default"})


def _compile_cell(tmp_path, mode="forward") -> Cell:
    text = BASE + f"backends: [compile]\nmodes: [{mode}]\ndecode: {{new_tokens: 3}}\nmeasure: {{warmup: 1, repeats: 2, max_time_s: 0}}\n"
    return _cells(tmp_path, text)[0]


def _broken_backend(graph, example_inputs):
    raise RuntimeError("the compiler broke")


def test_a_compile_failure_is_a_cell_error(tmp_path, monkeypatch):
    """A backend compiler that raises (here a TorchDynamo backend of the test's) becomes a CellError naming it."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **options: real(fn, backend=_broken_backend, dynamic=options.get("dynamic")))
    with pytest.raises(workloads.CellError, match=r"torch.compile failed: BackendCompilerFailed: .*the compiler broke"):
        workloads.measure_cell(_compile_cell(tmp_path))


def test_a_recompilation_after_the_warm_up_is_a_cell_error(tmp_path, monkeypatch):
    """Anything compiled after the warm-up would have been timed: the cell is an error, not a number."""
    counts = iter(range(100))
    monkeypatch.setattr(workloads, "compiled_frames", lambda: next(counts))
    monkeypatch.setattr(torch, "compile", lambda fn, **options: fn)  # nothing to compile: the counter says it recompiled
    with pytest.raises(workloads.CellError, match=r"torch.compile compiled 1 frame\(s\) again after the warm-up"):
        workloads.measure_cell(_compile_cell(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["train", "decode"])
def test_a_compiled_cell_records_its_compile_time_and_times_no_compilation(tmp_path, mode):
    """Through the harness: compiled in the warm-up (metrics.compile_s), nothing compiled while timing
    (else the cell would be an error), the options recorded."""
    cell = _compile_cell(tmp_path, mode)
    before = compiled_frames()
    result = workloads.measure_cell(cell)
    assert result["status"] == "ok", result["error"]
    assert result["metrics"]["compile_s"] > 0 and result["metrics"]["backend_options"] == {}
    assert compiled_frames() > before


def test_the_reports_baseline_backend(tmp_path):
    """The run line's report.baseline_backend, else torch: the report reads results files only, so
    a run line of a file older than that field (commit 3601d8f) gets torch even while the scenario
    file it names says otherwise."""
    cells = pd.DataFrame({"backend": ["torch", "compile"]})
    assert baseline_backend([], cells) == "torch"
    assert baseline_backend([], cells.iloc[1:]) is None
    assert baseline_backend([{"started_at": "1", "report": {"baseline_backend": "compile"}}], cells) == "compile"
    path = tmp_path / "s.yaml"
    path.write_text(BASE + "backends: [torch, compile]\nreport: {baseline_backend: compile}\n")
    old = {"started_at": "2", "scenario_file": str(path), "scenario_sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "preset": None, "overrides": []}
    assert baseline_backend([old], cells) == "torch"
    assert baseline_backend([old, {"started_at": "3", "report": {"baseline_backend": "compile"}}], cells) == "compile"


@pytest.mark.slow
def test_the_report_divides_each_backend_by_the_baseline(tmp_path):
    """A run of torch, compile and fla through the command line, compile the scenario's baseline:
    the report's backend table holds torch's median over compile's per cell, fla's reason where it
    did not run, and the decode latency plot has a line per backend."""
    scenario = tmp_path / "b.yaml"
    scenario.write_text(
        "name: tiny-backends\nvariants: {linear: {}}\nbackends: [torch, compile, fla]\nreport: {baseline_backend: compile}\n"
        "axes: {seq_len: 16, batch: 1, heads: 2, d_key: 8}\nmodes: [decode]\ndecode: {new_tokens: 3}\n"
        "measure: {warmup: 1, repeats: 2, max_time_s: 0}\n"
    )
    done = attnbench("run", str(scenario), "--out", str(tmp_path / "out"), "--no-progress", env={"TRITON_INTERPRET": "0"})
    assert done.returncode == 0, done.stderr
    cells = prepare(load([tmp_path / "out"]))
    assert baseline_backend(runs_of(cells["file"].unique()), cells) == "compile", "the scenario's report.baseline_backend"
    ratios = backend_ratios(cells, "compile")
    eager = ratios[ratios["backend"] == "torch"]
    assert len(eager) == 1 and (eager["ratio"] == eager["metrics.median_s"] / eager["baseline_s"]).all()
    fla = ratios[ratios["backend"] == "fla"]
    assert len(fla) == 1 and (fla["status"] == "skipped").all() and fla["ratio"].isna().all()
    assert fla["error"].str.contains("TRITON_INTERPRET=1|attnbench\\[fla\\]").all(), list(fla["error"])
    page = build_report([tmp_path / "out"], tmp_path / "report").read_text()
    assert "Backends against compile" in page and "torch / compile" in page and "fla / compile" in page and "skipped" in page
    assert {"linear[torch]", "linear[compile]"} <= set(cells.loc[cells["status"] == "ok", "series"])
    assert (tmp_path / "report" / "plots" / "tiny-backends-decode-latency.png").is_file()

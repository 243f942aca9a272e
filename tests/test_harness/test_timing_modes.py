"""Timing modes (``measure.timing``) and per-cell profiles (``attnbench run --profile``), issue 32
items 2 and 3: checked where a scenario loads, timed and recorded on the CPU, refused clearly
where they cannot run (``cudagraph`` without CUDA), profiles written beside the results file."""

from __future__ import annotations

import json
import os
import stat
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import attnbench

from harness.measuring import profiling
from harness.measuring.measure import TimingError, clock_for, time_callable
from harness.report import build_report, prepare
from harness.results import ResultsWriter, load, read_records
from harness.results.compare import EXIT_INCOMPARABLE, compare
from harness.running import workloads
from harness.scenarios.scenario import ScenarioError, load_scenario


def _scenario(tmp_path, *, modes="[forward]", measure="", device="cpu", extra="") -> Path:
    path = tmp_path / "timing.yaml"
    path.write_text(
        "name: timing\nvariants: {linear: {}}\n"
        f"axes: {{seq_len: 16, batch: 1, heads: 2, d_key: 8, device: {device}}}\nmodes: {modes}\ndecode: {{new_tokens: 2}}\n"
        f"measure: {{warmup: 1, repeats: 2, target_rel_ci: null{', ' + measure if measure else ''}}}\n{extra}"
    )
    return path


def test_events_is_the_default_and_every_mode_loads_where_it_can_run(tmp_path):
    (cell,) = load_scenario(str(_scenario(tmp_path))).cells()
    assert cell.measure["timing"] == "events"
    for timing in ("profiler", "wall"):
        assert load_scenario(str(_scenario(tmp_path, measure=f"timing: {timing}"))).cells()[0].measure["timing"] == timing
    assert load_scenario(str(_scenario(tmp_path, measure="timing: cudagraph", device="cuda"))).cells()[0].measure["timing"] == "cudagraph"
    assert load_scenario(str(_scenario(tmp_path, modes="[decode]", measure="timing: wall"))).cells()[0].measure["timing"] == "wall"


@pytest.mark.parametrize(
    "measure, modes, device, extra, said",
    [
        ("timing: fast", "[forward]", "cpu", "", "measure.timing: expected 'events', 'cudagraph', 'profiler' or 'wall', got \"fast\""),
        ("timing: cudagraph", "[forward]", "cpu", "", "measure.timing: 'cudagraph' replays a CUDA graph and needs a CUDA device; axes.device has 'cpu'"),
        ("timing: cudagraph", "[forward]", "cuda", "", None),  # a variant's own axes put it on the CPU (below)
        ("timing: profiler", "[forward, decode]", "cpu", "", "measure.timing: 'profiler' times one call; decode cells (modes) time each step"),
        ("timing: cudagraph", "[decode]", "cuda", "", "measure.timing: 'cudagraph' times one call; decode cells"),
    ],
)
def test_a_timing_mode_that_cannot_run_is_refused_when_the_scenario_loads(tmp_path, measure, modes, device, extra, said):
    path = _scenario(tmp_path, modes=modes, measure=measure, device=device, extra=extra)
    if said is None:
        path.write_text(path.read_text().replace("linear: {}", "linear: {axes: {device: [cuda, cpu]}}"))
        said = "measure.timing: 'cudagraph' replays a CUDA graph and needs a CUDA device; axes.device has 'cpu'"
    with pytest.raises(ScenarioError) as raised:
        load_scenario(str(path))
    assert str(path) in str(raised.value) and said in str(raised.value), raised.value


def test_a_quality_scenario_keeps_the_default_timing():
    with pytest.raises(ScenarioError, match="measure.timing: a quality task times its own training"):
        load_scenario("quality/retrieval-capacity", preset="quick", overrides=["measure.timing=wall"])


def test_cudagraph_is_refused_on_the_cpu_when_the_cell_is_built():
    with pytest.raises(TimingError, match="'cudagraph' replays a CUDA graph and needs a CUDA device, not 'cpu'"):
        clock_for("cudagraph", "cpu", flush_l2=True)
    with pytest.raises(TimingError, match="expected one of events, cudagraph, profiler, wall, got 'fast'"):
        clock_for("fast", "cpu", flush_l2=True)


def test_a_cpu_cell_asked_for_cudagraph_is_refused_before_it_is_timed(tmp_path):
    """A cell that reaches a worker with ``cudagraph`` on the CPU (a results file's cells, a plugin
    scenario) raises TimingError, which the worker records as the cell's error."""
    (cell,) = load_scenario(str(_scenario(tmp_path))).cells()
    with pytest.raises(TimingError, match="'cudagraph' replays a CUDA graph"):
        workloads.measure_cell(cell.replace(measure={**cell.measure, "timing": "cudagraph"}))
    cell = cell.replace(mode="decode", axes={**cell.axes, "new_tokens": 2}, measure={**cell.measure, "timing": "profiler"})
    with pytest.raises(TimingError, match="'profiler' times one call; a decode cell times each step with events or wall"):
        workloads.measure_cell(cell)


def test_the_profiler_times_the_operators_and_wall_the_whole_call():
    """One call: 20 ms of host sleep and one small operator. ``wall`` and ``events`` (perf_counter on
    the CPU) see the sleep; ``profiler`` sees only the operators' self time."""
    x = torch.ones(64)

    def call():
        time.sleep(0.02)
        return x + 1

    for timing in ("events", "wall"):
        assert time_callable(call, warmup=0, repeats=2, timing=timing).median_s >= 0.02, timing
    profiled = time_callable(call, warmup=0, repeats=2, timing="profiler")
    assert 0 < profiled.median_s < 0.01, profiled.samples_s


@pytest.mark.parametrize("mode", ["forward", "train", "decode"])
def test_a_cell_records_its_timing_mode(tmp_path, mode):
    timing = "wall" if mode == "decode" else "profiler"
    (cell,) = load_scenario(str(_scenario(tmp_path, modes=f"[{mode}]", measure=f"timing: {timing}"))).cells()
    result = workloads.measure_cell(cell)
    assert result["status"] == "ok" and result["metrics"]["timing"] == timing and result["metrics"]["median_s"] > 0, result
    assert "profile" not in result["metrics"] and "trace" not in result, "profiled without --profile"


@pytest.mark.parametrize("mode", ["forward", "decode"])
def test_a_profiled_cell_returns_its_trace_and_top_operators(tmp_path, mode):
    (cell,) = load_scenario(str(_scenario(tmp_path, modes=f"[{mode}]"))).cells()
    result = workloads.measure_cell(profiling.request(cell, "torch", tmp_path / "timing-1.jsonl"))
    profile, trace = result["metrics"]["profile"], result["trace"]
    assert result["metrics"]["timing"] == "events" and profile["tool"] == "torch" and profile["sort_by"] == "self_cpu_time"
    assert trace["traceEvents"] and any(event.get("name", "").startswith("aten::") for event in trace["traceEvents"])
    top = profile["top"]
    assert 0 < len(top) <= profiling.TOP_OPERATORS and all(row["name"].startswith("aten::") and row["calls"] >= 1 for row in top)
    assert [row["self_s"] for row in top] == sorted((row["self_s"] for row in top), reverse=True)
    assert 0 < sum(row["share"] for row in top) <= 1 + 1e-9 and sum(row["self_s"] for row in top) <= profile["self_s"] * (1 + 1e-9)


def test_what_each_profile_tool_is_asked_and_why_a_cell_is_skipped(tmp_path, monkeypatch):
    results = tmp_path / "timing-1.jsonl"
    (cell,) = load_scenario(str(_scenario(tmp_path))).cells()
    assert profiling.request(cell, None, results) is cell
    assert profiling.request(cell, "torch", results).profile == {"tool": "torch"}
    monkeypatch.setattr(profiling.shutil, "which", lambda name: None)
    for tool in ("ncu", "nsys"):
        assert profiling.request(cell, tool, results).profile == {"tool": tool, "skipped": f"{tool} is not on PATH"}
        assert profiling.wrapper(profiling.request(cell, tool, results).profile) is None
    monkeypatch.setattr(profiling.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert "this cell runs on the CPU" in profiling.request(cell, "nsys", results).profile["skipped"]
    asked = profiling.request(cell.replace(axes=dict(cell.axes, device="cuda")), "nsys", results).profile
    assert asked["recorded"] == f"timing-1.profiles/{cell.cell_id}.nsys-rep"
    command = profiling.wrapper(asked)
    assert command[:2] == ["nsys", "profile"] and "--capture-range=cudaProfilerApi" in command and command[-1] == asked["report"]
    assert (tmp_path / "timing-1.profiles").is_dir(), "the tool's report goes beside the results file"
    assert profiling.wrapper(dict(asked, tool="ncu"))[:3] == ["ncu", "--profile-from-start", "off"]
    quality = cell.replace(mode="quality")
    assert profiling.request(quality, "torch", results).profile["skipped"].startswith("a quality cell")


@pytest.mark.slow
def test_profile_and_the_profiler_timing_through_the_command_line(tmp_path):
    """Done-when of issue 32 items 2 and 3: ``--profile`` leaves a trace with ``traceEvents`` per
    cell, named by its id beside the results file and recorded in it; ``measure.timing: profiler``
    runs on the CPU and is recorded; the report lists each profiled cell's top operators."""
    scenario = _scenario(tmp_path, modes="[forward, train]", measure="timing: profiler")
    done = attnbench("run", str(scenario), "--out", str(tmp_path / "out"), "--no-progress", "--profile", "--report", str(tmp_path / "report"))
    assert done.returncode == 0, done.stderr
    (path,) = (tmp_path / "out").glob("*.jsonl")
    cells = [record for record in read_records(path) if record["kind"] == "cell"]
    assert len(cells) == 2
    for record in cells:
        profile = record["metrics"]["profile"]
        assert record["metrics"]["timing"] == "profiler" and profile["trace"] == f"{path.stem}.profiles/{record['cell_id']}.json"
        assert json.loads((path.parent / profile["trace"]).read_text())["traceEvents"]
    page = (tmp_path / "report" / "index.html").read_text()
    assert "Profiles" in page and cells[0]["metrics"]["profile"]["top"][0]["name"] in page and ">profiler (operators&#39; self CPU time)<" in page


@pytest.mark.slow
def test_ncu_and_nsys_are_skipped_with_the_reason_where_they_are_not_installed(tmp_path):
    scenario = _scenario(tmp_path)
    bare = {"PATH": os.path.dirname(sys.executable)}  # python, but no ncu or nsys
    done = attnbench("run", str(scenario), "--out", str(tmp_path / "out"), "--no-progress", "--profile", "nsys", env=bare)
    assert done.returncode == 0 and "--profile nsys: skipped, nsys is not on PATH" in done.stderr, done.stderr
    (path,) = (tmp_path / "out").glob("*.jsonl")
    (record,) = [record for record in read_records(path) if record["kind"] == "cell"]
    assert record["status"] == "ok" and record["metrics"]["profile"] == {"tool": "nsys", "skipped": "nsys is not on PATH"}


@pytest.mark.slow
def test_a_wrapped_worker_measures_through_its_wrapper(tmp_path):
    """``Worker(wrapper=...)`` starts the worker under a command (as ``nsys profile ... -o REPORT``
    does): a stand-in tool that writes its report and runs the rest of its command line."""
    from harness.running.worker import Worker

    tool = tmp_path / "tool"
    tool.write_text('#!/bin/sh\necho wrapped > "$1"\nshift\nexec "$@"\n')
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    (cell,) = load_scenario(str(_scenario(tmp_path))).cells()
    worker = Worker(wrapper=[str(tool), str(tmp_path / "report")])
    try:
        result = worker.measure(cell, 120)
    finally:
        worker.close()
    assert result["status"] == "ok" and (tmp_path / "report").read_text() == "wrapped\n", result


def _results(path: Path, cells: list[dict]) -> str:
    """A results file of one run on machine m0 with these ok forward cells (``variant``, ``samples``, ``metrics`` added)."""
    writer = ResultsWriter(path)
    writer.write_run({"run_id": "r", "started_at": "2026-12-01T00:00:00+00:00", "scenario": "s", "machine": {"machine_id": "m0", "hostname": "h"}})
    for index, cell in enumerate(cells):
        samples = cell["samples"]
        writer.write_cell({
            "run_id": "r", "cell_id": f"c{index}", "scenario": "s", "variant": cell["variant"], "backend": "torch", "params": {},
            "axes": {"seq_len": 256, "device": "cpu"}, "mode": "forward", "target": "core", "status": "ok", "error": None,
            "machine_id": "m0", "started_at": f"2026-12-01T00:00:0{index}+00:00",
            "metrics": {"median_s": float(np.median(samples)), "samples_s": samples, "tokens_per_s": 256 / float(np.median(samples)),
                        **cell.get("metrics", {})},
        })  # fmt: skip
    writer.close()
    return str(path)


SAMPLES = [1e-3, 1.1e-3, 0.9e-3, 1.05e-3, 0.95e-3]


def test_compare_refuses_to_judge_two_timing_modes(tmp_path):
    """A cell of a file written before the modes is ``events``; against ``profiler`` it is not
    comparable (named in the note), and a comparison of nothing else exits 2."""
    old = _results(tmp_path / "old.jsonl", [{"variant": "linear", "samples": SAMPLES}])
    events = _results(tmp_path / "events.jsonl", [{"variant": "linear", "samples": SAMPLES, "metrics": {"timing": "events"}}])
    profiled = _results(tmp_path / "profiler.jsonl", [{"variant": "linear", "samples": SAMPLES, "metrics": {"timing": "profiler"}}])
    assert compare(old, events).table.iloc[0]["mark"] != "not comparable"
    result = compare(events, profiled)
    row = result.table.iloc[0]
    assert row["mark"] == "not comparable" and "timed differently: base measure.timing events, head profiler" in row["note"]
    assert result.exit_code == EXIT_INCOMPARABLE


def test_the_report_names_each_cells_timing_and_lists_the_profiled_operators(tmp_path):
    top = [{"name": "aten::bmm", "calls": 4, "self_s": 6e-4, "share": 0.6}, {"name": "aten::add", "calls": 2, "self_s": 4e-4, "share": 0.4}]
    profile = {"tool": "torch", "sort_by": "self_cpu_time", "self_s": 1e-3, "top": top, "trace": "s.profiles/c0.json"}
    path = _results(tmp_path / "s.jsonl", [
        {"variant": "linear", "samples": SAMPLES, "metrics": {"timing": "profiler", "profile": profile}},
        {"variant": "linear", "samples": SAMPLES, "metrics": {"timing": "wall"}},
        {"variant": "softmax", "samples": SAMPLES, "metrics": {"timing": "wall", "profile": {"tool": "nsys", "skipped": "nsys is not on PATH"}}},
    ])  # fmt: skip
    cells = prepare(load(path))
    assert sorted(cells["series"]) == ["linear (profiler)", "linear (wall)", "softmax (wall)"], "both modes of one cell are kept, labelled"
    page = build_report([path], tmp_path / "report").read_text()
    timed = page[page.index("Every timed cell") :]
    assert "<td>profiler</td>" in timed and "<td>wall</td>" in timed
    profiles = page[page.index("Profiles: top operators by self time") :]
    for shown in ("aten::bmm", "600 µs", "60.0%", "s.profiles/c0.json", "not profiled: nsys is not on PATH"):
        assert shown in profiles, shown

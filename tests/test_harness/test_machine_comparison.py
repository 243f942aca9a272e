"""Machines side by side (harness.report.machines) on results files of two machines written here: only cells
measured on the same terms enter a mean, the others are shown with their reason; every ratio has compare's
bootstrap interval and a verdict only where it excludes 1; rows by ratio; a headline per mode and variant; each
cell's roof fraction on its own machine and the sentence saying whether the machine or the code explains most."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from harness.report import prepare, render
from harness.report.header import machine_sections, runs_of
from harness.report.machines import geometric_mean, machine_pairs, side_by_side
from harness.results import load

AXES = {"seq_len": 256, "batch": 1, "heads": 2, "d_key": 32, "d_value": 32, "dtype": "float32", "device": "cpu"}
#: Machine B's calibrated roof is twice A's: a cell's roofline time on B is half its time on A.
ROOFLINE_S = {"a": 1e-4, "b": 0.5e-4}


def run_line(machine: str, *, threads: int = 2) -> dict:
    calibration = {"device": "cpu", "torch_threads": threads, "matmul_flops_per_s": {"float32": 1e11}, "bandwidth_bytes_per_s": 3e10}
    return {
        "kind": "run",
        "schema": 2,
        "run_id": f"run-{machine}",
        "started_at": "2026-12-06T05:00:00+00:00",
        "scenario": "s",
        "torch_threads": 1,
        "machine": {"machine_id": machine, "hostname": "vm", "cpu": {"model": f"CPU {machine.upper()}"}, "calibration": calibration},
    }


def samples(median_s: float, *, noise: float = 0.01, count: int = 30, seed: int = 0) -> list[float]:
    return list(median_s * (1 + noise * np.random.default_rng(seed).standard_normal(count)))


def cell(machine: str, variant: str, median_s: float, *, mode="forward", dtype="float32", threads=1, noise=0.01, seed=0, busy=0.5, **metrics) -> dict:
    """One ok timed cell of scenario 's' on ``machine``: its raw samples around ``median_s``, its roof fraction
    against the machine's ``ROOFLINE_S``; ``metrics`` (unstable, disturbed, samples_s, ...) override."""
    drawn = samples(median_s, noise=noise, seed=seed)
    return {
        "kind": "cell",
        "schema": 2,
        "run_id": f"run-{machine}",
        "cell_id": f"{variant}-{mode}-{dtype}",
        "scenario": "s",
        "variant": variant,
        "backend": "torch",
        "params": {},
        "axes": {**AXES, "dtype": dtype},
        "mode": mode,
        "target": "core",
        "status": "ok",
        "error": None,
        "machine_id": machine,
        "metrics": {
            "median_s": float(np.median(drawn)),
            "samples_s": drawn,
            "unstable": False,
            "timing": "events",
            "torch_threads": threads,
            "roofline_s": ROOFLINE_S[machine],
            "roofline_fraction": ROOFLINE_S[machine] / float(np.median(drawn)),
            "load": {"other_cores": busy, "cores": 2},
            **metrics,
        },
    }


def write(path: Path, machine: str, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in [run_line(machine), *records]))
    return path


def files(tmp_path: Path, a: list[dict], b: list[dict]) -> list[Path]:
    return [write(tmp_path / "a.jsonl", "a", a), write(tmp_path / "b.jsonl", "b", b)]


def pairs_of(tmp_path: Path, a: list[dict], b: list[dict]):
    """machine_pairs of the two files, indexed by (variant, mode)."""
    return machine_pairs(prepare(load(files(tmp_path, a, b)))).set_index(["label", "mode"], drop=False)


def test_a_cell_timed_on_other_terms_or_untrusted_is_shown_with_its_reason_and_left_out_of_every_mean(tmp_path):
    """The softmax cell ran on 2 threads on B against 1 on A (the issue's ratio of 191), linear is disturbed on B,
    delta unstable on A, performer timed by the profiler on B, lsh inaccurate on A, rwkv out of memory on B, based
    with one raw sample on A: each is shown with why; the mean is dpfp's ratio alone (about 2), not pulled by theirs."""
    a = [
        cell("a", "softmax", 0.3e-3),
        cell("a", "linear", 1e-3),
        cell("a", "delta", 1e-3, unstable=True),
        cell("a", "dpfp", 1e-3),
        cell("a", "performer", 1e-3),
        cell("a", "lsh", 1e-3, inaccurate=True),
        cell("a", "rwkv", 1e-3),
        cell("a", "based", 1e-3, samples_s=[1e-3]),
    ]
    b = [
        cell("b", "softmax", 59e-3, threads=2),
        cell("b", "linear", 9e-3, disturbed=True, unstable=True),
        cell("b", "delta", 1e-3),
        cell("b", "dpfp", 2e-3),
        cell("b", "performer", 1e-3, timing="profiler"),
        cell("b", "lsh", 1e-3),
        {**cell("b", "rwkv", 1e-3), "status": "oom", "metrics": {}},
        cell("b", "based", 1e-3),
    ]
    verdicts = pairs_of(tmp_path, a, b)["verdict"].droplevel("mode").to_dict()
    assert verdicts == {
        "softmax": "not compared: torch threads A 1, B 2",
        "linear": "not compared: B disturbed",
        "delta": "not compared: A unstable",
        "dpfp": "B slower",
        "performer": "not compared: timing A events, B profiler",
        "lsh": "not compared: A inaccurate",
        "rwkv": "not compared: B oom",
        "based": "not compared: A has 1 raw samples",
    }
    (section,) = side_by_side(prepare(load(files(tmp_path, a, b))))
    rows = {row[0]: row[1] for row in section.headline.rows}
    assert set(rows) == {"all variants", "dpfp"} and rows["all variants"].startswith("2.00") and rows["all variants"].endswith("1 of 8 cells"), rows
    assert (
        "Left out of every mean (7 cells; some for several reasons): 1 failed on one machine, 1 timed differently (measure.timing, "
        "metrics.clock), 1 timed on different torch threads, 2 unstable or disturbed, 1 inaccurate, 1 fewer than 2 raw samples. "
        "No comparable cell: based, delta, linear, lsh, performer, rwkv, softmax." in section.headline.caption
    ), section.headline.caption


def test_every_ratio_has_its_interval_and_a_verdict_only_where_the_interval_excludes_1(tmp_path):
    """B twice as slow with quiet samples: B slower, interval above 1; the same time with noisy samples: the
    interval spans 1, no verdict; colours (row classes) follow the verdict."""
    a = [cell("a", "linear", 1e-3), cell("a", "softmax", 1e-3, noise=0.3), cell("a", "dpfp", 1e-3)]
    b = [cell("b", "linear", 2e-3, seed=1), cell("b", "softmax", 1e-3, noise=0.3, seed=1), cell("b", "dpfp", 0.5e-3, seed=1)]
    pairs = pairs_of(tmp_path, a, b)
    slower, same, faster = (pairs.loc[(variant, "forward")] for variant in ("linear", "softmax", "dpfp"))
    assert 1 < slower["ci_low"] < slower["ratio"] < slower["ci_high"] and slower["verdict"] == "B slower"
    assert same["ci_low"] < 1 < same["ci_high"] and same["verdict"] == "no clear difference"
    assert faster["ci_high"] < 1 and faster["verdict"] == "B faster"
    (section,) = side_by_side(prepare(load(files(tmp_path, a, b))))
    interval = section.pairs.headers.index("95% interval")
    assert all(row[interval].startswith("[") for row in section.pairs.rows)
    assert section.pairs.row_classes == ["b-slower", "no-clear-difference", "b-faster"]


def test_rows_are_sorted_by_ratio_the_compared_ones_first(tmp_path):
    ratios = {"linear": 1.5, "softmax": 0.5, "dpfp": 3.0, "delta": 1.0}
    a = [cell("a", variant, 1e-3) for variant in ratios] + [cell("a", "rwkv", 1e-3)]
    b = [cell("b", variant, ratio * 1e-3, seed=1) for variant, ratio in ratios.items()] + [cell("b", "rwkv", 9e-3, threads=2)]
    (section,) = side_by_side(prepare(load(files(tmp_path, a, b))))
    assert [row[0] for row in section.pairs.rows] == ["dpfp", "linear", "delta", "softmax", "rwkv"]
    assert section.pairs.row_classes[-1] == "not-compared"


def test_the_headline_has_a_geometric_mean_with_its_interval_per_mode_and_per_variant(tmp_path):
    """forward: B twice and 1.5 times as slow (mean sqrt(3)); train: B as fast. Each mean's interval holds it;
    a variant's row has its own cells only."""
    a = [cell("a", "linear", 1e-3), cell("a", "softmax", 1e-3), cell("a", "linear", 1e-3, mode="train"), cell("a", "softmax", 1e-3, mode="train")]
    b = [
        cell("b", "linear", 2e-3, seed=1),
        cell("b", "softmax", 1.5e-3, seed=1),
        cell("b", "linear", 1e-3, mode="train", seed=1, noise=0.2),
        cell("b", "softmax", 1e-3, mode="train", seed=2, noise=0.2),
    ]
    cells = prepare(load(files(tmp_path, a, b)))
    pairs = machine_pairs(cells)
    forward = pairs[pairs["mode"] == "forward"]
    mean, low, high = geometric_mean(forward)
    assert mean == pytest.approx(np.sqrt(3), rel=0.02) and low < mean < high
    (section,) = side_by_side(cells)
    assert section.headline.headers == ["variant", "forward", "train"]
    rows = {row[0]: dict(zip(section.headline.headers[1:], row[1:])) for row in section.headline.rows}
    assert rows["all variants"]["forward"] == f"{mean:.3f} [{low:.3f}, {high:.3f}] B slower, 2 of 2 cells"
    assert "no clear difference, 2 of 2 cells" in rows["all variants"]["train"]
    assert rows["linear"]["forward"].startswith("2.0") and rows["linear"]["forward"].endswith("B slower, 1 of 1 cells")


def test_each_cells_roof_fraction_and_the_sentence_say_whether_the_machine_or_the_code_explains_most(tmp_path):
    """B's roof is twice A's. linear and softmax run twice as fast on B (same fraction: the machine); dpfp runs
    twice as slow on B (a quarter of A's fraction: the code)."""
    a = [cell("a", variant, 1e-3) for variant in ("linear", "softmax", "dpfp")]
    b = [cell("b", "linear", 0.5e-3), cell("b", "softmax", 0.5e-3), cell("b", "dpfp", 2e-3)]
    (section,) = side_by_side(prepare(load(files(tmp_path, a, b))))
    rows = {row[0]: dict(zip(section.pairs.headers, row)) for row in section.pairs.rows}
    assert (rows["linear"]["A roof fraction"], rows["linear"]["B roof fraction"]) == ("0.1", "0.1")
    assert (rows["dpfp"]["A roof fraction"], rows["dpfp"]["B roof fraction"]) == ("0.1", "0.025")
    assert rows["linear"]["B / A = machine × code"] == "0.500 × 1.000 (machine)" and rows["dpfp"]["B / A = machine × code"].endswith("(code)")
    assert section.machine_or_code.startswith(
        "Of 3 comparable cells with a roof on both machines, 2 differ mostly by the machine (B's roof is lower for 0, higher for 2; "
        "the roofs differ more than the fractions of them reached) and 1 mostly by the code (it reaches a smaller fraction of B's "
        "roof than of A's for 1, a larger one for 0): for most, the machine. Rule: "
    ), section.machine_or_code
    (tie,) = side_by_side(prepare(load(files(tmp_path, a[1:], b[1:]))))
    assert "for most, neither: as many each." in tie.machine_or_code


def test_the_machine_boxes_say_the_load_and_the_unstable_cells_of_each_machine_and_the_page_shows_the_section(tmp_path):
    a = [cell("a", "linear", 1e-3, busy=1.5, unstable=True), cell("a", "softmax", 1e-3, busy=1.9)]
    b = [cell("b", "linear", 2e-3, busy=0.2, seed=1), cell("b", "softmax", 2e-3, busy=0.4, seed=1, disturbed=True, unstable=True)]
    paths = files(tmp_path, a, b)
    cells = prepare(load(paths))
    boxes = {section.name: dict(section.facts) for section in machine_sections(cells, runs_of(paths))}
    assert boxes["vm (CPU A)"]["while measured"] == "2 timed cells; other processes kept 1.70 cores of 2 busy on average (at most 1.90); 1 unstable"
    assert boxes["vm (CPU B)"]["while measured"] == (
        "2 timed cells; other processes kept 0.30 cores of 2 busy on average (at most 0.40); 1 unstable (1 of them disturbed)"
    )
    assert "measured on 2 torch threads (a cell timed on fewer" in boxes["vm (CPU A)"]["calibrated peaks"]
    sections = side_by_side(cells)
    page = render(
        "report.html.j2",
        title="t",
        generated="now",
        files=[],
        summary=[],
        several_machines=True,
        machines=[],
        scenarios=[],
        side_by_side=sections,
        comparison=None,
    )
    assert "<h3>s: B = vm (CPU B) against A = vm (CPU A)</h3>" in page and "none of 2 cells comparable" in page
    assert "The machine or the code.</b> No comparable cell has a calibrated roof on both machines" in page
    assert '<tr class="not-compared"><td>linear</td>' in page and "not compared: A unstable" in page and "not compared: B disturbed" in page


def test_a_machine_with_several_runs_says_what_each_met(tmp_path):
    first = write(tmp_path / "a.jsonl", "a", [cell("a", "linear", 1e-3, busy=1.5, unstable=True)])
    later = [dict(record, run_id="run-a-later") for record in [run_line("a"), cell("a", "softmax", 1e-3, busy=0.1)]]
    second = tmp_path / "a-later.jsonl"
    second.write_text("".join(json.dumps(record) + "\n" for record in later))
    (section,) = machine_sections(prepare(load([first, second])), runs_of([first, second]))
    assert dict(section.facts)["while measured"] == (
        "run run-a (s): 1 timed cell; other processes kept 1.50 cores of 2 busy on average (at most 1.50); 1 unstable · "
        "run run-a-la (s): 1 timed cell; other processes kept 0.10 cores of 2 busy on average (at most 0.10); 0 unstable"
    )

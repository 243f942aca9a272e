"""compare end to end on real results written by the runner (in subprocesses).

The timed variant is fault_slow (tests/test_harness/fault_plugin.py): each call sleeps FAULT_SLOW_S
seconds, so its true time is known and stable, while the µs-scale compute of a real variant
on a shared 2-core machine can genuinely differ several-fold between two runs (contention
from other processes is a real change, not noise). softmax cells ride along to show that
cells copied unchanged stay "unchanged". A slower or failing head is made the way an
interrupted run is finished: a copy of the base results without one cell, completed by
``attnbench run --resume`` under a different FAULT_SLOW_S, so exactly that cell is
measured again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from harness.results import read_records
from harness.results.compare import EXIT_INCOMPARABLE, EXIT_OK, EXIT_REGRESSION, TABLE_COLUMNS, UNDECIDED, CompareError, compare

PLUGIN = str(Path(__file__).with_name("fault_plugin.py"))
SCENARIO = """
name: tiny-compare
variants: {fault_slow: {}, softmax: {}}
axes: {seq_len: [16, 32], batch: 1, heads: 2, d_key: 8}
modes: [forward]
measure: {warmup: 1, repeats: 15, timeout_s: 60, fresh_worker: false}
"""
BASE_SLEEP = "0.02"


def attnbench_run(*args: str, sleep: str, exit_code: int = 0) -> None:
    command = [sys.executable, "-m", "harness.cli", "run", *args, "--plugin", PLUGIN, "--no-progress"]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "FAULT_SLOW_S": sleep}, timeout=300)
    assert done.returncode == exit_code, done.stderr


def fresh_run(scenario: Path, out: Path, sleep: str) -> Path:
    attnbench_run(str(scenario), "--out", str(out), sleep=sleep)
    (path,) = out.glob("*.jsonl")
    return path


def rerun_one_cell(scenario: Path, base: Path, target: Path, seq_len: int, sleep: str, *extra: str, exit_code: int = 0) -> Path:
    """``base`` without its fault_slow cell at ``seq_len``, completed by ``--resume`` with FAULT_SLOW_S=``sleep``."""
    target.parent.mkdir(parents=True)
    lines = base.read_text().splitlines(keepends=True)
    dropped = [line for line in lines if '"variant": "fault_slow"' in line and f'"seq_len": {seq_len},' in line]
    assert len(dropped) == 1
    target.write_text("".join(line for line in lines if line not in dropped))
    attnbench_run(str(scenario), "--resume", str(target), *extra, sleep=sleep, exit_code=exit_code)
    return target


def as_other_machine(source: Path, target: Path) -> Path:
    """A copy of ``source`` whose run lines say it was measured on another machine with a GPU."""
    other = {"hostname": "gpu-box-b", "machine_id": "b0b0b0b0b0b0b0b0", "gpu": {"name": "Simulated GPU B"}}
    records = read_records(source)
    for record in records:
        if record["kind"] == "run":
            record["machine"] = {**record["machine"], **other}
    target.write_text("".join(json.dumps(record) + "\n" for record in records))
    return target


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """base and again: two fresh runs; slower: base with fault_slow at T=32 measured again at
    five times the sleep; failing: base with fault_slow at T=16 measured again with a FAULT_SLOW_S
    that makes it raise, plus the cells of a new seq_len 64."""
    root = tmp_path_factory.mktemp("compare")
    scenario = root / "scenario.yaml"
    scenario.write_text(textwrap.dedent(SCENARIO))
    with ThreadPoolExecutor(2) as pool:
        base, again = pool.map(lambda name: fresh_run(scenario, root / name, BASE_SLEEP), ["base", "again"])
        slower = pool.submit(rerun_one_cell, scenario, base, root / "slower" / "head.jsonl", 32, "0.1")
        failing = pool.submit(failing_with_new_cells, scenario, base, root / "failing")
        return {"base": base, "again": again, "slower": slower.result(), "failing": failing.result()}


def failing_with_new_cells(scenario: Path, base: Path, directory: Path) -> Path:
    """``directory`` holding ``base`` with fault_slow at T=16 measured again failing (FAULT_SLOW_S not a
    number) and a second file with the cells of a new seq_len 64 (a resume keeps its run's overrides)."""
    rerun_one_cell(scenario, base, directory / "head.jsonl", 16, "not-a-number", exit_code=1)
    attnbench_run(str(scenario), "--out", str(directory), "--set", "seq_len=[64]", sleep=BASE_SLEEP)
    return directory


def row(result, variant: str, seq_len: int) -> pd.Series:
    rows = result.table[(result.table["variant"] == variant) & result.table["axes"].str.startswith(f"T={seq_len} ")]
    assert len(rows) == 1, result.format_table()
    return rows.iloc[0]


@pytest.mark.slow
@pytest.mark.serial  # compares timings (the runs fixture)
def test_identical_inputs_are_not_flagged(runs):
    result = compare(runs["base"], runs["base"])
    assert list(result.table.columns) == TABLE_COLUMNS
    assert len(result.table) == 4 and set(result.table["mark"]) <= {"unchanged", UNDECIDED}, result.format_table()
    assert (result.table["ratio"] == 1.0).all()
    assert ((result.table["ci_low"] <= 1) & (result.table["ci_high"] >= 1)).all()
    assert result.regressions.empty and result.exit_code == EXIT_OK
    assert result.format_table().endswith("(factor 1.1, alpha 0.05); exit code 0")


@pytest.mark.slow
@pytest.mark.serial  # compares timings (the runs fixture)
def test_two_real_runs_are_matched_cell_by_cell(runs):
    """Only what holds on a loaded machine: two runs minutes apart may truly differ (a busy
    machine slows µs-scale cells several-fold), so no mark is asserted here; the marks
    themselves are tested on constructed samples (test_stability.py)."""
    result = compare(runs["base"], runs["again"])
    assert len(result.table) == 4 and not result.table["mark"].isin(("new", "removed", "not comparable")).any()
    assert ((result.table["ci_low"] <= result.table["ratio"]) & (result.table["ratio"] <= result.table["ci_high"])).all()


@pytest.mark.slow
@pytest.mark.serial  # compares timings (the runs fixture)
def test_a_cell_five_times_as_slow_is_worse(runs):
    """A sleep of 0.1 s against 0.02 s: a load that delays wake-ups by milliseconds cannot hide it."""
    result = compare(runs["base"], runs["slower"])
    slow = row(result, "fault_slow", 32)
    assert slow["mark"] == "worse" and 3 < slow["ratio"] < 6 and slow["ci_low"] > 2, result.format_table()
    assert result.table.iloc[0]["variant"] == "fault_slow", "the table is sorted by ratio, largest first"
    assert list(result.regressions.index) == [0]
    assert (result.table["ratio"].iloc[1:] == 1.0).all(), "the other cells are the base's own samples"
    assert result.exit_code == EXIT_REGRESSION
    reverse = compare(runs["slower"], runs["base"])
    assert row(reverse, "fault_slow", 32)["mark"] == "better" and reverse.exit_code == EXIT_OK


@pytest.mark.slow
@pytest.mark.serial  # compares timings (the runs fixture)
def test_a_cell_that_starts_failing_is_a_regression(runs):
    result = compare(runs["base"], runs["failing"])
    broken = row(result, "fault_slow", 16)
    assert broken["mark"] == "newly failing" and "head error" in broken["note"] and "ValueError" in broken["note"]
    assert pd.isna(broken["ratio"]) and pd.isna(broken["head_median_s"])
    assert row(result, "softmax", 64)["mark"] == "new" and row(result, "fault_slow", 64)["mark"] == "new"
    assert list(result.regressions["mark"]) == ["newly failing"] and result.exit_code == EXIT_REGRESSION
    reverse = compare(runs["failing"], runs["base"])
    assert row(reverse, "fault_slow", 16)["mark"] == "fixed" and row(reverse, "softmax", 64)["mark"] == "removed"
    assert reverse.exit_code == EXIT_OK


@pytest.mark.slow
@pytest.mark.serial  # compares timings (the runs fixture)
def test_different_machines_are_refused_unless_allowed(runs, tmp_path):
    other = as_other_machine(runs["base"], tmp_path / "other.jsonl")
    with pytest.raises(CompareError, match="different machines") as refused:
        compare(runs["base"], other)
    message = str(refused.value)
    assert "gpu-box-b" in message and "Simulated GPU B" in message and "attnbench report" in message
    result = compare(runs["base"], other, allow_different_machines=True)
    assert set(result.table["mark"]) == {"not comparable"}
    assert all("gpu-box-b (Simulated GPU B)" in note and "head on" in note for note in result.table["note"])
    assert result.exit_code == EXIT_INCOMPARABLE


@pytest.mark.slow
@pytest.mark.serial  # compares timings (the runs fixture)
def test_the_comparison_is_reproducible(runs):
    first, second = compare(runs["base"], runs["again"], seed=3), compare(runs["base"], runs["again"], seed=3)
    pd.testing.assert_frame_equal(first.table, second.table)


@pytest.mark.slow
@pytest.mark.serial  # compares timings (the runs fixture)
def test_bad_thresholds_are_refused(runs):
    with pytest.raises(CompareError, match="factor"):
        compare(runs["base"], runs["base"], factor=0.9)


def test_drift_between_rounds_widens_the_interval_instead_of_raising_a_false_alarm():
    """Identical code measured in rounds on a drifting machine: pooled samples look like a 1.3x
    slowdown with a tight interval, the two-stage (rounds, then samples) bootstrap does not."""
    from harness.results.compare import ratio_ci, timing_mark

    rng = np.random.default_rng(0)
    fast, slow = 1.0, 1.3
    base = [list(level + 1e-3 * rng.standard_normal(7)) for level in (fast, fast, slow)]
    head = [list(level + 1e-3 * rng.standard_normal(7)) for level in (slow, slow, fast)]
    pooled = ratio_ci(sum(base, []), sum(head, []), alpha=0.05, seed=1)
    assert timing_mark(*pooled[:3], factor=1.1) == "worse", pooled
    by_round = ratio_ci(base, head, alpha=0.05, seed=1)
    assert by_round[1] <= 1 <= by_round[2] and timing_mark(*by_round[:3], factor=1.1) != "worse", by_round


def test_a_real_slowdown_measured_in_rounds_is_still_worse():
    from harness.results.compare import ratio_ci, timing_mark

    rng = np.random.default_rng(1)
    base = [list(1.0 + 0.02 * rng.standard_normal(7)) for _ in range(3)]
    head = [list(2.0 + 0.04 * rng.standard_normal(7)) for _ in range(3)]
    assert timing_mark(*ratio_ci(base, head, alpha=0.05, seed=2)[:3], factor=1.1) == "worse"

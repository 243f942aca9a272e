"""The statistics of compare on constructed samples: one outlier cannot blind a comparison, and an
interval too wide to judge the factor says so. No real timing here, so no verdict depends on how
quiet the machine is."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import attnbench

from harness.results import ResultsWriter
from harness.results.compare import EXIT_OK, EXIT_REGRESSION, UNDECIDED, compare, ratio_ci, timing_mark

#: The smoke-cpu cell of the issue (softmax forward, T=256): one sample 8x the others.
OBSERVED_MS = [0.59, 0.54, 4.72, 0.61, 0.55]


def write_side(path, samples_by_variant: dict[str, list[float]], *, machine_id="m0") -> str:
    """A results file of one run with one ok forward cell per variant, of these samples."""
    writer = ResultsWriter(path)
    writer.write_run({"run_id": "r", "started_at": "2026-12-01T00:00:00+00:00", "scenario": "s", "machine": {"machine_id": machine_id, "hostname": "h"}})
    for variant, samples in samples_by_variant.items():
        writer.write_cell(
            {
                "run_id": "r",
                "cell_id": variant,
                "scenario": "s",
                "variant": variant,
                "backend": "torch",
                "params": {},
                "axes": {"seq_len": 256, "device": "cpu"},
                "mode": "forward",
                "target": "core",
                "status": "ok",
                "error": None,
                "machine_id": machine_id,
                "started_at": "2026-12-01T00:00:01+00:00",
                "metrics": {"median_s": float(np.median(samples)), "p20_s": 0.0, "p80_s": 0.0, "iqr_s": 0.0, "samples_s": samples},
            }
        )
    return str(path)


def test_the_three_times_slower_cell_with_an_outlier_is_worse_and_exits_1(tmp_path):
    base = [ms / 1e3 for ms in OBSERVED_MS]
    head = [3 * s for s in base]
    result = compare(write_side(tmp_path / "base.jsonl", {"softmax": base}), write_side(tmp_path / "head.jsonl", {"softmax": head}))
    row = result.table.iloc[0]
    assert row["mark"] == "worse" and abs(row["ratio"] - 3) < 1e-9 and 2 < row["ci_low"] < 3 < row["ci_high"] < 4, result.format_table()
    assert "2 severe outlier(s) left out" in row["note"]
    assert result.exit_code == EXIT_REGRESSION
    done = attnbench("compare", str(tmp_path / "base.jsonl"), str(tmp_path / "head.jsonl"))
    assert done.returncode == 1 and "worse" in done.stdout, done.stdout + done.stderr


def test_the_plain_bootstrap_of_the_median_is_what_the_outlier_blinded():
    """Without the outlier fences the interval of the same samples spans 1 (the issue's [0.374, 24.064])."""
    import harness.results.compare as statistics

    base = np.array(OBSERVED_MS)
    rng = np.random.default_rng(0)
    ratios = statistics._bootstrap_medians([3 * base], rng) / statistics._bootstrap_medians([base], rng)
    assert np.quantile(ratios, 0.025) < 1 < 3 < np.quantile(ratios, 0.975)


def test_outliers_are_the_severe_ones_only():
    from harness.results.compare import _without_outliers

    assert list(_without_outliers([1.0, 1.1, 0.9, 1.05, 9.0])) == [1.0, 1.1, 0.9, 1.05]
    spread = [1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.6]  # a long tail within 3 IQR stays
    assert list(_without_outliers(spread)) == spread


@pytest.mark.parametrize(
    ("ratio", "low", "high", "mark"),
    [
        (3.0, 2.7, 3.3, "worse"),
        (0.5, 0.45, 0.55, "better"),
        (1.02, 0.97, 1.06, "unchanged"),
        (1.05, 1.02, 1.08, "unchanged"),  # significant, but within the factor
        (1.3, 0.9, 1.8, UNDECIDED),  # beyond the factor, interval spans 1
        (1.0, 0.7, 1.4, UNDECIDED),  # no change measured, but a 1.4x change is not excluded
        (1.08, 1.01, 1.4, UNDECIDED),  # a real change of unknown size
    ],
)
def test_marks(ratio, low, high, mark):
    assert timing_mark(ratio, low, high, factor=1.1) == mark


def test_too_few_samples_instead_of_not_significant(tmp_path):
    """Three samples a side, 20 % apart at random: too few to judge a factor of 1.1, and the note says what to do."""
    rng = np.random.default_rng(3)
    base, head = list(1e-3 * (1 + 0.2 * rng.random(3))), list(1e-3 * (1 + 0.2 * rng.random(3)))
    result = compare(write_side(tmp_path / "b.jsonl", {"softmax": base}), write_side(tmp_path / "h.jsonl", {"softmax": head}))
    row = result.table.iloc[0]
    assert row["mark"] == UNDECIDED and "more samples" in row["note"] and result.exit_code == EXIT_OK, result.format_table()


def test_many_samples_decide_what_few_cannot():
    """The same noise (±10 % uniform), a true ratio of 1.0: 5 samples cannot tell, 200 can."""
    rng = np.random.default_rng(4)
    draw = lambda n: list(1 + 0.2 * rng.random(n))  # noqa: E731
    assert timing_mark(*ratio_ci(draw(5), draw(5), alpha=0.05, seed=0)[:3], factor=1.1) == UNDECIDED
    assert timing_mark(*ratio_ci(draw(200), draw(200), alpha=0.05, seed=0)[:3], factor=1.1) == "unchanged"


def test_rounds_of_different_lengths_are_resampled_in_two_stages():
    """Adaptive sampling gives rounds of different lengths; a drifting machine still widens the interval."""
    rng = np.random.default_rng(0)
    base = [list(level + 1e-3 * rng.standard_normal(n)) for level, n in ((1.0, 5), (1.0, 9), (1.3, 7))]
    head = [list(level + 1e-3 * rng.standard_normal(n)) for level, n in ((1.3, 6), (1.3, 5), (1.0, 12))]
    ratio, low, high, _ = ratio_ci(base, head, alpha=0.05, seed=1)
    assert low <= 1 <= high and timing_mark(ratio, low, high, factor=1.1) != "worse"
    slower = [[2 * s for s in r] for r in base]
    assert timing_mark(*ratio_ci(base, slower, alpha=0.05, seed=1)[:3], factor=1.1) == "worse"


# --- adaptive sampling and the load record ------------------------------------------------


def test_sampling_stops_at_the_minimum_when_the_median_is_sure():
    from harness.measuring.measure import sample_until_stable

    timing = sample_until_stable(lambda: 1.0, repeats=5, target_rel_ci=0.05, max_time_s=60)
    assert len(timing.samples_s) == 5 and timing.rel_ci == 0 and timing.unstable is False
    assert timing.summary()["unstable"] is False and timing.summary()["target_rel_ci"] == 0.05


def test_sampling_goes_on_until_the_median_is_sure():
    """Three samples far apart, then mostly 1.0 or 1.04 with an occasional 2.0: the median is sure once there are enough."""
    from itertools import chain

    from harness.measuring.measure import sample_until_stable

    rng = np.random.default_rng(0)
    values = chain([1.0, 2.0, 1.5], (float(rng.choice([1.0, 1.04, 2.0], p=[0.45, 0.4, 0.15])) for _ in range(1000)))
    timing = sample_until_stable(lambda: next(values), repeats=3, target_rel_ci=0.05, max_time_s=60)
    assert 3 < len(timing.samples_s) < 1000 and timing.rel_ci <= 0.05 and not timing.unstable


def test_sampling_that_never_settles_is_unstable():
    """Alternating 1 and 3: the median's interval never narrows; sampling stops at MAX_SAMPLES, or at once with no time left."""
    from harness.measuring.measure import MAX_SAMPLES, sample_until_stable

    values = iter(np.tile([1.0, 3.0], MAX_SAMPLES))
    timing = sample_until_stable(lambda: next(values), repeats=4, target_rel_ci=0.05, max_time_s=600)
    assert len(timing.samples_s) == MAX_SAMPLES and timing.unstable
    values = iter(np.tile([1.0, 3.0], 10))
    timing = sample_until_stable(lambda: next(values), repeats=4, target_rel_ci=0.05, max_time_s=0)
    assert len(timing.samples_s) == 4 and timing.unstable and timing.rel_ci > 0.05


def test_fixed_sampling_has_no_verdict():
    from harness.measuring.measure import sample_until_stable

    timing = sample_until_stable(lambda: 1.0, repeats=3)
    assert len(timing.samples_s) == 3 and timing.unstable is None and "unstable" not in timing.summary()


def test_other_processes_cpu_time_is_all_busy_time_minus_our_own(monkeypatch):
    import harness.measuring.busyness as load

    busy, own = iter([100.0, 103.5]), iter([10.0, 11.0])
    monkeypatch.setattr(load, "busy_cpu_s", lambda: next(busy))
    monkeypatch.setattr(load, "own_cpu_s", lambda: next(own))
    with load.LoadMeter() as meter:
        pass
    assert meter.record["other_cpu_s"] == pytest.approx(2.5)
    assert meter.record["other_cores"] == pytest.approx(2.5 / meter.record["wall_s"])
    assert len(meter.record["loadavg_before"]) == 3 and meter.record["cores"] >= 1


def burner():
    """A process that keeps one core busy until killed."""
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def test_a_busy_process_beside_is_seen():
    """While a CPU-bound process runs, other processes keep at least half a core busy, however loaded the machine already is."""
    import time

    from harness.measuring.busyness import LoadMeter

    process = burner()
    try:
        time.sleep(0.3)
        with LoadMeter() as meter:
            time.sleep(1.0)
    finally:
        process.kill()
        process.wait()
    assert meter.record["other_cores"] >= 0.5, meter.record


@pytest.mark.slow
def test_a_run_beside_a_busy_process_says_so(tmp_path):
    """The summary line of ``attnbench run`` names the unstable cells and the load; with a
    CPU-bound process beside it the load is at least half a core (the count of unstable cells
    depends on the machine and is not asserted); unstable: a wide interval, or disturbed."""
    import re

    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(
        "name: tiny\nvariants: {softmax: {}, linear: {}}\naxes: {seq_len: 32, batch: 1, heads: 2, d_key: 8}\n"
        "modes: [forward]\nmeasure: {warmup: 1, repeats: 3, max_time_s: 0.5}\n"
    )
    process = burner()
    try:
        done = attnbench("run", str(scenario), "--out", str(tmp_path / "out"), "--no-progress")
    finally:
        process.kill()
        process.wait()
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip().splitlines()[-1]
    found = re.fullmatch(r"tiny: (\d+) of 2 timed cells unstable.*; other processes used ([\d.]+) of (\d+) cores during the run", line)
    assert found and float(found[2]) >= 0.5, done.stdout
    from harness.results import load

    cells = load(tmp_path / "out")
    assert (cells["metrics.load.other_cores"] >= 0.5).all() and cells["metrics.unstable"].isin([True, False]).all()
    assert (((cells["metrics.rel_ci"] > 0.05) | cells["metrics.disturbed"].eq(True)) == cells["metrics.unstable"]).all()

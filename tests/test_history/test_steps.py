"""The step finder on constructed series: its false-positive rate (noise only, a single outlier, an
unstable point, noise on two levels) and its power (steps of 5, 10, 30 %, a regression fixed later),
measured with fixed seeds. docs/history.md quotes the table that ``pytest tests/test_history/test_steps.py
-q -s`` prints; ``python tests/test_history/test_steps.py 100 1000`` prints it for longer series."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from harness.history.steps import find_steps

NOISE = 0.03  #: each point's run-to-run scatter, in log time (about 3 %)
TRIALS = 50
LENGTHS = (10, 30)
KINDS = (
    "noise only",
    "single outlier +50 %",
    "unstable point +30 %",
    "two levels 10 % apart",
    "step +5 %",
    "step +10 %",
    "step +30 %",
    "step -25 %",
    "fixed later +20 %",
)


def series(kind: str, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Median times of ``n`` commits and their ``rel_ci`` (each point's own interval half the scatter; on two levels
    each commit on one of them at random, 1 % scatter about each, intervals of ±0.5 %)."""
    log_times = rng.normal(0.0, NOISE, n)
    rel_ci = np.full(n, 1.96 * NOISE / 2)
    if kind.startswith("two levels"):
        return np.exp(np.log(1.1) * rng.integers(0, 2, n) + rng.normal(0.0, 0.01, n)), np.full(n, 0.005)
    if kind.startswith("fixed later"):
        log_times[n // 3 : 2 * n // 3] += np.log(1.2)
    elif kind.startswith("step"):
        log_times[n // 2 :] += np.log1p(float(kind.split()[1]) / 100)
    elif kind.startswith("single outlier"):
        log_times[rng.integers(2, n - 2)] += np.log(1.5)
    elif kind.startswith("unstable"):
        point = rng.integers(0, n)
        log_times[point] += np.log(1.3)
        rel_ci[point] = 0.3
    return np.exp(log_times), rel_ci


def measure(lengths, trials: int = TRIALS) -> dict[tuple[str, int], float]:
    """The fraction of ``trials`` series of each kind and length where a step is found (seeded), printed as a table."""
    table = {}
    for kind in KINDS:
        for n in lengths:
            rng = np.random.default_rng([KINDS.index(kind), n])
            table[kind, n] = np.mean([bool(find_steps(*series(kind, n, rng))) for _ in range(trials)])
    print(f"\nseries with a step found, of {trials} per row (3 % scatter per point):")
    print(f"{'series':<24}" + "".join(f"{f'{n} commits':>12}" for n in lengths))
    for kind in KINDS:
        print(f"{kind:<24}" + "".join(f"{table[kind, n]:>12.1%}" for n in lengths))
    return table


@pytest.fixture(scope="module")
def rates() -> dict[tuple[str, int], float]:
    return measure(LENGTHS)


@pytest.mark.parametrize("kind", ["noise only", "single outlier +50 %", "unstable point +30 %"])
def test_false_positive_rate_is_low(rates, kind):
    assert all(rates[kind, n] <= 0.03 for n in LENGTHS)


def test_two_levels_are_noise_once_a_series_shows_both(rates):
    assert rates["two levels 10 % apart", 30] <= 0.07  # at 10 commits a run of one level is often as long as a level


def test_power(rates):
    assert rates["step +30 %", 10] == rates["step +30 %", 30] == rates["step -25 %", 10] == 1.0
    assert rates["step +10 %", 30] >= 0.95 and rates["step +10 %", 10] >= 0.6
    assert rates["fixed later +20 %", 30] >= 0.95
    assert rates["step +5 %", 30] > 0.1  # a small step needs long levels (test_history_scale.py)


def test_the_step_is_placed_at_its_commit():
    rng = np.random.default_rng(7)
    times, rel_ci = series("step +30 %", 12, rng)
    assert find_steps(times, rel_ci) == [6]
    assert find_steps(times[::-1], rel_ci) == [6]  # a step down as well


def test_short_and_flat_series_have_no_steps():
    assert find_steps([1.0, 2.0, 2.0]) == []  # too short: two levels of two points need four
    assert find_steps(np.ones(20)) == []


def test_an_unstable_point_weighs_little():
    """The same jump at one point: a step with a tight interval beside its neighbour, none when its interval is wide."""
    times = np.array([1.0, 1.01, 0.99, 1.0, 1.02, 1.3, 1.31, 1.0, 0.99, 1.01, 1.0, 1.0])
    assert find_steps(times, np.full(12, 0.01)) == [5, 7]
    wide = np.full(12, 0.01)
    wide[5:7] = 0.5
    assert find_steps(times, wide) == []


if __name__ == "__main__":
    measure([int(n) for n in sys.argv[1:]] or LENGTHS, trials=200)

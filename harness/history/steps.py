"""Steps, not noise: where a series of timings (one cell on one machine, in commit order) changes
level. A penalised piecewise-constant fit in log time, each point weighted by its spread, as asv's
step detection (its weighted L1 form, robust to outliers): the segmentation minimising

    sum over segments of  sum_i |log t_i - level| / s_i   +   penalty x (number of steps)

(each level the weighted median of its points), found exactly by optimal partitioning (dynamic
programming over the last step's position). A point's spread ``s_i`` is its own (the median's
relative interval, ``rel_ci``) and the series' run-to-run scatter (a robust estimate from
successive differences, at least ``FLOOR``) in quadrature, so a noisy series or an unstable point
does not make steps. A change of less than ``MIN_CHANGE`` is not a step. A level holds at least ``MIN_SIZE`` points, so a single outlier is never a
level of its own; a step at the newest commit is found once a second commit confirms it. The
measured false-positive rate and power are in docs/history.md (``tests/test_history/test_steps.py``
measures them). Needs numpy only.
"""

from __future__ import annotations

import math

import numpy as np

#: The least run-to-run scatter assumed, in log time (about 1 %): no two runs repeat better.
FLOOR = 0.01
#: The least points of a level: a single point away from its neighbours is an outlier, not a step.
MIN_SIZE = 2
#: The fewest points of a series in which a step can be found: a level on each side of it.
MIN_POINTS = 2 * MIN_SIZE
#: The penalty of one step, in units of log(n): BIC's log(n) for each of a step's two parameters (its place and its level),
#: and a margin for the scatter being estimated from the series itself (the rates it gives: docs/history.md).
PENALTY_PER_LOG_N = 2.5
#: The least change of level reported, in log time (about 2 %): below it a step is noise, however sure
#: the fit (asv's regression threshold does the same, at 5 %).
MIN_CHANGE = 0.02
#: A two-sided 95 % normal quantile: a ``rel_ci`` (95 % half-width) over it is a standard error.
Z95 = 1.959964


def scatter(log_times: np.ndarray) -> float:
    """The run-to-run scatter of a series in log time: the scaled median absolute successive
    difference (robust to a few steps and outliers), at least ``FLOOR``."""
    if log_times.size < 3:
        return FLOOR
    differences = np.abs(np.diff(log_times))
    return max(FLOOR, float(1.4826 * np.median(differences) / math.sqrt(2)))


def spreads(log_times: np.ndarray, rel_ci: np.ndarray) -> np.ndarray:
    """Each point's standard error in log time: its own (``rel_ci / Z95``; a missing one counts as
    none) and the series' ``scatter`` in quadrature."""
    own = np.nan_to_num(np.asarray(rel_ci, dtype=float), nan=0.0) / Z95
    return np.sqrt(own**2 + scatter(log_times) ** 2)


def segment_costs(values: np.ndarray, sigma: np.ndarray) -> np.ndarray:
    """``costs[s, e]``: the weighted absolute deviation of ``values[s:e]`` from its weighted median,
    sum |y_i - m| / sigma_i (the fit's cost of one level over those points); inf where e <= s. Each
    start's windows at once, in the order of its sorted values: O(n^2) memory a start, O(n^3) in all."""
    n = values.size
    costs = np.full((n + 1, n + 1), np.inf)
    weights = 1.0 / sigma
    for start in range(n):
        y, w = values[start:], weights[start:]
        order = np.argsort(y)
        sorted_y = y[order]
        inside = order[None, :] <= np.arange(y.size)[:, None]  # row r: the points start .. start + r, in sorted order
        sorted_w = np.where(inside, w[order], 0.0)
        cumulative = np.cumsum(sorted_w, axis=1)
        median = sorted_y[np.argmax(cumulative >= cumulative[:, -1:] / 2, axis=1)]
        costs[start, start + 1 :] = (sorted_w * np.abs(sorted_y - median[:, None])).sum(axis=1)
    return costs


def change_points(values, sigma, *, penalty: float | None = None, min_size: int = MIN_SIZE) -> list[int]:
    """The indexes where a new level starts (each > 0) of the piecewise-constant fit of ``values``
    (standard errors ``sigma``) that minimises ``segment_costs`` plus ``penalty`` per step (default
    ``PENALTY_PER_LOG_N * log n``), every segment of at least ``min_size`` points: optimal
    partitioning, exact, O(n^2) segments."""
    y, sigma = np.asarray(values, dtype=float), np.asarray(sigma, dtype=float)
    n = y.size
    if n < 2 * min_size:
        return []
    beta = PENALTY_PER_LOG_N * math.log(n) if penalty is None else penalty
    costs = segment_costs(y, sigma)
    best = np.full(n + 1, np.inf)
    best[0] = -beta
    last = np.zeros(n + 1, dtype=int)
    starts = np.array([0] + list(range(min_size, n + 1)))  # where a level may start
    for end in range(min_size, n + 1):
        tried = starts[starts <= end - min_size]
        totals = best[tried] + costs[tried, end] + beta
        pick = int(np.argmin(totals))
        best[end], last[end] = totals[pick], tried[pick]
    points, end = [], n
    while (end := int(last[end])) > 0:
        points.append(end)
    return sorted(points)


def weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    order = np.argsort(values)
    cumulative = np.cumsum(weights[order])
    return float(values[order][np.argmax(cumulative >= cumulative[-1] / 2)])


def large_enough(values, sigma, points: list[int], min_change: float = MIN_CHANGE) -> list[int]:
    """``points`` without the steps whose levels on either side (weighted medians) differ by less
    than ``min_change``, the smallest merged first, until every one left passes."""
    points = list(points)
    while points:
        edges = [0, *points, len(values)]
        levels = [weighted_median(values[a:b], 1 / sigma[a:b]) for a, b in zip(edges, edges[1:])]
        changes = np.abs(np.diff(levels))
        if changes.min() >= min_change:
            break
        points.pop(int(np.argmin(changes)))
    return points


def find_steps(times, rel_ci=None, **options) -> list[int]:
    """The indexes where a series of median ``times`` (in commit order, each with its ``rel_ci``)
    steps to a new level by ``MIN_CHANGE`` or more: ``change_points`` of log time with ``spreads``."""
    log_times = np.log(np.asarray(times, dtype=float))
    sigma = spreads(log_times, np.zeros_like(log_times) if rel_ci is None else rel_ci)
    return large_enough(log_times, sigma, change_points(log_times, sigma, **options))

"""Steps, not noise: where a series of timings (one cell on one machine, in commit order) changes
level. A penalised piecewise-constant fit in log time, each point weighted by its spread, as asv's
step detection (its weighted L1 form, robust to outliers): the segmentation minimising

    sum over segments of  sum_i |log t_i - level| / s_i   +   penalty x (number of steps)

(each level the weighted median of its points). It is found as asv finds it, in O(n): optimal
partitioning (a dynamic programme over the last step's position) with levels of at most ``LONGEST``
points, exact for shorter series, then neighbouring levels merged while a merge lowers the sum.

The noise model is what asv's penalty gets right and successive differences get wrong: a GPU's time
often sits on one of two levels (clock states), and a run of points on one of them is noise, not a
level. A point's spread ``s_i`` is its own (the median's relative interval, ``rel_ci``) and the
series' scatter in quadrature; the scatter is the spread of the residuals about the levels of a
first, lenient fit (``scatter``: their trimmed mean absolute deviation, at least ``FLOOR``), so points
alternating between two levels count as scatter. A step stands only when its two levels are
``separated`` (a point after it lies beyond a point before it, the step's way, in at least
``SEPARATION`` of the pairs: two-level noise mixes its levels on both sides) and differ by
``MIN_CHANGE`` or more. A level holds at least ``MIN_SIZE`` points, so a single outlier is never a level
of its own; a jump at the newest commit (``newest_jump``) is reported apart, unconfirmed. The measured
false-positive rate, power and times are in docs/history.md. Needs numpy only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

#: The least run-to-run scatter assumed, in log time (about 1 %): no two runs repeat better.
FLOOR = 0.01
#: The least points of a level: a single point away from its neighbours is an outlier, not a step.
MIN_SIZE = 2
#: The fewest points of a series in which a step can be found: a level on each side of it.
MIN_POINTS = 2 * MIN_SIZE
#: The penalty of one step, in units of log(n): BIC's log(n) for each of a step's two parameters (its place and its level),
#: and a margin for the scatter being estimated from the series itself (the rates it gives: docs/history.md).
PENALTY_PER_LOG_N = 2.5
#: The first fit's penalty, in units of log(n): lenient, so that the scatter is measured about the levels of any real step.
LENIENT_PER_LOG_N = 1.0
#: The least change of level reported, in log time (about 2 %): below it a step is noise, however sure
#: the fit (asv's regression threshold does the same, at 5 %).
MIN_CHANGE = 0.02
#: The least share of the (weighted) pairs of points across a step ordered its way: levels of mixed noise overlap more.
SEPARATION = 0.9
#: The same between two levels of ``LONG`` points or more: runs of one state of two-state noise are short, and two
#: long levels of the same noise never differ this much, while a step of 1.2 standard deviations passes it.
LONG_SEPARATION, LONG = 0.8, 20
#: The most points of a level in the exact fit; longer levels are merged from such pieces (asv's max_size is 20).
LONGEST = 20
#: A newest point this many standard errors (and ``MIN_CHANGE``) off the last level is an unconfirmed jump.
NEWEST_Z = 3.0
#: A two-sided 95 % normal quantile: a ``rel_ci`` (95 % half-width) over it is a standard error.
Z95 = 1.959964
#: The mean absolute deviation of the 90 % smallest of normal residuals, in standard deviations (``scatter``'s scale).
TRIMMED_MAD = 0.6575


def weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    order = np.argsort(values)
    cumulative = np.cumsum(weights[order])
    return float(values[order][np.argmax(cumulative >= cumulative[-1] / 2)])


def levels(values: np.ndarray, weights: np.ndarray, changes) -> np.ndarray:
    """Each point's level: the weighted median of the points between the ``changes`` around it."""
    edges = [0, *changes, values.size]
    return np.concatenate([np.full(b - a, weighted_median(values[a:b], weights[a:b])) for a, b in zip(edges, edges[1:])])


def scatter(log_times: np.ndarray, changes=()) -> float:
    """The run-to-run scatter of a series in log time: the mean absolute residual about the (unweighted) levels
    between ``changes``, its largest tenth left out (one outlier does not count), as a standard deviation; at least ``FLOOR``.
    Residuals of points on two levels are as large as half their distance, so such noise is scatter, not steps."""
    if log_times.size < 3:
        return FLOOR
    residuals = np.sort(np.abs(log_times - levels(log_times, np.ones_like(log_times), changes)))
    kept = residuals[: max(1, int(math.ceil(0.9 * residuals.size)))]
    return max(FLOOR, float(kept.mean() / TRIMMED_MAD))


def spreads(log_times: np.ndarray, rel_ci, changes=()) -> np.ndarray:
    """Each point's standard error in log time: its own (``rel_ci / Z95``; a missing one counts as
    none) and the series' ``scatter`` about the levels between ``changes`` in quadrature."""
    own = np.nan_to_num(np.asarray(rel_ci, dtype=float), nan=0.0) / Z95
    return np.sqrt(own**2 + scatter(log_times, changes) ** 2)


def piece_costs(values: np.ndarray, weights: np.ndarray, longest: int) -> np.ndarray:
    """``costs[s, k]``: the weighted absolute deviation of ``values[s : s + k + 1]`` from its weighted median,
    sum w_i |y_i - m| (the fit's cost of one level over those points), for ``k < longest``; inf past the end.
    Starts in blocks, so memory stays flat: O(n longest^2) operations."""
    n, m = values.size, min(longest, values.size)
    y = sliding_window_view(np.concatenate([values, np.zeros(m - 1)]), m)
    w = sliding_window_view(np.concatenate([weights, np.zeros(m - 1)]), m)
    costs = np.empty((n, m))
    for first in range(0, n, 4096 // m + 1):
        block = slice(first, first + 4096 // m + 1)
        order = np.argsort(y[block], axis=1, kind="stable")
        sorted_y, sorted_w = np.take_along_axis(y[block], order, 1), np.take_along_axis(w[block], order, 1)
        inside = order[:, None, :] <= np.arange(m)[None, :, None]  # [start, length - 1, sorted place]
        weight = np.where(inside, sorted_w[:, None, :], 0.0)
        cumulative = np.cumsum(weight, axis=2)
        median = np.take_along_axis(sorted_y, np.argmax(cumulative >= cumulative[:, :, -1:] / 2, axis=2), 1)
        costs[block] = (weight * np.abs(sorted_y[:, None, :] - median[:, :, None])).sum(axis=2)
    costs[np.arange(n)[:, None] + np.arange(m)[None, :] >= n] = np.inf
    return costs


def cost(values: np.ndarray, weights: np.ndarray) -> float:
    """One level's cost: sum w_i |y_i - m| about the weighted median m."""
    return float(np.sum(weights * np.abs(values - weighted_median(values, weights))))


def merged(values: np.ndarray, weights: np.ndarray, points: list[int], penalty: float) -> list[int]:
    """``points`` less the steps whose removal costs less than ``penalty`` (the cheapest first): the pieces of
    the fit joined into the levels they belong to."""
    edges = [0, *points, values.size]
    own = [cost(values[a:b], weights[a:b]) for a, b in zip(edges, edges[1:])]
    joined = [cost(values[a:c], weights[a:c]) for a, c in zip(edges, edges[2:])]
    while joined:
        pick = int(np.argmin(np.subtract(joined, np.add(own[:-1], own[1:]))))
        if joined[pick] - own[pick] - own[pick + 1] >= penalty:
            break
        del edges[pick + 1]
        own[pick : pick + 2] = [joined[pick]]
        del joined[pick]
        for at in (pick - 1, pick):  # the new level with each neighbour
            if 0 <= at < len(joined):
                joined[at] = cost(values[edges[at] : edges[at + 2]], weights[edges[at] : edges[at + 2]])
    return edges[1:-1]


def placed(values: np.ndarray, weights: np.ndarray, points: list[int], reach: int, min_size: int) -> list[int]:
    """Each of ``points`` moved (by at most ``reach``) to where one step between its neighbours costs least: the
    merged pieces' edges are the best within pieces, not always across the merged levels."""
    edges = [0, *points, values.size]
    for i in range(1, len(edges) - 1):
        a, b = edges[i - 1], edges[i + 1]
        tried = range(max(a + min_size, edges[i] - reach), min(b - min_size, edges[i] + reach) + 1)
        edges[i] = min(tried, key=lambda k: cost(values[a:k], weights[a:k]) + cost(values[k:b], weights[k:b]))
    return edges[1:-1]


def change_points(values, sigma, *, penalty: float | None = None, min_size: int = MIN_SIZE, longest: int = LONGEST) -> list[int]:
    """The indexes where a new level starts (each > 0) of the piecewise-constant fit of ``values`` (standard
    errors ``sigma``) that minimises the weighted L1 cost plus ``penalty`` per step (default ``PENALTY_PER_LOG_N
    * log n``), every level of at least ``min_size`` points: optimal partitioning over levels of at most
    ``longest`` points (exact for a series that long), then ``merged`` and ``placed``."""
    y, weights = np.asarray(values, dtype=float), 1 / np.asarray(sigma, dtype=float)
    n = y.size
    if n < 2 * min_size:
        return []
    beta = PENALTY_PER_LOG_N * math.log(n) if penalty is None else penalty
    costs = piece_costs(y, weights, longest)
    m = costs.shape[1]
    ends = np.arange(n + 1)[:, None]
    starts = ends - np.arange(1, m + 1)[None, :]  # [end, length - 1]
    # the cost of a level ending at each end, by its length; inf where it would be too short or leave one too short before it
    ending = np.where((starts >= 0) & (np.arange(1, m + 1) >= min_size) & ((starts == 0) | (starts >= min_size)), costs[starts.clip(0), np.arange(m)], np.inf)
    best = np.full(m + n + 1, np.inf)  # best[m + s]: the least cost of the points before s
    best[m] = -beta
    last = np.zeros(n + 1, dtype=int)
    for end in range(min_size, n + 1):
        totals = best[end - 1 + m : end - 1 : -1] + ending[end]  # starts end - 1, end - 2, ..., end - m
        pick = int(np.argmin(totals))
        best[m + end], last[end] = totals[pick] + beta, end - 1 - pick
    points, end = [], n
    while (end := int(last[end])) > 0:
        points.append(end)
    if n <= longest:  # one piece could hold the series: the partition is exact
        return sorted(points)
    return placed(y, weights, merged(y, weights, sorted(points), beta), longest, min_size)


def separation(before: np.ndarray, before_w: np.ndarray, after: np.ndarray, after_w: np.ndarray) -> float:
    """The weighted share of the pairs (a point before, a point after) ordered the way of the step between the two
    levels' weighted medians: 1 when the levels do not overlap, about 0.5 for two samples of the same noise."""
    order = np.argsort(after)
    above = after_w[order].sum() - np.concatenate([[0.0], np.cumsum(after_w[order])])[np.searchsorted(after[order], before, side="right")]
    share = float(np.sum(before_w * above) / (before_w.sum() * after_w.sum()))  # pairs with the point after higher
    slower = weighted_median(after, after_w) > weighted_median(before, before_w)
    return share if slower else 1 - share


def pruned(values: np.ndarray, weights: np.ndarray, points: list[int]) -> list[int]:
    """``points`` without the steps whose levels (weighted medians) differ by less than ``MIN_CHANGE`` or are not
    ``separated`` by ``SEPARATION`` (``LONG_SEPARATION`` between long levels), the smallest change merged first, until
    every one left passes."""
    points = list(points)
    while points:
        edges = [0, *points, values.size]
        parts = [(values[a:b], weights[a:b]) for a, b in zip(edges, edges[1:])]
        changes = np.abs(np.diff([weighted_median(*part) for part in parts]))
        failing = [
            change < MIN_CHANGE or separation(*before, *after) < (LONG_SEPARATION if min(before[0].size, after[0].size) >= LONG else SEPARATION)
            for change, before, after in zip(changes, parts, parts[1:])
        ]
        if not any(failing):
            break
        points.pop(min((i for i, fails in enumerate(failing) if fails), key=lambda i: changes[i]))
    return points


@dataclass(frozen=True)
class Fit:
    """A series' fit: its log times, each point's standard error, where its levels change, whether its newest point jumped."""

    log_times: np.ndarray
    sigma: np.ndarray
    changes: list[int]
    newest: bool  #: the newest point lies off the last level (``newest_jump``): a step not yet confirmed


def newest_jump(log_times: np.ndarray, sigma: np.ndarray, changes: list[int]) -> bool:
    """Whether the newest point lies ``NEWEST_Z`` standard errors and ``MIN_CHANGE`` off the last level (of at least
    ``MIN_SIZE`` points before it): a step at the newest commit, which the next commit confirms or not."""
    start = changes[-1] if changes else 0
    if log_times.size - 1 - start < MIN_SIZE:
        return False
    jump = abs(log_times[-1] - weighted_median(log_times[start:-1], 1 / sigma[start:-1]))
    return bool(jump >= MIN_CHANGE and jump >= NEWEST_Z * sigma[-1])


def fit(times, rel_ci=None) -> Fit:
    """The fit of a series of median ``times`` (in commit order, each with its ``rel_ci``): a lenient fit with the
    scatter about the series' median, then the scatter about its levels, then ``change_points`` with it, ``pruned``."""
    log_times = np.log(np.asarray(times, dtype=float))
    own = np.zeros_like(log_times) if rel_ci is None else np.asarray(rel_ci, dtype=float)
    first = spreads(log_times, own)
    lenient = pruned(log_times, 1 / first, change_points(log_times, first, penalty=LENIENT_PER_LOG_N * math.log(max(log_times.size, 2))))
    sigma = spreads(log_times, own, lenient)
    changes = pruned(log_times, 1 / sigma, change_points(log_times, sigma))
    return Fit(log_times, sigma, changes, newest_jump(log_times, sigma, changes))


def find_steps(times, rel_ci=None) -> list[int]:
    """The indexes where a series of median ``times`` (in commit order, each with its ``rel_ci``) steps to a
    new level (``fit``'s changes)."""
    return fit(times, rel_ci).changes

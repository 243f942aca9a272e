"""The steps of a history: where each series (a cell on one machine) changes level (``steps.fit``), and
a jump at its newest commit, unconfirmed until the next commit; the ratio of the two levels (weighted
medians) with a bootstrap interval over the points of each side, so that one outlier beside a step
moves neither; the commands that confirm and narrow each step, ``steps.csv`` and the exit code of
``attnbench history``."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

import numpy as np
import pandas as pd
from tqdm import tqdm

from ..common.files import write_csv_atomic
from ..common.formatting import present
from ..results.compare import timing_mark
from .series import NO_COMMIT, History
from .steps import Fit, fit, weighted_median

EXIT_OK = 0  #: no slower step beyond the factor
EXIT_SLOWER = 1  #: a slower step beyond the factor (after --since)
EXIT_BAD_INPUT = 2
#: The columns of steps.csv, one row a step.
CSV_COLUMNS = ["machine_id", "scenario", "variant", "backend", "mode", "cell", "good_commit", "bad_commit", "ratio", "direction", "status"]
#: Bootstrap draws of each level.
DRAWS = 1000


@dataclass(frozen=True)
class Step:
    """One change of level of one series: the last commit before it and the first after."""

    machine_id: str
    machine: str
    scenario: str
    variant: str
    backend: str
    mode: str
    cell: str  #: target, parameters and axes
    good_commit: str
    bad_commit: str
    position: int  #: the first-after commit's place in the history
    between: int | None  #: commits of the first-parent history strictly between the two (None: not known)
    ratio: float  #: level after / level before
    ci_low: float
    ci_high: float
    commands: tuple[str, ...]
    confirmed: bool = True  #: False: a jump at the newest commit, one point after it

    @property
    def direction(self) -> str:
        return "slower" if self.ratio > 1 else "faster"

    @property
    def status(self) -> str:
        return "confirmed" if self.confirmed else "unconfirmed"


def cell_text(record) -> str:
    """What a step's ``cell`` column says: target, parameters and axes (``identity``'s texts)."""
    return " ".join(filter(None, [record["target"], record["params_text"], record["axes_text"]]))


def level_draws(values: np.ndarray, sigma: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``DRAWS`` bootstrap draws of one level (log time): the weighted median (weights 1 / ``sigma``) of its points
    drawn with replacement; a level of one point (an unconfirmed jump) drawn from its standard error."""
    if values.size == 1:
        return values[0] + rng.normal(0.0, sigma[0], DRAWS)
    draws = []
    for chunk in np.array_split(np.arange(DRAWS), max(1, DRAWS * values.size // 1_000_000)):  # memory stays flat
        picks = rng.integers(0, values.size, (chunk.size, values.size))
        order = np.argsort(values[picks], axis=1)
        cumulative = np.cumsum(np.take_along_axis(1 / sigma[picks], order, 1), axis=1)
        middle = np.argmax(cumulative >= cumulative[:, -1:] / 2, axis=1)
        draws.append(values[np.take_along_axis(picks, np.take_along_axis(order, middle[:, None], 1), 1)[:, 0]])
    return np.concatenate(draws)


def level_ratio(series: Fit, before: slice, after: slice, *, alpha: float, seed) -> tuple[float, float, float]:
    """The ratio of the levels after and before a step (their weighted medians) and its percentile bootstrap
    interval at 1 - ``alpha`` (``level_draws``)."""
    y, sigma, rng = series.log_times, series.sigma, np.random.default_rng(seed)
    change = weighted_median(y[after], 1 / sigma[after]) - weighted_median(y[before], 1 / sigma[before])
    draws = level_draws(y[after], sigma[after], rng) - level_draws(y[before], sigma[before], rng)
    low, high = np.quantile(draws, [alpha / 2, 1 - alpha / 2])
    return float(np.exp(change)), float(np.exp(low)), float(np.exp(high))


def commands(run: dict, good: str, bad: str, between: int | None) -> tuple[str, ...]:
    """``attnbench regress`` on the two commits with the scenario of ``run`` (its preset and ``--set``s),
    and ``attnbench bisect`` between them when more than one commit may have made the step."""
    if good.startswith(NO_COMMIT) or bad.startswith(NO_COMMIT):
        return ()
    scenario = [run["scenario"]] + (["--preset", run["preset"]] if present(run.get("preset")) else [])
    scenario += [part for override in run.get("overrides") or [] for part in ("--set", override)]
    found = [shlex.join(["attnbench", "regress", "--base", good[:12], "--head", bad[:12], *scenario, "--all-variants"])]
    if between is None or between > 0:
        found.append(shlex.join(["attnbench", "bisect", "--good", good[:12], "--bad", bad[:12], *scenario, "--all-variants"]))
    return tuple(found)


def find(history: History, *, alpha: float = 0.05) -> list[Step]:
    """Every step of every series of ``history`` (an unconfirmed one where its newest point jumped), in commit order."""
    runs = {run["run_id"]: run for run in history.runs}
    found = []
    for key, points in tqdm(history.series(), desc="history: steps", unit="series", delay=1, disable=None):
        series = fit(points["metrics.median_s"].to_numpy(float), points["rel_ci"].to_numpy(float))
        edges = [0, *series.changes, len(points)]
        spans = list(zip(edges, edges[1:], edges[2:])) + ([(edges[-2], len(points) - 1, len(points))] if series.newest else [])
        for before, at, after in spans:
            good, bad = points.iloc[at - 1], points.iloc[at]
            ratio, low, high = level_ratio(series, slice(before, at), slice(at, after), alpha=alpha, seed=[0, at])
            known = history.commits.iloc[[good["position"], bad["position"]]]["in_repo"].all()
            between = int(bad["position"] - good["position"] - 1) if known else None
            found.append(Step(
                machine_id=str(key["machine_key"]), machine=bad["machine"], scenario=key["scenario"], variant=key["variant"],
                backend=key["backend"], mode=key["mode"], cell=cell_text(bad),
                good_commit=good["commit"], bad_commit=bad["commit"], position=int(bad["position"]), between=between,
                ratio=ratio, ci_low=low, ci_high=high, commands=commands(runs.get(bad["run_id"], {}), good["commit"], bad["commit"], between),
                confirmed=after - at > 1,
            ))  # fmt: skip
    return sorted(found, key=lambda step: (step.position, step.scenario, step.variant, step.machine_id))


def alarming(steps: list[Step], factor: float, *, unconfirmed: bool = False) -> list[Step]:
    """The confirmed slower steps beyond ``factor`` whose interval lies above 1 (and the unconfirmed ones, with
    ``unconfirmed``): those that fail ``attnbench history``."""
    return [step for step in steps if mark(step, factor) == "worse" and (step.confirmed or unconfirmed)]


def mark(step: Step, factor: float) -> str:
    """The report's row mark of a step: compare's verdict (``timing_mark``) where it is worse or better, else none."""
    verdict = timing_mark(step.ratio, step.ci_low, step.ci_high, factor)
    return verdict if verdict in ("worse", "better") else ""


def write_csv(steps: list[Step], path) -> None:
    """``steps.csv``: ``CSV_COLUMNS``, then the interval and the commands, one row a step (``write_csv_atomic``: safe in a spreadsheet)."""
    rows = [
        {
            **{column: getattr(step, column) for column in CSV_COLUMNS},
            "ci_low": step.ci_low,
            "ci_high": step.ci_high,
            "commits_between": step.between,
            "commands": " ; ".join(step.commands),
        }
        for step in steps
    ]
    columns = CSV_COLUMNS + ["ci_low", "ci_high", "commits_between", "commands"]
    write_csv_atomic(path, pd.DataFrame(rows, columns=columns))

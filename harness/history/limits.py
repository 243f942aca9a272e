"""What a history cannot see, said rather than left unsaid: the series too short for a step (fewer than
``steps.MIN_POINTS`` points: a level of two on each side of a step) and the unstable series, a point of
which has its whole interval more than ``--factor`` off its level with no step to explain it (a machine
whose runs differ, or a step too new to be confirmed). docs/history.md states the rule and its measured
false-flag rate."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..common.formatting import counted, percent
from .changes import Step, cell_text
from .series import History
from .steps import MIN_POINTS, MIN_SIZE, spreads, weighted_median


def off_level(times, rel_ci, changes: list[int], factor: float) -> np.ndarray:
    """Each point's median over its level (the weighted median of the points between the ``changes``, as
    ``steps`` fits it), NaN unless the point's whole interval (median × (1 ± ``rel_ci``); a missing one counts
    as none) lies more than ``factor`` above the level or below it."""
    log_times = np.log(np.asarray(times, dtype=float))
    own = np.nan_to_num(np.asarray(rel_ci, dtype=float), nan=0.0)
    sigma = spreads(log_times, own, changes)
    edges = [0, *changes, log_times.size]
    levels = np.concatenate([np.full(b - a, weighted_median(log_times[a:b], 1 / sigma[a:b])) for a, b in zip(edges, edges[1:])])
    ratio = np.exp(log_times - levels)
    off = (ratio * (1 - own) > factor) | (ratio * (1 + own) < 1 / factor)
    return np.where(off, ratio, np.nan)


@dataclass(frozen=True)
class Series:
    """One series (a cell on one machine) as the page and the command name it."""

    machine_id: str
    machine: str
    scenario: str
    variant: str
    backend: str
    mode: str
    cell: str
    points: int

    @property
    def where(self) -> tuple:
        return (self.scenario, self.variant, self.backend, self.mode, self.cell)

    def name(self) -> str:
        return f"{self.machine} {self.scenario} {self.variant}[{self.backend}] {self.mode} {self.cell}"


@dataclass(frozen=True)
class Unstable:
    """An unstable series: how many of its points lie off their level, and the furthest of them."""

    series: Series
    off: int
    commit: str
    ratio: float  #: the furthest point's median over its level
    rel_ci: float  #: its own interval

    def line(self, factor: float) -> str:
        return (
            f"unstable series: {self.series.name()}: {self.off} of {counted(self.series.points, 'point')} with their interval more than x{factor} "
            f"off their level, the furthest x{self.ratio:.2f} at {self.commit[:10]} ({percent(self.rel_ci)}); no step explains it"
        )


@dataclass
class Limits:
    """What the steps of a history cannot tell: its series with too few points, its unstable series."""

    series: list[Series]
    commits: int
    unstable: list[Unstable]
    factor: float

    @property
    def short(self) -> list[Series]:
        return [series for series in self.series if series.points < MIN_POINTS]

    def blind(self) -> bool:
        """Whether no series is long enough for a step."""
        return len(self.short) == len(self.series)

    def lines(self) -> list[str]:
        """What ``attnbench history`` says: ``too_few``, then each unstable series."""
        return self.too_few() + [unstable.line(self.factor) for unstable in self.unstable]

    def too_few(self) -> list[str]:
        """The sentence the page and ``attnbench history`` say when series are too short for a step (none when none is)."""
        need = f"a step needs at least {MIN_POINTS} ({MIN_SIZE} on each side)"
        if self.blind():
            longest = max(series.points for series in self.series)
            have = counted(self.commits, "commit") if longest == self.commits else f"at most {counted(longest, 'point')} a series (commits on one machine)"
            return [f"{have}: {need}; none can be found yet"]
        if self.short:
            have = f"{len(self.short)} of {len(self.series)} series {'has' if len(self.short) == 1 else 'have'} fewer than {MIN_POINTS} points"
            return [f"{have}: {need}; none can be found in them yet"]
        return []


def examine(history: History, steps: list[Step], factor: float) -> Limits:
    """The ``Limits`` of ``history`` whose steps are ``steps``; a point whose interval lies more than ``factor`` off its level makes a series unstable."""
    found, unstable = [], []
    for key, points in history.series():
        record = points.iloc[-1]
        series = Series(
            str(key["machine_key"]), record["machine"], key["scenario"], key["variant"], key["backend"], key["mode"], cell_text(record), len(points)
        )
        found.append(series)
        at = {s.position for s in steps if s.machine_id == series.machine_id and (s.scenario, s.variant, s.backend, s.mode, s.cell) == series.where}
        changes = [index for index, position in enumerate(points["position"]) if position in at]
        ratios = off_level(points["metrics.median_s"].to_numpy(float), points["rel_ci"].to_numpy(float), changes, factor)
        if np.isnan(ratios).all():
            continue
        furthest = int(np.nanargmax(np.abs(np.log(ratios))))
        unstable.append(
            Unstable(
                series,
                int(np.count_nonzero(~np.isnan(ratios))),
                points["commit"].iloc[furthest],
                float(ratios[furthest]),
                float(points["rel_ci"].iloc[furthest]),
            )
        )
    return Limits(found, len(history.commits), unstable, factor)

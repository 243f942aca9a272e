"""The steps of a history: where each series (a cell on one machine) changes level (``steps.find_steps``),
the ratio after/before with compare's bootstrap interval over the runs on each side, the commands
that confirm and narrow each step, ``steps.csv`` and the exit code of ``attnbench history``."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..common.files import write_csv_atomic
from ..common.formatting import present
from ..results.compare import ratio_ci, timing_mark
from .series import NO_COMMIT, History
from .steps import find_steps

EXIT_OK = 0  #: no slower step beyond the factor
EXIT_SLOWER = 1  #: a slower step beyond the factor (after --since)
EXIT_BAD_INPUT = 2
#: The columns of steps.csv, one row a step.
CSV_COLUMNS = ["machine_id", "scenario", "variant", "backend", "mode", "cell", "good_commit", "bad_commit", "ratio", "direction"]


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
    ratio: float  #: median after / median before
    ci_low: float
    ci_high: float
    commands: tuple[str, ...]

    @property
    def direction(self) -> str:
        return "slower" if self.ratio > 1 else "faster"


def cell_text(record) -> str:
    """What a step's ``cell`` column says: target, parameters and axes (``identity``'s texts)."""
    return " ".join(filter(None, [record["target"], record["params_text"], record["axes_text"]]))


def _rounds(points: pd.DataFrame) -> list[np.ndarray]:
    """Each point's timing samples (its median alone where a record kept none): compare's rounds."""
    return [
        np.asarray(samples if isinstance(samples, list) and samples else [median], dtype=float)
        for samples, median in zip(points["samples"], points["metrics.median_s"])
    ]


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
    """Every step of every series of ``history``, in commit order."""
    runs = {run["run_id"]: run for run in history.runs}
    found = []
    for key, points in history.series():
        changes = find_steps(points["metrics.median_s"].to_numpy(float), points["rel_ci"].to_numpy(float))
        edges = [0, *changes, len(points)]
        for before, at, after in zip(edges, edges[1:], edges[2:]):
            good, bad = points.iloc[at - 1], points.iloc[at]
            ratio, low, high, _ = ratio_ci(_rounds(points.iloc[before:at]), _rounds(points.iloc[at:after]), alpha=alpha, seed=[0, at])
            known = history.commits.iloc[[good["position"], bad["position"]]]["in_repo"].all()
            between = int(bad["position"] - good["position"] - 1) if known else None
            found.append(Step(
                machine_id=str(key["machine_key"]), machine=bad["machine"], scenario=key["scenario"], variant=key["variant"],
                backend=key["backend"], mode=key["mode"], cell=cell_text(bad),
                good_commit=good["commit"], bad_commit=bad["commit"], position=int(bad["position"]), between=between,
                ratio=ratio, ci_low=low, ci_high=high, commands=commands(runs.get(bad["run_id"], {}), good["commit"], bad["commit"], between),
            ))  # fmt: skip
    return sorted(found, key=lambda step: (step.position, step.scenario, step.variant, step.machine_id))


def alarming(steps: list[Step], factor: float) -> list[Step]:
    """The slower steps beyond ``factor`` whose interval lies above 1: those that fail ``attnbench history``."""
    return [step for step in steps if mark(step, factor) == "worse"]


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

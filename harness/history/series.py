"""The points of a history: per cell, machine and commit the latest median time and its interval,
in commit order. The order is the repository's first-parent history where the commits are in
it; a commit that is not (another branch, another clone) or a run without a commit (``commit`` null)
is placed by its runs' start time among them, and ``History.notes`` says so. A time of 0 (which no
timing can be: the reader refuses negative and non-finite ones) is set aside with a note; a cell
without the optional ``backend`` or ``target`` has them empty, a series of its own as the report
reads it. Reads each results file once, as the report does."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from ..common.checkouts import RegressError, commit_of, git
from ..common.formatting import counted, present
from ..report.cells import machine_names
from ..results import load
from ..results.identity import CELL_KEY, identify, latest

#: One series: a cell on one machine (never two machines in one series).
SERIES_KEY = CELL_KEY + ["machine_key"]
#: The metrics and machine fields a history reads (its points, the machines' names).
KEPT = ["metrics.median_s", "metrics.rel_ci", "metrics.unstable", "machine.machine_id", "machine.hostname", "machine.gpu.name", "machine.cpu.model"]
#: What a results record says when the run knew no commit.
NO_COMMIT = "no commit"


class HistoryError(ValueError):
    """The history cannot be made; the message names the file or option and what was expected."""


@dataclass
class History:
    """Every point (``points``: one row per cell, machine and commit, ``position`` its place in
    ``commits``), the commits in order (their short label, date and whether the repository knows
    them) and what was said about the order (``notes``)."""

    points: pd.DataFrame
    commits: pd.DataFrame
    runs: list[dict]
    notes: list[str] = field(default_factory=list)

    def series(self) -> list[tuple[dict, pd.DataFrame]]:
        """(key, points in commit order) per cell and machine."""
        return [(dict(zip(SERIES_KEY, key)), points.sort_values("position")) for key, points in self.points.groupby(SERIES_KEY, sort=True)]


def first_parent(repo) -> list[str]:
    """The commits of HEAD's first-parent history of the git repository at ``repo``, oldest first."""
    return git(repo, "rev-list", "--first-parent", "--reverse", "HEAD").split()


def resolve(repo, revision: str) -> str:
    """The full hash of ``revision`` in ``repo``; HistoryError when git does not know it."""
    try:
        return commit_of(repo, revision, "--since")
    except RegressError as exc:
        raise HistoryError(str(exc)) from None


#: A commit as results files record it: a (possibly abbreviated) hexadecimal hash.
COMMIT_HASH = re.compile(r"[0-9a-f]{4,64}")


def is_ancestor(repo, commit: str, base: str) -> bool:
    """Whether ``commit`` is ``base`` or one of its ancestors (False for a commit the repository does not know, or for a
    results file's commit that is no hash: it never reaches git, which could read it as an option)."""
    if not COMMIT_HASH.fullmatch(commit):
        return False
    done = subprocess.run(["git", "-C", str(repo), "merge-base", "--is-ancestor", commit, base], capture_output=True)
    return done.returncode == 0


def _commit_label(frame: pd.DataFrame, runs: list[dict]) -> pd.Series:
    """A point's commit: the hash, or ``no commit <its run's start time>`` (each such run its own point)."""
    started = {run["run_id"]: run["started_at"] for run in runs}
    return pd.Series(
        [commit if present(commit) else f"{NO_COMMIT} {started[run_id]}" for commit, run_id in zip(frame["commit"], frame["run_id"])],
        index=frame.index,
    )


def order_commits(first_seen: pd.Series, known: list[str]) -> pd.DataFrame:
    """The commits of ``first_seen`` (commit -> earliest start time of its runs) in order: those in
    ``known`` (first-parent, oldest first) by it, each other one before the first known commit
    measured later than it. Columns: commit, in_repo, first_seen; the index is the position."""
    place = {commit: index for index, commit in enumerate(known)}
    ordered = sorted((c for c in first_seen.index if c in place), key=place.__getitem__)
    others = sorted((c for c in first_seen.index if c not in place), key=lambda c: (first_seen[c], c))
    merged, queue = [], list(others)
    for commit in ordered:
        while queue and first_seen[queue[0]] < first_seen[commit]:
            merged.append(queue.pop(0))
        merged.append(commit)
    merged += queue
    return pd.DataFrame({"commit": merged, "in_repo": [c in place for c in merged], "first_seen": [first_seen[c] for c in merged]})


def build(paths, repo=None) -> History:
    """The history of the results files or directories ``paths``, ordered by ``repo``'s first-parent
    history (None or not a git repository: by the runs' start times)."""
    runs = []
    frame = load(paths, runs=runs)
    frame = frame[[column for column in frame.columns if not column.startswith(("metrics.", "machine.")) or column in KEPT]]  # identify reads every column
    timed = frame[(frame["status"] == "ok") & frame.get("metrics.median_s", pd.Series(np.nan, index=frame.index)).notna()]
    timed = timed.assign(
        **{column: timed.get(column, pd.Series(None, index=timed.index)).map(lambda v: v if present(v) else "") for column in ("backend", "target")}
    )
    notes = []
    if not (zero := timed[timed["metrics.median_s"] <= 0]).empty:
        first = zero.iloc[0]
        notes.append(
            f"{counted(len(zero), 'timed cell')} with metrics.median_s 0 set aside (no timing is 0 s: a clock or writer fault), "
            f"the first in {first['file']}: {first['variant']} {first['mode']}"
        )
        timed = timed[timed["metrics.median_s"] > 0]
    if timed.empty:
        raise HistoryError(f"no timed cells (status ok with metrics.median_s above 0) in {', '.join(map(str, paths))}: nothing to draw")
    points = identify(timed.assign(commit=_commit_label(timed, runs)))
    points = latest(points, SERIES_KEY + ["commit"])
    points["machine"] = points["machine_key"].map(machine_names(points))  # two machines of one name: told apart
    try:
        known = first_parent(repo) if repo is not None else []
    except RegressError as exc:
        known = []
        notes.append(f"--repo {repo}: {exc}; every commit is ordered by its runs' start time")
    commits = order_commits(points.groupby("commit")["started_at"].min(), known)
    outside = commits[~commits["in_repo"]]
    if len(outside) and known:
        no_commit, one = int(outside["commit"].str.startswith(NO_COMMIT).sum()), len(outside) == 1
        notes.append(
            f"{len(outside)} of {counted(len(commits), 'commit')} {'is' if one else 'are'} not on the first-parent history of {Path(repo).resolve()}"
            + (f" ({counted(no_commit, 'run')} with commit null)" if no_commit else "")
            + f": {'it is' if one else 'they are'} placed by {'its' if one else 'their'} runs' start time"
        )
    elif no_repo_runs := int(commits["commit"].str.startswith(NO_COMMIT).sum()):
        have = f"{counted(no_repo_runs, 'run')} {'has' if no_repo_runs == 1 else 'have'} no commit (commit null)"
        notes.append(f"{have}: each is a point of its own, placed by its start time")
    position = {commit: index for index, commit in enumerate(commits["commit"])}
    points = points.assign(
        position=points["commit"].map(position),
        rel_ci=points.get("metrics.rel_ci", pd.Series(np.nan, index=points.index)),
        unstable=points.get("metrics.unstable", pd.Series(False, index=points.index)).map(lambda value: present(value) and bool(value)),
    )
    return History(points, commits, runs, notes)

"""``attnbench bisect --good GOOD --bad BAD``: the first commit at which the cells regress flags became worse.

1. ``regress --base GOOD --head BAD`` (harness.revisions.regress: the same cells, rounds and thresholds) names the cells
   to follow: those it marks ``worse``. None: nothing to bisect.
2. The commits ``git rev-list --first-parent --reverse GOOD..BAD`` are searched by halving, assuming a cell that
   became worse stays worse. Each probe is regress again, ``--base GOOD --head PROBE`` on the followed cells only
   (its own worktrees, a worker per revision, base and head interleaved, a bootstrap interval per cell):
   ``bad`` when one of them is ``worse``; ``good`` when every measured one is ``unchanged`` or ``better``, or when
   none was measured because the diff GOOD..PROBE touches none of the files they run (regress's own choice);
   else undecided. An undecided probe whose cells were only too noisy to judge (``too few samples to decide``,
   ``unstable: not compared``) is measured once more with twice the rounds; undecided again, or for another
   reason (a failing or incorrect cell), the search stops and names the commits still in question.
3. It prints the first bad commit (hash, subject) with each followed cell's ratio and interval there.

Exit codes (docs/regress.md): 0 found, 1 stopped undecided, 2 cannot bisect, 3 nothing to bisect, 130 interrupted.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from pathlib import Path

from ..common.checkouts import RegressError, commit_of, git, repository
from ..common.formatting import format_ratio, present
from ..results import load
from ..results.compare import UNDECIDED, UNSTABLE
from ..results.identity import identify
from .regress import RegressResult, regress

EXIT_FOUND = 0  #: the first bad commit is named
EXIT_UNDECIDED = 1  #: a probe stayed undecided: the commits still in question are named
EXIT_ERROR = 2  #: cannot bisect: a git failure, an unknown revision, GOOD not an ancestor of BAD, a bad scenario
EXIT_NOTHING = 3  #: regress --base GOOD --head BAD marks no cell worse
#: The columns that name a cell in compare's table and in the identified results frame.
ROW_KEY = ("scenario", "variant", "backend", "params", "axes", "mode", "target")
NOISY = (UNDECIDED, UNSTABLE)  #: marks that more samples may turn into a verdict


@dataclass
class Probe:
    """One commit measured against GOOD: ``verdict`` good, bad or undecided, why, and the followed cells' rows
    of compare's table (ratio, ci_low, ci_high, mark; empty when nothing was measured)."""

    commit: str
    subject: str
    verdict: str
    reason: str
    rows: list[dict] = field(default_factory=list)


@dataclass
class BisectResult:
    """What ``bisect`` found: the followed cells' rows at BAD (``flagged``), every probe in order, and the
    commits still in question (``left``: the first bad commit alone when found)."""

    good: str
    bad: str
    flagged: list[dict]
    probes: list[Probe]
    left: list[tuple[str, str]]

    @property
    def exit_code(self) -> int:
        if not self.flagged:
            return EXIT_NOTHING
        return EXIT_FOUND if len(self.left) == 1 else EXIT_UNDECIDED


def _row_key(row: dict) -> tuple:
    return tuple(row[column] for column in ROW_KEY)


def worse_cells(result: RegressResult) -> tuple[set[str], list[dict]]:
    """The cell ids and compare rows of the cells ``result`` marks worse (rows matched to the head's records
    by the same identity columns compare's table is made of)."""
    if result.comparison is None:
        return set(), []
    rows = [row for row in result.comparison.table.to_dict("records") if row["mark"] == "worse"]
    frame = identify(load([result.paths["head"]])).rename(columns={"params_text": "params", "axes_text": "axes"})
    ids = {_row_key(record): record["cell_id"] for record in frame.to_dict("records")}
    return {ids[_row_key(row)] for row in rows}, rows


def judge(result: RegressResult) -> tuple[str, str, list[dict]]:
    """(verdict, reason, rows) of one probe's regress run over the followed cells."""
    if result.incorrect("head"):
        return "undecided", "incorrect: " + "; ".join(problem for check in result.incorrect("head") for problem in check["problems"]), []
    if result.comparison is None:
        return "good", "the diff from GOOD touches no file the followed cells run: not measured", []
    rows = result.comparison.table.to_dict("records")
    marks = [row["mark"] for row in rows]
    if "worse" in marks:
        return "bad", f"{marks.count('worse')} of {len(rows)} cells worse", rows
    if all(mark in ("unchanged", "better") for mark in marks):
        return "good", f"{len(rows)} cells unchanged or better", rows
    return "undecided", "; ".join(f"{describe_row(row)}: {row['mark']}" for row in rows if row["mark"] not in ("unchanged", "better")), rows


def describe_row(row: dict) -> str:
    """``delta[torch] T=128 ... forward/core: ratio 1.931 [1.674, 2.896]``."""
    cell = f"{row['variant']}[{row['backend']}]{' ' + row['params'] if row['params'] else ''} {row['axes']} {row['mode']}/{row['target']}"
    if not present(row.get("ratio")):
        return cell
    return f"{cell}: ratio {format_ratio(row['ratio'])} [{row['ci_low']:.3f}, {row['ci_high']:.3f}]"


def candidates(repo: Path, good: str, bad: str) -> list[tuple[str, str]]:
    """(commit, subject) of GOOD..BAD's first-parent commits (``git log --first-parent --reverse``), BAD last; a
    RegressError when GOOD is not an ancestor of BAD or nothing lies between them."""
    good_commit, bad_commit = commit_of(repo, good), commit_of(repo, bad)
    if good_commit == bad_commit or git(repo, "merge-base", good_commit, bad_commit) != good_commit:
        raise RegressError(f"--good {good} ({good_commit[:10]}) must be an ancestor of --bad {bad} ({bad_commit[:10]})")
    lines = git(repo, "log", "--first-parent", "--reverse", "--format=%H %s", f"{good_commit}..{bad_commit}").splitlines()
    return [tuple(line.split(" ", 1)) if " " in line else (line, "") for line in lines]


def bisect(repo, loaded, *, good: str, bad: str, rounds: int = 3, out_dir=Path("results"), say=print, **options) -> BisectResult:
    """Find the first commit of GOOD..BAD at which the cells ``regress(base=good, head=bad)`` marks worse became
    worse (module docstring); ``options`` go to every ``regress`` call (all_variants, threads, factor, alpha, ...), which
    compares timings only (no static kernel diff: bisect follows the timed cells)."""
    repo = repository(repo)
    commits = candidates(repo, good, bad)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    folder = Path(out_dir) / f"bisect-{loaded.name}-{stamp}"
    say(f"bisect: {len(commits)} commits in {good}..{bad} (first parents); regress --base {good} --head {bad} first")
    first = regress(repo, loaded, base=good, head=bad, rounds=rounds, out_dir=folder / "bad", say=lambda line: say(f"  {line}"), kernel_diff=False, **options)
    if first.comparison is not None:
        say("\n".join(f"  {line}" for line in first.comparison.format_table().splitlines()))
    followed, flagged = worse_cells(first)
    if not followed:
        say(f"bisect: regress marks no cell worse at {bad}: nothing to bisect")
        return BisectResult(good, bad, [], [], commits)
    say(f"bisect: following {len(followed)} worse cells: " + "; ".join(map(describe_row, flagged)))
    probes, low, high = [], -1, len(commits) - 1  # commits[low] is good (-1: GOOD), commits[high] is bad
    rows_at = {high: flagged}
    while high - low > 1:
        middle = (low + high) // 2
        commit, subject = commits[middle]
        for attempt_rounds in (rounds, 2 * rounds):
            result = regress(repo, loaded, base=good, head=commit, rounds=attempt_rounds, out_dir=folder / f"probe-{commit[:10]}-{attempt_rounds}r",
                             say=lambda line: None, cells=followed, kernel_diff=False, **options)  # fmt: skip
            probe = Probe(commit, subject, *judge(result))
            say(f"bisect: {commit[:10]} {subject[:60]}: {probe.verdict} ({probe.reason}; {attempt_rounds} rounds)")
            if probe.verdict != "undecided" or not probe.rows or any(row["mark"] not in (*NOISY, "unchanged", "better") for row in probe.rows):
                break
        probes.append(probe)
        if probe.verdict == "undecided":
            break
        if probe.verdict == "bad":
            high, rows_at[middle] = middle, probe.rows
        else:
            low = middle
    left = commits[low + 1 : high + 1]
    result = BisectResult(good, bad, flagged, probes, left)
    _say_outcome(result, rows_at.get(high, []), say)
    return result


def _say_outcome(result: BisectResult, rows: list[dict], say) -> None:
    if result.exit_code == EXIT_FOUND:
        commit, subject = result.left[0]
        say(f"first bad commit: {commit} {subject}")
        for row in rows:
            say(f"  {describe_row(row)}: {row['mark']}")
        later = {_row_key(row) for row in result.flagged} - {_row_key(row) for row in rows if row["mark"] == "worse"}
        if later:
            say(f"  {len(later)} of the followed cells are not worse there: they may have become worse later (bisect again with --good {commit[:10]})")
        return
    say(f"bisect stopped undecided: the first bad commit is one of these {len(result.left)} (oldest first; the last is bad):")
    for commit, subject in result.left:
        say(f"  {commit} {subject}")

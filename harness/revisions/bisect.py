"""``attnbench bisect --good GOOD --bad BAD``: the first commit at which the cells regress flags became worse.

1. ``regress --base GOOD --head BAD`` (harness.revisions.regress: the same cells, rounds and thresholds) names the cells
   to follow: the touched cells it marks ``worse`` (not the controls). None: nothing to bisect. A regress run of the same
   pair already in ``--out`` (``regress-SCENARIO-TIME/``, same scenario file, preset, overrides, rounds, threads and
   ``--all-variants``; neither side with uncommitted changes) is reused instead of measured again (:func:`reusable`).
2. The commits ``git rev-list --first-parent --reverse GOOD..BAD`` are searched by halving, assuming a cell that
   became worse stays worse. Each probe is regress again, ``--base GOOD --head PROBE`` on the followed cells only
   (its own worktrees, a worker per revision, base and head interleaved, a bootstrap interval per cell):
   ``bad`` when one of them is ``worse``; ``good`` when every measured one is ``unchanged`` or ``better``, or when
   none was measured because the diff GOOD..PROBE touches none of the files they run (regress's own choice);
   else undecided (also when a control, a followed cell whose code GOOD..PROBE did not change, moved).
   An undecided probe whose cells were only too noisy to judge (``too few samples to decide``,
   ``unstable: not compared``) is measured once more with twice the rounds; undecided again, or for another
   reason (a failing or incorrect cell), the search stops and names the commits still in question.
3. It prints the first bad commit (hash, subject) with each followed cell's ratio and interval there.

Exit codes (docs/regress.md): 0 found, 1 stopped undecided, 2 cannot bisect, 3 nothing to bisect, 130 interrupted.
"""

from __future__ import annotations

import datetime as dt
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from ..common.checkouts import SIDES, RegressError, commit_of, repository
from ..common.formatting import format_ratio, present
from ..results import ResultsFileError, read_records
from ..results.compare import compare
from .next_steps import MOVED, NOISY, Invocation, mark_controls
from .regress import RegressResult, first_parent_commits, regress, row_cell_ids, row_key, scenario_spec, shared_flags

EXIT_FOUND = 0  #: the first bad commit is named
EXIT_UNDECIDED = 1  #: a probe stayed undecided: the commits still in question are named
EXIT_ERROR = 2  #: cannot bisect: a git failure, an unknown revision, GOOD not an ancestor of BAD, a bad scenario
EXIT_NOTHING = 3  #: regress --base GOOD --head BAD marks no cell worse
#: regress's options a next command repeats where they differ from these defaults (``regress.shared_flags``).
SHARED_DEFAULTS = {"all_variants": False, "threads": 1, "factor": 1.1, "alpha": 0.05, "plugins": ()}
SUBJECT_WIDTH = 60  #: a probe's line shortens the commit's subject to this many characters, at a word


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


def _is_control(row: dict) -> bool:
    return bool(row.get("control", False))


def worse_cells(result: RegressResult) -> tuple[set[str], list[dict]]:
    """The cell ids and compare rows of the touched cells ``result`` marks worse (a control is never followed)."""
    if result.comparison is None:
        return set(), []
    rows = result.comparison.table.to_dict("records")
    ids = row_cell_ids(result.comparison, result.paths["head"])
    worse = [(cell_id, row) for cell_id, row in zip(ids, rows) if row["mark"] == "worse" and not _is_control(row)]
    return {cell_id for cell_id, _ in worse}, [row for _, row in worse]


def reusable(out_dir: Path, loaded, repo: Path, good: str, bad: str, rounds: int, options: dict) -> RegressResult | None:
    """The newest regress run of the commits ``good`` and ``bad`` name in ``out_dir`` (``regress-NAME-TIME/``, or a bisect's
    ``bisect-NAME-TIME/bad/regress-NAME-TIME/``) measured as ``regress(rounds=rounds, **options)`` would measure it:
    the same scenario file, preset and overrides, rounds, threads and all_variants, both sides committed (no
    uncommitted change); compared again with ``options``' factor and alpha. None when there is none."""
    name, good, bad = loaded.name, commit_of(repo, good, "--good"), commit_of(repo, bad, "--bad")
    folders = [*Path(out_dir).glob(f"regress-{name}-*"), *Path(out_dir).glob(f"bisect-{name}-*/bad/regress-{name}-*")]
    wanted = {"rounds": rounds, "threads": options.get("threads", 1), "all_variants": options.get("all_variants", False)}
    for folder in sorted(folders, key=lambda folder: folder.name, reverse=True):
        paths = {side: folder / f"{side}.jsonl" for side in SIDES}
        if not all(path.is_file() for path in paths.values()):
            continue
        try:
            runs = {side: next((record for record in read_records(path) if record["kind"] == "run"), {}) for side, path in paths.items()}
        except (ResultsFileError, OSError):  # a damaged file: not reused
            continue
        same = all(
            (run.get("revision") or {}).get("commit") == commit
            and (run.get("revision") or {}).get("dirty_files") == 0
            and (run.get("scenario_sha256"), run.get("preset"), run.get("overrides")) == (loaded.sha256, loaded.preset, list(loaded.overrides))
            and {key: (run.get("regress") or {}).get(key) for key in wanted} == wanted
            for run, commit in ((runs["base"], good), (runs["head"], bad))
        )
        if same:
            comparison = compare([paths["base"]], [paths["head"]], factor=options.get("factor", 1.1), alpha=options.get("alpha", 0.05))
            mark_controls(comparison, {tuple(config) for config in runs["head"]["regress"]["touched"]})
            return RegressResult((None, None), [], {side: {} for side in SIDES}, {}, comparison, paths)
    return None


def judge(result: RegressResult) -> tuple[str, str, list[dict]]:
    """(verdict, reason, rows) of one probe's regress run over the followed cells."""
    if result.incorrect("head"):
        return "undecided", "incorrect: " + "; ".join(problem for check in result.incorrect("head") for problem in check["problems"]), []
    if result.comparison is None:
        return "good", "the diff from GOOD touches no file the followed cells run: not measured", []
    rows = result.comparison.table.to_dict("records")
    moved = [row for row in rows if _is_control(row) and row["mark"] in MOVED]
    if moved:
        return "undecided", "the controls moved: " + "; ".join(f"{describe_row(row)}: {row['mark']}" for row in moved), rows
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
    good_commit, bad_commit = commit_of(repo, good, "--good"), commit_of(repo, bad, "--bad")
    commits = first_parent_commits(repo, good_commit, bad_commit)
    if not commits:
        raise RegressError(f"--good {good} ({good_commit[:10]}) must be an ancestor of --bad {bad} ({bad_commit[:10]})")
    return commits


def short_subject(subject: str) -> str:
    """A commit subject of at most ``SUBJECT_WIDTH`` characters, shortened at a word (never mid-word)."""
    return textwrap.shorten(subject, SUBJECT_WIDTH, placeholder=" ...")


def bisect(repo, loaded, *, good: str, bad: str, rounds: int = 3, out_dir=Path("results"), say=print, **options) -> BisectResult:
    """Find the first commit of GOOD..BAD at which the cells ``regress(base=good, head=bad)`` marks worse became
    worse (module docstring); ``options`` go to every ``regress`` call (all_variants, threads, factor, alpha, ...), which
    compares timings only (no static kernel diff: bisect follows the timed cells)."""
    given_repo, repo = repo, repository(repo)
    commits = candidates(repo, good, bad)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    folder = Path(out_dir) / f"bisect-{loaded.name}-{stamp}"
    first = reusable(out_dir, loaded, repo, good, bad, rounds, options)
    if first is not None:
        say(f"bisect: {len(commits)} commits in {good}..{bad} (first parents); reusing regress --base {good} --head {bad}: {first.paths['head'].parent}")
    else:
        say(f"bisect: {len(commits)} commits in {good}..{bad} (first parents); regress --base {good} --head {bad} first")
        first = regress(
            repo, loaded, base=good, head=bad, rounds=rounds, out_dir=folder / "bad", say=lambda line: say(f"  {line}"), kernel_diff=False, **options
        )
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
            say(f"bisect: {commit[:10]} {short_subject(subject)}: {probe.verdict} ({probe.reason}; {attempt_rounds} rounds)")
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
    if result.exit_code == EXIT_FOUND:
        say(_confirm_step(result.left[0][0], loaded, rounds, out_dir, given_repo, options))
    return result


def _confirm_step(commit: str, loaded, rounds: int, out_dir, repo, options: dict) -> str:
    """The next step once the commit is found: its diff, and regress of the commit against its parent (bisect's ratios
    are against GOOD)."""
    flags = shared_flags(**{key: options.get(key, default) for key, default in SHARED_DEFAULTS.items()}, out_dir=out_dir, repo=repo)
    parent = Invocation(f"{commit[:10]}^", commit[:10], scenario_spec(loaded), loaded.preset, list(loaded.overrides), flags)
    return f"next: read its diff (git show {commit[:10]}); the ratios above are against GOOD; against its parent: {parent.command('regress', rounds)}"


def _say_outcome(result: BisectResult, rows: list[dict], say) -> None:
    if result.exit_code == EXIT_FOUND:
        commit, subject = result.left[0]
        say(f"first bad commit: {commit} {subject}")
        for row in rows:
            say(f"  {describe_row(row)}: {row['mark']}")
        later = {row_key(row) for row in result.flagged} - {row_key(row) for row in rows if row["mark"] == "worse"}
        if later:
            say(f"  {len(later)} of the followed cells are not worse there: they may have become worse later (bisect again with --good {commit[:10]})")
        return
    say(f"bisect stopped undecided: the first bad commit is one of these {len(result.left)} (oldest first; the last is bad):")
    for commit, subject in result.left:
        say(f"  {commit} {subject}")

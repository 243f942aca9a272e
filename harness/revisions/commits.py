"""``attnbench run SCENARIO --commits RANGE``: the scenario measured at each first-parent commit of a range
(``every`` Nth: a grid anchored at the repository's root commit, the newest always), each in a temporary worktree
with its own code, worker processes and Triton cache (as regress does: ``checkouts.worktree``,
``LocalExecutor(code_root=...)``), the scenario file taken from the newest commit so that every commit measures
the same cells. Results are keyed by what was measured (``measured_as``: the scenario's content, preset and
``--set`` overrides), one file per commit, machine and key, ``SCENARIO-COMMIT-MACHINE-KEY.jsonl``: a cell
recorded at a commit under this key on this machine by a clean run is not measured again (``force``: it is;
``retry_failed``: a failed one is; a cell that failed for a passing reason is, ``PASSING_TRIES`` times in all),
so a changed scenario measures its cells anew and leaves the old files as they are. A commit whose code cannot
run is recorded with the reason in each cell, and the range goes on. ``dry_run`` lists the commits, those already
measured and the estimated duration, and measures nothing. docs/history.md; ``attnbench history`` draws the
results (``harness.history``)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from ..common.checkouts import RegressError, commit_of, git, repository, scratch_directory, worktree
from ..common.formatting import counted, one_line
from ..measuring import machine
from ..results import FAILED, ResultsFileError, cell_record, read_records, run_header
from ..running import runner
from ..running.estimate import Estimator, Measured, format_duration, roofs_for
from ..running.executors import main_device, unmeasured
from ..running.executors.local import LocalExecutor
from ..running.planning import learned_from
from ..running.worker import CHECKOUT_WORKER, OOM_KILLED, TIMED_OUT
from ..scenarios.cell import Cell
from ..scenarios.scenario import LoadedScenario, load_scenario
from ..scenarios.scenario_files import ScenarioError, set_target

#: What a commit's code must import to measure a cell: its worker's loop (as ``Worker(code_root=...)`` finds it, from
#: before and after harness/ was grouped by role) and its variants, each from the commit's own checkout: it prints the files
#: they came from, and an attnbench installed elsewhere (``pip install -e``, as nox does, serves the packages a commit does
#: not have) is no stand-in.
IMPORT_CHECK = CHECKOUT_WORKER.rpartition("\n")[0] + "\nimport variants\nprint(sys.modules[serve.__module__].__file__)\nprint(variants.__file__)"
#: Seconds ``IMPORT_CHECK`` may take: a commit whose code takes longer (an import that hangs) cannot run, and the range goes
#: on. The check took 14-19 s of wall time on the 2-core development VM under a load of 6 (``CHECKOUT_S``).
IMPORT_CHECK_TIMEOUT_S = 120
#: What a commit costs besides its run (``harness.running.estimate``'s, the run's start included): its worktree added and
#: removed, and ``IMPORT_CHECK`` in a fresh interpreter over sources not yet compiled. Measured on the 2-core development VM:
#: the worktree 0.4-0.6 s, the import check 4.7-5.3 s of CPU (14-19 s of wall time while other processes kept a load of 6).
CHECKOUT_S = 6.0
#: How many times in all a cell that failed for a passing reason (``passing_failure``) is measured at a commit before
#: its failure stands as the commit's: once a night, so a busy night's timeout heals the next, and a cell that always
#: hangs at that commit costs three nights, not every night.
PASSING_TRIES = 3
#: What each cell of a commit that cannot run says (``_record_failure``), and the reason of an import check stopped at its
#: timeout: a failure of the moment (a busy machine's night) as a cell's timeout is (``passing_failure``).
CANNOT_RUN, IMPORT_TIMED_OUT = "this commit cannot run the scenario: ", "its code did not import within"


@dataclass
class CommitRun:
    """What became of one commit: ``measured`` (with the run's summary), ``skipped`` (measured
    before on this machine) or ``cannot run`` (with the reason)."""

    commit: str
    outcome: str
    path: Path
    summary: runner.RunSummary | None = None
    reason: str = ""


def range_commits(repo: Path, spec: str, every: int = 1) -> list[str]:
    """The first-parent commits of ``A..B`` (oldest first) on the grid of ``every``: those whose first-parent distance from
    the repository's root commit is a multiple of ``every``, and the newest. Anchored at the root, the grid stays where it
    is when commits are added or the range begins elsewhere, so a nightly measures each commit of it once (a shallow clone,
    whose root moves with each fetch, is refused). Each end is resolved by ``checkouts.commit_of`` first, so git never reads
    a revision as an option."""
    first, dots, last = spec.partition("..")
    if not dots or not first or not last or last.startswith("."):
        raise RegressError("not a range of commits (A..B, such as HEAD~10..HEAD or v1.0..main)")
    if every < 1:
        raise RegressError(f"--every must be at least 1, got {every}")
    if every > 1 and git(repo, "rev-parse", "--is-shallow-repository") == "true":  # its root is a boundary that moves
        raise RegressError(f"--every {every} counts commits from the root commit, and the repository at {repo} is a shallow clone (git fetch --unshallow)")
    commits = git(repo, "rev-list", "--first-parent", "--reverse", f"{commit_of(repo, first)}..{commit_of(repo, last)}", "--").split()
    if not commits:
        raise RegressError(f"the range {spec!r} holds no commit (is the first revision an ancestor of the second?)")
    start = int(git(repo, "rev-list", "--first-parent", "--count", commits[0], "--")) - 1  # the oldest's distance from the root
    return [commit for index, commit in enumerate(commits) if (start + index) % every == 0 or commit == commits[-1]]


def measured_as(loaded: LoadedScenario) -> dict:
    """What a nightly's results are keyed by, as a run line records it: the scenario's name and content, preset and overrides
    (``in_effect``)."""
    return {**runner.scenario_identity(loaded), "overrides": in_effect(loaded.overrides)}


def in_effect(overrides) -> list:
    """``--set`` ``overrides`` sorted where their order changes nothing (no two set one field, nor one a field inside
    another's), else as given: a nightly whose options are written in another order measures the same scenario."""
    try:
        fields = [tuple(set_target(assignment)) for assignment in overrides]
    except ScenarioError:  # not --set options (a results file edited by hand): as they are
        return list(overrides)
    nested = any(one[: len(other)] == other or other[: len(one)] == one for index, one in enumerate(fields) for other in fields[index + 1 :])
    return list(overrides) if nested else sorted(overrides)


def results_file(out_dir: Path, loaded: LoadedScenario, commit: str, machine_id: str) -> Path:
    """The file of ``loaded``'s cells at ``commit`` on machine ``machine_id``, named with a hash of ``measured_as``."""
    key = hashlib.sha256(json.dumps(measured_as(loaded), sort_keys=True).encode()).hexdigest()[:10]
    return out_dir / _file_name(loaded.name, commit[:12], machine_id, key)


def _file_name(scenario: str, commit: str, machine_id: str, key: str) -> str:
    """``SCENARIO-COMMIT-MACHINE-KEY.jsonl`` (``*`` for a part: the pattern of every such file)."""
    return f"{scenario}-{commit}-{machine_id}-{key}.jsonl"


def recorded_cells(out_dir: Path, loaded: LoadedScenario, machine_id: str) -> dict[str, dict[str, list[dict]]]:
    """Per commit and cell_id, the records (oldest first) in ``out_dir`` that measure ``loaded``'s cell at that commit: of
    runs on machine ``machine_id`` measured as ``loaded`` is (``measured_as``), with the commit's code (not ``dirty``)."""
    wanted, recorded = measured_as(loaded), {}
    for path in sorted(out_dir.glob("*.jsonl")) if out_dir.is_dir() else []:
        try:
            records = read_records(path)
        except ResultsFileError:
            continue  # not a file of this command's making; the history will say what is wrong with it
        runs = {
            record["run_id"]
            for record in records
            if record["kind"] == "run"
            and record["machine"].get("machine_id") == machine_id
            and record.get("dirty") is False
            and {**{key: record.get(key) for key in wanted}, "overrides": in_effect(record.get("overrides") or [])} == wanted
        }
        for record in records:
            if record["kind"] == "cell" and record["run_id"] in runs and record.get("commit"):
                recorded.setdefault(record["commit"], {}).setdefault(record["cell_id"], []).append(record)
    for cells in recorded.values():
        for records in cells.values():
            records.sort(key=lambda record: str(record.get("started_at") or ""))
    return recorded


def passing_failure(record: dict) -> bool:
    """Whether a cell record failed for a reason of the moment, not of its commit's code (``harness.running.worker``'s
    words, ``TIMED_OUT`` and ``OOM_KILLED``): ``crashed`` (its worker died or did not start), ``oom`` by the out-of-memory
    killer (not the variant's own out-of-memory error, which a sweep to the memory limit expects) or an ``error`` of its
    timeout or of its commit's import check's (``IMPORT_TIMED_OUT``)."""
    status, error = record["status"], record.get("error") or ""
    timed_out = error.startswith((TIMED_OUT, CANNOT_RUN + IMPORT_TIMED_OUT))
    return status == "crashed" or (status == "oom" and error.startswith(OOM_KILLED)) or (status == "error" and timed_out)


def settled(records: list[dict], retry_failed: bool = False) -> bool:
    """Whether a cell's records at a commit (oldest first) measure it: the latest did not fail for a passing reason, or
    ``PASSING_TRIES`` did; with ``retry_failed`` (``--retry-failed``), the latest did not fail at all."""
    if retry_failed:
        return records[-1]["status"] not in FAILED
    return not passing_failure(records[-1]) or sum(map(passing_failure, records)) >= PASSING_TRIES


def cannot_import(root: Path, env: dict) -> str | None:
    """Why the checkout at ``root`` cannot measure, or None: its worker loop or variants do not import, not within
    ``IMPORT_CHECK_TIMEOUT_S``, or not from ``root`` (from an installed attnbench: the commit lacks them)."""
    environment = {**os.environ, **env, "PYTHONPATH": str(root)}
    try:
        done = subprocess.run([sys.executable, "-c", IMPORT_CHECK], cwd=root, capture_output=True, text=True, env=environment, timeout=IMPORT_CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"{IMPORT_TIMED_OUT} {IMPORT_CHECK_TIMEOUT_S} s (stopped; IMPORT_CHECK_TIMEOUT_S)"
    if done.returncode != 0:
        return (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
    files = done.stdout.splitlines()[-2:]
    for name, file in zip(("its worker loop", "variants"), files):
        if not Path(file).resolve().is_relative_to(root.resolve()):
            return f"{name} imported from {file}, not from the commit (an installed attnbench stood in for code the commit does not have)"
    return None if len(files) == 2 else f"the import check printed {files} instead of the files it imported"


def _record_failure(path: Path, loaded: LoadedScenario, fingerprint: dict, command: str, reason: str) -> None:
    """A results file whose every cell is an error with ``reason``: the commit is in the history, with why."""
    run_id = f"cannot-run-{fingerprint['git']['commit'][:12]}"
    with runner.append_writer(path) as writer:
        writer.write_run(run_header(loaded, run_id, command, fingerprint))
        for cell in loaded.cells():
            writer.write_cell(cell_record(cell, unmeasured("error", CANNOT_RUN + reason), run_id, fingerprint))


def _scenario(repo: Path, newest: str, spec: str, preset: str | None, overrides: list[str]) -> LoadedScenario:
    """``spec`` as a file, or the newest commit's shipped scenario of that name."""
    if Path(spec).is_file():
        return load_scenario(spec, preset=preset, overrides=overrides)
    with scratch_directory() as scratch, worktree(repo, newest, "scenario", scratch) as revision:
        shipped = revision.root / "scenarios" / f"{spec}.yaml"
        if not shipped.is_file():
            raise ScenarioError(f"{one_line(spec)}: no such scenario file here, nor in scenarios/ at {newest[:10]}, the range's newest commit")
        try:
            return load_scenario(str(shipped), preset=preset, overrides=overrides)
        except ScenarioError as exc:  # named as the user knows it, not by the temporary worktree's path
            raise ScenarioError(str(exc).replace(str(shipped), f"scenarios/{spec}.yaml at {newest[:10]}")) from None


@dataclass
class Range:
    """A range to measure: its commits (oldest first), the scenario they measure, this machine's fingerprint, the
    records of its cells at each commit on it (``recorded_cells``; none with ``force``) and whether a failed cell is
    measured again (``retry_failed``)."""

    repo: Path
    spec: str
    out_dir: Path
    commits: list[str]
    loaded: LoadedScenario
    here: dict
    recorded: dict[str, dict[str, list[dict]]]
    retry_failed: bool = False

    def left(self, commit: str) -> list[Cell]:
        """The cells to measure at ``commit``: those not recorded there, or not ``settled``."""
        recorded = self.recorded.get(commit, {})
        return [cell for cell in self.loaded.cells() if cell.cell_id not in recorded or not settled(recorded[cell.cell_id], self.retry_failed)]

    @property
    def done(self) -> set[str]:
        """The commits with no cell left: skipped."""
        return {commit for commit in self.commits if not self.left(commit)}

    def headline(self) -> str:
        todo = sum(commit not in self.done for commit in self.commits)
        return f"{self.loaded.name}: {counted(len(self.commits), 'commit')} of {self.spec}, {todo} to measure -> {self.out_dir}/"


def commit_range(
    repo, spec: str, commits_range: str, out_dir, *, preset=None, overrides=(), every: int = 1, force: bool = False, retry_failed: bool = False
) -> Range:
    """The ``Range`` of ``commits_range`` (``every``: ``range_commits``) for scenario ``spec``, results in ``out_dir``."""
    repo, out_dir = repository(repo), Path(out_dir)
    commits = range_commits(repo, commits_range, every)
    loaded = _scenario(repo, commits[-1], spec, preset, list(overrides))
    here = machine.fingerprint(main_device(loaded.cells()))
    recorded = {} if force else recorded_cells(out_dir, loaded, here["machine_id"])
    return Range(repo, commits_range, out_dir, commits, loaded, here, recorded, retry_failed)


def measure_commits(repo, spec: str, commits_range: str, out_dir, *, plugins=(), command="", progress=True, say=print, **chosen_by) -> list[CommitRun]:
    """Measure ``spec`` at each commit of ``commits_range`` into ``out_dir`` (``chosen_by``: ``commit_range``'s options)."""
    chosen = commit_range(repo, spec, commits_range, out_dir, **chosen_by)
    say(chosen.headline())
    with scratch_directory() as scratch:
        return _measure(chosen, scratch, force=chosen_by.get("force", False), plugins=plugins, command=command, progress=progress, say=say)


def dry_run(chosen: Range, *, gpu: str | None = None, measured_from: str | None = None) -> list[str]:
    """What ``run --commits --dry-run`` prints: the headline, each commit (measured on this machine, in part or
    not) with the estimate of what is left of it, the total and the roofs (EstimateError: an unknown GPU or file)."""
    cells = chosen.loaded.cells()
    roofs = roofs_for(cells, gpu)
    unread = None
    if measured_from:
        measured = Measured(measured_from)
    else:  # this machine's nights of this scenario, as measured (any key), as `run --dry-run` learns from its results
        files = sorted(chosen.out_dir.glob(_file_name(chosen.loaded.name, "*", chosen.here["machine_id"], "*")))
        measured, unread = learned_from(files, chosen.here["machine_id"], chosen.out_dir) if files else (None, None)
    estimator = Estimator(roofs, measured=measured)
    described = dict(line.split("\t", 1) for line in git(chosen.repo, "show", "-s", "--format=%H%x09%cs %s", *chosen.commits).splitlines())
    lines, total, todo = [chosen.headline() + " (dry run: nothing is measured)"], 0.0, 0
    for commit in chosen.commits:
        left = chosen.left(commit)
        if not left:
            state = "measured on this machine"
        else:
            seconds = estimator.sweep(left).seconds() + CHECKOUT_S
            total, todo = total + seconds, todo + 1
            part = f"{len(cells) - len(left)} of {len(cells)} cells measured; " if len(left) < len(cells) else ""
            state = f"to measure: {part}{counted(len(left), 'cell')}, ~{format_duration(seconds)}"
        lines.append(f"  {commit[:10]} {textwrap.shorten(described[commit], 60, placeholder=' ...')}: {state}")
    whole = estimator.sweep(cells).seconds()
    lines.append(
        f"estimated {format_duration(total)} for {counted(todo, 'commit')} to measure: each its cells as `attnbench run --dry-run` estimates them "
        f"({format_duration(whole)} for all {counted(len(cells), 'cell')}, the run's start included) and {CHECKOUT_S:.0f} s for its worktree and import check"
    )
    learned = [f"estimates from {measured.source} where a cell was measured, else from the model"] if measured is not None else []
    return lines + learned + ([unread] if unread else []) + [f"roof ({kind}): {roof.describe()}" for kind, roof in roofs.items()]


def _measure(chosen: Range, scratch: Path, *, force, plugins, command, progress, say) -> list[CommitRun]:
    """The cells ``left`` at each commit of ``chosen`` in its worktree under ``scratch``, one commit after the other, into
    its ``results_file`` under the results directory's lock: resumed, or (``force``) a new run appended, whose records
    supersede the earlier ones (history and report read a cell's latest); nothing is deleted."""
    repo, loaded, out_dir, here = chosen.repo, chosen.loaded, chosen.out_dir, chosen.here
    finished = []
    for commit in chosen.commits:
        path = results_file(out_dir, loaded, commit, here["machine_id"])
        if not (left := chosen.left(commit)):
            finished.append(CommitRun(commit, "skipped", path))
            continue
        part = loaded.narrowed(left)
        fingerprint = {**here, "git": {"commit": commit, "dirty": False, "describe": commit[:10]}}
        with worktree(repo, commit, commit[:12], scratch) as revision:
            reason = cannot_import(revision.root, revision.env)
            if reason is not None:
                _record_failure(path, part, fingerprint, command, reason)
                finished.append(CommitRun(commit, "cannot run", path, reason=reason))
            else:
                executor = LocalExecutor(plugins, code_root=revision.root, env=revision.env, fingerprint=fingerprint)
                resume = path if path.exists() and not force else False
                summary = runner.run(
                    part, out_dir, resume=resume, retry_failed=True, path=path, plugins=plugins, command=command, progress=progress, executor=executor
                )
                finished.append(CommitRun(commit, "measured", path, summary))
                if summary.interrupted or summary.write_error:
                    break
        say(_line(finished[-1]))
    return finished


def _line(run: CommitRun) -> str:
    if run.outcome == "cannot run":
        return f"{run.commit[:10]}: cannot run the scenario ({run.reason}) -> {run.path}"
    return f"{run.commit[:10]}: {run.summary.headline()}"


def exit_code(finished: list[CommitRun]) -> int:
    """``attnbench run``'s exit code over the commits: 130 interrupted, 2 a results file could not be
    written, 1 a cell failed (a commit that cannot run fails each of its cells), else 0."""
    summaries = [run.summary for run in finished if run.summary is not None]
    if any(summary.interrupted for summary in summaries):
        return 130
    if any(summary.write_error for summary in summaries):
        return 2
    return 1 if any(run.outcome == "cannot run" for run in finished) or any(summary.failed for summary in summaries) else 0

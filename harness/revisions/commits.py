"""``attnbench run SCENARIO --commits RANGE``: the scenario measured at each first-parent commit of a range
(every Nth), each in a temporary worktree with its own code, worker processes and Triton cache (as
regress does: ``checkouts.worktree``, ``LocalExecutor(code_root=...)``), the scenario file taken from the
newest commit so that every commit measures the same cells. One results file per commit and machine,
``SCENARIO-COMMIT-MACHINE.jsonl``; a commit already measured on this machine is skipped (``force``:
measured again); a commit whose code cannot run is recorded with the reason in each cell, and the range
goes on. ``dry_run`` lists the commits, those already measured and the estimated duration, and measures
nothing. docs/history.md; ``attnbench history`` draws the results (``harness.history``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from ..common.checkouts import RegressError, commit_of, git, repository, scratch_directory, worktree
from ..common.formatting import counted
from ..measuring import machine
from ..results import ResultsFileError, ResultsWriter, cell_record, read_records, run_header
from ..running import runner
from ..running.estimate import Estimator, Measured, format_duration, roofs_for
from ..running.executors import main_device, unmeasured
from ..running.executors.local import LocalExecutor
from ..running.worker import CHECKOUT_WORKER
from ..scenarios.scenario import LoadedScenario, load_scenario

#: What a commit's code must import to measure a cell: its worker's loop (as ``Worker(code_root=...)`` finds it, from
#: before and after harness/ was grouped by role) and its variants.
IMPORT_CHECK = CHECKOUT_WORKER.rpartition("\n")[0] + "\nimport variants"
#: What a commit costs besides its run (``harness.running.estimate``'s, the run's start included): its worktree added and
#: removed, and ``IMPORT_CHECK`` in a fresh interpreter over sources not yet compiled. Measured on the 2-core development VM:
#: the worktree 0.4-0.6 s, the import check 4.7-5.3 s of CPU (14-19 s of wall time while other processes kept a load of 6).
CHECKOUT_S = 6.0


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
    """The first-parent commits of ``A..B`` (oldest first), the newest and every ``every``-th before it. Each end is
    resolved to its commit first, so git never reads a revision as an option."""
    first, dots, last = spec.partition("..")
    if not dots or not first or not last or last.startswith("."):
        raise RegressError("not a range of commits (A..B, such as HEAD~10..HEAD or v1.0..main)")
    if every < 1:
        raise RegressError(f"--every must be at least 1, got {every}")
    commits = git(repo, "rev-list", "--first-parent", "--reverse", f"{_end(repo, first)}..{_end(repo, last)}", "--").split()
    if not commits:
        raise RegressError(f"the range {spec!r} holds no commit (is the first revision an ancestor of the second?)")
    return commits[::-1][::every][::-1]


def _end(repo: Path, revision: str) -> str:
    """The commit of one end of a range; one that begins with ``-`` (git would read it as an option) is none."""
    try:
        if not revision.startswith("-"):
            return commit_of(repo, revision)
    except RegressError:
        pass
    raise RegressError(f"{revision!r} is not a revision of the repository at {repo}")


def results_file(out_dir: Path, scenario: str, commit: str, machine_id: str) -> Path:
    return out_dir / f"{scenario}-{commit[:12]}-{machine_id}.jsonl"


def recorded_cells(out_dir: Path, loaded: LoadedScenario, machine_id: str) -> dict[str, set[str]]:
    """Per commit, the cells of ``loaded`` recorded on machine ``machine_id`` in ``out_dir``."""
    recorded = {}
    for path in sorted(out_dir.glob("*.jsonl")) if out_dir.is_dir() else []:
        try:
            records = read_records(path)
        except ResultsFileError:
            continue  # not a file of this command's making; the history will say what is wrong with it
        runs = {record["run_id"] for record in records if record["kind"] == "run" and record["machine"].get("machine_id") == machine_id}
        for record in records:
            if record["kind"] == "cell" and record["run_id"] in runs and record["scenario"] == loaded.name and record.get("commit"):
                recorded.setdefault(record["commit"], set()).add(record["cell_id"])
    return recorded


def measured_before(out_dir: Path, loaded: LoadedScenario, machine_id: str) -> set[str]:
    """The commits at which every cell of ``loaded`` is recorded on machine ``machine_id`` in ``out_dir``."""
    wanted = {cell.cell_id for cell in loaded.cells()}
    return {commit for commit, cells in recorded_cells(out_dir, loaded, machine_id).items() if wanted <= cells}


def cannot_import(root: Path, env: dict) -> str | None:
    """Why the checkout at ``root`` cannot measure (its worker or variants do not import), or None."""
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_CHECK], cwd=root, capture_output=True, text=True, env={**os.environ, **env, "PYTHONPATH": str(root)}, timeout=600
    )
    if done.returncode == 0:
        return None
    return (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]


def _record_failure(path: Path, loaded: LoadedScenario, fingerprint: dict, command: str, reason: str) -> None:
    """A results file whose every cell is an error with ``reason``: the commit is in the history, with why."""
    run_id = f"cannot-run-{fingerprint['git']['commit'][:12]}"
    with ResultsWriter(path) as writer:
        writer.write_run(run_header(loaded, run_id, command, fingerprint))
        for cell in loaded.cells():
            writer.write_cell(cell_record(cell, unmeasured("error", f"this commit cannot run the scenario: {reason}"), run_id, fingerprint))


def _scenario(repo: Path, newest: str, spec: str, preset: str | None, overrides: list[str]) -> LoadedScenario:
    """``spec`` as a file, or the newest commit's shipped scenario of that name."""
    if Path(spec).is_file():
        return load_scenario(spec, preset=preset, overrides=overrides)
    with scratch_directory() as scratch, worktree(repo, newest, "scenario", scratch) as revision:
        return load_scenario(str(revision.root / "scenarios" / f"{spec}.yaml"), preset=preset, overrides=overrides)


@dataclass
class Range:
    """A range to measure: its commits (oldest first), the scenario they measure, this machine's fingerprint and the
    cells already recorded at each commit on it (none with ``force``)."""

    repo: Path
    spec: str
    out_dir: Path
    commits: list[str]
    loaded: LoadedScenario
    here: dict
    recorded: dict[str, set[str]]

    @property
    def done(self) -> set[str]:
        """The commits whose every cell is recorded on this machine: skipped."""
        wanted = {cell.cell_id for cell in self.loaded.cells()}
        return {commit for commit in self.commits if wanted <= self.recorded.get(commit, set())}

    def headline(self) -> str:
        todo = sum(commit not in self.done for commit in self.commits)
        return f"{self.loaded.name}: {counted(len(self.commits), 'commit')} of {self.spec}, {todo} to measure -> {self.out_dir}/"


def commit_range(repo, spec: str, commits_range: str, out_dir, *, preset=None, overrides=(), every: int = 1, force: bool = False) -> Range:
    """The ``Range`` of ``commits_range`` (every ``every``-th, the newest always) for scenario ``spec``, results in ``out_dir``."""
    repo, out_dir = repository(repo), Path(out_dir)
    commits = range_commits(repo, commits_range, every)
    loaded = _scenario(repo, commits[-1], spec, preset, list(overrides))
    here = machine.fingerprint(main_device(loaded.cells()))
    recorded = {} if force else recorded_cells(out_dir, loaded, here["machine_id"])
    return Range(repo, commits_range, out_dir, commits, loaded, here, recorded)


def measure_commits(
    repo, spec: str, commits_range: str, out_dir, *, preset=None, overrides=(), every=1, force=False, plugins=(), command="", progress=True, say=print
) -> list[CommitRun]:
    """Measure ``spec`` at each commit of ``commits_range`` (every ``every``-th, the newest always) into ``out_dir``."""
    chosen = commit_range(repo, spec, commits_range, out_dir, preset=preset, overrides=overrides, every=every, force=force)
    say(chosen.headline())
    with scratch_directory() as scratch:
        return _measure(chosen, scratch, force=force, plugins=plugins, command=command, progress=progress, say=say)


def dry_run(chosen: Range, *, gpu: str | None = None, measured_from: str | None = None) -> list[str]:
    """What ``run --commits --dry-run`` prints: the headline, each commit (measured on this machine, in part or
    not) with the estimate of what is left of it, the total and the roofs (EstimateError: an unknown GPU or file)."""
    cells = chosen.loaded.cells()
    roofs = roofs_for(cells, gpu)
    estimator = Estimator(roofs, measured=Measured(measured_from) if measured_from else None)
    described = dict(line.split("\t", 1) for line in git(chosen.repo, "show", "-s", "--format=%H%x09%cs %s", *chosen.commits).splitlines())
    lines, total, todo = [chosen.headline() + " (dry run: nothing is measured)"], 0.0, 0
    for commit in chosen.commits:
        recorded = chosen.recorded.get(commit, set())
        left = [cell for cell in cells if cell.cell_id not in recorded]
        if not left:
            state = "measured on this machine"
        else:
            seconds = estimator.sweep(left).seconds() + CHECKOUT_S
            total, todo = total + seconds, todo + 1
            part = f"{len(cells) - len(left)} of {len(cells)} cells recorded; " if len(left) < len(cells) else ""
            state = f"to measure: {part}{counted(len(left), 'cell')}, ~{format_duration(seconds)}"
        lines.append(f"  {commit[:10]} {textwrap.shorten(described[commit], 60, placeholder=' ...')}: {state}")
    whole = estimator.sweep(cells).seconds()
    lines.append(
        f"estimated {format_duration(total)} for {counted(todo, 'commit')} to measure: each its cells as `attnbench run --dry-run` estimates them "
        f"({format_duration(whole)} for all {counted(len(cells), 'cell')}, the run's start included) and {CHECKOUT_S:.0f} s for its worktree and import check"
    )
    return lines + [f"roof ({kind}): {roof.describe()}" for kind, roof in roofs.items()]


def _measure(chosen: Range, scratch: Path, *, force, plugins, command, progress, say) -> list[CommitRun]:
    """Each commit of ``chosen`` not ``done`` in its worktree under ``scratch``, one after the other."""
    repo, loaded, out_dir, here, done = chosen.repo, chosen.loaded, chosen.out_dir, chosen.here, chosen.done
    finished = []
    for commit in chosen.commits:
        path = results_file(out_dir, loaded.name, commit, here["machine_id"])
        if commit in done:
            finished.append(CommitRun(commit, "skipped", path))
            continue
        if force:
            path.unlink(missing_ok=True)
        fingerprint = {**here, "git": {"commit": commit, "dirty": False, "describe": commit[:10]}}
        with worktree(repo, commit, commit[:12], scratch) as revision:
            reason = cannot_import(revision.root, revision.env)
            if reason is not None:
                _record_failure(path, loaded, fingerprint, command, reason)
                finished.append(CommitRun(commit, "cannot run", path, reason=reason))
            else:
                executor = LocalExecutor(plugins, code_root=revision.root, env=revision.env, fingerprint=fingerprint)
                summary = runner.run(
                    loaded, out_dir, resume=path if path.exists() else False, path=path, plugins=plugins, command=command, progress=progress, executor=executor
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

"""Performance over time: every commit, every machine, steps found (``attnbench history``, docs/history.md).

``series`` orders the points of results files by commit, ``steps`` finds where a series changes level,
``changes`` makes each a step with its ratio, interval and commands, ``limits`` says what the steps cannot
tell (series too short for a step, unstable series), ``page`` draws the page in the report's style. It
reads results files only; measuring a range of commits is ``revisions.commits``.
May import: common, report, results."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..common.formatting import counted
from .changes import EXIT_BAD_INPUT, EXIT_OK, EXIT_SLOWER, Step, alarming, find
from .limits import Limits, examine
from .page import write_page
from .series import HistoryError, build, is_ancestor, resolve

__all__ = ["EXIT_BAD_INPUT", "HistoryError", "HistoryResult", "history"]


@dataclass
class HistoryResult:
    index: Path
    steps: list[Step]
    alarming: list[Step]
    limits: Limits
    notes: list[str]

    @property
    def exit_code(self) -> int:
        return EXIT_SLOWER if self.alarming else EXIT_OK

    def lines(self, factor: float) -> list[str]:
        """What ``attnbench history`` prints: the count of steps, what they cannot tell (``Limits.lines``), each
        unconfirmed step (a jump at the newest commit), then each slower step beyond ``factor`` that fails."""
        confirmed = [step for step in self.steps if step.confirmed]
        faster, slower = sum(step.direction == "faster" for step in confirmed), sum(step.confirmed for step in self.alarming)
        found = f"history: {counted(len(confirmed), 'step')} ({slower} slower by more than {factor}, {faster} faster)"
        unconfirmed = [step for step in self.steps if not step.confirmed]
        found += f", {len(unconfirmed)} unconfirmed at the newest commit" if unconfirmed else ""
        return (
            [f"{found} -> {self.index}"]
            + self.limits.lines()
            + [f"unconfirmed ({step.direction}, the next commit confirms it or not): {describe(step)}" for step in unconfirmed]
            + [f"slower: {describe(step)}" for step in self.alarming]
        )


def describe(step: Step) -> str:
    """A step as the command prints it: its series, ratio, interval and commits."""
    return (
        f"{step.machine} {step.scenario} {step.variant}[{step.backend}] {step.mode} {step.cell}: x{step.ratio:.3f} "
        f"[{step.ci_low:.3f}, {step.ci_high:.3f}] from {step.good_commit[:10]} to {step.bad_commit[:10]}"
    )


def history(paths, out_dir, *, repo=".", factor: float = 1.1, since: str | None = None, alpha: float = 0.05, fail_unconfirmed: bool = False) -> HistoryResult:
    """Write the history page of the results files or directories ``paths`` into ``out_dir``, ordered
    by ``repo``'s first-parent history; the steps found, and those slower than ``factor`` after ``since``
    (confirmed ones, and with ``fail_unconfirmed`` a jump at the newest commit too)."""
    built = build(paths, repo)
    steps = find(built, alpha=alpha)
    slower = alarming(steps, factor, unconfirmed=fail_unconfirmed)
    if since is not None:
        base = resolve(repo, since)
        slower = [step for step in slower if not is_ancestor(repo, step.bad_commit, base)]
    limits = examine(built, steps, factor)
    index = write_page(built, steps, limits, out_dir, factor=factor, alarming=slower, since=since)
    return HistoryResult(index, steps, slower, limits, built.notes)

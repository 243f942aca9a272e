"""What a regress comparison means once its controls are counted, and the command to run next.

A *control* is a measured cell whose code the diff did not change (its configuration is not touched: ``--all-variants``
measures them). Its ratio should be 1; a control marked ``worse`` or ``better`` (its interval excludes 1 and its ratio is
beyond the factor) says the machine moved the timings, so the verdict on the touched cells is "not trusted" and regress
exits 2 instead of 1. The comparison table (``CompareResult.table``) carries a boolean ``control`` column for this
(``mark_controls``; a table without it has no controls). docs/regress.md, "Reading the output", shows the lines.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

import pandas as pd

from ..common.formatting import format_ratio
from ..results.compare import UNDECIDED, UNSTABLE, CompareResult

#: Marks of a control that moved: its interval excludes 1 and its ratio is beyond the factor.
MOVED = ("worse", "better")
#: Marks that more samples may turn into a verdict.
NOISY = (UNDECIDED, UNSTABLE)
#: Noisy touched cells are measured again with as many rounds as they have (twice, then four times --rounds) at most
#: this many times before they are left noisy: at most 4x the rounds, for those cells only.
MAX_DOUBLINGS = 2
CONTROL_NOTE = "control: its code did not change"


def mark_controls(comparison: CompareResult, touched: set[tuple[str, str, str]]) -> None:
    """Add the ``control`` column: a row whose (variant, backend, params text) is not in ``touched``; its note says so."""
    table = comparison.table
    table["control"] = [(row["variant"], row["backend"], row["params"] or "") not in touched for row in table.to_dict("records")]
    table.loc[table["control"], "note"] = [CONTROL_NOTE + (f"; {note}" if note else "") for note in table.loc[table["control"], "note"]]


def _is_control(table: pd.DataFrame) -> pd.Series:
    return table["control"].astype(bool) if "control" in table else pd.Series(False, index=table.index)


def controls(comparison: CompareResult) -> pd.DataFrame:
    return comparison.table[_is_control(comparison.table)]


def touched_rows(comparison: CompareResult) -> pd.DataFrame:
    return comparison.table[~_is_control(comparison.table)]


def moved_controls(comparison: CompareResult) -> pd.DataFrame:
    """The controls marked worse or better: the machine, not the code, moved them."""
    found = controls(comparison)
    return found[found["mark"].isin(MOVED)]


def trusted(comparison: CompareResult) -> bool:
    """False when a control moved: then no verdict on the touched cells is trusted."""
    return moved_controls(comparison).empty


def noisy_rows(comparison: CompareResult) -> pd.DataFrame:
    """The touched rows more rounds may decide (``too few samples to decide``, ``unstable: not compared``)."""
    rows = touched_rows(comparison)
    return rows[rows["mark"].isin(NOISY)]


def cell_name(row: dict) -> str:
    """``delta[torch] T=128 B=2 ... forward/core`` (with the parameters when there are some)."""
    return f"{row['variant']}[{row['backend']}]{' ' + row['params'] if row['params'] else ''} {row['axes']} {row['mode']}/{row['target']}"


def _with_ratio(row: dict) -> str:
    return f"{cell_name(row)} {format_ratio(row['ratio'])} [{row['ci_low']:.3f}, {row['ci_high']:.3f}] {row['mark']}"


def _counts(rows: pd.DataFrame) -> str:
    found = rows["mark"].value_counts()
    return ", ".join(f"{count} {mark}" for mark, count in found.items()) or "none"


def verdict_lines(comparison: CompareResult) -> list[str]:
    """The counts of the touched cells and of the controls, then, when a control moved, that the verdict is not trusted."""
    touched, control = touched_rows(comparison), controls(comparison)
    thresholds = f"(factor {comparison.factor:g}, alpha {comparison.alpha:g})"
    lines = [f"touched cells (their code changed): {len(touched)}: {_counts(touched)} {thresholds}"]
    if control.empty:
        return lines + ["controls: none measured (--all-variants measures the cells whose code did not change as controls)"]
    lines.append(f"controls (code unchanged): {len(control)}: {_counts(control)}")
    moved = moved_controls(comparison)
    if not moved.empty:
        lines += [f"  control moved: {_with_ratio(row)}" for row in moved.to_dict("records")]
        lines.append(
            f"not trusted: the controls moved ({len(moved)} of {len(control)}): the machine changed the timings, so the touched cells' marks are not a verdict"
        )
    return lines


@dataclass
class Invocation:
    """What the user ran, to write the next command: the revisions and the scenario as typed, the options regress and
    bisect share (``flags``, as argv words: --all-variants, --threads N, --factor F, ...), and what git says of the range:
    ``commits``, the first-parent (commit, subject) of base..head (None: base is not an ancestor of head);
    ``dirty_files``, the working tree's uncommitted changes when head is None."""

    base: str
    head: str | None
    scenario: str
    preset: str | None = None
    overrides: list[str] = field(default_factory=list)
    flags: list[str] = field(default_factory=list)
    commits: list[tuple[str, str]] | None = None
    dirty_files: int = 0

    def command(self, verb: str, rounds: int) -> str:
        """``attnbench regress ...`` or ``attnbench bisect ...`` for this range and scenario with ``rounds``."""
        if verb == "bisect":
            revisions = ["--good", self.base, "--bad", self.head or "HEAD"]
        else:
            revisions = ["--base", self.base, *(["--head", self.head] if self.head else [])]
        scenario = [self.scenario, *(["--preset", self.preset] if self.preset else []), *(word for item in self.overrides for word in ("--set", item))]
        return shlex.join(["attnbench", verb, *revisions, *scenario, "--rounds", str(rounds), *self.flags])


def _bisect_step(worse: pd.DataFrame, invocation: Invocation, rounds: int) -> list[str]:
    """Where the worse cells came from: the command of the bisect, or why there is nothing to bisect."""
    cells = f"{len(worse)} worse cells"
    followed = [f"  {cell_name(row)}" for row in worse.to_dict("records")]
    if invocation.head is None and invocation.dirty_files:
        if not invocation.commits:
            return [f"next: the {cells} come from the working tree's uncommitted changes, the only difference from {invocation.base}: nothing to bisect"]
        step = f"next: commit the working tree's changes, then find which commit of {invocation.base}..HEAD made the {cells} worse:"
    elif invocation.commits is None:
        return [f"next: {invocation.base} is not an ancestor of {invocation.head or 'HEAD'}, so bisect cannot search between them; "
                f"start from their merge base (git merge-base {invocation.base} {invocation.head or 'HEAD'})"]  # fmt: skip
    elif len(invocation.commits) == 1:
        commit, subject = invocation.commits[0]
        return [f"next: nothing to bisect: {commit[:10]} ({subject}) is the only commit in {invocation.base}..{invocation.head or 'HEAD'}"]
    else:
        step = f"next: find which of the {len(invocation.commits)} commits made the {cells} worse:"
    return [step, f"  {invocation.command('bisect', rounds)}", "  it follows these cells:", *followed]


def next_steps(comparison: CompareResult | None, invocation: Invocation, rounds: int, rounds_noisy: int) -> list[str]:
    """The commands to run next: a bisect of the range for worse touched cells (when the controls did not move); more
    rounds for the cells still noisy after ``rounds_noisy`` rounds, or for all when the controls moved."""
    if comparison is None:
        return []
    more = 2 * rounds_noisy
    if not trusted(comparison):
        return [f"next: measure again on a quieter machine, with more rounds: {invocation.command('regress', 2 * rounds)}"]
    lines = []
    worse = touched_rows(comparison)
    worse = worse[worse["mark"] == "worse"]
    if not worse.empty:
        lines += _bisect_step(worse, invocation, rounds)
    noisy = noisy_rows(comparison)
    if not noisy.empty:
        lines.append(
            f"next: {len(noisy)} touched cells stay undecided after {rounds_noisy} rounds ({_counts(noisy)}); "
            f"on a quieter machine, measure them with more rounds: {invocation.command('regress', more)}"
        )
    return lines

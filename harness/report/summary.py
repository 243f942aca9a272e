"""The report's first answer, at its top: which variant is fastest (docs/reports.md, 'Which is fastest').

One table per scenario, machine, mode, timing and set of axes held fixed (dtype, device, batch, heads, widths, ...),
so that only like is compared with like; a column per length (``axes.seq_len``; the longest only where there are
more than ``MAX_LENGTHS``). At each length the fastest cell by median time is named with its time, and every other
cell's median is shown as a multiple of it (×1.7) beside its peak memory. A cell measured unstable or inaccurate is
marked and never named fastest: the fastest stable, accurate one is. Quality cells get the same table for their task's
headline metric (``harness.tasks.Score``, the mean over seeds, ranked as the frontier ranks it; variants that tie
named together, the faster first), a column per value of the task's first axis. Each machine is summarised on its own.
"""

from __future__ import annotations

import json
import math

import pandas as pd

from ..common.formatting import format_seconds, mib, present, text
from ..results.compare import is_unstable
from ..results.identity import axes_text, nested
from ..scenarios.axes import SHORT
from ..tasks import Score
from .cells import TIMED_MODES, base_label, tasks_of
from .figures import Table, natural, table
from .seeds import axes_without_seed, over_seeds

#: The axis whose values are a summary table's columns for timed cells.
LENGTH = "seq_len"
#: The most lengths a table shows; with more, only the longest.
MAX_LENGTHS = 4
#: What a summary cell says of a time that is not to be trusted, in the order the marks are written.
MARKS = {"metrics.unstable": "unstable", "metrics.inaccurate": "inaccurate"}
#: The one column of a quality table whose task has no axis of its own.
ALL = "all"
#: The row class of the first row (the winner at each length), styled in report.html.j2.
WINNER = "winner"


def summary_tables(cells: pd.DataFrame) -> list[Table]:
    """The summary of the report's cells (``prepare``): for each scenario, its timed tables in the order of
    ``TIMED_MODES``, then one per quality task with a score."""
    several_machines = cells["machine"].nunique() > 1
    return [
        table
        for _, scenario in cells.groupby("scenario", sort=True)
        for table in [*_speed_tables(scenario, several_machines), *_quality_tables(scenario, several_machines)]
    ]


def _held_fixed(record: dict, column: str) -> dict:
    """A timed cell's axes other than ``column``: what its table holds fixed. Where the cell has a value width, its
    key width is left out: a variant's own d_key (Based's 16) is part of its label (``base_label``)."""
    axes = nested(record, "axes", (column,))
    if "d_value" in axes:
        axes.pop("d_key", None)
    return axes


def _marks(record: dict) -> list[str]:
    """``MARKS`` that a cell carries: why its time is not to be trusted (empty: it may be named fastest)."""
    return [mark for column, mark in MARKS.items() if is_unstable(record.get(column))]


def _multiple(ratio: float) -> str:
    """``×1.70``, ``×12.3``, ``×140``: a time as a multiple of the fastest, to three digits."""
    return f"×{ratio:#.3g}" if ratio < 100 else f"×{ratio:.0f}"


# --- timed cells ----------------------------------------------------------------------------


def _speed_tables(cells: pd.DataFrame, several_machines: bool) -> list[Table]:
    if f"axes.{LENGTH}" not in cells:
        return []
    timed = cells[cells["mode"].isin(TIMED_MODES) & cells[f"axes.{LENGTH}"].notna()]
    if timed.empty:
        return []
    show_backend = timed["backend"].nunique() > 1
    records = timed.to_dict("records")
    timed = timed.assign(
        _label=[base_label(record, show_backend) for record in records],
        _fixed=[json.dumps(_held_fixed(record, LENGTH), sort_keys=True) for record in records],
    )
    machines = list(dict.fromkeys(timed["machine_key"]))
    several_timings = timed.groupby(["machine_key", "mode"])["timing"].nunique().max() > 1
    groups = sorted(
        timed.groupby(["machine_key", "mode", "timing", "_fixed"], sort=False, dropna=False),
        key=lambda item: (machines.index(item[0][0]), TIMED_MODES.index(item[0][1])),  # held axes: in the order measured
    )
    tables = []
    for (machine_key, mode, timing, fixed), group in groups:
        siblings = timed.loc[(timed["machine_key"] == machine_key) & (timed["mode"] == mode), "_fixed"].unique()
        title = _title(group, mode, _differing(siblings, fixed), timing if several_timings else None, several_machines)
        tables.append(_speed_table(group, title, json.loads(fixed)))
    return tables


def _speed_table(group: pd.DataFrame, title: str, fixed: dict) -> Table:
    """One group's table: the fastest at each length, then each cell's multiple of it and its memory."""
    lengths = sorted(group[f"axes.{LENGTH}"].unique())
    shown = lengths[-1:] if len(lengths) > MAX_LENGTHS else lengths
    columns, winners = {}, {}
    for length in shown:
        at = group[group[f"axes.{LENGTH}"] == length]
        fastest = _fastest(at)
        reference = fastest["metrics.median_s"] if fastest is not None else None
        winners[length] = f"{fastest['_label']}: {format_seconds(reference)}" if fastest is not None else "none (no stable, accurate cell)"
        columns[length] = {record["_label"]: _speed_text(record, reference) for record in at.to_dict("records")}
    longest = group[(group[f"axes.{LENGTH}"] == shown[-1]) & (group["status"] == "ok")].set_index("_label")["metrics.median_s"]
    order = sorted(group["_label"].unique(), key=lambda label: (_rank(longest.get(label)), natural(label)))
    clocks = ", ".join(clock for clock in group["clock"].unique() if present(clock))
    caption = f"Held fixed: {axes_text(fixed) or 'nothing'}" + (f"; timed by: {clocks}" if clocks else "") + "."
    if len(shown) < len(lengths):
        caption += f" Only the longest of {len(lengths)} lengths; the plots below show them all."
    return _grid(title, "fastest", SHORT[LENGTH], winners, columns, order, caption)


def _fastest(at: pd.DataFrame) -> dict | None:
    """The cell with the least median among the ok cells without ``_marks``; None when there is none."""
    eligible = [record for record in at.to_dict("records") if record["status"] == "ok" and present(record["metrics.median_s"]) and not _marks(record)]
    return min(eligible, key=lambda record: record["metrics.median_s"], default=None)


def _speed_text(record: dict, reference: float | None) -> str:
    """``×1.70 · 12.0 MiB (unstable)``; the time itself where no cell is the reference; the status of a failed cell."""
    median = record["metrics.median_s"]
    if record["status"] != "ok" or not present(median):
        return record["status"]
    parts = [_multiple(median / reference) if reference else format_seconds(median)]
    if present(record.get("metrics.peak_mem_bytes")):
        parts.append(mib(record["metrics.peak_mem_bytes"]))
    flags = _marks(record)
    return " · ".join(parts) + (f" ({', '.join(flags)})" if flags else "")


# --- quality cells --------------------------------------------------------------------------


def _quality_tables(cells: pd.DataFrame, several_machines: bool) -> list[Table]:
    tables = []
    for task in tasks_of(cells):
        own = cells[(cells["target"] == task.name) & (cells["mode"] == "quality")]
        if task.score is None or f"metrics.{task.score.metric}" not in own:
            continue
        column = next((axis for axis in task.axes[:1] if f"axes.{axis}" in own), None)
        points = _quality_points(own, task.score, column)
        failed = own[own["status"] != "ok"]
        failed = failed.assign(**_column_and_rest(axes_without_seed(failed), column))
        for (machine_key, fixed), group in points.groupby(["machine_key", "_fixed"], sort=False):
            siblings = points.loc[points["machine_key"] == machine_key, "_fixed"].unique()
            lost = failed[(failed["machine_key"] == machine_key) & (failed["_fixed"] == fixed)]
            title = _title(group, "quality", _differing(siblings, fixed), None, several_machines)
            tables.append(_quality_table(group, lost, task.score, column, title, json.loads(fixed)))
    return tables


def _quality_points(own: pd.DataFrame, score: Score, column: str | None) -> pd.DataFrame:
    """``over_seeds``' rows with ``ranked`` (the mean of the metric as the frontier compares it: past a stopping
    threshold, a tie) and ``_column_and_rest``."""
    metric = f"metrics.{score.metric}"
    points = over_seeds(own, score)
    ranked = over_seeds(own.assign(**{metric: score.compared(own)}), score)["mean"].to_numpy()
    return points.assign(ranked=ranked, **_column_and_rest(points["axes_rest"], column))


def _column_and_rest(axes_rest: pd.Series, column: str | None) -> dict:
    """From each cell's axes without its seed (JSON, ``seeds.axes_without_seed``): ``_at``, its value of ``column``
    (``ALL`` without one), and ``_fixed``, the others (JSON)."""
    axes = [json.loads(value) for value in axes_rest]
    return {
        "_at": [axes_of.get(column, ALL) for axes_of in axes],
        "_fixed": [json.dumps({key: value for key, value in axes_of.items() if key != column}, sort_keys=True) for axes_of in axes],
    }


def _quality_table(group: pd.DataFrame, failed: pd.DataFrame, score: Score, column: str | None, title: str, fixed: dict) -> Table:
    """One group's table: the best variant at each value of ``column``, then each variant's mean metric (the status
    of a variant with no ok cell there)."""
    columns, winners = {}, {}
    for at, points in group.groupby("_at", sort=False):
        goodness = points["ranked"] if score.higher_is_better else -points["ranked"]
        best = points.assign(_goodness=goodness).sort_values(["_goodness", "words_per_s"], ascending=False)
        tied = best[best["ranked"] == best["ranked"].iloc[0]]
        names = ", ".join(tied["series"]) + (" (tie)" if len(tied) > 1 else "")
        winners[at] = f"{names}: {score.metric} {text(best['mean'].iloc[0])}"
        columns[at] = {
            record["series"]: text(record["mean"]) + (f" ({record['seeds']} seeds)" if record["seeds"] > 1 else "") for record in best.to_dict("records")
        }
    for record in failed.to_dict("records"):
        columns.setdefault(record["_at"], {}).setdefault(record["series"], record["status"])
    order = sorted(dict.fromkeys([*group["series"], *failed["series"]]), key=natural)
    direction = "higher" if score.higher_is_better else "lower"
    caption = f"Held fixed: {axes_text(fixed) or 'nothing'}; {score.metric}: {direction} is better, the mean over seeds where a variant has several."
    if score.stop_field:
        caption += f" Training stops at the task's {score.stop_field}: the variants past it tie."
    return _grid(title, "best", SHORT.get(column, column), winners, columns, order, caption)


# --- shared ----------------------------------------------------------------------------------


def _grid(title: str, winner: str, axis: str | None, winners: dict, columns: dict, order: list[str], caption: str) -> Table:
    """A Table with a column per key of ``columns`` (a value of ``axis``, in order), a first row naming each column's
    winner (``winners``), then a row per label of ``order``: ``columns`` maps a value to each label's text."""
    values = sorted(columns, key=lambda value: natural(str(value)))
    headers = [ALL if value == ALL else f"{axis}={value:g}" if isinstance(value, (int, float)) else f"{axis}={value}" for value in values]
    rows = [{"label": winner, "kind": WINNER, **{header: winners.get(value) for header, value in zip(headers, values)}}]
    rows += [{"label": label, "kind": "", **{header: columns[value].get(label) for header, value in zip(headers, values)}} for label in order]
    return table(title, pd.DataFrame(rows), [("variant", "label", text), *((header, header, text) for header in headers)], caption, classes="kind")


def _title(group: pd.DataFrame, mode: str, differing: dict, timing: str | None, several_machines: bool) -> str:
    """``smoke-cpu: forward``, then what tells this table from its siblings: the held axes that differ, the timing
    where a mode has several, the machine where the report has several."""
    first = group.iloc[0]
    parts = [f"{first['scenario']}: {mode}", axes_text(differing), timing if present(timing) else "", f"on {first['machine']}" if several_machines else ""]
    return " · ".join(part for part in parts if part)


def _differing(siblings, fixed: str) -> dict:
    """The axes of ``fixed`` (JSON) whose values differ among ``siblings`` (the held axes of the tables of one mode)."""
    every = [json.loads(sibling) for sibling in siblings]
    return {key: value for key, value in json.loads(fixed).items() if len({json.dumps(axes.get(key)) for axes in every}) > 1}


def _rank(median) -> float:
    return median if present(median) else math.inf

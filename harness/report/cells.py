"""The report's cells: ``results.load``'s frame with each cell's identity, machine name, line
label (``series``) and its scenario's x axis (``prepare``: the axis it sweeps, ``swept``); colours and line styles."""

from __future__ import annotations

import numpy as np
import pandas as pd

from .. import tasks
from ..common.formatting import present
from ..results.identity import CELL_KEY, identify, latest
from ..scenarios import axes as axis_table
from .figures import distinct_colours, natural

#: Axes that can be the x axis of a plot, in order of preference (after a task's own axes).
X_CANDIDATES = axis_table.X_CANDIDATES
#: Axes that, when they vary within one line, become part of its label.
LABEL_AXES = X_CANDIDATES + tuple(axis.name for axis in axis_table.TABLE if not axis.x)
TIMED_MODES = ("forward", "train", "decode")
#: The cells of one line of a plot, before its axes: one variant configuration on one machine, in one mode and timing.
LINE = ["variant", "params_text", "backend", "target", "machine_key", "mode", "timing"]
DASHES = ("-", "--", ":", "-.")
#: What one measurement is, per machine and timing mode (``timing``: metrics.timing, ``events``
#: in files from before the modes): a cell measured again in the same mode supersedes the earlier one.
MEASUREMENT = CELL_KEY + ["machine_key", "axes.device", "timing"]
#: Optional columns of a cell line (docs/results.md) the report reads, added empty when no cell has them.
READ = ["axes.device", "axes.seq_len", "axes.dtype"]
#: Metric columns the plots and tables read (added, empty, when no cell has them).
PLOTTED = [
    f"metrics.{name}"
    for name in (
        "median_s",
        "p20_s",
        "p80_s",
        "tokens",
        "tokens_per_s",
        "peak_mem_bytes",
        "memory_kind",
        "words_per_s",
        "throttled",
        "rel_ci",
        "unstable",
        "roofline_fraction",
        "bound",
        "load.other_cores",
        "rel_error",
        "rel_error_tolerance",
    )
]


def base_label(record: dict, show_backend: bool) -> str:
    """``performer(m=32)``, with ``[backend]`` when the report holds several backends, and a
    variant's own query/key width where it differs from the values' (``based(d_key=16)``)."""
    params = record["params_text"]
    d_key, d_value = record.get("axes.d_key"), record.get("axes.d_value")
    if pd.notna(d_key) and pd.notna(d_value) and d_key != d_value:
        params = ", ".join(filter(None, [params, f"d_key={d_key:g}"]))
    return record["variant"] + (f"({params})" if params else "") + (f"[{record['backend']}]" if show_backend else "")


def varying_axes(cells: pd.DataFrame, x: str) -> list[str]:
    """The axes (other than ``x``) that take several values along one line (``LINE``) at one ``x``: part of its label."""
    group = [*LINE, f"axes.{x}"]
    return [axis for axis in LABEL_AXES if axis != x and f"axes.{axis}" in cells and cells.groupby(group, dropna=False)[f"axes.{axis}"].nunique().max() > 1]


def tasks_of(cells: pd.DataFrame) -> list[tasks.Task]:
    """The registered tasks whose cells these are (a plugin's task not loaded here has none). Only
    quality cells have one, so a report of speed cells imports no task module (nor the variants
    and torch they import): it reads the results files alone."""
    targets = set(cells.loc[cells["mode"] == "quality", "target"].dropna())
    return [task for task in tasks.tasks() if task.name in targets] if targets else []


def swept(cells: pd.DataFrame, axis: str) -> bool:
    """Whether ``axis`` takes several values along one line (``LINE``). An axis that differs only between
    variants (Based's own d_key 16 beside the others' 32) is a property of each line, not a sweep."""
    column = f"axes.{axis}"
    return column in cells and bool((cells.groupby(LINE, dropna=False)[column].nunique() > 1).any())


def x_axis(cells: pd.DataFrame) -> str:
    """The axis to plot against: the first of the cells' task axes and ``X_CANDIDATES`` that is
    ``swept``, else the first of them the cells have (nothing swept: the plots are bars by variant),
    else device (a task without axes)."""
    candidates = [*(axis for task in tasks_of(cells) for axis in task.axes), *X_CANDIDATES]
    return next((axis for axis in candidates if swept(cells, axis)), next((axis for axis in candidates if f"axes.{axis}" in cells), "device"))


def _series(cells: pd.DataFrame, x: str) -> pd.Series:
    """Each cell's line label: variant, parameters, backend, and any other axis that varies."""
    extra = varying_axes(cells, x)
    return pd.Series(
        [" ".join([record["_label"], *(f"{axis}={record[f'axes.{axis}']}" for axis in extra)]) for record in cells.to_dict("records")],
        index=cells.index,
        dtype=object,
    )


def machine_names(cells: pd.DataFrame) -> dict[str, str]:
    """machine_id -> display name, in order of appearance; the id is added where names collide."""
    first = cells.drop_duplicates("machine_key")
    names = dict(zip(first["machine_key"], first["machine"]))
    collide = pd.Series(names).duplicated(keep=False)
    return {key: f"{name} #{key[:6]}" if collide[key] else name for key, name in names.items()}


def prepare(frame: pd.DataFrame) -> pd.DataFrame:
    """The cells of ``load`` with what the report needs: the identity columns (machines are
    matched without the device name), the machine's display name, each scenario's x axis
    and each cell's line label (``series``; with its timing mode where the report holds several), what timed it
    (``clock``: ``metrics.clock``, or its timing mode for a record without one); the latest measurement of each cell in each timing mode only."""
    cells = identify(frame.assign(**{column: np.nan for column in READ if column not in frame}), ignore_axes=("device",))
    timing = cells["metrics.timing"] if "metrics.timing" in cells else pd.Series(np.nan, index=cells.index)
    cells["timing"] = timing.where(timing.map(present), "events").where(cells["mode"] != "quality")
    clock = cells["metrics.clock"] if "metrics.clock" in cells else pd.Series(np.nan, index=cells.index)
    cells["clock"] = clock.where(clock.map(present), cells["timing"])
    cells = latest(cells, MEASUREMENT)
    show_backend, show_timing = cells["backend"].nunique() > 1, cells["timing"].nunique() > 1
    cells["_label"] = [
        base_label(record, show_backend) + (f" ({record['timing']})" if show_timing and present(record["timing"]) else "")
        for record in cells.to_dict("records")
    ]
    cells["machine"] = cells["machine_key"].map(machine_names(cells))
    x_of = {name: x_axis(group) for name, group in cells.groupby("scenario")}
    cells["x_axis"] = cells["scenario"].map(x_of)
    cells["series"] = pd.concat([_series(group, x_of[name]) for name, group in cells.groupby("scenario")])
    missing = [column for column in PLOTTED if column not in cells]
    return cells.drop(columns="_label").assign(**dict.fromkeys(missing, np.nan))


def palette(cells: pd.DataFrame) -> dict[str, tuple]:
    """One colour per line label for the whole report, so a variant looks the same in every plot; labels in
    the legend's order, each as far from those before it as ``distinct_colours`` can put it."""
    labels = sorted(cells["series"].unique(), key=natural)
    return dict(zip(labels, distinct_colours(len(labels))))


def machine_styles(cells: pd.DataFrame) -> dict[str, str]:
    """One line style per machine (solid for the first)."""
    return {name: DASHES[index % len(DASHES)] for index, name in enumerate(cells["machine"].unique())}

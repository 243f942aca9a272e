"""An HTML report of results files: what was measured where, plots per scenario, machines
side by side, and optionally a comparison of two commits.

``build_report(paths, out_dir)`` writes ``out_dir/index.html`` (self-contained: every plot
is embedded as a PNG data URI), ``out_dir/cells.csv`` (one row per cell) and every plot as a
PNG file under ``out_dir/plots/``. It reads results files only (``harness.results``), never
the runner, so a report can be made on a laptop from files measured on a cluster. How to
read it is in docs/reports.md.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import importlib.resources
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jinja2
import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.ticker import MaxNLocator, NullLocator

from . import tasks
from .compare import CELL_KEY, UNSTABLE_SUFFIX, CompareResult, format_median, identify, is_unstable, latest
from .figures import FAILURE_MARK, Figures, Plot, Table, natural, natural_columns, new_figure, table
from .formatting import MIB, flag, format_ratio, format_seconds, fraction, gib, mib, percent, present, si, text
from .frontier import cell_flags, frontier_plot
from .results import FAILED, load, read_records
from .seeds import seed_table

#: Axes that can be the x axis of a plot, in order of preference (after a task's own axes).
X_CANDIDATES = ("seq_len", "batch", "heads", "d_key", "d_value", "new_tokens")
#: Axes that, when they vary within one line, become part of its label.
LABEL_AXES = X_CANDIDATES + ("dtype", "device", "model")
TIMED_MODES = ("forward", "train", "decode")
#: The quality table's columns after those of the tasks (``harness.tasks.Task.metrics``).
COMMON_QUALITY_METRICS = ("words_per_s", "peak_mem_bytes", "wall_s")
DASHES = ("-", "--", ":", "-.")
#: What one measurement is, per machine: a cell measured again supersedes the earlier one.
MEASUREMENT = CELL_KEY + ["machine_key", "axes.device"]
#: Metric columns the plots and tables read (added, empty, when no cell has them).
PLOTTED = [
    f"metrics.{name}"
    for name in ("median_s", "p20_s", "p80_s", "tokens", "tokens_per_s", "peak_mem_bytes", "memory_kind", "words_per_s", "throttled",
                 "rel_ci", "unstable", "roofline_fraction", "bound", "load.other_cores")
]
#: The caption of a table with a median measured unstable (shown with compare.UNSTABLE_SUFFIX).
UNSTABLE_NOTE = ("A time marked * was measured unstable (its median never reached measure.target_rel_ci): do not trust it; "
                 "ratios with one are left out of means.")
#: How an unstable cell's point is drawn on top of its line: an open ring around it.
UNSTABLE_MARK = {"marker": "o", "markersize": 11, "markerfacecolor": "none", "markeredgewidth": 1.5, "linestyle": "none"}


# --- the cells ----------------------------------------------------------------------------


def _base_label(record: dict, show_backend: bool) -> str:
    """``performer(m=32)``, with ``[backend]`` when the report holds several backends, and a
    variant's own query/key width where it differs from the values' (``based(d_key=16)``)."""
    params = record["params_text"]
    d_key, d_value = record.get("axes.d_key"), record.get("axes.d_value")
    if pd.notna(d_key) and pd.notna(d_value) and d_key != d_value:
        params = ", ".join(filter(None, [params, f"d_key={d_key:g}"]))
    return record["variant"] + (f"({params})" if params else "") + (f"[{record['backend']}]" if show_backend else "")


def _varying_axes(cells: pd.DataFrame, x: str) -> list[str]:
    """The axes (other than ``x``) that take several values along one line of one machine."""
    group = ["_label", "machine_key", "mode", f"axes.{x}"]
    return [
        axis for axis in LABEL_AXES
        if axis != x and f"axes.{axis}" in cells and cells.groupby(group, dropna=False)[f"axes.{axis}"].nunique().max() > 1
    ]


def _tasks_of(cells: pd.DataFrame) -> list[tasks.Task]:
    """The registered tasks whose cells these are (a plugin's task not loaded here has none)."""
    targets = set(cells["target"].dropna())
    return [task for task in tasks.tasks() if task.name in targets]


def x_axis(cells: pd.DataFrame) -> str:
    """The swept axis to plot against: the first of the cells' task axes and ``X_CANDIDATES``
    that varies, else the first of them the cells have, else device (a task without axes)."""
    candidates = [*(axis for task in _tasks_of(cells) for axis in task.axes), *X_CANDIDATES]
    for axis in candidates:
        if f"axes.{axis}" in cells and cells[f"axes.{axis}"].nunique() > 1:
            return axis
    return next((axis for axis in candidates if f"axes.{axis}" in cells), "device")


def _series(cells: pd.DataFrame, x: str) -> pd.Series:
    """Each cell's line label: variant, parameters, backend, and any other axis that varies."""
    extra = _varying_axes(cells, x)
    return pd.Series(
        [
            " ".join([record["_label"], *(f"{axis}={record[f'axes.{axis}']}" for axis in extra)])
            for record in cells.to_dict("records")
        ],
        index=cells.index,
        dtype=object,
    )


def _machine_names(cells: pd.DataFrame) -> dict[str, str]:
    """machine_id -> display name, in order of appearance; the id is added where names collide."""
    first = cells.drop_duplicates("machine_key")
    names = dict(zip(first["machine_key"], first["machine"]))
    collide = pd.Series(names).duplicated(keep=False)
    return {key: f"{name} #{key[:6]}" if collide[key] else name for key, name in names.items()}


def prepare(frame: pd.DataFrame) -> pd.DataFrame:
    """The cells of ``load`` with what the report needs: the identity columns (machines are
    matched without the device name), the machine's display name, each scenario's x axis
    and each cell's line label (``series``); the latest measurement of each cell only."""
    cells = identify(frame, ignore_axes=("device",))
    cells = latest(cells, MEASUREMENT)
    show_backend = cells["backend"].nunique() > 1
    cells["_label"] = [_base_label(record, show_backend) for record in cells.to_dict("records")]
    cells["machine"] = cells["machine_key"].map(_machine_names(cells))
    x_of = {name: x_axis(group) for name, group in cells.groupby("scenario")}
    cells["x_axis"] = cells["scenario"].map(x_of)
    cells["series"] = pd.concat([_series(group, x_of[name]) for name, group in cells.groupby("scenario")])
    missing = [column for column in PLOTTED if column not in cells]
    return cells.drop(columns="_label").assign(**dict.fromkeys(missing, np.nan))


def palette(cells: pd.DataFrame) -> dict[str, tuple]:
    """One colour per line label for the whole report, so a variant looks the same in every plot."""
    labels = sorted(cells["series"].unique(), key=natural)
    if len(labels) > 20:
        return dict(zip(labels, sns.color_palette("husl", len(labels))))
    tab20 = sns.color_palette("tab20")
    return dict(zip(labels, tab20[0::2] + tab20[1::2]))  # the ten strong colours first, then their light shades


def _machine_styles(cells: pd.DataFrame) -> dict[str, str]:
    """One line style per machine (solid for the first)."""
    return {name: DASHES[index % len(DASHES)] for index, name in enumerate(cells["machine"].unique())}


# --- plots --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Metric:
    """What a plot shows: the y value of a cell and its p20-p80 band (None: no band)."""

    slug: str
    title: str
    ylabel: str
    value: Callable[[pd.DataFrame], pd.Series]
    band: Callable[[pd.DataFrame], tuple[pd.Series, pd.Series]] | None = None
    detail: Callable[[pd.DataFrame], str] = lambda cells: ""


METRICS = (
    Metric("time", "Time per call (median, p20-p80 band)", "seconds",
           lambda c: c["metrics.median_s"], lambda c: (c["metrics.p20_s"], c["metrics.p80_s"])),
    Metric("throughput", "Throughput (tokens/s at the median, band from p80 and p20)", "tokens / s",
           lambda c: c["metrics.tokens_per_s"], lambda c: (c["metrics.tokens"] / c["metrics.p80_s"], c["metrics.tokens"] / c["metrics.p20_s"])),
    Metric("memory", "Peak memory", "MiB", lambda c: c["metrics.peak_mem_bytes"] / MIB,
           detail=lambda c: "Counter: " + ", ".join(c["metrics.memory_kind"].dropna().unique()) + " (docs/results.md)."),
    Metric("roofline", "Fraction of the roofline (calibrated peaks)", "fraction of the limit", lambda c: c["metrics.roofline_fraction"],
           detail=lambda c: "The time the machine's calibrated matmul FLOP/s and copy bandwidth allow for the cell's FLOPs and "
                            "minimum bytes, over its median time; 1 is the limit (docs/results.md, 'Roofline')."),
)


def _geometric(values) -> bool:
    """Whether sorted distinct positive ``values`` grow by one constant factor of at least 2."""
    values = np.unique(np.asarray([v for v in values if present(v)], dtype=float))
    if len(values) < 2 or values[0] <= 0:
        return False
    ratios = values[1:] / values[:-1]
    return bool(ratios[0] >= 2 and np.allclose(ratios, ratios[0], rtol=1e-6))


def _draw_lines(ax, ok: pd.DataFrame, x: str, metric: Metric, figures: Figures) -> None:
    """One line per label and machine, with its band."""
    for (series, machine), line in ok.groupby(["series", "machine"], sort=True):
        line = line.sort_values(f"axes.{x}")
        xs, ys = line[f"axes.{x}"].to_numpy(float), metric.value(line).to_numpy(float)
        colour, style = figures.colours[series], figures.styles[machine]
        ax.plot(xs, ys, color=colour, linestyle=style, marker="o", markersize=4)
        unstable = line["metrics.unstable"].map(lambda value: value is True).to_numpy()
        ax.plot(xs[unstable], ys[unstable], color=colour, **UNSTABLE_MARK)
        if metric.band is not None:
            low, high = metric.band(line)
            ax.fill_between(xs, low.to_numpy(float), high.to_numpy(float), color=colour, alpha=0.2, linewidth=0)


def _draw_failures(ax, failed: pd.DataFrame, x: str, figures: Figures) -> None:
    """An 'x' on the x axis at the position of each failed cell, in its line's colour; the
    failures at one position are stacked upwards so that none hides another."""
    failed = failed.sort_values(["series", "machine"])
    heights = 0.04 + 0.06 * failed.groupby(f"axes.{x}").cumcount()
    for record, height in zip(failed.to_dict("records"), heights):
        ax.plot(record[f"axes.{x}"], height, color=figures.colours[record["series"]], transform=ax.get_xaxis_transform(), clip_on=False, **FAILURE_MARK)


def _draw_bars(ax, ok: pd.DataFrame, failed: pd.DataFrame, metric: Metric, figures: Figures) -> None:
    """A sweep of a single point: one horizontal bar per label (and machine) with the band as an
    error bar; a failed cell gets an 'x' at the start of its row."""
    entries = pd.concat([ok, failed]).sort_values(["series", "machine"], ascending=False, key=natural_columns).reset_index(drop=True)
    values = metric.value(entries).where(entries["status"] == "ok")
    error = None
    if metric.band is not None:
        low, high = metric.band(entries)
        error = np.vstack([values - low, high - values])
    positions = np.arange(len(entries))
    bars = ax.barh(positions, values.fillna(0), xerr=error, color=[figures.colours[s] for s in entries["series"]], alpha=0.85)
    for bar, unstable in zip(bars, entries["metrics.unstable"].map(lambda value: value is True)):
        bar.set_hatch("//" if unstable else None)
    several = entries["machine"].nunique() > 1
    ax.set_yticks(positions, [f"{r['series']} · {r['machine']}" if several else r["series"] for r in entries.to_dict("records")])
    for position in positions[entries["status"].isin(FAILED).to_numpy()]:
        ax.plot(0.02, position, color=figures.colours[entries["series"][position]], transform=ax.get_yaxis_transform(), clip_on=False, **FAILURE_MARK)


def _draw_panel(ax, ok: pd.DataFrame, failed: pd.DataFrame, x: str, metric: Metric, figures: Figures) -> None:
    """Lines against ``x`` for a sweep, bars for a single point."""
    if pd.concat([ok, failed])[f"axes.{x}"].nunique() == 1:
        _draw_bars(ax, ok, failed, metric, figures)
        ax.set(xlabel=metric.ylabel)
        return
    _draw_lines(ax, ok, x, metric, figures)
    _draw_failures(ax, failed, x, figures)
    _scale_axes(ax, pd.concat([ok, failed])[f"axes.{x}"], metric.value(ok).dropna())
    ax.set(xlabel=x, ylabel=metric.ylabel)


def _scale_axes(ax, xs, ys) -> None:
    """Log x (base 2, ticks at the swept values) for a geometric sweep, then log y when every
    value is positive."""
    if _geometric(xs):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(set(xs)), [f"{value:g}" for value in sorted(set(xs))])
        ax.xaxis.set_minor_locator(NullLocator())
        if len(ys) and (np.asarray(ys, dtype=float) > 0).all():
            ax.set_yscale("log")


def _metric_plot(cells: pd.DataFrame, metric: Metric, figures: Figures, name: str) -> Plot | None:
    """``metric`` against the scenario's x axis, one panel per mode; None without data."""
    x = cells["x_axis"].iloc[0]
    timed = cells[cells["mode"].isin(TIMED_MODES)]
    ok = timed[(timed["status"] == "ok") & metric.value(timed).notna()]
    failed = timed[timed["status"].isin(FAILED)]
    if ok.empty:
        return None
    modes = [mode for mode in TIMED_MODES if mode in set(timed["mode"])]
    figure, axes = new_figure(len(modes))
    for ax, mode in zip(axes, modes):
        _draw_panel(ax, ok[ok["mode"] == mode], failed[failed["mode"] == mode], x, metric, figures)
        ax.set_title(mode)
    figures.legend(figure, pd.concat([ok, failed]), not failed.empty)
    unstable = int(ok["metrics.unstable"].map(lambda value: value is True).sum())
    warning = (f"{unstable} unstable cell(s), ringed (hatched bars): their median is not known to measure.target_rel_ci; do not trust them."
               if unstable else "")
    caption = " ".join(filter(None, [f"{metric.title} against {x}.", metric.detail(ok), warning, _decode_note(cells)]))
    return figures.save(figure, f"{name}-{metric.slug}", metric.title, caption)


def _decode_note(cells: pd.DataFrame) -> str:
    """What one decode call is, when the scenario decodes."""
    if "decode" not in set(cells["mode"]) or "axes.new_tokens" not in cells:
        return ""
    steps = "/".join(str(int(s)) for s in sorted(cells["axes.new_tokens"].dropna().unique()))
    return f"decode: one call is the {steps} generated tokens of one round, after a prefill of {cells['x_axis'].iloc[0]} tokens."


def _latency_plot(cells: pd.DataFrame, figures: Figures, name: str) -> Plot | None:
    """Decode: each generated token's median latency against its position, one panel per context."""
    if "metrics.step_latency_s" not in cells:
        return None
    decode = cells[(cells["mode"] == "decode") & (cells["status"] == "ok") & cells["metrics.step_latency_s"].map(lambda v: isinstance(v, list))]
    if decode.empty:
        return None
    contexts = sorted(decode["axes.seq_len"].unique())
    figure, axes = new_figure(len(contexts))
    for ax, context in zip(axes, contexts):
        for record in decode[decode["axes.seq_len"] == context].sort_values("series", key=natural_columns).to_dict("records"):
            latency = np.asarray(record["metrics.step_latency_s"], dtype=float)
            positions = context + np.arange(1, len(latency) + 1)
            ax.plot(positions, latency * 1e3, color=figures.colours[record["series"]], linestyle=figures.styles[record["machine"]], marker=".")
        ax.set(title=f"context {context}", xlabel="position of the generated token", ylabel="latency (ms)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    figures.legend(figure, decode, False)
    title = "Decode latency per generated token (median over rounds)"
    return figures.save(figure, f"{name}-decode-latency", title, f"{title}, after a prefill of the context; one panel per context length.")


# --- tables -------------------------------------------------------------------------------


def _cell_columns(cells: pd.DataFrame) -> list[tuple[str, str, Callable]]:
    """The columns that name a cell: line label, machine (when several), mode, axes."""
    machine = [("machine", "machine", text)] if cells["machine"].nunique() > 1 else []
    return [("variant", "series", text), *machine, ("mode", "mode", text), ("axes", "axes_text", text)]


def _failures_table(cells: pd.DataFrame) -> Table | None:
    failures = cells[cells["status"] != "ok"].sort_values(["status", "series", "mode"], key=natural_columns)
    if failures.empty:
        return None
    columns = _cell_columns(cells) + [("status", "status", text), ("message", "error", text)]
    caption = "Every cell without valid numbers (oom, error, nan, skipped) and its message; failed cells are the 'x' marks on the plots."
    return table("Cells that failed or were skipped", failures, columns, caption, classes="status")


def _model_table(cells: pd.DataFrame) -> Table | None:
    """Model-level cells in the paper's shape: variant, d_dot, words/s, memory."""
    model = cells[cells["target"] == "model"].sort_values(["series", "mode"], key=natural_columns)
    if model.empty:
        return None
    columns = [
        ("variant", "variant", text), ("d_dot", "params.d_dot", text), ("params", "params_text", text),
        *_cell_columns(cells)[1:], ("words/s", "metrics.words_per_s", si), ("memory", "metrics.peak_mem_bytes", mib),
        ("status", "status", text),
    ]
    return table("Model: words per second and memory", model, columns, "words/s: tokens per second of one training step (one word per token).")


def _quality_table(cells: pd.DataFrame) -> Table | None:
    """Every quality metric the cells have: their tasks' own columns, then throughput, memory, time."""
    quality = cells[cells["mode"] == "quality"]
    metrics = dict.fromkeys([*(metric for task in _tasks_of(quality) for metric in task.metrics), *COMMON_QUALITY_METRICS])
    found = [metric for metric in metrics if f"metrics.{metric}" in quality and quality[f"metrics.{metric}"].notna().any()]
    if not found:
        return None
    quality = quality[quality[[f"metrics.{m}" for m in found]].notna().any(axis=1)].sort_values(["series", "mode"], key=natural_columns)
    columns = _cell_columns(cells) + [(_quality_header(m), f"metrics.{m}", _quality_format(m)) for m in found]
    return table("Quality", quality, columns)


def _quality_header(metric: str) -> str:
    """``words_per_s`` -> ``words/s``, ``peak_mem_bytes`` -> ``peak memory``, ``wall_s`` -> ``wall (s)``."""
    if metric.endswith("_per_s"):
        return metric.removesuffix("_per_s") + "/s"
    return {"peak_mem_bytes": "peak memory", "wall_s": "wall (s)"}.get(metric, metric)


def _quality_format(metric: str) -> Callable:
    return si if metric.endswith("_per_s") else mib if metric.endswith("_bytes") else text


def _timing_table(cells: pd.DataFrame) -> Table | None:
    ok = cells[(cells["status"] == "ok") & cells["mode"].isin(TIMED_MODES)]
    if ok.empty:
        return None
    ok = ok.sort_values(["mode", "series", f"axes.{cells['x_axis'].iloc[0]}"])
    columns = _cell_columns(cells) + [
        ("median", "metrics.median_s", format_seconds), ("p20", "metrics.p20_s", format_seconds), ("p80", "metrics.p80_s", format_seconds),
        ("±CI", "metrics.rel_ci", percent), ("stability", "metrics.unstable", flag),
        ("tokens/s", "metrics.tokens_per_s", si), ("roofline", "metrics.roofline_fraction", fraction), ("bound", "metrics.bound", text),
        ("peak memory", "metrics.peak_mem_bytes", mib), ("other cores", "metrics.load.other_cores", fraction), ("throttled", "metrics.throttled", text),
    ]
    caption = ("±CI: half the 95 % interval of the median, relative; unstable: it stayed wider than measure.target_rel_ci. roofline: the "
               "fraction of the machine's calibrated limit (docs/results.md, 'Roofline'). other cores: the cores other processes kept busy meanwhile.")
    ok = ok.assign(stability=ok["metrics.unstable"].map(lambda value: "unstable" if value is True else "stable"))
    return table("Every timed cell", ok, columns, caption, classes="stability")


# --- backends side by side ----------------------------------------------------------------


def backend_ratios(cells: pd.DataFrame, baseline: str) -> pd.DataFrame:
    """Every timed cell of a backend other than ``baseline`` with the baseline backend's cell of the
    same measurement (scenario, variant, params, axes, mode, target, machine): ``baseline_s`` (its
    median time), ``ratio`` (the cell's median over it; missing where either cell failed),
    ``baseline_unstable`` and ``unstable`` (either cell measured unstable).
    ``cells`` from ``prepare``; the rows carry ``variant_label`` (the line label without the backend)."""
    timed = cells[cells["mode"].isin(TIMED_MODES)]
    timed = timed.assign(variant_label=[_base_label(record, False) for record in timed.to_dict("records")])
    key = [column for column in CELL_KEY if column != "backend"] + ["machine_key"]
    base = timed[(timed["backend"] == baseline) & (timed["status"] == "ok")]
    renamed = {"metrics.median_s": "baseline_s", "metrics.unstable": "baseline_unstable"}
    pairs = timed[timed["backend"] != baseline].merge(base[key + list(renamed)].rename(columns=renamed), on=key)
    pairs["baseline_unstable"] = pairs["baseline_unstable"].map(is_unstable)
    return pairs.assign(ratio=(pairs["metrics.median_s"] / pairs["baseline_s"]).where(pairs["status"] == "ok"),
                        unstable=pairs["baseline_unstable"] | pairs["metrics.unstable"].map(is_unstable))


def _backend_table(cells: pd.DataFrame, baseline: str | None) -> Table | None:
    """Per variant, mode and axes: the baseline backend's median time and each other backend's
    ratio to it (its status where it has no time: skipped, error, ...); None with one backend."""
    if baseline is None or cells["backend"].nunique() < 2:
        return None
    pairs = backend_ratios(cells, baseline)
    if pairs.empty:
        return None
    backends = [backend for backend in dict.fromkeys(cells["backend"]) if backend != baseline]
    rows = []
    for _, group in pairs.groupby(["variant_label", "machine", "mode", "axes_text"], sort=False):
        first = group.iloc[0]
        row = {"variant_label": first["variant_label"], "machine": first["machine"], "mode": first["mode"], "axes_text": first["axes_text"],
               "baseline_s": format_median(first["baseline_s"], first["baseline_unstable"])}
        for record in group.to_dict("records"):
            row[record["backend"]] = _marked_ratio(record["ratio"], record["unstable"]) if present(record["ratio"]) else record["status"]
            if present(record.get("metrics.compile_s")):
                row[f"{record['backend']}_compile_s"] = record["metrics.compile_s"]
        rows.append(row)
    frame = pd.DataFrame(rows).sort_values(["mode", "variant_label", "axes_text"], key=natural_columns)
    machine = [("machine", "machine", text)] if cells["machine"].nunique() > 1 else []
    columns = [("variant", "variant_label", text), *machine, ("mode", "mode", text), ("axes", "axes_text", text),
               (f"{baseline} (median)", "baseline_s", text), *((f"{b} / {baseline}", b, text) for b in backends)]
    notes = []
    if "compile_compile_s" in frame:
        columns.append(("compile time", "compile_compile_s", format_seconds))
        notes.append("compile time: the untimed first call of the compile backend (tracing, compiling, one run: metrics.compile_s).")
    ratios = pairs[~pairs["unstable"]].dropna(subset="ratio")
    means = "; ".join(f"{backend} {np.exp(np.log(group['ratio']).mean()):.3f} over {len(group)} cells" for backend, group in ratios.groupby("backend"))
    if pairs["unstable"].any():
        notes.append(UNSTABLE_NOTE)
    caption = " ".join([f"Each backend's median time over {baseline}'s on the same cell (report.baseline_backend); below 1 is faster.",
                        f"Geometric means: {means or 'none'}.", *notes])
    return table(f"Backends against {baseline}", frame, columns, caption)


# --- machines side by side ----------------------------------------------------------------


def machine_ratios(cells: pd.DataFrame) -> pd.DataFrame:
    """For each scenario measured on several machines: every matching ok cell's median time on
    each other machine over that on the scenario's first machine (matched on scenario,
    variant, backend, params, axes without the device, mode, target). ``cells`` from ``prepare``."""
    ok = cells[cells["status"] == "ok"]
    rows = []
    for _, scenario in ok.groupby("scenario", sort=True):
        machines = list(dict.fromkeys(scenario["machine"]))
        reference = scenario[scenario["machine"] == machines[0]]
        for machine in machines[1:]:
            other = scenario[scenario["machine"] == machine]
            pairs = reference.merge(other, on=CELL_KEY, suffixes=("_ref", ""))
            pairs["reference"], pairs["median_s_ref"], pairs["median_s"] = machines[0], pairs["metrics.median_s_ref"], pairs["metrics.median_s"]
            pairs["unstable_ref"], pairs["unstable"] = pairs["metrics.unstable_ref"].map(is_unstable), pairs["metrics.unstable"].map(is_unstable)
            rows.append(pairs.assign(ratio=pairs["median_s"] / pairs["median_s_ref"]))
    columns = ["scenario", "series", "mode", "axes_text", "reference", "machine", "median_s_ref", "median_s", "ratio", "unstable_ref", "unstable"]
    return pd.concat(rows, ignore_index=True)[columns] if rows else pd.DataFrame(columns=columns)


def _ratio_tables(ratios: pd.DataFrame) -> list[Table]:
    tables = []
    for (scenario, reference, machine), group in ratios.groupby(["scenario", "reference", "machine"], sort=False):
        either = group["unstable_ref"] | group["unstable"]
        stable = group.loc[~either, "ratio"]
        geomean = f"{np.exp(np.log(stable).mean()):.3f}" if len(stable) else "none"
        group = group.assign(
            ref_text=[format_median(s, u) for s, u in zip(group["median_s_ref"], group["unstable_ref"])],
            text=[format_median(s, u) for s, u in zip(group["median_s"], group["unstable"])],
            ratio_text=[_marked_ratio(r, u) for r, u in zip(group["ratio"], either)],
        )
        columns = [("variant", "series", text), ("mode", "mode", text), ("axes", "axes_text", text),
                   (reference, "ref_text", text), (machine, "text", text), ("ratio", "ratio_text", text)]
        caption = f"median time on {machine} / on {reference}, per matching cell; geometric mean {geomean} over {len(stable)} cells."
        caption += f" {UNSTABLE_NOTE}" if either.any() else ""
        tables.append(table(f"{scenario}: {machine} / {reference}", group.sort_values(["mode", "series"], key=natural_columns), columns, caption))
    return tables


# --- the header: machines and runs --------------------------------------------------------


def _runs(files) -> list[dict]:
    """The run lines of every file, each with its file."""
    return [dict(record, file=str(path)) for path in files for record in read_records(path) if record["kind"] == "run"]


def _gpu_facts(gpu: dict | None, versions: dict) -> list[tuple[str, str]]:
    if not gpu:
        return [("GPU", "none")]
    return [
        ("GPU", f"{gpu.get('name')}, {gib(gpu.get('memory_bytes'))}, compute capability {text(gpu.get('compute_capability'))}"),
        ("driver / CUDA", f"driver {text(gpu.get('driver_version'))}, CUDA driver {text(gpu.get('cuda_driver_version'))}, "
                          f"CUDA runtime {text(versions.get('cuda'))}"),
        ("power limit / ECC", f"{text(gpu.get('power_limit_w'))} W, ECC {text(gpu.get('ecc_enabled'))}"),
    ]


def _machine_facts(machine: dict) -> list[tuple[str, str]]:
    """The fingerprint as (label, text) rows."""
    cpu, versions = machine.get("cpu") or {}, machine.get("versions") or {}
    return [
        ("hostname", text(machine.get("hostname"))),
        ("platform", f"{text(machine.get('platform'))}, Python {text(machine.get('python'))}"),
        ("CPU", f"{text(cpu.get('model'))}, {text(cpu.get('usable_cores'))} usable of {text(cpu.get('logical_cores'))} cores, "
                f"{text(cpu.get('torch_threads'))} torch threads"),
        ("memory", gib(machine.get("memory_bytes"))),
        *_gpu_facts(machine.get("gpu"), versions),
        ("versions", f"torch {text(versions.get('torch'))}, triton {text(versions.get('triton'))}, cudnn {text(versions.get('cudnn'))}, "
                     f"numpy {text(versions.get('numpy'))}"),
        *_calibration_facts(machine.get("calibration")),
        ("machine id", machine["machine_id"]),
    ]


def _calibration_facts(calibration: dict | None) -> list[tuple[str, str]]:
    """The calibrated (and datasheet) peaks as (label, text) rows; none for a run without calibration."""
    if not calibration:
        return []
    flops = ", ".join(f"{dtype} {si(value)}FLOP/s" for dtype, value in calibration["matmul_flops_per_s"].items())
    rows = [("calibrated peaks", f"matmul {flops}; copy {si(calibration['bandwidth_bytes_per_s'])}B/s "
                                 f"({calibration['torch_threads']} torch threads)")]
    sheet = calibration.get("datasheet")
    if sheet:
        peaks = ", ".join(f"{key} {si(value)}FLOP/s" for key, value in sheet.items() if key not in ("name", "bandwidth_bytes_per_s"))
        rows.append(("datasheet peaks", f"{sheet['name']}: {peaks}; memory {si(sheet['bandwidth_bytes_per_s'])}B/s; SM clock "
                                        f"{text(calibration.get('sm_clock_mhz'))} MHz"))
    return rows


def _commit_text(run: dict) -> str:
    commit = run.get("commit")
    return "-" if not commit else commit[:12] + (" (dirty: uncommitted changes)" if run.get("dirty") else "")


def _reproduce(run: dict) -> str:
    """The shell lines that repeat a run: check out its commit, then its exact command."""
    checkout = f"git checkout {run['commit']}\n" if run.get("commit") else ""
    command = run.get("command") or f"attnbench run {run.get('scenario_file') or run['scenario']}"
    return checkout + command


def _run_view(run: dict) -> dict:
    """What the page shows of a run line (fields the format does not require may be missing)."""
    return {
        "run_id": run["run_id"], "scenario": run["scenario"], "started_at": run["started_at"],
        "scenario_file": run.get("scenario_file") or "-", "sha256": (run.get("scenario_sha256") or "-")[:12],
        "preset": run.get("preset") or "none", "overrides": " ".join(run.get("overrides") or []) or "none",
        "resumed_from": run.get("resumed_from"), "commit": _commit_text(run), "reproduce": _reproduce(run),
    }


@dataclass
class MachineSection:
    name: str
    facts: list[tuple[str, str]]
    runs: list[dict]
    throttled: Table | None
    throttled_count: int


def _throttled(cells: pd.DataFrame) -> pd.DataFrame:
    return cells[cells["metrics.throttled"].map(lambda value: value is True)]


def _machine_section(name: str, runs: list[dict], cells: pd.DataFrame) -> MachineSection:
    throttled = _throttled(cells)
    dates = sorted(run["started_at"] for run in runs)
    facts = _machine_facts(runs[-1]["machine"]) + [
        ("commits", ", ".join(dict.fromkeys(_commit_text(run) for run in runs))),
        ("run dates", dates[0] if dates[0] == dates[-1] else f"{dates[0]} to {dates[-1]}"),
    ]
    reasons = [(f"reasons {when}", f"metrics.throttle_{when}.reasons", text) for when in ("before", "after")]
    throttled_table = table("Throttled cells", throttled, [("scenario", "scenario", text), *_cell_columns(cells), *reasons]) if len(throttled) else None
    return MachineSection(name, facts, [_run_view(run) for run in runs], throttled_table, len(throttled))


def _machine_sections(cells: pd.DataFrame, runs: list[dict]) -> list[MachineSection]:
    names = dict(zip(cells["machine_key"], cells["machine"]))
    sections = []
    for key, name in names.items():
        own = [run for run in runs if run["machine"]["machine_id"] == key]
        sections.append(_machine_section(name, own, cells[cells["machine_key"] == key]))
    return sections


# --- the report ---------------------------------------------------------------------------


@dataclass
class ScenarioSection:
    name: str
    target: str
    x: str
    statuses: str
    plots: list[Plot]
    tables: list[Table]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-") or "scenario"


def _statuses(cells: pd.DataFrame) -> str:
    counts = cells["status"].value_counts()
    unstable = int(cells["metrics.unstable"].map(lambda value: value is True).sum())
    busy = cells["metrics.load.other_cores"].dropna()
    load = f"; other processes used {busy.mean():.1f} cores on average while they were measured" if len(busy) else ""
    return f"{len(cells)} cells: " + ", ".join(f"{count} {status}" for status, count in counts.items()) + f"; {unstable} unstable" + load


def baseline_backend(runs: list[dict], cells: pd.DataFrame) -> str | None:
    """The backend a scenario's report divides the others by (``report.baseline_backend``): as its
    latest run line records it, else as its scenario file says while that file is still the one
    measured (same sha256, preset and overrides reloaded), else 'torch' when the cells have it."""
    if not runs:
        return "torch" if "torch" in set(cells["backend"]) else None
    run = max(runs, key=lambda run: run["started_at"])
    if "report" in run:
        return (run["report"] or {}).get("baseline_backend")
    path = Path(run.get("scenario_file") or "")
    if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == run.get("scenario_sha256"):
        from .scenario import ScenarioError, load_scenario

        try:
            return load_scenario(str(path), preset=run.get("preset"), overrides=run.get("overrides") or []).scenario.report.baseline_backend
        except ScenarioError:
            pass
    return "torch" if "torch" in set(cells["backend"]) else None


def _scenario_section(name: str, cells: pd.DataFrame, figures: Figures, baseline: str | None = None) -> ScenarioSection:
    slug = _slug(name)
    plots = [_metric_plot(cells, metric, figures, slug) for metric in METRICS] + [_latency_plot(cells, figures, slug)]
    task_sections = []
    for task in _tasks_of(cells):
        own = cells[cells["target"] == task.name]
        task_sections += [*(task.report(own, figures, slug) if task.report else []), *(_score_sections(own, task.score, figures, slug) if task.score else [])]
    plots += [part for part in task_sections if isinstance(part, Plot)]
    tables = [_model_table(cells), _backend_table(cells, baseline), *(part for part in task_sections if isinstance(part, Table)),
              _quality_table(cells), _failures_table(cells), _timing_table(cells)]
    targets = ", ".join(cells["target"].dropna().unique())
    return ScenarioSection(name, targets, cells["x_axis"].iloc[0], _statuses(cells),
                           [p for p in plots if p is not None], [t for t in tables if t is not None])


def _score_sections(cells: pd.DataFrame, score: tasks.Score, figures: Figures, slug: str) -> list:
    """A task's headline metric over seeds (``harness.seeds``) and against speed (``harness.frontier``)."""
    return [seed_table(cells, score), frontier_plot(cells, score, figures, slug)]


def _marked_ratio(ratio, unstable: bool) -> str:
    """A ratio (``format_ratio``), with compare.UNSTABLE_SUFFIX when a time in it was measured unstable."""
    return format_ratio(ratio) + (UNSTABLE_SUFFIX if unstable else "")


def _compare_table(result: CompareResult) -> Table:
    """compare's table; a median measured unstable is shown with a * (``format_median``)."""
    columns = [
        ("scenario", "scenario", text), ("variant", "variant", text), ("params", "params", text), ("axes", "axes", text),
        ("mode", "mode", text), ("base", "base_text", text), ("head", "head_text", text),
        ("ratio", "ratio", format_ratio), ("CI low", "ci_low", format_ratio), ("CI high", "ci_high", format_ratio),
        ("mark", "mark", text), ("note", "note", text),
    ]
    shown = result.table.assign(**{f"{side}_text": [format_median(seconds, unstable) for seconds, unstable in
                                                    zip(result.table[f"{side}_median_s"], result.table[f"{side}_unstable"])] for side in ("base", "head")})
    caption = result.summary() + (f" {UNSTABLE_NOTE}" if result.unstable_shown() else "")
    return table("Comparison of two commits", shown, columns, caption, classes="mark")


def _csv_value(value):
    return json.dumps(value) if isinstance(value, (list, dict)) else value


def write_cells_csv(frame: pd.DataFrame, path: Path, cells: pd.DataFrame | None = None) -> None:
    """Every cell of ``load``, one row each; list values (raw samples, latencies) as JSON. Given
    the report's ``cells`` (``prepare``), a quality cell also says whether its variant is on its
    task's quality–speed frontier (``quality_frontier``, ``harness.frontier``)."""
    if cells is not None:
        flags = [cell_flags(cells[cells["target"] == task.name], task.score) for task in _tasks_of(cells) if task.score]
        if flags:
            frame = frame.assign(quality_frontier=pd.concat(flags).reindex(frame.index))
    frame.map(_csv_value).to_csv(path, index=False)


def _template() -> jinja2.Template:
    source = importlib.resources.files("harness").joinpath("templates/report.html.j2").read_text(encoding="utf-8")
    return jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined).from_string(source)


def build_report(paths, out_dir, *, title: str | None = None, compare_base: CompareResult | None = None) -> Path:
    """Write the report of the results files or directories ``paths`` into ``out_dir``
    (index.html, cells.csv, plots/*.png); return the path of index.html."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    frame = load(paths)
    if frame.empty:
        raise ValueError("the results files hold no cells: nothing to report")
    cells = prepare(frame)
    write_cells_csv(frame, out_dir / "cells.csv", cells)
    runs = _runs(frame["file"].unique())
    figures = Figures(out_dir, palette(cells), _machine_styles(cells))
    scenarios = [
        _scenario_section(name, group, figures, baseline_backend([run for run in runs if run["scenario"] == name], group))
        for name, group in cells.groupby("scenario", sort=True)
    ]
    page = _template().render(
        title=title or "attnbench report: " + ", ".join(section.name for section in scenarios),
        generated=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        files=list(frame["file"].unique()),
        machines=_machine_sections(cells, runs),
        scenarios=scenarios,
        side_by_side=_ratio_tables(machine_ratios(cells)),
        comparison=_compare_table(compare_base) if compare_base is not None else None,
    )
    index = out_dir / "index.html"
    index.write_text(page, encoding="utf-8")
    return index

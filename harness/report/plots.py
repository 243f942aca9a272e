"""The report's plots: each metric against the axis a scenario sweeps (one panel per mode; bars by variant
where it sweeps none), decode latency, speed against accuracy. Each caption says what its cells held fixed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.ticker import FuncFormatter, MaxNLocator, NullLocator

from ..common.formatting import MIB, present, si, text
from ..results import FAILED
from ..results.identity import axes_text
from .cells import LABEL_AXES, TIMED_MODES, swept, varying_axes
from .figures import FAILURE_MARK, Figures, Plot, decades, natural, natural_columns, new_figure

#: How an unstable cell's point is drawn on top of its line: an open ring around it.
UNSTABLE_MARK = {"marker": "o", "markersize": 11, "markerfacecolor": "none", "markeredgewidth": 1.5, "linestyle": "none"}
#: Inches of a bar chart's height per bar, and beside them (title, axis label, ticks).
BAR_HEIGHT, BAR_MARGIN = 0.24, 1.3


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
    Metric("time", "Time per call (median, p20-p80 band)", "seconds", lambda c: c["metrics.median_s"], lambda c: (c["metrics.p20_s"], c["metrics.p80_s"])),
    Metric(
        "throughput",
        "Throughput (tokens/s at the median, band from p80 and p20)",
        "tokens / s",
        lambda c: c["metrics.tokens_per_s"],
        lambda c: (c["metrics.tokens"] / c["metrics.p80_s"], c["metrics.tokens"] / c["metrics.p20_s"]),
    ),
    Metric(
        "memory",
        "Peak memory",
        "MiB",
        lambda c: c["metrics.peak_mem_bytes"] / MIB,
        detail=lambda c: "Counter: " + ", ".join(c["metrics.memory_kind"].dropna().unique()) + " (docs/results.md).",
    ),
    Metric(
        "roofline",
        "Fraction of the roofline (calibrated peaks)",
        "fraction of the limit",
        lambda c: c["metrics.roofline_fraction"],
        detail=lambda c: (
            "The time the machine's calibrated matmul FLOP/s and copy bandwidth allow for the cell's FLOPs and "
            "minimum bytes, over its median time; 1 is the limit (docs/results.md, 'Roofline')."
        ),
    ),
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


def _bar_rows(cells: pd.DataFrame) -> list[tuple]:
    """The rows of a bar chart, top to bottom: each (label, machine) of ``cells``, in the legend's order."""
    return sorted(set(zip(cells["series"], cells["machine"])), key=lambda row: (natural(row[0]), natural(row[1])))


def _draw_bars(ax, ok: pd.DataFrame, failed: pd.DataFrame, metric: Metric, figures: Figures, rows: list[tuple], labelled: bool) -> None:
    """Nothing swept: one horizontal bar per label (and machine: its line style is the bar's edge) at its place in
    ``rows`` (the same in every panel, named on the first, ``labelled``), the band as an error bar; a failed cell
    gets an 'x' at the start of its row. A log axis where the values are over a decade apart, else values read as
    the tables write them (``si``: 175k, where matplotlib writes 175000 into its neighbours)."""
    entries = pd.concat([ok, failed]).reset_index(drop=True)
    values = metric.value(entries).where(entries["status"] == "ok")
    error = None
    if metric.band is not None:
        low, high = metric.band(entries)
        error = np.vstack([values - low, high - values])
    positions = np.array([len(rows) - 1 - rows.index(row) for row in zip(entries["series"], entries["machine"])])
    several = len({machine for _, machine in rows}) > 1
    bars = ax.barh(
        positions,
        values.fillna(0),
        xerr=error,
        color=[figures.colours[s] for s in entries["series"]],
        alpha=0.85,
        edgecolor="black" if several else None,
    )
    shown = values.dropna()
    if len(shown) and (shown > 0).all() and shown.max() > 10 * shown.min():
        ax.set_xscale("log")  # values decades apart: each bar reaches from the axis's left edge
    else:
        ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: si(value)))
    for bar, unstable, machine in zip(bars, entries["metrics.unstable"].map(lambda value: value is True), entries["machine"]):
        bar.set(hatch="//" if unstable else None, linestyle=figures.styles[machine])
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.set_yticks(np.arange(len(rows))[::-1], [f"{series} · {machine}" if several else series for series, machine in rows] if labelled else [])
    for position, series in zip(positions[entries["status"].isin(FAILED).to_numpy()], entries.loc[entries["status"].isin(FAILED), "series"]):
        ax.plot(0.02, position, color=figures.colours[series], transform=ax.get_yaxis_transform(), clip_on=False, **FAILURE_MARK)


def _widen_for_names(figure, ax) -> None:
    """Widen ``figure`` by the longest name of ``ax``'s bars, measured: its panels keep their width beside them."""
    renderer = FigureCanvasAgg(figure).get_renderer()
    figure.set_figwidth(figure.get_figwidth() + max(label.get_window_extent(renderer).width for label in ax.get_yticklabels()) / figure.dpi)


def _draw_panel(ax, ok: pd.DataFrame, failed: pd.DataFrame, x: str, metric: Metric, figures: Figures, rows: list[tuple], labelled: bool) -> None:
    """Lines against ``x`` where the panel's cells sweep it, else bars (``_draw_bars``)."""
    if not swept(pd.concat([ok, failed]), x):
        _draw_bars(ax, ok, failed, metric, figures, rows, labelled)
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


def plotted_against(cells: pd.DataFrame) -> str:
    """What a scenario's plots are drawn against: its x axis (``prepare``), or 'variant' where they are bars."""
    x = cells["x_axis"].iloc[0]
    return x if swept(cells, x) else "variant (nothing swept)"


def held_fixed(cells: pd.DataFrame, x: str) -> str:
    """What the cells of a figure held fixed, as the summary writes axes (``T=256 B=1 H=2``): each axis but a swept
    ``x`` and those a line's label names (``varying_axes``) with one value; an axis that differs only between
    variants (Based's own d_key) with its commonest value and the variants that differ."""
    fixed = {}
    shown = [axis for axis in LABEL_AXES if f"axes.{axis}" in cells and not (axis == x and swept(cells, x)) and axis not in varying_axes(cells, x)]
    for axis in shown:
        values = cells[f"axes.{axis}"].dropna()
        counts = values.value_counts()
        if len(counts):
            others = cells.loc[values.index[values != counts.index[0]]].groupby(f"axes.{axis}")["variant"].unique()
            differ = "; ".join(f"{text(value)} for {', '.join(sorted(variants))}" for value, variants in others.items())
            fixed[axis] = text(counts.index[0]) + (f" ({differ})" if differ else "")
    return axes_text(fixed) or "nothing"


def metric_plot(cells: pd.DataFrame, metric: Metric, figures: Figures, name: str) -> Plot | None:
    """``metric`` against the scenario's x axis, one panel per mode (bars by variant where nothing is swept); None without data."""
    x = cells["x_axis"].iloc[0]
    timed = cells[cells["mode"].isin(TIMED_MODES)]
    ok = timed[(timed["status"] == "ok") & metric.value(timed).notna()]
    failed = timed[timed["status"].isin(FAILED)]
    if ok.empty:
        return None
    modes = [mode for mode in TIMED_MODES if mode in set(timed["mode"])]
    shown = pd.concat([ok, failed])
    bars = not swept(shown, x)
    rows = _bar_rows(shown)
    figure, axes = new_figure(len(modes), max(3.6, BAR_HEIGHT * len(rows) + BAR_MARGIN) if bars else 3.6)
    for index, (ax, mode) in enumerate(zip(axes, modes)):
        _draw_panel(ax, ok[ok["mode"] == mode], failed[failed["mode"] == mode], x, metric, figures, rows, labelled=index % 3 == 0)
        ax.set_title(mode)
    if bars:
        _widen_for_names(figure, axes[0])
    figures.legend(figure, shown, not failed.empty, named=bars)
    unstable = int(ok["metrics.unstable"].map(lambda value: value is True).sum())
    warning = (
        f"{unstable} unstable cell(s), ringed (hatched bars): their median is not known to measure.target_rel_ci, "
        "or another process took a core they needed; do not trust them."
        if unstable
        else ""
    )
    drawn = f"{metric.title} by variant" if bars else f"{metric.title} against {x}"
    caption = " ".join(filter(None, [f"{drawn}; held fixed: {held_fixed(shown, x)}.", metric.detail(ok), warning, _decode_note(cells)]))
    return figures.save(figure, f"{name}-{metric.slug}", metric.title, caption)


def _decode_note(cells: pd.DataFrame) -> str:
    """What one decode call is, when the scenario decodes: its generated tokens, after a prefill of its length."""
    decode = cells[cells["mode"] == "decode"]
    if decode.empty or "axes.new_tokens" not in cells:
        return ""
    steps = "/".join(str(int(s)) for s in sorted(decode["axes.new_tokens"].dropna().unique()))
    if cells["x_axis"].iloc[0] == "seq_len" and swept(decode, "seq_len"):
        prefill = "seq_len tokens (the x axis)"
    else:
        prefill = "/".join(str(int(length)) for length in sorted(decode["axes.seq_len"].dropna().unique())) + " tokens"
    return f"decode: one call is the {steps} generated tokens of one round, after a prefill of {prefill}."


def latency_plot(cells: pd.DataFrame, figures: Figures, name: str) -> Plot | None:
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


#: The marker of each dtype on the speed-against-error plot.
DTYPE_MARKERS = {"float32": "o", "bfloat16": "s", "float16": "^", "float64": "D"}


def accuracy_plot(cells: pd.DataFrame, figures: Figures, name: str) -> Plot | None:
    """Tokens/s against the relative error from the float64 reference (``metrics.rel_error``), one
    point per timed cell, one panel per mode: a form that is fast because it is wrong sits to the
    right. Colour: the line label (variant and backend); marker: the dtype, its fill the machine; dashed: each dtype's tolerance.
    The error axis reaches a decade on either side of its points (``decades``): it labels decades only, none overlapping."""
    if "metrics.rel_error" not in cells:
        return None
    timed = cells[cells["mode"].isin(TIMED_MODES) & (cells["status"] == "ok")]
    timed = timed[timed["metrics.rel_error"].map(lambda value: present(value) and value > 0) & timed["metrics.tokens_per_s"].notna()]
    if timed.empty:
        return None
    modes = [mode for mode in TIMED_MODES if mode in set(timed["mode"])]
    figure, axes = new_figure(len(modes))
    for ax, mode in zip(axes, modes):
        own = timed[timed["mode"] == mode]
        for record in own.to_dict("records"):
            ax.plot(
                record["metrics.rel_error"],
                record["metrics.tokens_per_s"],
                color=figures.colours[record["series"]],
                marker=DTYPE_MARKERS.get(record["axes.dtype"], "x"),
                fillstyle=figures.fill(record["machine"]),
                linestyle="none",
                markersize=6,
                alpha=0.8,
            )
        tolerances = own["metrics.rel_error_tolerance"].dropna().unique()
        for tolerance in tolerances:
            ax.axvline(tolerance, color="grey", linestyle="--", linewidth=1)
        errors = decades([*own["metrics.rel_error"], *tolerances])
        ax.set(title=mode, xscale="log", yscale="log", xlim=errors, xlabel="relative error from float64", ylabel="tokens / s")
    figures.legend(figure, timed, False, machines="points")
    markers = ", ".join(f"{marker} {dtype}" for dtype, marker in DTYPE_MARKERS.items() if dtype in set(timed["axes.dtype"]))
    if timed["machine"].nunique() > 1:
        markers += "; their fill: the machine (key below)"
    title = "Speed against accuracy"
    caption = (
        f"{title}: each timed cell's tokens/s against its relative L2 error from the float64 reference (metrics.rel_error); "
        f"markers: {markers}; dashed: the dtypes' tolerances, beyond which a cell is inaccurate and its speed not to be compared."
    )
    return figures.save(figure, f"{name}-accuracy", title, caption)

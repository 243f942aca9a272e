"""The report's plots: each metric against a scenario's x axis (one panel per mode), decode latency,
speed against accuracy."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd
from matplotlib.ticker import FuncFormatter, MaxNLocator, NullLocator

from ..common.formatting import MIB, present, si
from ..results import FAILED
from .cells import TIMED_MODES
from .figures import FAILURE_MARK, Figures, Plot, decades, natural_columns, new_figure

#: How an unstable cell's point is drawn on top of its line: an open ring around it.
UNSTABLE_MARK = {"marker": "o", "markersize": 11, "markerfacecolor": "none", "markeredgewidth": 1.5, "linestyle": "none"}


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


def _draw_bars(ax, ok: pd.DataFrame, failed: pd.DataFrame, metric: Metric, figures: Figures) -> None:
    """A sweep of a single point: one horizontal bar per label (and machine) with the band as an
    error bar; a failed cell gets an 'x' at the start of its row. Values read as the tables write them
    (``si``: 175k, where matplotlib writes 175000 into its neighbours)."""
    entries = pd.concat([ok, failed]).sort_values(["series", "machine"], ascending=False, key=natural_columns).reset_index(drop=True)
    values = metric.value(entries).where(entries["status"] == "ok")
    error = None
    if metric.band is not None:
        low, high = metric.band(entries)
        error = np.vstack([values - low, high - values])
    positions = np.arange(len(entries))
    bars = ax.barh(positions, values.fillna(0), xerr=error, color=[figures.colours[s] for s in entries["series"]], alpha=0.85)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: si(value)))
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


def metric_plot(cells: pd.DataFrame, metric: Metric, figures: Figures, name: str) -> Plot | None:
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
    warning = (
        f"{unstable} unstable cell(s), ringed (hatched bars): their median is not known to measure.target_rel_ci, "
        "or another process took a core they needed; do not trust them."
        if unstable
        else ""
    )
    caption = " ".join(filter(None, [f"{metric.title} against {x}.", metric.detail(ok), warning, _decode_note(cells)]))
    return figures.save(figure, f"{name}-{metric.slug}", metric.title, caption)


def _decode_note(cells: pd.DataFrame) -> str:
    """What one decode call is, when the scenario decodes."""
    if "decode" not in set(cells["mode"]) or "axes.new_tokens" not in cells:
        return ""
    steps = "/".join(str(int(s)) for s in sorted(cells["axes.new_tokens"].dropna().unique()))
    return f"decode: one call is the {steps} generated tokens of one round, after a prefill of {cells['x_axis'].iloc[0]} tokens."


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
    right. Colour: the line label (variant and backend); marker: the dtype; dashed: each dtype's tolerance.
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
                linestyle="none",
                markersize=6,
                alpha=0.8,
            )
        tolerances = own["metrics.rel_error_tolerance"].dropna().unique()
        for tolerance in tolerances:
            ax.axvline(tolerance, color="grey", linestyle="--", linewidth=1)
        errors = decades([*own["metrics.rel_error"], *tolerances])
        ax.set(title=mode, xscale="log", yscale="log", xlim=errors, xlabel="relative error from float64", ylabel="tokens / s")
    figures.legend(figure, timed, False)
    markers = ", ".join(f"{marker} {dtype}" for dtype, marker in DTYPE_MARKERS.items() if dtype in set(timed["axes.dtype"]))
    title = "Speed against accuracy"
    caption = (
        f"{title}: each timed cell's tokens/s against its relative L2 error from the float64 reference (metrics.rel_error); "
        f"markers: {markers}; dashed: the dtypes' tolerances, beyond which a cell is inaccurate and its speed not to be compared."
    )
    return figures.save(figure, f"{name}-accuracy", title, caption)

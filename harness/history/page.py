"""The history page: per scenario and variant, each cell's median time against commit order, one line
per machine, each point with its interval, the steps marked; the steps at the top with the commands
that confirm and narrow them. A static page in the report's style (its template and figures), every
plot embedded, so it opens from disk offline; ``steps.csv`` beside it."""

from __future__ import annotations

import datetime as dt
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FixedLocator, MaxNLocator

from ..common.files import write_atomic
from ..common.formatting import format_ratio, format_seconds, percent, text
from ..report import render
from ..report.figures import PLAIN_TEXT, Figures, Plot, Table, new_figure, table
from ..report.plots import UNSTABLE_MARK
from .changes import Step, cell_text, mark, write_csv
from .limits import Limits, Unstable
from .series import NO_COMMIT, History

#: The most points of a line drawn with a marker on each point and error bars (a longer one: a thin line in a band).
DOTTED = 100
#: Colours of the steps' marks.
STEP_COLOURS = {"slower": "#c0392b", "faster": "#1e8449"}
#: Tick labels along the commit axis, at most.
TICKS = 12
#: A panel title's characters a line, at most: a wrapped title stays above its own panel (new_figure's 4.6 inches).
TITLE_CHARS = 48
#: The colour of a panel's title when a series in it is unstable.
WARNING_COLOUR = "#b9770e"


@dataclass
class Group:
    """One scenario and variant: its plot, its points, whether a step is in it."""

    scenario: str
    variant: str
    plot: Plot
    points: Table
    steps: int
    unstable: int


def short(commit: str) -> str:
    """A commit's first 10 characters (a run without one: its label)."""
    return commit if commit.startswith(NO_COMMIT) else commit[:10]


#: The columns that tell a group's cells apart (its panels).
CELL_COLUMNS = ["backend", "mode", "target", "params_text", "axes_text"]


def _panel_title(cell) -> str:
    return f"{cell['backend']} {cell['mode']} {cell_text(cell)}"


def panel_title(cell, unstable: list[Unstable], short: bool) -> str:
    """A panel's title wrapped to ``TITLE_CHARS`` a line, then what its series cannot tell: which machines' are
    unstable, whether one is too short for a step."""
    lines = textwrap.wrap(_panel_title(cell).replace(",", ", "), TITLE_CHARS, break_on_hyphens=False)
    if unstable:
        lines += textwrap.wrap("unstable series: " + "; ".join(u.series.machine for u in unstable), TITLE_CHARS)
    if short:
        lines.append("too few points for a step")
    return "\n".join(lines)


def _draw_panel(ax, cell: pd.DataFrame, steps: list[Step], commits: pd.DataFrame, colours: dict) -> None:
    """One cell: a line per machine (median, its interval as error bars or, on a long line, a band; unstable points ringed),
    a vertical mark at each step, commits along x."""
    for machine, line in cell.groupby("machine", sort=True):
        line = line.sort_values("position")
        xs, ys = line["position"].to_numpy(float), line["metrics.median_s"].to_numpy(float)
        spread = ys * np.nan_to_num(line["rel_ci"].to_numpy(float))
        if xs.size <= DOTTED:
            ax.errorbar(xs, ys, yerr=spread, color=colours[machine], marker="o", markersize=4, capsize=2, linewidth=1.2)
        else:  # a long line: its intervals a band (error bars would hide it, and take long to draw)
            ax.plot(xs, ys, color=colours[machine], linewidth=0.6)
            ax.fill_between(xs, ys - spread, ys + spread, color=colours[machine], alpha=0.25, linewidth=0)
        unstable = line["unstable"].to_numpy(bool)
        ax.plot(xs[unstable], ys[unstable], color=colours[machine], **UNSTABLE_MARK)
    for step in steps:
        ax.axvline(step.position - 0.5, color=STEP_COLOURS[step.direction], linestyle="--" if step.confirmed else ":", linewidth=1.5)
    shown = sorted(set(cell["position"]))
    ticks = shown[:: max(1, -(-len(shown) // TICKS))]
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.set_xticklabels([short(commits["commit"].iloc[p]) for p in ticks], rotation=60, ha="right", fontsize="x-small")
    ax.yaxis.set_major_locator(MaxNLocator(5))
    ax.set(ylabel="median time (s)")


def group_figure(scenario: str, variant: str, points: pd.DataFrame, steps: list[Step], limits: Limits, history: History, colours: dict) -> Figure:
    """The figure of one scenario and variant: a panel per cell (``_draw_panel``), titled by ``panel_title``, the legend outside the panels."""
    cells = list(points.groupby(CELL_COLUMNS, sort=True))
    figure, axes = new_figure(len(cells))
    for ax, (_, cell) in zip(axes, cells):
        record = cell.iloc[0]
        where = (scenario, variant, record["backend"], record["mode"], cell_text(record))
        own = [s for s in steps if (s.scenario, s.variant, s.backend, s.mode, s.cell) == where]
        unstable = [u for u in limits.unstable if u.series.where == where]
        short = not limits.blind() and any(series.where == where for series in limits.short)
        _draw_panel(ax, cell, own, history.commits, colours)
        ax.set_title(panel_title(record, unstable, short), fontsize="small", color=WARNING_COLOUR if unstable else "black")
    handles = [Line2D([], [], color=colours[m], marker="o", label=m) for m in sorted(points["machine"].unique())]
    handles += [Line2D([], [], color=colour, linestyle="--", label=f"step: {direction}") for direction, colour in STEP_COLOURS.items()]
    if any(not step.confirmed for step in steps):
        handles.append(Line2D([], [], color="grey", linestyle=":", label="unconfirmed (newest commit)"))
    figure.legend(handles=handles, loc="outside right upper", fontsize="small")
    return figure


def _group_plot(scenario: str, variant: str, points: pd.DataFrame, steps: list[Step], limits: Limits, history: History, figures: Figures) -> Plot:
    figure = group_figure(scenario, variant, points, steps, limits, history, figures.colours)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"history-{scenario}-{variant}").strip("-")
    caption = (
        f"{scenario} / {variant}: median time per commit (oldest left), one line per machine, error bars (a band on a long line) the median's 95 % interval, "
        "a ring an unstable point; a dashed line a step (red slower, green faster), dotted where it is unconfirmed (a jump at the newest commit); "
        "an amber title an unstable series."
    )
    return figures.save(figure, name, f"{scenario} / {variant}", caption)


def _points_table(points: pd.DataFrame) -> Table:
    shown = ["backend", "mode", "target", "params_text", "axes_text", "machine", "position", "commit", "started_at", "metrics.median_s", "rel_ci", "unstable"]
    rows = points[shown].sort_values(["backend", "mode", "params_text", "axes_text", "machine", "position"])
    titles = {key: _panel_title(dict(zip(CELL_COLUMNS, key))) for key in rows[CELL_COLUMNS].drop_duplicates().itertuples(index=False)}
    rows = rows.assign(short=rows["commit"].map(short), what=[titles[key] for key in rows[CELL_COLUMNS].itertuples(index=False)])
    columns = [
        ("cell", "what", text),
        ("machine", "machine", text),
        ("commit", "short", text),
        ("measured", "started_at", text),
        ("median", "metrics.median_s", format_seconds),
        ("interval ±", "rel_ci", percent),
        ("unstable", "unstable", lambda v: "yes" if v else ""),
    ]
    return table("Every point", rows, columns, "Each point: the cell's latest measurement at that commit on that machine.")


#: The columns that name a series (a cell on one machine) in the page's tables of steps and of unstable series.
SERIES_COLUMNS = [
    ("machine", "machine", text),
    ("scenario", "scenario", text),
    ("variant", "variant", text),
    ("backend", "backend", text),
    ("mode", "mode", text),
    ("cell", "cell", text),
]


def steps_table(steps: list[Step], factor: float) -> Table:
    frame = pd.DataFrame([{**step.__dict__, "direction": step.direction,
                           "interval": f"[{format_ratio(step.ci_low)}, {format_ratio(step.ci_high)}]",
                           "good": short(step.good_commit), "bad": short(step.bad_commit),
                           "between": "unknown" if step.between is None else str(step.between),
                           "confirm": " ; ".join(step.commands) or "-", "mark": mark(step, factor) if step.confirmed else "",
                           "status": step.status}
                          for step in steps])  # fmt: skip
    columns = [
        *SERIES_COLUMNS,
        ("last before", "good", text),
        ("first after", "bad", text),
        ("commits between", "between", text),
        ("after / before", "ratio", format_ratio),
        ("95 % interval", "interval", text),
        ("direction", "direction", text),
        ("status", "status", text),
        ("confirm and narrow", "confirm", text),
    ]
    caption = (
        f"Red: slower by more than --factor {factor}, its interval above 1; green: faster by as much. "
        "Unconfirmed: a jump at the newest commit, one point after it (the next commit confirms it or not; it fails only with --fail-unconfirmed)."
    )
    return table("Steps found", frame, columns, caption, classes="mark")


def unstable_table(unstable: list[Unstable], factor: float) -> Table:
    frame = pd.DataFrame([{**u.series.__dict__, "off": f"{u.off} of {u.series.points}", "commit": short(u.commit), "ratio": u.ratio, "rel_ci": u.rel_ci}
                          for u in unstable])  # fmt: skip
    columns = [
        *SERIES_COLUMNS,
        ("points off their level", "off", text),
        ("furthest at", "commit", text),
        ("its median / level", "ratio", format_ratio),
        ("its interval", "rel_ci", percent),
    ]
    caption = f"Points whose 95 % interval lies more than x{factor} off their level (the steps' fit), no step between: docs/history.md."
    return table("Unstable series", frame, columns, caption)


def write_page(history: History, steps: list[Step], limits: Limits, out_dir, *, factor: float, alarming: list[Step], since: str | None = None) -> Path:
    """Write ``out_dir/index.html``, ``steps.csv`` and ``plots/*.png``; return index.html's path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_csv(steps, out_dir / "steps.csv")
    machines = sorted(history.points["machine"].unique())
    figures = Figures(out_dir, dict(zip(machines, sns.color_palette("colorblind", len(machines)))), {})
    groups = []
    with matplotlib.rc_context(PLAIN_TEXT):
        for (scenario, variant), points in history.points.groupby(["scenario", "variant"], sort=True):
            own = [s for s in steps if s.scenario == scenario and s.variant == variant]
            plot = _group_plot(scenario, variant, points, own, limits, history, figures)
            unstable = sum(u.series.where[:2] == (scenario, variant) for u in limits.unstable)
            groups.append(Group(scenario, variant, plot, _points_table(points), len(own), unstable))
    page = render(
        "history.html.j2",
        title="attnbench history: " + ", ".join(sorted(history.points["scenario"].unique())),
        generated=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        files=list(history.points["file"].unique()),
        commits=len(history.commits),
        machines=machines,
        notes=history.notes,
        factor=factor,
        since=since,
        steps=steps_table(steps, factor) if steps else None,
        unconfirmed_steps=sum(not step.confirmed for step in steps),
        too_few=limits.too_few(),
        blind=limits.blind(),
        some_short=bool(limits.short),
        unstable=unstable_table(limits.unstable, factor) if limits.unstable else None,
        alarming=len(alarming),
        groups=groups,
    )
    index = out_dir / "index.html"
    write_atomic(index, page)
    return index

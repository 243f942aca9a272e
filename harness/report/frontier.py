"""The quality–speed frontier: each variant's quality on a task (its ``harness.tasks.Score``,
averaged over seeds) against its training speed on the same machine (words/s of the quality
run itself), with the Pareto frontier, the variants no other variant beats on both, drawn and
named (docs/reports.md).

Points are compared only within one machine, scenario and set of axes (e.g. d_model 64
and T 128), so each panel is one such group.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..tasks import Score
from .figures import Figures, Plot, decades, natural, new_figure
from .seeds import axes_without_seed, over_seeds

PANEL = ["machine_key", "machine", "scenario", "mode", "target", "axes_rest"]
#: Speeds spanning more than this ratio get a log axis.
WIDE_SPAN = 3
MAX_PANELS = 12


def on_frontier(speed: np.ndarray, quality: np.ndarray, higher_is_better: bool) -> np.ndarray:
    """Which points are Pareto-optimal: no other point is at least as fast and at least as good,
    and better in one of the two. Points with a missing speed or quality are never on it."""
    speed, quality = np.asarray(speed, dtype=float), np.asarray(quality, dtype=float)
    goodness = quality if higher_is_better else -quality
    known = np.isfinite(speed) & np.isfinite(goodness)
    result = np.zeros(len(speed), dtype=bool)
    for i in np.flatnonzero(known):
        others = known & (speed >= speed[i]) & (goodness >= goodness[i]) & ((speed > speed[i]) | (goodness > goodness[i]))
        result[i] = not others.any()
    return result


def frontier_points(cells: pd.DataFrame, score: Score) -> pd.DataFrame:
    """The seed-averaged points of ``over_seeds`` with ``on_frontier`` per panel, each cell's
    metric taken as ``score.compared`` gives it (past a task's stopping threshold: ties)."""
    column = f"metrics.{score.metric}"
    points = over_seeds(cells.assign(**{column: score.compared(cells)}) if column in cells else cells, score)
    flags = pd.Series(False, index=points.index)
    for _, panel in points.groupby(PANEL, sort=False, dropna=False):
        flags[panel.index] = on_frontier(panel["words_per_s"], panel["mean"], score.higher_is_better)
    return points.assign(on_frontier=flags)


def cell_flags(cells: pd.DataFrame, score: Score) -> pd.Series:
    """For each ok quality cell with the score: whether its group (all its seeds) is on the frontier."""
    points = frontier_points(cells, score)
    keyed = cells.assign(axes_rest=axes_without_seed(cells))
    merged = keyed.reset_index().merge(points[[*PANEL, "series", "on_frontier"]], on=[*PANEL, "series"], how="left")
    return pd.Series(merged["on_frontier"].to_numpy(), index=merged["index"].to_numpy())


def frontier_plot(cells: pd.DataFrame, score: Score, figures: Figures, name: str) -> Plot | None:
    """Quality against training words/s, one panel per machine and set of axes (the first
    ``MAX_PANELS``), the frontier as a line through its points and each of them named."""
    points = frontier_points(cells, score)
    points = points[points["words_per_s"].notna()]
    if points.empty:
        return None
    panels = sorted(points.groupby(PANEL, sort=False, dropna=False), key=lambda item: natural(item[1]["axes_text"].iloc[0]))[:MAX_PANELS]
    figure, axes = new_figure(len(panels))
    several_machines = points["machine_key"].nunique() > 1
    for ax, (_, panel) in zip(axes, panels):
        for record in panel.to_dict("records"):
            colour = figures.colours[record["series"]]
            ax.errorbar(
                record["words_per_s"],
                record["mean"],
                yerr=[[record["mean"] - record["low"]], [record["high"] - record["mean"]]],
                color=colour,
                marker="o",
                capsize=3,
                linestyle="none",
            )
        best = panel[panel["on_frontier"]].sort_values("words_per_s")
        ax.plot(best["words_per_s"], best["mean"], color="black", linewidth=1, zorder=0)
        for record in best.to_dict("records"):
            ax.annotate(record["series"], (record["words_per_s"], record["mean"]), textcoords="offset points", xytext=(4, 4), fontsize="x-small")
        title = panel["axes_text"].iloc[0] + (f"\n{panel['machine'].iloc[0]}" if several_machines else "")
        ax.set(title=title, xlabel="training words/s", ylabel=f"{score.metric} ({'higher' if score.higher_is_better else 'lower'} is better)")
        ax.ticklabel_format(axis="y", useOffset=False)  # losses that differ in the fifth digit read as themselves
        _speed_axis(ax, panel["words_per_s"])
    figures.legend(figure, cells[cells["series"].isin(points["series"])], False, machines="panels")
    title = f"Quality against speed: {score.metric} and training words/s"
    caption = (
        f"{title}, per variant (mean over seeds; bars: lowest to highest seed). The black line joins the variants on the "
        "Pareto frontier, those no other variant beats in both speed and quality on this machine; they are named. "
        f"Speed is the quality run's own training throughput. Panels: {len(panels)} of {points.groupby(PANEL).ngroups}."
    )
    if score.stop_field is not None:
        caption += (
            f" Training stops once {score.metric} reaches the task's {score.stop_field}; a {score.metric} past it is drawn at it, "
            "since how far past it lands is chance, so the variants that reached it tie and speed alone ranks them."
        )
    return figures.save(figure, f"{name}-frontier", title, caption)


def _speed_axis(ax, speeds) -> None:
    """A log axis that labels decades only (``decades``) where the speeds span more than WIDE_SPAN; a linear one
    with a few plain ticks where they lie close together (a log axis then labels every minor tick on top of the next)."""
    from matplotlib.ticker import EngFormatter, MaxNLocator

    if speeds.max() > WIDE_SPAN * speeds.min():
        ax.set(xscale="log", xlim=decades(speeds))
        return
    ax.xaxis.set_major_locator(MaxNLocator(4))
    ax.xaxis.set_major_formatter(EngFormatter(places=1))

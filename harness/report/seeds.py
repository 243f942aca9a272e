"""Quality over seeds: a task's headline metric (``harness.tasks.Score``) aggregated over the
cells that differ only in their ``seed`` axis, as the report's "over seeds" table and the
spread its plots draw (docs/reports.md).

A group is one machine's cells of one scenario, line label (variant, parameters, backend),
mode and axes other than the seed; its row holds the mean, the minimum and maximum over its
seeds, how many seeds it has and how many of them reached the task's threshold.
"""

from __future__ import annotations

import json

import pandas as pd

from ..common.formatting import si, text
from ..results.identity import axes_text, nested
from ..tasks import Score
from .figures import Table, natural_columns, table

SEED = "axes.seed"
#: The columns ``over_seeds`` adds to each group's identity.
SUMMARY = ("mean", "low", "high", "seeds", "passed", "words_per_s")
GROUP = ["machine_key", "machine", "scenario", "series", "mode", "target", "axes_rest"]


def axes_without_seed(cells: pd.DataFrame) -> pd.Series:
    """Each cell's axes (device left out, as the report matches machines) without its seed, as JSON."""
    return pd.Series(
        [json.dumps(nested(record, "axes", ("device", "seed")), sort_keys=True) for record in cells.to_dict("records")],
        index=cells.index,
        dtype=object,
    )


def over_seeds(cells: pd.DataFrame, score: Score) -> pd.DataFrame:
    """One row per group of ok cells that differ only in their seed: ``mean``, ``low``, ``high``
    of ``metrics.<score.metric>``, ``seeds`` (how many), ``passed`` (how many reached
    its threshold, ``score.passed``), the mean training ``words_per_s``, and the axes as ``axes_rest``
    (JSON) and ``axes_text``. Cells without the metric are left out; a group of one seed is a row too."""
    column = f"metrics.{score.metric}"
    if column not in cells:
        return pd.DataFrame(columns=[*GROUP, *SUMMARY, "axes_text"])
    ok = cells[(cells["status"] == "ok") & cells[column].notna()]
    ok = ok.assign(axes_rest=axes_without_seed(ok), _passed=score.passed(ok))
    speed = ok["metrics.words_per_s"] if "metrics.words_per_s" in ok else pd.Series(float("nan"), index=ok.index)
    ok = ok.assign(_speed=pd.to_numeric(speed, errors="coerce"))
    rows = [
        {
            **dict(zip(GROUP, key)),
            "mean": group[column].mean(),
            "low": group[column].min(),
            "high": group[column].max(),
            "seeds": len(group),
            "passed": int(group["_passed"].sum()),
            "words_per_s": group["_speed"].mean(),
        }
        for key, group in ok.groupby(GROUP, sort=False, dropna=False)
    ]
    summary = pd.DataFrame(rows, columns=[*GROUP, *SUMMARY])
    return summary.assign(axes_text=[axes_text(json.loads(axes)) for axes in summary["axes_rest"]])


def swept(cells: pd.DataFrame) -> bool:
    """Whether any group of these cells was measured at several seeds."""
    if SEED not in cells or cells[SEED].nunique() < 2:
        return False
    return bool(cells.assign(axes_rest=axes_without_seed(cells)).groupby(GROUP, dropna=False)[SEED].nunique().max() > 1)


def seed_table(cells: pd.DataFrame, score: Score) -> Table | None:
    """The report's "over seeds" table of one task's cells, or None where no seed was swept."""
    if not swept(cells):
        return None
    summary = over_seeds(cells, score).sort_values(["series", "axes_text"], key=natural_columns)
    spread = summary.assign(
        range=[f"{low:.4g} – {high:.4g}" for low, high in zip(summary["low"], summary["high"])],
        passed_text=[f"{passed} of {seeds}" for passed, seeds in zip(summary["passed"], summary["seeds"])],
    )
    machine = [("machine", "machine", text)] if cells["machine"].nunique() > 1 else []
    columns = [
        ("variant", "series", text),
        *machine,
        ("axes", "axes_text", text),
        (f"{score.metric} (mean)", "mean", text),
        ("min – max", "range", text),
        ("seeds", "seeds", text),
    ]
    if score.has_threshold():
        columns.append((f"passed ({score.describe()})", "passed_text", text))
    columns.append(("words/s (mean)", "words_per_s", si))
    caption = (
        f"{score.metric} over the seeds of each cell (axes.seed): mean, lowest and highest"
        + (f", and the seeds that reached {score.describe()}" if score.has_threshold() else "")
        + "."
    )
    return table(f"{score.metric} over seeds", spread, columns, caption)


def draw_over_seeds(ax, line: pd.DataFrame, x: str, y: str, colour) -> None:
    """One line's ``y`` against ``x``: the mean over seeds, and where a point has several seeds
    a band from the lowest to the highest of them."""
    stats = line.groupby(x)[y].agg(["mean", "min", "max", "count"]).reset_index().sort_values(x)
    ax.plot(stats[x], stats["mean"], color=colour, marker="o")
    if (stats["count"] > 1).any():
        ax.fill_between(stats[x], stats["min"], stats["max"], color=colour, alpha=0.2, linewidth=0)

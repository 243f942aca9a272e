"""An HTML report of results files: what was measured where, plots per scenario, machines
side by side, and optionally a comparison of two commits.

``build_report(paths, out_dir)`` writes ``out_dir/index.html`` (self-contained: every plot
is embedded as a PNG data URI), ``out_dir/cells.csv`` (one row per cell) and every plot as a
PNG file under ``out_dir/plots/``. It reads results files only (``harness.results``), never
the runner or a scenario file, so a report can be made on a laptop from files measured on a
cluster. The page is put together here from ``cells`` (what the report makes of each cell),
``summary`` (which is fastest, at the page's top), ``plots``, ``tables``, ``header`` (machines
and runs) and ``machines`` (machines side by side). How to read it is in docs/reports.md.

The report group owns this page, its sections (``cells``, ``summary``, ``header``, ``machines``, ``plots``, ``tables``),
what every plot and table is made of (``figures``), quality over seeds (``seeds``), the quality–speed
frontier (``frontier``); its template is harness/templates/report.html.j2. May import: common,
results, scenarios (the axes table), tasks (the registry).
"""

from __future__ import annotations

import datetime as dt
import json
import re
from dataclasses import dataclass
from pathlib import Path

import jinja2
import matplotlib
import pandas as pd

from .. import tasks
from ..common.files import write_atomic, write_csv_atomic
from ..results import load
from ..results.compare import CompareResult
from .cells import machine_styles, palette, prepare, tasks_of
from .figures import PLAIN_TEXT, Figures, Plot, Table
from .frontier import cell_flags, frontier_plot
from .header import machine_sections
from .machines import side_by_side
from .plots import METRICS, accuracy_plot, latency_plot, metric_plot, plotted_against
from .seeds import seed_table
from .summary import summary_tables
from .tables import (
    backend_table,
    compare_table,
    failures_table,
    model_table,
    profile_table,
    quality_table,
    ranking_table,
    timing_table,
)


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
    """How many cells ended how, how many were unstable, the load while they were measured: per machine where there are several."""
    if cells["machine"].nunique() > 1:
        return " · ".join(f"on {machine}, {_statuses(own)}" for machine, own in cells.groupby("machine", sort=False))
    counts = cells["status"].value_counts()
    unstable = int(cells["metrics.unstable"].map(lambda value: value is True).sum())
    busy = cells["metrics.load.other_cores"].dropna()
    load = f"; other processes used {busy.mean():.1f} cores on average while they were measured" if len(busy) else ""
    return f"{len(cells)} cells: " + ", ".join(f"{count} {status}" for status, count in counts.items()) + f"; {unstable} unstable" + load


def baseline_backend(runs: list[dict], cells: pd.DataFrame) -> str | None:
    """The backend a scenario's report divides the others by (``report.baseline_backend``): as its
    latest run line records it; for a file written before run lines recorded it (commit 3601d8f),
    'torch' when the cells have it. Read from the results file alone: the report never loads
    a scenario."""
    run = max(runs, key=lambda run: run["started_at"], default={})
    if "report" in run:
        return (run["report"] or {}).get("baseline_backend")
    return "torch" if "torch" in set(cells["backend"]) else None


def _scenario_section(name: str, cells: pd.DataFrame, figures: Figures, baseline: str | None = None) -> ScenarioSection:
    slug = _slug(name)
    plots = [metric_plot(cells, metric, figures, slug) for metric in METRICS] + [latency_plot(cells, figures, slug), accuracy_plot(cells, figures, slug)]
    task_sections = []
    for task in tasks_of(cells):
        own = cells[cells["target"] == task.name]
        task_sections += [*(task.report(own, figures, slug) if task.report else []), *(_score_sections(own, task.score, figures, slug) if task.score else [])]
    plots += [part for part in task_sections if isinstance(part, Plot)]
    tables = [
        model_table(cells),
        ranking_table(cells),
        backend_table(cells, baseline),
        *(part for part in task_sections if isinstance(part, Table)),
        quality_table(cells),
        failures_table(cells),
        timing_table(cells),
        profile_table(cells),
    ]
    targets = ", ".join(cells["target"].dropna().unique())
    return ScenarioSection(name, targets, plotted_against(cells), _statuses(cells), [p for p in plots if p is not None], [t for t in tables if t is not None])


def _score_sections(cells: pd.DataFrame, score: tasks.Score, figures: Figures, slug: str) -> list:
    """A task's headline metric over seeds (``harness.report.seeds``) and against speed (``harness.report.frontier``)."""
    return [seed_table(cells, score), frontier_plot(cells, score, figures, slug)]


def _csv_value(value):
    return json.dumps(value) if isinstance(value, (list, dict)) else value


def write_cells_csv(frame: pd.DataFrame, path: Path, cells: pd.DataFrame | None = None) -> None:
    """Every cell of ``load``, one row each; list values (raw samples, latencies) as JSON, text safe
    in a spreadsheet (``write_csv_atomic``). Given
    the report's ``cells`` (``prepare``), a quality cell also says whether its variant is on its
    task's quality–speed frontier (``quality_frontier``, ``harness.report.frontier``)."""
    if cells is not None:
        flags = [cell_flags(cells[cells["target"] == task.name], task.score) for task in tasks_of(cells) if task.score]
        if flags:
            frame = frame.assign(quality_frontier=pd.concat(flags).reindex(frame.index))
    write_csv_atomic(path, frame.map(_csv_value))


def render(template: str, **values) -> str:
    """The page of ``template`` (harness/templates/, each framed by page.html.j2: the style, the render check) with ``values``."""
    environment = jinja2.Environment(loader=jinja2.PackageLoader("harness", "templates"), autoescape=True, undefined=jinja2.StrictUndefined)
    return environment.get_template(template).render(**values)


def build_report(paths, out_dir, *, title: str | None = None, compare_base: CompareResult | None = None) -> Path:
    """Write the report of the results files or directories ``paths`` into ``out_dir``
    (index.html, cells.csv, plots/*.png); return the path of index.html."""
    runs: list[dict] = []
    frame = load(paths, runs=runs)  # each file read once: its cells and its run lines
    if frame.empty:
        raise ValueError("the results files hold no cells: nothing to report")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cells = prepare(frame)
    write_cells_csv(frame, out_dir / "cells.csv", cells)
    runs = [run for run in runs if run["file"] in set(frame["file"])]  # of the files that hold cells
    figures = Figures(out_dir, palette(cells), machine_styles(cells))
    with matplotlib.rc_context(PLAIN_TEXT):
        scenarios = [
            _scenario_section(name, group, figures, baseline_backend([run for run in runs if run["scenario"] == name], group))
            for name, group in cells.groupby("scenario", sort=True)
        ]
    page = render(
        "report.html.j2",
        title=title or "attnbench report: " + ", ".join(section.name for section in scenarios),
        generated=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        files=list(frame["file"].unique()),
        summary=summary_tables(cells),
        several_machines=cells["machine"].nunique() > 1,
        machines=machine_sections(cells, runs),
        scenarios=scenarios,
        side_by_side=side_by_side(cells),
        comparison=compare_table(compare_base) if compare_base is not None else None,
    )
    index = out_dir / "index.html"
    write_atomic(index, page)
    return index

"""Plots that fit the data (issue 57, item 4), read back from each matplotlib Figure as ``Figures.save`` writes it: the
x axis is the axis a scenario sweeps, never one that differs only between variants (Based's own d_key 16 beside the
others' 32), and where nothing is swept the plots are bars by variant; captions say what was held fixed and the decode
caption the real prefill length; every entry of the legends lies inside the saved figure, with a key to the machines'
line styles when there are several; neighbouring colours are told apart; tables scroll within the page."""

from __future__ import annotations

import json
import re
from itertools import combinations
from pathlib import Path

import jinja2
import numpy as np
import pandas as pd
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from harness.report import build_report, prepare
from harness.report import cells as report_cells
from harness.report.figures import Figures, Table, lab, new_figure
from harness.report.plots import METRICS, metric_plot
from harness.results import load

#: The time plot (the others are its code with another metric).
TIME = METRICS[0]
#: Based projects queries and keys to 16 dimensions: its cells' d_key is 16 where every other variant's is 32.
OWN_D_KEY = {"based": 16}
#: A ΔE (CIELAB) at which two lines are told apart at a glance; a hue circle of 22 (seaborn's husl) has neighbours at 9.
MIN_DISTANCE = 20
#: A page (the frame of every attnbench page) of one table.
PAGE = '{% extends "page.html.j2" %}{% from "table.html.j2" import render_table %}{% block body %}{{ render_table(table) }}{% endblock %}'


def _cell(variant: str, seq_len: int, mode: str, machine: str) -> dict:
    axes = {"seq_len": seq_len, "batch": 1, "heads": 2, "d_key": OWN_D_KEY.get(variant, 32), "d_value": 32, "dtype": "float32", "device": "cpu"}
    median = 1e-6 * seq_len * (2 if variant == "based" else 1)
    return {"kind": "cell", "schema": 2, "run_id": f"run-{machine}", "cell_id": f"{variant}-{seq_len}-{mode}", "scenario": "s", "variant": variant,
            "backend": "torch", "params": {}, "axes": {**axes, **({"new_tokens": 8} if mode == "decode" else {})}, "mode": mode, "target": "core",
            "status": "ok", "error": None, "metrics": {"median_s": median, "p20_s": 0.9 * median, "p80_s": 1.1 * median, "tokens": seq_len},
            "machine_id": machine, "started_at": "2026-12-06T05:00:01+00:00"}  # fmt: skip


def _cells(folder: Path, lengths, variants=("softmax", "based"), machines=("m1",), modes=("forward", "decode")) -> pd.DataFrame:
    """The report's cells (``prepare``) of one results file per machine: each variant at each length in each mode."""
    folder.mkdir()
    for machine in machines:
        run = {"kind": "run", "schema": 2, "run_id": f"run-{machine}", "started_at": "2026-12-06T05:00:00+00:00", "scenario": "s",
               "machine": {"machine_id": machine, "hostname": f"host-{machine}", "cpu": {"model": "Test CPU"}}}  # fmt: skip
        records = [run, *(_cell(variant, length, mode, machine) for variant in variants for length in lengths for mode in modes)]
        (folder / f"{machine}.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return prepare(load(folder))


def _time_plot(cells: pd.DataFrame, out: Path, monkeypatch):
    """The time plot of ``cells`` and its figure, as saved."""
    saved = []
    save = Figures.save
    monkeypatch.setattr(Figures, "save", lambda self, figure, *args: saved.append(figure) or save(self, figure, *args))
    plot = metric_plot(cells, TIME, Figures(out, report_cells.palette(cells), report_cells.machine_styles(cells)), "s")
    (figure,) = saved
    return plot, figure


def test_a_sweep_of_lengths_is_drawn_against_them_not_against_a_variants_own_d_key(tmp_path, monkeypatch):
    cells = _cells(tmp_path / "results", (64, 128, 256))
    assert set(cells["x_axis"]) == {"seq_len"}
    plot, figure = _time_plot(cells, tmp_path, monkeypatch)
    assert [ax.get_xlabel() for ax in figure.axes] == ["seq_len", "seq_len"]
    assert "against seq_len; held fixed: B=1 H=2 Dk=32 (16 for based) Dv=32 float32 cpu" in plot.caption, plot.caption
    assert "after a prefill of seq_len tokens (the x axis)" in plot.caption, plot.caption


def test_nothing_swept_is_drawn_as_bars_by_variant_and_the_caption_names_the_prefill(tmp_path, monkeypatch):
    cells = _cells(tmp_path / "results", (256,))
    plot, figure = _time_plot(cells, tmp_path, monkeypatch)
    forward, decode = figure.axes
    assert [ax.get_xlabel() for ax in figure.axes] == ["seconds", "seconds"] and len(forward.patches) == len(decode.patches) == 2
    assert [label.get_text() for label in forward.get_yticklabels()] == ["based(d_key=16)", "softmax"], "the first panel names the bars"
    assert not [label.get_text() for label in decode.get_yticklabels() if label.get_text()], "the others share its rows"
    assert plot.caption.startswith(f"{TIME.title} by variant; held fixed: T=256 B=1 H=2 Dk=32 (16 for based) Dv=32"), plot.caption
    assert "after a prefill of 256 tokens." in plot.caption and "d_key tokens" not in plot.caption, plot.caption


@pytest.mark.filterwarnings("error:constrained_layout not applied")
@pytest.mark.parametrize(("lengths", "count"), [((64, 256), 24), ((256,), 6)], ids=["lines", "bars"])
def test_every_legend_entry_lies_inside_the_saved_figure_with_a_key_to_two_machines(tmp_path, monkeypatch, lengths, count):
    """24 labels (every core variant in two dtypes, and two more) and two machines, as a report of two machines' cuda-variants."""
    variants = tuple(f"variant{number}_with_a_long_name(scan=parallel)" for number in range(count))
    cells = _cells(tmp_path / "results", lengths, variants=variants, machines=("m1", "m2"), modes=("forward",))
    _, figure = _time_plot(cells, tmp_path, monkeypatch)
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    renderer = canvas.get_renderer()
    inside = figure.bbox.padded(1)  # a pixel's rounding
    entries = [(artist.get_text() if hasattr(artist, "get_text") else "handle", artist.get_window_extent(renderer))
               for legend in figure.legends for artist in [*legend.get_texts(), *legend.legend_handles]]  # fmt: skip
    assert entries and not [(text, box) for text, box in entries if not inside.contains(box.x0, box.y0) or not inside.contains(box.x1, box.y1)], figure.bbox
    machine_key = [legend for legend in figure.legends if legend.get_title().get_text() == "line style: machine"]
    assert len(machine_key) == 1 and [text.get_text() for text in machine_key[0].get_texts()] == ["host-m1 (Test CPU)", "host-m2 (Test CPU)"]
    assert len({handle.get_linestyle() for handle in machine_key[0].legend_handles}) == 2
    legends = [legend.get_window_extent(renderer) for legend in figure.legends]
    assert not [pair for pair in combinations(legends, 2) if pair[0].overlaps(pair[1])], "the keys overlap"
    assert not [ax for ax in figure.axes for box in legends if ax.get_window_extent(renderer).overlaps(box)], "a panel reaches into a key"


def test_a_legend_of_one_machine_has_no_machine_key(tmp_path):
    labels = [f"variant{number}" for number in range(3)]
    figure, _ = new_figure(2)
    Figures(tmp_path, dict.fromkeys(labels, (0, 0, 0)), {"m": "-"}).legend(figure, pd.DataFrame({"series": labels, "machine": "m"}), False)
    assert [len(legend.get_texts()) for legend in figure.legends] == [3]


@pytest.mark.parametrize("count", [10, 22, 24])
def test_neighbouring_colours_and_every_pair_are_told_apart(tmp_path, count):
    labels = [f"variant{number:02d} dtype=float32" for number in range(count)]
    colours = report_cells.palette(pd.DataFrame({"series": labels}))
    coordinates = lab([colours[label] for label in labels])  # the legend's order
    neighbours = np.linalg.norm(np.diff(coordinates, axis=0), axis=1)
    assert neighbours.min() >= MIN_DISTANCE, neighbours.round(1)
    assert min(np.linalg.norm(a - b) for a, b in combinations(coordinates, 2)) >= MIN_DISTANCE


def test_a_table_scrolls_sideways_within_the_page():
    """A table of every page (``render_table``) in its wrapper, whose style (the frame of every page) scrolls it."""
    wide = Table("every cell", [f"column {number}" for number in range(40)], [["a long value of a cell"] * 40])
    environment = jinja2.Environment(loader=jinja2.PackageLoader("harness", "templates"), autoescape=True, undefined=jinja2.StrictUndefined)
    page = environment.from_string(PAGE).render(title="t", table=wide)
    assert re.search(r'<div class="table-scroll">\s*<table>\s*<caption>every cell', page), "the table is not in its wrapper"
    style = re.search(r"\.table-scroll \{([^}]*)\}", page)
    assert style and "overflow-x: auto" in style.group(1) and "max-width: 100%" in style.group(1), style


def test_the_page_says_what_the_plots_are_drawn_against_and_wraps_its_tables(tmp_path):
    results = tmp_path / "results"
    _cells(results, (256,), modes=("forward",))
    page = (build_report([results], tmp_path / "report")).read_text()
    assert "plotted against variant (nothing swept);" in page
    assert re.search(r'<div class="table-scroll">\s*<table>\s*<caption>Every timed cell', page), "the table of every cell is not in its wrapper"

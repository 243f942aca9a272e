"""What the pictures of a report and of the history page show (issue 53, item 2), read back from each matplotlib
Figure as ``Figures.save`` writes it: every tick label is plain text (10⁻², 4×10⁻², never the mathtext source
``$\\mathdefault{10^{-2}}$`` that ``PLAIN_TEXT`` would show), a results file's ``$`` strings stay text, and no two
labels of an axis overlap. The report is of the example results (reports/examples/cpu-dev-vm) as they are (one
length: bars) and swept over lengths (lines), with quality cells of three tasks; the history is three commits of a
scratch repository."""

from __future__ import annotations

import json
import re
from itertools import combinations
from pathlib import Path

import matplotlib
import pandas as pd
import pytest
import seaborn as sns
from histories import repository, write_history
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from harness.history import history
from harness.report import build_report
from harness.report.figures import PLAIN_TEXT, Figures, PlainLogFormatter, decades, drawn_labels, new_figure, plain_log_ticks
from harness.results import TIMINGS, read_records

EXAMPLE = Path(__file__).parents[2] / "reports" / "examples" / "cpu-dev-vm" / "cuda-variants-20261205T083558Z.jsonl"
#: The example's variants the report shows, as the results call them: one of them named with mathtext in it.
VARIANTS = {"softmax": "softmax", "linear": "a$b$c", "dpfp": "dpfp"}
#: The example's modes the report shows (a panel each).
MODES = ("forward", "decode")
#: The example's cells swept over lengths: bfloat16 (relative errors and their tolerance 1.4 decades apart, on an
#: axis that matplotlib labels at 2×, 3×, 4× ... of each decade, too close to fit), forward.
SWEPT = {"dtype": "bfloat16", "mode": "forward"}
#: The lengths the example's cells (measured at 256) are swept over: a geometric sweep, drawn on log axes.
LENGTHS = (64, 256, 1024)
#: A log axis's label: a decade or a multiple of one in unicode (10⁻², 4×10⁻²); a swept length on a base-2 axis.
PLAIN_LOG = re.compile(r"(\d×)?10⁻?[⁰¹²³⁴⁵⁶⁷⁸⁹]+|\d+")
#: Mathtext source, as matplotlib's log axes write their labels ('$\\mathdefault{4\\times10^{-2}}$'); a variant's name
#: may hold a '$' (VARIANTS), shown as written.
MATHTEXT = re.compile(r"^\$.*\$$|\\mathdefault|\\times|\^\{")


def _swept(cell: dict, length: int) -> dict:
    """``cell`` at ``length``: its times scaled as length² (so that they span decades), its tokens as length; without
    memory and roofline (their plots are the time plot's code, drawn for the example's cells)."""
    share = length / cell["axes"]["seq_len"]
    metrics = {
        name: [v * share**2 for v in value] if isinstance(value, list) else value * share**2 for name, value in cell["metrics"].items() if name in TIMINGS
    }
    metrics = {**cell["metrics"], **metrics, "tokens": cell["metrics"]["tokens"] * share, "peak_mem_bytes": None, "roofline_fraction": None}
    metrics["tokens_per_s"] = metrics["tokens"] / metrics["median_s"]
    axes = {**cell["axes"], "seq_len": length}
    return {**cell, "cell_id": f"{cell['cell_id']}-{length}", "axes": axes, "metrics": metrics}


def _quality(run: dict, target: str, variant: str, axes: dict, metrics: dict, **extra) -> dict:
    """A quality cell of ``target`` on the example's machine (its run and scenario: ``_results``'s)."""
    cell_id = f"{target}-{variant}-" + "-".join(map(str, axes.values()))
    return {"kind": "cell", "schema": 2, "run_id": run["run_id"], "cell_id": cell_id, "scenario": target, "variant": variant, "backend": "torch",
            "params": {}, "axes": {**axes, "device": "cpu"}, "mode": "quality", "target": target, "status": "ok", "error": None,
            "metrics": metrics, "machine_id": run["machine"]["machine_id"], "started_at": run["started_at"], **extra}  # fmt: skip


def _quality_cells(run: dict) -> list[dict]:
    """MQAR over lengths and seeds, each variant 10× faster than the next (the frontier's log axis), the copy task's
    loss curves, retrieval over the number of keys (these two without a speed: no frontier)."""
    cells = []
    for variant, speed in (("softmax", 1e3), ("a$b$c", 1e4)):
        for seed in (0, 1):
            cells += [
                _quality(run, "mqar", variant, {"seq_len": T, "d_model": 64, "seed": seed}, {"accuracy": 0.99 - T / 1000 - seed / 50, "words_per_s": speed})
                for T in (64, 128, 256)
            ]
        curve = [[step, 3.0 / (1 + step) ** (0.8 if variant == "softmax" else 0.5)] for step in (0, 100, 200, 400)]
        cells.append(_quality(run, "copy", variant, {"seq_len": 64}, {"losses": curve, "loss": curve[-1][1], "loss_threshold": 0.05}))
        cells += [
            _quality(run, "retrieval", variant, {"S": S, "d_key": 16}, {"loss": S / 80, "d_dot": 64, "steps": 500}, task={"setting": 1}) for S in (20, 40, 80)
        ]
    return cells


def _results(folder: Path) -> Path:
    records = read_records(EXAMPLE)
    example = [{**cell, "variant": VARIANTS[cell["variant"]]} for cell in records[1:] if cell["variant"] in VARIANTS and cell["mode"] in MODES]
    run = records[0]
    swept = [_swept(cell, length) for cell in example if cell["axes"]["dtype"] == SWEPT["dtype"] and cell["mode"] == SWEPT["mode"] for length in LENGTHS]
    quality = _quality_cells(run)
    folder.mkdir()
    for scenario, own in (
        ("cuda-variants", example),
        ("swept", swept),
        *((target, [c for c in quality if c["target"] == target]) for target in ("mqar", "copy", "retrieval")),
    ):
        lines = [{**record, "run_id": f"{scenario}-run", "scenario": scenario} for record in (run, *own)]
        (folder / f"{scenario}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return folder


@pytest.fixture(scope="module")
def figures(tmp_path_factory) -> dict[str, Figure]:
    """Every figure a report of ``_results`` and a history page draw, by plot name, as saved."""
    root = tmp_path_factory.mktemp("figures")
    saved, save = {}, Figures.save

    def keep(self, figure, name, title, caption):
        saved[name] = figure
        return save(self, figure, name, title, caption)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Figures, "save", keep)
        build_report([_results(root / "results")], root / "report")
        commits = repository(root / "repo", 3)
        history([write_history(root / "history", commits, lambda *_: 1.0, machines={"box-a": "a" * 16})], root / "page", repo=root / "repo")
    return saved


def _axes(figures: dict[str, Figure]):
    """(plot name, axis) for each visible x and y axis of every figure."""
    return [(name, axis) for name, figure in figures.items() for ax in figure.axes if ax.get_visible() for axis in (ax.xaxis, ax.yaxis)]


_labels = drawn_labels


def test_the_report_and_the_history_draw_every_kind_of_figure(figures):
    speed = [f"{scenario}-{kind}" for scenario in ("cuda-variants", "swept") for kind in ("time", "throughput", "accuracy")]
    assert {
        *speed,
        "cuda-variants-memory",
        "cuda-variants-roofline",
        "cuda-variants-decode-latency",
        "mqar-mqar",
        "copy-copy-loss",
        "retrieval-capacity",
        "mqar-frontier",
    } <= set(figures), sorted(figures)
    assert any(name.startswith("history-") for name in figures), sorted(figures)


def test_every_tick_label_is_plain_text(figures):
    shown = {(name, axis.axis_name, label.get_text()) for name, axis in _axes(figures) for label in [*_labels(axis), axis.get_offset_text()]}
    assert not [label for label in shown if MATHTEXT.search(label[2])], sorted(shown)


def test_log_axes_show_plain_numbers(figures):
    logs = [(name, axis) for name, axis in _axes(figures) if axis.get_scale() == "log"]
    assert {name for name, _ in logs} >= {"swept-time", "swept-throughput", "cuda-variants-accuracy", "copy-copy-loss", "mqar-frontier"}
    for name, axis in logs:
        texts = [label.get_text() for label in _labels(axis)]
        assert texts and all(PLAIN_LOG.fullmatch(text) for text in texts), (name, axis.axis_name, texts)
    errors = [label.get_text() for ax in figures["swept-accuracy"].axes for label in _labels(ax.xaxis)]
    assert set(errors) == {"10⁻³", "10⁻²", "10⁻¹"}, errors


def test_no_two_labels_of_an_axis_overlap(figures):
    for name, axis in _axes(figures):
        renderer = axis.get_figure(root=True).canvas.get_renderer()
        boxes = [label.get_window_extent(renderer) for label in _labels(axis)]
        assert not [pair for pair in combinations(boxes, 2) if pair[0].overlaps(pair[1])], (name, axis.axis_name, [label.get_text() for label in _labels(axis)])


def test_an_axis_whose_multiples_of_a_decade_meet_labels_decades_only():
    """A bar chart's log axis over 1.4 decades (3e-2 s to 7e-1 s, smoke-cpu's train panel): matplotlib labels 2×, 3×, 4×,
    6× of each decade, which met in a panel of three ('2×10⁻¹3×10⁻¹4×10⁻¹6×10⁻¹'): only the decades are left there; a
    figure of one panel has the room for them all."""
    for panels, expected in ((3, ["10⁻¹"]), (1, ["10⁻¹", "3×10⁻²", "4×10⁻²", "6×10⁻²", "2×10⁻¹", "3×10⁻¹", "4×10⁻¹", "6×10⁻¹"])):
        figure, (ax, *_) = new_figure(panels)
        ax.barh(range(3), [0.03, 0.2, 0.7])
        ax.set_xscale("log")
        ax.set_xlim(0.025, 0.75)
        plain_log_ticks(figure)
        figure.draw_without_rendering()
        texts = [label.get_text() for label in drawn_labels(ax.xaxis)]
        boxes = [label.get_window_extent() for label in drawn_labels(ax.xaxis)]
        assert texts == expected and not [pair for pair in combinations(boxes, 2) if pair[0].overlaps(pair[1])], (panels, texts)  # room: kept


def test_a_results_files_mathtext_is_shown_as_written(figures):
    legend = [text.get_text() for figure in (figures["swept-time"], figures["mqar-mqar"]) for legend in figure.legends for text in legend.get_texts()]
    assert "a$b$c" in legend, legend


@pytest.mark.parametrize(
    ("low", "high", "expected"),
    [(1e-7, 1e-1, ["10⁻⁷", "10⁻⁵", "10⁻³", "10⁻¹"]), (0.021, 0.069, ["3×10⁻²", "4×10⁻²", "6×10⁻²"]), (3e4, 3e5, ["10⁵", "2×10⁵", "3×10⁵", "4×10⁴", "6×10⁴"])],
)
def test_a_log_axis_is_labelled_as_matplotlib_would_in_unicode(low, high, expected):
    figure = Figure()
    ax = figure.subplots()
    ax.set(xscale="log", xlim=(low, high))
    with matplotlib.rc_context(PLAIN_TEXT):
        plain_log_ticks(figure)
        FigureCanvasAgg(figure).draw()
    assert isinstance(ax.xaxis.get_major_formatter(), PlainLogFormatter)
    assert set(expected) <= {label.get_text() for label in _labels(ax.xaxis)}


@pytest.mark.parametrize(
    ("values", "limits"),
    [([2.1e-7, 3e-7], (1e-7, 1e-6)), ([1e-4], (10**-4.1, 1e-3)), ([1.02e-7, 0.05], (10 ** (-7 + 0.0086 - 0.1), 1e-1))],
)
def test_decades_hold_the_values_clear_of_the_ends_and_a_decade_each_side(values, limits):
    assert decades(values) == pytest.approx(limits, rel=1e-3)


@pytest.mark.parametrize("series", [3, 22])
def test_the_legend_fits_its_figure_in_as_many_columns_as_it_takes(tmp_path, series):
    """22 labels (every core variant in two dtypes, as reports/examples/cpu-dev-vm) ran off the figure's foot in one column."""
    labels = [f"variant{number}(scan=parallel, d_key=16) dtype=bfloat16" for number in range(series)]
    figure, _ = new_figure(3)
    Figures(tmp_path, dict(zip(labels, sns.color_palette("husl", series))), {}).legend(figure, pd.DataFrame({"series": labels, "machine": "m"}), True)
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    (legend,) = figure.legends
    box = legend.get_window_extent(canvas.get_renderer())
    assert len(legend.get_texts()) == series + 1 and box.x0 >= 0 and box.y0 >= 0 and box.x1 <= figure.bbox.x1 and box.y1 <= figure.bbox.y1, (box, figure.bbox)
    assert all(ax.get_window_extent().x1 < box.x0 for ax in figure.axes), "a panel reaches into the legend"

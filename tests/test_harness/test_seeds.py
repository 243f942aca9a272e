"""Seeds as an axis of every quality task, the report's aggregation over them (harness.report.seeds)
and the quality–speed frontier (harness.report.frontier): the statistics on constructed cells, the
scenario rules on the shipped MQAR scenario, and one real tiny MQAR run through the CLI."""

from __future__ import annotations

import csv
import re
from typing import Literal

import numpy as np
import pandas as pd
import pytest
from helpers import attnbench
from pydantic import BaseModel

from harness import tasks
from harness.report.figures import Figures
from harness.report.frontier import cell_flags, frontier_plot, frontier_points, on_frontier
from harness.report.seeds import over_seeds, seed_table, swept
from harness.scenarios.scenario import ScenarioError, load_scenario

ACCURACY = tasks.Score("accuracy", higher_is_better=True, threshold=0.9)


def cells_of(rows: list[tuple[str, int, int, float, float]], machine: str = "m1") -> pd.DataFrame:
    """Quality cells as the report prepares them: (series, seq_len, seed, accuracy, words/s)."""
    return pd.DataFrame(
        [
            {
                "machine_key": machine,
                "machine": f"host-{machine}",
                "scenario": "mqar",
                "series": series,
                "mode": "quality",
                "target": "mqar",
                "status": "ok",
                "axes.seq_len": seq_len,
                "axes.d_model": 64,
                "axes.dtype": "float32",
                "axes.device": "cpu",
                "axes.seed": seed,
                "metrics.accuracy": accuracy,
                "metrics.words_per_s": speed,
            }
            for series, seq_len, seed, accuracy, speed in rows
        ]
    )


# --- scenarios ------------------------------------------------------------------------------


def test_a_seed_axis_gives_each_cell_its_seed_in_axes_and_task():
    cells = load_scenario("quality/mqar", preset="ci", overrides=["seed=[0, 1, 2]"]).cells()
    assert sorted((cell.variant, cell.axes["seed"]) for cell in cells) == [(v, s) for v in ("linear", "softmax") for s in (0, 1, 2)]
    assert all(cell.task["seed"] == cell.axes["seed"] for cell in cells)
    assert len({cell.cell_id for cell in cells}) == 6


def test_without_a_seed_axis_cells_keep_the_task_seed_and_their_ids():
    cells = load_scenario("quality/mqar", preset="ci", overrides=["task.seed=4"]).cells()
    assert all("seed" not in cell.axes and cell.task["seed"] == 4 for cell in cells)


@pytest.mark.parametrize(
    ("spec", "override", "message"),
    [
        ("quality/mqar", "seed=[-1]", "axes.seed: expected integers >= 0"),
        ("quality/mqar", "seed=[1, 1]", "axes.seed: a seed is listed twice"),
        ("quality/mqar", "seed=[true]", "axes.seed: expected integers >= 0"),
        ("smoke-cpu", "seed=[0, 1]", "axes.seed: seeds sweep a quality task's seed; a speed scenario has none"),
    ],
)
def test_bad_seed_axes_are_refused_naming_the_field(spec, override, message):
    with pytest.raises(ScenarioError, match=re.escape(message)):
        load_scenario(spec, overrides=[override])


class UnseededConfig(BaseModel):
    name: Literal["unseeded"]


def test_a_task_without_a_seed_field_cannot_sweep_seeds(tmp_path, monkeypatch):
    """The task joins the registry for this test only (a plugin loaded here would stay registered
    for every later test of the session)."""
    tasks.names()
    unseeded = tasks.Task(name="unseeded", config=UnseededConfig, axes=("width",), run=dict, d_keys=lambda config, axes: axes["width"])
    monkeypatch.setitem(tasks._TASKS, "unseeded", unseeded)
    path = tmp_path / "spread.yaml"
    path.write_text("name: spread\nvariants: {softmax: {}}\ntask: {name: unseeded}\ntarget: unseeded\nmodes: [quality]\naxes: {width: [8], seed: [0, 1]}\n")
    with pytest.raises(ScenarioError, match="the unseeded task, whose config has no seed field"):
        load_scenario(str(path))


# --- aggregation over seeds ---------------------------------------------------------------------


def test_over_seeds_gives_mean_range_and_passed_seeds_per_group():
    cells = cells_of(
        [
            ("delta", 128, 0, 1.0, 10.0),
            ("delta", 128, 1, 0.855, 12.0),
            ("delta", 128, 2, 0.95, 14.0),
            ("delta", 256, 0, 0.1, 8.0),
            ("linear", 128, 0, 0.5, 30.0),
            ("linear", 128, 1, 0.7, 30.0),
        ]
    )
    summary = over_seeds(cells, ACCURACY).set_index(["series", "axes_text"])
    delta = summary.loc[("delta", "T=128 float32 d_model=64")]
    assert (delta["seeds"], delta["passed"], delta["low"], delta["high"]) == (3, 2, 0.855, 1.0)
    assert delta["mean"] == pytest.approx((1.0 + 0.855 + 0.95) / 3) and delta["words_per_s"] == pytest.approx(12.0)
    assert summary.loc[("delta", "T=256 float32 d_model=64")]["seeds"] == 1
    assert summary.loc[("linear", "T=128 float32 d_model=64")]["passed"] == 0
    assert len(summary) == 3


def test_failed_cells_and_other_machines_are_kept_apart():
    cells = pd.concat([cells_of([("delta", 128, 0, 1.0, 10.0), ("delta", 128, 1, 0.2, 10.0)]), cells_of([("delta", 128, 0, 0.4, 5.0)], "m2")])
    cells.loc[cells.index[1], "status"] = "nan"
    summary = over_seeds(cells.reset_index(drop=True), ACCURACY)
    assert sorted(zip(summary["machine_key"], summary["seeds"], summary["mean"])) == [("m1", 1, 1.0), ("m2", 1, 0.4)]


def test_the_seed_table_appears_only_where_seeds_were_swept():
    one_seed = cells_of([("delta", 128, 0, 1.0, 10.0), ("linear", 128, 0, 0.5, 30.0)])
    assert not swept(one_seed) and seed_table(one_seed, ACCURACY) is None
    several = cells_of([("delta", 128, 0, 1.0, 10.0), ("delta", 128, 1, 0.5, 10.0)])
    table = seed_table(several, ACCURACY)
    assert swept(several)
    assert table.headers[-2:] == ["passed (accuracy ≥ 0.9)", "words/s (mean)"]
    assert table.rows == [["delta", "T=128 float32 d_model=64", "0.75", "0.5 – 1", "2", "1 of 2", "10"]]


def test_a_score_passes_in_its_direction():
    perplexity = tasks.Score("valid_ppl", higher_is_better=False, threshold=100.0)
    ppl = pd.DataFrame({"metrics.valid_ppl": [99.0, 100.0, 101.0, np.nan]})
    assert perplexity.passed(ppl).tolist() == [True, True, False, False]
    assert ACCURACY.passed(pd.DataFrame({"metrics.accuracy": [0.9, 0.89]})).tolist() == [True, False]
    assert not tasks.Score("bleu", higher_is_better=True).passed(pd.DataFrame({"metrics.bleu": [99.0]})).any()


def test_a_score_that_stops_training_takes_each_cells_own_threshold_and_ties_past_it():
    """Retrieval stops at the task's target_loss: that is each cell's threshold, and a loss below it is compared as the target."""
    score = tasks.get("retrieval").score
    cells = pd.DataFrame({"metrics.loss": [0.0002, 0.0009, 0.002, 0.0002], "task.target_loss": [0.001, 0.001, 0.001, 0.0001]})
    assert score.passed(cells).tolist() == [True, True, False, False]
    assert score.compared(cells).tolist() == [0.001, 0.001, 0.002, 0.0002]
    assert score.describe() == "loss ≤ target_loss"
    assert ACCURACY.compared(pd.DataFrame({"metrics.accuracy": [0.95, 1.0]})).tolist() == [0.95, 1.0]


# --- the frontier ---------------------------------------------------------------------------------


def test_on_frontier_keeps_exactly_the_points_no_other_beats_on_both():
    speed = np.array([1.0, 2.0, 3.0, 2.0, 3.0, np.nan, 0.5])
    quality = np.array([0.9, 0.8, 0.5, 0.7, 0.5, 1.0, 0.9])
    # 0: best quality (6 has no speed); 1: faster than 0, better than 2/4; 3: beaten by 1; 2 and 4 tie, both kept;
    # 6: as good as 0 but slower, so beaten.
    assert on_frontier(speed, quality, higher_is_better=True).tolist() == [True, True, True, False, True, False, False]
    assert on_frontier(speed, -quality, higher_is_better=False).tolist() == [True, True, True, False, True, False, False]


def test_frontier_points_compare_only_within_one_panel():
    cells = cells_of(
        [
            ("delta", 128, 0, 1.0, 10.0),
            ("linear", 128, 0, 0.5, 30.0),
            ("softmax", 128, 0, 0.4, 20.0),
            ("softmax", 256, 0, 0.1, 1.0),
        ]
    )
    points = frontier_points(cells, ACCURACY).set_index(["series", "axes_text"])["on_frontier"]
    assert points.to_dict() == {
        ("delta", "T=128 float32 d_model=64"): True,
        ("linear", "T=128 float32 d_model=64"): True,
        ("softmax", "T=128 float32 d_model=64"): False,
        ("softmax", "T=256 float32 d_model=64"): True,
    }
    flags = cell_flags(cells, ACCURACY)
    assert flags.reindex(cells.index).tolist() == [True, True, False, True]


def test_cells_that_reached_the_target_where_training_stops_tie_and_the_fastest_wins():
    """Retrieval at S = 40: both reached the target loss; the smaller loss of the slower one is chance, not a better memory."""
    cells = cells_of([("performer", 40, 0, np.nan, 10.0), ("linear", 40, 0, np.nan, 30.0), ("softmax", 40, 0, np.nan, 5.0)])
    cells = cells.assign(**{"metrics.loss": [0.00014, 0.00021, 0.0004], "task.target_loss": 0.001}).drop(columns="metrics.accuracy")
    score = tasks.get("retrieval").score
    assert frontier_points(cells, score).set_index("series")["on_frontier"].to_dict() == {"performer": False, "linear": True, "softmax": False}
    without_ties = tasks.Score("loss", higher_is_better=False)
    assert frontier_points(cells, without_ties).set_index("series")["on_frontier"].to_dict() == {"performer": True, "linear": True, "softmax": False}


def test_the_frontier_plot_names_its_panels(tmp_path):
    cells = cells_of([("delta", 128, 0, 1.0, 10.0), ("delta", 128, 1, 0.8, 11.0), ("linear", 128, 0, 0.5, 30.0)])
    figures = Figures(tmp_path, {"delta": (0, 0, 1), "linear": (1, 0, 0)}, {"host-m1": "-"})
    plot = frontier_plot(cells, ACCURACY, figures, "mqar")
    assert (tmp_path / plot.file).read_bytes().startswith(b"\x89PNG") and "Panels: 1 of 1" in plot.caption
    assert frontier_plot(cells.assign(**{"metrics.words_per_s": np.nan}), ACCURACY, figures, "none") is None


# --- end to end -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_seed_sweep_reports_seeds_and_the_frontier(tmp_path):
    """Three seeds of MQAR's ci preset through the CLI: every cell has its seed and a positive
    training throughput, and the report has the seed table, the frontier plot and the CSV column."""
    done = attnbench(
        "run",
        "quality/mqar",
        "--preset",
        "ci",
        "--set",
        "seed=[0, 1, 2]",
        "--out",
        str(tmp_path / "out"),
        "--report",
        str(tmp_path / "report"),
        "--no-progress",
    )
    assert done.returncode == 0, done.stderr
    html = (tmp_path / "report" / "index.html").read_text()
    assert "accuracy over seeds" in html and "Quality against speed" in html
    assert (tmp_path / "report" / "plots" / "mqar-frontier.png").is_file()
    with open(tmp_path / "report" / "cells.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert sorted((row["variant"], row["axes.seed"]) for row in rows) == [(v, s) for v in ("linear", "softmax") for s in "012"]
    assert all(float(row["metrics.words_per_s"]) > 0 and row["quality_frontier"] in ("True", "False") for row in rows)
    assert any(row["quality_frontier"] == "True" for row in rows)

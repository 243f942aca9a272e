"""Bounded bootstraps and unstable measurements (issue 36): resampling holds a bounded number of
values whatever the sample count, with the same figures as one chunk; a cell measured unstable is
marked wherever its number appears and never judged better or worse; CPU cells beside other work
say so and leave the busy cores alone."""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import harness
import harness.measuring.stats as stats
from harness.results import read_records
from harness.results.compare import EXIT_OK, EXIT_REGRESSION, UNSTABLE, compare, ratio_ci
from harness.scenarios.cell import Cell

#: An old results file (schema 1): one softmax cell with five samples, one failed linear cell.
SCHEMA_1 = Path(__file__).with_name("schema-1.jsonl")


def _peak_bytes(function, *args, **kwargs) -> int:
    """The peak of memory traced (numpy's arrays included) while ``function`` runs."""
    tracemalloc.start()
    try:
        function(*args, **kwargs)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_bootstraps_are_the_same_in_chunks_of_any_size(monkeypatch):
    """Chunks of a few resamples give the very figures of one chunk for all of them."""
    rng = np.random.default_rng(3)
    samples = rng.lognormal(size=37)
    base = [rng.lognormal(size=n) for n in (5, 9, 7)]
    head = [1.2 * rng.lognormal(size=n) for n in (8, 6)]
    whole = stats.median_rel_ci(samples), ratio_ci(base, head, alpha=0.05, seed=[1, 2])
    monkeypatch.setattr(stats, "CHUNK_VALUES", 3 * 37 + 5)
    assert stats.chunk_rows(37) == 3 and stats.chunk_rows(10**9) == 1
    assert (stats.median_rel_ci(samples), ratio_ci(base, head, alpha=0.05, seed=[1, 2])) == whole


@pytest.mark.parametrize(("statistic", "count"), [("median_rel_ci", 20_000), ("ratio_ci", 10_000)])
def test_a_long_sample_list_resamples_in_bounded_memory(statistic, count):
    """One chunk of every resample held 1000 x 20,000 values (300 MB) for median_rel_ci and
    2000 x 10,000 per side (450 MB) for ratio_ci; in chunks the peak stays under 200 MB (2 s)."""
    samples = np.random.default_rng(0).lognormal(size=count)
    if statistic == "median_rel_ci":
        peak = _peak_bytes(stats.median_rel_ci, samples)
    else:
        peak = _peak_bytes(ratio_ci, samples, samples * 1.01, alpha=0.05, seed=0)
    assert peak < 200 * 2**20, f"{statistic} peaked at {peak / 2**20:.0f} MB"


def _results(path: Path, *, scale: float = 1.0, unstable: bool | None = None) -> Path:
    """SCHEMA_1 read (as schema 2) and written to ``path``, its softmax samples times ``scale``,
    its ``metrics.unstable`` set to ``unstable``."""
    records = read_records(SCHEMA_1)
    for record in records:
        if record.get("status") == "ok":
            metrics = record["metrics"]
            metrics.update(samples_s=[scale * sample for sample in metrics["samples_s"]], median_s=scale * metrics["median_s"], unstable=unstable)
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


@pytest.mark.parametrize("side", ["base", "head"])
def test_a_side_measured_unstable_is_marked_and_not_judged(tmp_path, side):
    """Three times slower is "worse" (exit 1) when both sides are stable; with either side unstable
    the cell is "unstable: not compared" (no ratio, exit 0) and its median carries a * in the text
    table and the report's comparison."""
    from harness.report.tables import compare_table

    stable = compare(_results(tmp_path / "base.jsonl", unstable=False), _results(tmp_path / "head.jsonl", scale=3, unstable=False))
    assert stable.table["mark"].iloc[0] == "worse" and stable.exit_code == EXIT_REGRESSION and " *" not in stable.format_table()
    base = _results(tmp_path / "base.jsonl", unstable=side == "base")
    head = _results(tmp_path / "head.jsonl", scale=3, unstable=side == "head")
    result = compare(base, head)
    row = int(np.flatnonzero(result.table["variant"] == "softmax")[0])
    cell = result.table.iloc[row]
    assert cell["mark"] == UNSTABLE and f"{side} unstable" in cell["note"] and pd.isna(cell["ratio"]), result.format_table()
    assert cell[f"{side}_unstable"] and result.exit_code == EXIT_OK, result.format_table()
    text = result.format_table().splitlines()
    assert sum(" *" in line for line in text) == 1 and any(line.startswith("* measured unstable") for line in text), text
    shown = compare_table(result)
    marked = [shown.rows[row][shown.headers.index(column)].endswith(" *") for column in ("base", "head")]
    assert marked == [side == "base", side == "head"] and "marked *" in shown.caption, shown.rows[row]
    template = (Path(harness.__file__).parent / "templates" / "page.html.j2").read_text()
    assert shown.row_classes[row] == "unstable-not-compared" and "tr.unstable-not-compared" in template  # shaded as unstable rows are


def test_only_unstable_cells_compare_nothing(tmp_path):
    """Every timed cell unstable on one side: nothing was compared, exit 2 (the failed cell aside)."""
    from harness.results.compare import EXIT_INCOMPARABLE

    base = _results(tmp_path / "base.jsonl", unstable=True)
    head = _results(tmp_path / "head.jsonl", unstable=False)
    for path in (base, head):
        path.write_text("".join(line + "\n" for line in path.read_text().splitlines() if '"status": "error"' not in line))
    assert compare(base, head).exit_code == EXIT_INCOMPARABLE


def test_the_reports_side_by_side_tables_mark_unstable_times(tmp_path):
    """Machines and backends side by side: an unstable time and its ratio carry a *, the caption
    says why, and the geometric mean leaves that ratio out."""
    from harness.report.cells import prepare
    from harness.report.machines import side_by_side
    from harness.report.tables import backend_table
    from harness.results import load

    records = [record for record in read_records(SCHEMA_1) if record.get("status") != "error"]
    ok = records[1]
    ok["metrics"]["unstable"] = False
    compiled = json.loads(json.dumps(ok)) | {"backend": "compile", "cell_id": "c3"}
    compiled["metrics"].update(median_s=2 * ok["metrics"]["median_s"], unstable=True)
    here = tmp_path / "here.jsonl"
    here.write_text("".join(json.dumps(record) + "\n" for record in [*records, compiled]))
    backends = backend_table(prepare(load(here)), "torch")
    assert backends.rows[0][-1] == "2.000 *" and "Geometric means: none." in backends.caption and "marked *" in backends.caption, backends

    elsewhere = [json.loads(json.dumps(record)) for record in [*records, compiled]]
    for record in elsewhere:
        record["machine_id"] = "m2"
        if record["kind"] == "run":
            record["machine"].update(machine_id="m2", hostname="other")
    there = tmp_path / "there.jsonl"
    there.write_text("".join(json.dumps(record) + "\n" for record in elsewhere))
    (section,) = side_by_side(prepare(load([here, there])))
    verdicts = sorted(row[section.pairs.headers.index("verdict")] for row in section.pairs.rows)
    assert verdicts[-1] == "not compared: A unstable; B unstable" and "unstable (* beside its median)" in section.pairs.caption, section.pairs
    assert section.headline.rows[0][1].endswith(f"1 of {len(verdicts)} cells"), section.headline  # issue 57: the unstable pair is in no mean


def test_the_threads_of_a_cpu_measurement_leave_the_busy_cores_alone():
    """Half a core of other work takes a core; at least one thread is left; fewer threads stay."""
    from harness.measuring.busyness import busy_cores, spare_threads

    assert [busy_cores(load) for load in (None, 0.0, 0.49, 0.5, 1.4, 1.5, 3.7)] == [0, 0, 0, 1, 1, 2, 4]
    assert [spare_threads(8, 8, load) for load in (None, 0.2, 0.6, 2.5, 7.9, 12.0)] == [8, 8, 7, 5, 1, 1]
    assert spare_threads(2, 8, 3.0) == 2


def _cells(tmp_path, device: str = "cpu", **measure) -> list[Cell]:
    from harness.scenarios.scenario import load_scenario

    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(
        json.dumps(
            {
                "name": "tiny",
                "variants": {"linear": {}},
                "axes": {"seq_len": 16, "batch": 1, "heads": 1, "d_key": 8, "device": device},
                "modes": ["forward"],
                "measure": {"warmup": 1, "repeats": 3, "max_time_s": 0, **measure},
            }
        )
    )
    return load_scenario(str(scenario)).cells()


def test_a_busy_machine_is_announced_before_cpu_cells(tmp_path):
    from harness.measuring.busyness import busy_warning

    cells = _cells(tmp_path)
    line = busy_warning(cells, 1.6, 2, 1)
    assert line.startswith("warning: the machine is busy: other processes keep 1.6 of 2 cores busy, 0 free;") and "1 thread)" in line, line
    assert "\n" not in line and busy_warning(cells, 0.3, 2, 2) is None and busy_warning(cells, None, 2, 2) is None
    assert busy_warning([cell.replace(axes=dict(cell.axes, device="cuda")) for cell in cells], 1.6, 2, None) is None


def test_attnbench_run_says_so_before_the_first_cell(tmp_path, monkeypatch, capsys):
    """The warning is the first line of ``attnbench run`` on a busy machine (load injected), after
    the checks and before the worker starts (stopped there as Ctrl-C would, to stay quick)."""
    import harness.running.runner
    from harness.cli import EXIT_INTERRUPTED, main
    from harness.running.executors.local import LocalExecutor

    _cells(tmp_path)
    monkeypatch.setattr(harness.running.runner, "other_cores_now", lambda: os.cpu_count() - 0.4)
    before_first_cell = []

    def start(self, todo, fingerprint):
        before_first_cell.append(capsys.readouterr().err)
        raise KeyboardInterrupt

    monkeypatch.setattr(LocalExecutor, "start", start)
    assert main(["run", str(tmp_path / "tiny.yaml"), "--out", str(tmp_path / "out"), "--no-progress"]) == EXIT_INTERRUPTED
    (err,) = before_first_cell
    assert err.startswith("warning: the machine is busy:") and "the CPU timings of 1 cell will be unreliable" in err, err

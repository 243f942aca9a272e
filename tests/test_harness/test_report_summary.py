"""The report's summary, "which is fastest" (harness.report.summary), on results files written here: the fastest
named at each length, the others as multiples with their memory, unstable and inaccurate cells marked and never
named, like compared with like only (dtypes, machines), quality cells by their task's headline metric, and the
summary on the page before its first plot."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from harness.common.formatting import MIB
from harness.report import build_report, prepare
from harness.report.summary import MAX_LENGTHS, summary_tables
from harness.results import load

AXES = {"batch": 2, "heads": 4, "d_key": 32, "d_value": 32, "dtype": "float32", "device": "cpu"}


def run_line(machine: str = "m1", scenario: str = "s") -> dict:
    return {
        "kind": "run",
        "schema": 2,
        "run_id": f"run-{machine}",
        "started_at": "2026-12-06T05:00:00+00:00",
        "scenario": scenario,
        "machine": {"machine_id": machine, "hostname": f"host-{machine}", "cpu": {"model": "Test CPU"}},
        "commit": "abc1234",
        "dirty": False,
    }


def cell(variant: str, seq_len: int, median_s: float | None, *, mode="forward", machine="m1", status="ok", axes=None, params=None, **metrics) -> dict:
    """One timed cell of scenario 's': ``metrics`` beside its median (peak memory 1 MiB unless given)."""
    shown = {"median_s": median_s, "peak_mem_bytes": MIB, "unstable": False, **metrics} if status == "ok" else {}
    return {
        "kind": "cell",
        "schema": 2,
        "run_id": f"run-{machine}",
        "cell_id": f"{variant}-{json.dumps(params)}-{seq_len}-{mode}-{json.dumps(axes)}",
        "scenario": "s",
        "variant": variant,
        "backend": "torch",
        "params": params or {},
        "axes": {"seq_len": seq_len, **AXES, **(axes or {})},
        "mode": mode,
        "target": "core",
        "status": status,
        "error": None if status == "ok" else "boom",
        "metrics": shown,
        "machine_id": machine,
        "started_at": "2026-12-06T05:00:01+00:00",
    }


def write(path: Path, records: list[dict], machine: str = "m1") -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in [run_line(machine), *records]))
    return path


def summarise(tmp_path: Path, records: list[dict]) -> dict:
    """The summary tables of ``records`` by title, each as {row label: {column: text}}."""
    tables = summary_tables(prepare(load(write(tmp_path / "r.jsonl", records))))
    return {table.title: {row[0]: dict(zip(table.headers[1:], row[1:])) for row in table.rows} for table in tables}


def test_the_fastest_is_named_at_each_length_and_every_other_as_a_multiple_with_its_memory(tmp_path):
    """softmax is fastest at T=128, linear at T=1024: each named with its time; the others are multiples of it."""
    summary = summarise(
        tmp_path,
        [
            cell("softmax", 128, 0.001, peak_mem_bytes=4 * MIB),
            cell("linear", 128, 0.0025),
            cell("performer", 128, 0.003, params={"m": 32}),
            cell("softmax", 1024, 0.040, peak_mem_bytes=64 * MIB),
            cell("linear", 1024, 0.010),
            cell("performer", 1024, 0.017, params={"m": 32}),
        ],
    )
    assert list(summary) == ["s: forward"]
    rows = summary["s: forward"]
    assert rows["fastest"] == {"T=128": "softmax: 1 ms", "T=1024": "linear: 10 ms"}
    assert rows["softmax"] == {"T=128": "×1.00 · 4.0 MiB", "T=1024": "×4.00 · 64.0 MiB"}
    assert rows["linear"] == {"T=128": "×2.50 · 1.0 MiB", "T=1024": "×1.00 · 1.0 MiB"}
    assert rows["performer(m=32)"] == {"T=128": "×3.00 · 1.0 MiB", "T=1024": "×1.70 · 1.0 MiB"}
    assert list(rows)[1:] == ["linear", "performer(m=32)", "softmax"]  # fastest first at the longest length


@pytest.mark.parametrize("mark", ["unstable", "inaccurate"])
def test_an_unstable_or_inaccurate_cell_is_marked_and_never_named_fastest(tmp_path, mark):
    """The least median belongs to a marked cell: the fastest stable, accurate cell is named, and the marked one shows
    its multiple of it (below 1) with its mark."""
    summary = summarise(tmp_path, [cell("softmax", 128, 0.002), cell("linear", 128, 0.001, **{mark: True}), cell("delta", 128, 0.004)])
    rows = summary["s: forward"]
    assert rows["fastest"] == {"T=128": "softmax: 2 ms"}
    assert rows["linear"] == {"T=128": f"×0.500 · 1.0 MiB ({mark})"}
    assert rows["delta"] == {"T=128": "×2.00 · 1.0 MiB"}


def test_without_a_stable_accurate_cell_none_is_named_and_times_are_shown(tmp_path):
    summary = summarise(tmp_path, [cell("softmax", 128, 0.002, unstable=True), cell("linear", 128, 0.001, unstable=True, inaccurate=True)])
    rows = summary["s: forward"]
    assert rows["fastest"] == {"T=128": "none (no stable, accurate cell)"}
    assert rows["linear"] == {"T=128": "1 ms · 1.0 MiB (unstable, inaccurate)"}


def test_a_failed_cell_shows_its_status_and_a_missing_one_a_dash(tmp_path):
    summary = summarise(tmp_path, [cell("softmax", 128, 0.002), cell("softmax", 1024, None, status="oom"), cell("linear", 1024, 0.004)])
    rows = summary["s: forward"]
    assert rows["softmax"] == {"T=128": "×1.00 · 1.0 MiB", "T=1024": "oom"}
    assert rows["linear"] == {"T=128": "-", "T=1024": "×1.00 · 1.0 MiB"}


def test_groups_never_mix_dtypes_and_each_says_what_it_holds_fixed(tmp_path):
    """A bfloat16 cell twice as fast is named only in its own table: float32 and bfloat16 are summarised apart."""
    bf16 = {"dtype": "bfloat16"}
    records = [cell("softmax", 128, 0.002), cell("linear", 128, 0.003), cell("softmax", 128, 0.001, axes=bf16), cell("linear", 128, 0.0005, axes=bf16)]
    tables = {table.title: table for table in summary_tables(prepare(load(write(tmp_path / "r.jsonl", records))))}
    assert list(tables) == ["s: forward · float32", "s: forward · bfloat16"]  # in the order measured
    for dtype, fastest in (("float32", "softmax: 2 ms"), ("bfloat16", "linear: 500 µs")):
        own = tables[f"s: forward · {dtype}"]
        assert own.rows[0] == ["fastest", fastest] and own.caption == f"Held fixed: B=2 H=4 Dv=32 {dtype} cpu; timed by: events.", own


def test_the_caption_names_what_timed_the_cells(tmp_path):
    """A CPU cell timed with measure.timing events was timed by perf_counter (metrics.clock), and the caption says so."""
    records = [cell(variant, 128, median, clock="wall (perf_counter)") for variant, median in (("softmax", 0.002), ("linear", 0.001))]
    (table,) = summary_tables(prepare(load(write(tmp_path / "r.jsonl", records))))
    assert table.caption == "Held fixed: B=2 H=4 Dv=32 float32 cpu; timed by: wall (perf_counter).", table.caption


def test_modes_are_summarised_apart_in_their_order(tmp_path):
    records = [cell(variant, 128, median, mode=mode) for mode in ("decode", "train", "forward") for variant, median in (("softmax", 0.002), ("linear", 0.001))]
    assert list(summarise(tmp_path, records)) == ["s: forward", "s: train", "s: decode"]


def test_a_variants_own_key_width_is_compared_with_the_others(tmp_path):
    """based with its own d_key 16 (d_value the axis' 32) is in the table of the d_value=32 cells, labelled with it."""
    rows = summarise(tmp_path, [cell("softmax", 128, 0.002), cell("based", 128, 0.001, axes={"d_key": 16})])["s: forward"]
    assert rows["fastest"] == {"T=128": "based(d_key=16): 1 ms"} and rows["softmax"] == {"T=128": "×2.00 · 1.0 MiB"}


def test_with_many_lengths_only_the_longest_is_shown_and_said(tmp_path):
    lengths = [128 * 2**i for i in range(MAX_LENGTHS + 1)]
    records = [cell(variant, length, factor * length * 1e-6) for length in lengths for variant, factor in (("softmax", 1), ("linear", 2))]
    (table,) = summary_tables(prepare(load(write(tmp_path / "r.jsonl", records))))
    assert table.headers == ["variant", f"T={lengths[-1]}"] and f"Only the longest of {len(lengths)} lengths" in table.caption


def test_each_machine_is_summarised_on_its_own(tmp_path):
    """The same cells on two machines, the other variant faster on each: two tables, each naming its machine's fastest."""
    here = write(tmp_path / "a.jsonl", [cell("softmax", 128, 0.001), cell("linear", 128, 0.002)])
    there = write(tmp_path / "b.jsonl", [cell("softmax", 128, 0.004, machine="m2"), cell("linear", 128, 0.002, machine="m2")], machine="m2")
    tables = {table.title: table.rows[0] for table in summary_tables(prepare(load([here, there])))}
    assert tables == {
        "s: forward · on host-m1 (Test CPU)": ["fastest", "softmax: 1 ms"],
        "s: forward · on host-m2 (Test CPU)": ["fastest", "linear: 2 ms"],
    }


def quality_cell(task: str, variant: str, seed: int, value: float | None, status: str = "ok", words_per_s: float = 1000.0) -> dict:
    """A quality cell of ``task`` at T=64 whose headline metric (MQAR: accuracy, copy: loss, MT: BLEU) is ``value``."""
    metric = {"mqar": "accuracy", "copy": "loss", "mt": "bleu"}[task]
    return {
        **cell(variant, 64, None, status=status),
        "cell_id": f"{variant}-{seed}",
        "axes": {"seq_len": 64, "d_model": 64, "seed": seed, "dtype": "float32", "device": "cpu"},
        "mode": "quality",
        "target": task,
        "metrics": {metric: value, "words_per_s": words_per_s} if status == "ok" else {},
    }


def test_quality_cells_name_the_best_by_the_tasks_headline_metric_over_seeds(tmp_path):
    """MQAR: linear's mean accuracy over two seeds (0.9) beats softmax's (0.8), though softmax has the best seed and
    trains faster; an oom shows as such."""
    records = [
        quality_cell("mqar", "softmax", 0, 0.95, words_per_s=2000.0),
        quality_cell("mqar", "softmax", 1, 0.65, words_per_s=2000.0),
        quality_cell("mqar", "linear", 0, 0.85),
        quality_cell("mqar", "linear", 1, 0.95),
        quality_cell("mqar", "delta", 0, None, status="oom"),
    ]
    assert summarise(tmp_path, records)["s: quality"] == {
        "best": {"T=64": "linear: accuracy 0.9"},
        "delta": {"T=64": "oom"},
        "linear": {"T=64": "0.9 (2 seeds)"},
        "softmax": {"T=64": "0.8 (2 seeds)"},
    }


def test_variants_that_tie_on_the_metric_are_named_together_the_faster_first(tmp_path):
    records = [quality_cell("mqar", "softmax", 0, 1.0), quality_cell("mqar", "linear", 0, 1.0, words_per_s=2000.0), quality_cell("mqar", "delta", 0, 0.5)]
    assert summarise(tmp_path, records)["s: quality"]["best"] == {"T=64": "linear, softmax (tie): accuracy 1"}


@pytest.mark.parametrize(("task", "best"), [("copy", {"T=64": "linear: loss 0.2"}), ("mt", {"all": "softmax: bleu 0.5"})])
def test_lower_or_higher_is_better_as_the_task_says_with_a_column_per_value_of_its_first_axis(tmp_path, task, best):
    """Copy's loss: the lowest is best, a column per seq_len; MT's BLEU: the highest, one column (the task has no axis)."""
    records = [quality_cell(task, "softmax", 0, 0.5), quality_cell(task, "linear", 0, 0.2), quality_cell(task, "delta", 0, 0.3)]
    tables = summary_tables(prepare(load(write(tmp_path / "r.jsonl", records))))
    assert [(table.title, table.rows[0][1:]) for table in tables] == [("s: quality", list(best.values()))] and tables[0].headers[1:] == list(best)


def test_the_page_shows_the_summary_before_its_first_plot(tmp_path):
    results = write(tmp_path / "r.jsonl", [cell("softmax", 128, 0.002), cell("linear", 128, 0.001), cell("softmax", 1024, 0.02), cell("linear", 1024, 0.01)])
    page = build_report([results], tmp_path / "report").read_text()
    summary, first_plot = page.index('<h2 id="summary">'), page.index("<img")
    assert summary < first_plot and page.index('href="#summary"') < summary
    fastest = re.search(r'<tr class="winner"><td>fastest</td><td>([^<]*)</td><td>([^<]*)</td></tr>', page)
    assert fastest and fastest.groups() == ("linear: 1 ms", "linear: 10 ms") and fastest.start() < first_plot

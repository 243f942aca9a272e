"""Results files: written one whole line at a time, loaded strictly into one DataFrame."""

from __future__ import annotations

import json
import math
import os
import re
import uuid
from pathlib import Path

import pytest

from harness import results
from harness.results import ResultsFileError, ResultsWriter

MACHINE_A = {
    "machine_id": "a" * 16,
    "hostname": "gpu-node-1",
    "cpu": {"model": "AMD EPYC 9654", "cores": 96},
    "gpu": {"name": "NVIDIA H100 80GB HBM3", "count": 1},
}
MACHINE_B = {
    "machine_id": "b" * 16,
    "hostname": "läptop",
    "cpu": {"model": "Apple M2", "cores": 8},
    "gpu": None,
}


def run_record(machine, **overrides) -> dict:
    record = {
        "run_id": uuid.uuid4().hex,
        "started_at": "2026-12-01T10:00:00+00:00",
        "scenario": "smoke",
        "scenario_file": "scenarios/smoke.yaml",
        "scenario_sha256": "0" * 64,
        "command": "attnbench run scenarios/smoke.yaml",
        "machine": machine,
        "commit": "a7ae4f0",
        "dirty": False,
        "resumed_from": None,
    }
    return {**record, **overrides}


def cell_record(run, cell_id, *, seq_len=256, status="ok", metrics=None, **overrides) -> dict:
    record = {
        "run_id": run["run_id"],
        "cell_id": cell_id,
        "scenario": run["scenario"],
        "variant": "delta",
        "backend": "torch",
        "params": {"chunk_size": 64, "phi": "elu+1"},
        "axes": {"seq_len": seq_len, "batch": 2, "heads": 4, "d_key": 64, "d_value": 64, "dtype": "float32", "device": "cpu"},
        "mode": "forward",
        "target": "core",
        "status": status,
        "error": None,
        "metrics": {"median_s": 0.01, "samples_s": [0.011, 0.01, 0.012], "tokens_per_s": 5e4, "throttled": None} if metrics is None else metrics,
        "machine_id": run["machine"]["machine_id"],
        "commit": run["commit"],
        "started_at": "2026-12-01T10:00:01+00:00",
        "duration_s": 1.5,
    }
    return {**record, **overrides}


def write_file(path, machine, cell_ids=("c1", "c2")) -> dict:
    """A results file with one run on ``machine`` and one ok cell per id; returns the run."""
    writer = ResultsWriter(path)
    run = run_record(machine)
    writer.write_run(run)
    for number, cell_id in enumerate(cell_ids):
        writer.write_cell(cell_record(run, cell_id, seq_len=256 * 2**number))
    return run


# --- writing and loading ------------------------------------------------------------------


def test_round_trip_two_machines(tmp_path):
    run_a = write_file(tmp_path / "a.jsonl", MACHINE_A, ["c1", "c2"])
    run_b = write_file(tmp_path / "b.jsonl", MACHINE_B, ["c1"])

    df = results.load([tmp_path / "a.jsonl", str(tmp_path / "b.jsonl")])

    assert len(df) == 3
    assert list(df.columns[: len(results.COLUMNS)]) == results.COLUMNS
    for column in [
        "params.chunk_size",
        "params.phi",
        "axes.seq_len",
        "axes.dtype",
        "metrics.median_s",
        "metrics.samples_s",
        "machine.machine_id",
        "machine.hostname",
        "machine.cpu.model",
        "machine.gpu.name",
    ]:
        assert column in df.columns, column
    assert "kind" not in df.columns and "schema" not in df.columns
    assert df["run_id"].tolist() == [run_a["run_id"], run_a["run_id"], run_b["run_id"]]
    assert df["file"].tolist() == [str(tmp_path / "a.jsonl")] * 2 + [str(tmp_path / "b.jsonl")]
    assert df["axes.seq_len"].tolist() == [256, 512, 256]
    assert df["machine.hostname"].tolist() == ["gpu-node-1", "gpu-node-1", "läptop"]
    assert df["machine.cpu.model"].tolist() == ["AMD EPYC 9654"] * 2 + ["Apple M2"]
    assert df["machine.gpu.name"].iloc[0] == "NVIDIA H100 80GB HBM3"
    assert df["machine_id"].tolist() == df["machine.machine_id"].tolist() == ["a" * 16] * 2 + ["b" * 16]
    assert all(samples == [0.011, 0.01, 0.012] for samples in df["metrics.samples_s"])
    assert df["metrics.tokens_per_s"].tolist() == [5e4] * 3


def test_a_directory_means_its_jsonl_files_sorted(tmp_path):
    write_file(tmp_path / "b.jsonl", MACHINE_B, ["x"])
    write_file(tmp_path / "a.jsonl", MACHINE_A, ["y"])
    (tmp_path / "notes.txt").write_text("not a results file\n")
    df = results.load(tmp_path)
    assert df["cell_id"].tolist() == ["y", "x"]
    assert df.equals(results.load([str(tmp_path)]))


def test_the_readme_example_runs(tmp_path):
    write_file(tmp_path / "results" / "a.jsonl", MACHINE_A, ["c1", "c2"])
    df = results.load([tmp_path / "results"])
    medians = df[df.status == "ok"].groupby(["variant", "axes.seq_len"])["metrics.tokens_per_s"].median()
    assert medians.to_dict() == {("delta", 256): 5e4, ("delta", 512): 5e4}


def test_only_run_lines_give_an_empty_frame_with_the_fixed_columns(tmp_path):
    ResultsWriter(tmp_path / "r.jsonl").write_run(run_record(MACHINE_A))
    df = results.load(tmp_path / "r.jsonl")
    assert df.empty and list(df.columns) == results.COLUMNS


def test_every_line_is_whole_json_with_kind_and_schema(tmp_path):
    path = tmp_path / "deep" / "er" / "r.jsonl"  # parent directories are created
    write_file(path, MACHINE_B, ["c1"])
    text = path.read_text(encoding="utf-8")
    assert text.endswith("\n") and "läptop" in text
    lines = [json.loads(line) for line in text.splitlines()]
    assert [(line["kind"], line["schema"]) for line in lines] == [("run", 2), ("cell", 2)]


def test_each_record_is_one_os_write_of_one_whole_line(tmp_path, monkeypatch):
    writes = []
    real_write = os.write

    def spy(fd, data):
        writes.append(bytes(data))
        return real_write(fd, data)

    monkeypatch.setattr(results.os, "write", spy)
    write_file(tmp_path / "r.jsonl", MACHINE_A, ["c1", "c2"])
    assert len(writes) == 3
    assert all(data.endswith(b"\n") and data.count(b"\n") == 1 for data in writes)
    assert b"".join(writes) == (tmp_path / "r.jsonl").read_bytes()


def test_nan_and_infinities_round_trip_as_strings(tmp_path):
    path = tmp_path / "r.jsonl"
    writer = ResultsWriter(path)
    run = run_record(MACHINE_A)
    writer.write_run(run)
    metrics = {"loss": math.nan, "ppl": math.inf, "delta": -math.inf, "median_s": 0.5, "samples_s": [0.5, math.nan, math.inf], "nested": {"x": -math.inf}}
    writer.write_cell(cell_record(run, "c1", status="nan", metrics=metrics))

    def no_constants(name):
        raise AssertionError(f"bare {name} in the file")

    raw = json.loads(path.read_text().splitlines()[1], parse_constant=no_constants)["metrics"]
    assert raw["loss"] == "NaN" and raw["ppl"] == "Infinity" and raw["delta"] == "-Infinity"
    assert raw["samples_s"] == [0.5, "NaN", "Infinity"]

    row = results.load(path).iloc[0]
    assert math.isnan(row["metrics.loss"])
    assert row["metrics.ppl"] == math.inf and row["metrics.delta"] == -math.inf
    assert row["metrics.nested.x"] == -math.inf and row["metrics.median_s"] == 0.5
    samples = row["metrics.samples_s"]
    assert samples[0] == 0.5 and math.isnan(samples[1]) and samples[2] == math.inf


def test_nan_outside_metrics_is_refused(tmp_path):
    writer = ResultsWriter(tmp_path / "r.jsonl")
    run = run_record(MACHINE_A)
    writer.write_run(run)
    with pytest.raises(ValueError):
        writer.write_cell(cell_record(run, "c1", params={"scale": math.nan}))


# --- resume -------------------------------------------------------------------------------


def test_completed_cell_ids_counts_every_status(tmp_path):
    path = tmp_path / "r.jsonl"
    writer = ResultsWriter(path)
    run = run_record(MACHINE_A)
    writer.write_run(run)
    for status in results.STATUSES:
        writer.write_cell(cell_record(run, f"cell-{status}", status=status, metrics={}))
    assert results.completed_cell_ids(path) == {f"cell-{status}" for status in results.STATUSES}


def test_a_resumed_run_appends_a_second_run_line(tmp_path):
    path = tmp_path / "r.jsonl"
    first = write_file(path, MACHINE_A, ["c1", "c2"])
    assert results.completed_cell_ids(path) == {"c1", "c2"}

    writer = ResultsWriter(path)
    moved = {**MACHINE_A, "hostname": "gpu-node-2"}
    second = run_record(moved, resumed_from=first["run_id"])
    writer.write_run(second)
    writer.write_cell(cell_record(second, "c3"))

    records = results.read_records(path)
    assert [record["kind"] for record in records] == ["run", "cell", "cell", "run", "cell"]
    assert records[3]["resumed_from"] == first["run_id"]
    assert results.completed_cell_ids(path) == {"c1", "c2", "c3"}
    df = results.load(path)
    assert df["machine.hostname"].tolist() == ["gpu-node-1", "gpu-node-1", "gpu-node-2"]
    assert df["run_id"].tolist() == [first["run_id"]] * 2 + [second["run_id"]]


def test_repair_tail_cuts_exactly_the_partial_line(tmp_path):
    path = tmp_path / "r.jsonl"
    write_file(path, MACHINE_A, ["c1"])
    good = path.read_bytes()
    with open(path, "ab") as handle:
        handle.write(b'{"kind": "cell", "schema": 1, "run_id": "ab')

    assert results.repair_tail(path) is True
    assert path.read_bytes() == good
    assert results.load(path)["cell_id"].tolist() == ["c1"]
    assert results.repair_tail(path) is False
    assert path.read_bytes() == good


def test_repair_tail_of_a_lone_partial_line_empties_the_file(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_bytes(b'{"kind": "run", "sch')
    assert results.repair_tail(path) is True
    assert path.read_bytes() == b""


# --- bad files ----------------------------------------------------------------------------


#: name: (the file's text made from a good run line and a good cell line, bad line, regex)
CORRUPTIONS = {
    "garbage line": (lambda run, cell: f"{run}\nthis is not json\n{cell}\n", 2, "not valid JSON"),
    "wrong schema": (
        lambda run, cell: run.replace('"schema": 2', '"schema": 3') + "\n",
        1,
        "file .*broken-file\\.jsonl was written with results schema 3; this attnbench reads schemas 1 to 2",
    ),
    "truncated tail": (lambda run, cell: f"{run}\n{cell}\n{cell[:30]}", 3, "--resume"),
    "cell before run": (lambda run, cell: f"{cell}\n{run}\n", 1, "cell before any run line"),
    "unknown status": (lambda run, cell: f"{run}\n" + cell.replace('"ok"', '"fine"') + "\n", 2, "'fine'"),
    "no kind": (lambda run, cell: f"{run}\n" + cell.replace('"kind": "cell", ', "") + "\n", 2, "'kind'"),
    "unknown run": (lambda run, cell: f"{run}\n" + cell.replace('"run_id": "', '"run_id": "x') + "\n", 2, "no run line above"),
    "missing cell_id": (lambda run, cell: f"{run}\n" + cell.replace('"cell_id"', '"cell"') + "\n", 2, "'cell_id'"),
    "nested too deeply": (lambda run, cell: f"{run}\n" + "[" * 100_000 + "]" * 100_000 + "\n", 2, "nested too deeply"),
    "metrics a list": (
        lambda run, cell: f"{run}\n" + json.dumps(dict(json.loads(cell), metrics=[1, 2])) + "\n",
        2,
        "metrics: expected a JSON object, got \\[1, 2\\]",
    ),
}


@pytest.mark.parametrize("name", CORRUPTIONS)
def test_a_corrupt_file_names_itself_and_the_line(tmp_path, name):
    make, line, words = CORRUPTIONS[name]
    path = tmp_path / "broken-file.jsonl"
    write_file(path, MACHINE_A, ["c1"])
    run, cell = path.read_text(encoding="utf-8").splitlines()
    path.write_text(make(run, cell), encoding="utf-8")
    for reader in (results.read_records, results.load, results.completed_cell_ids):
        with pytest.raises(ResultsFileError) as info:
            reader(path)
        message = str(info.value)
        assert "broken-file.jsonl" in message and f"line {line}" in message, message
        assert re.search(words, message), message


def test_missing_file(tmp_path):
    with pytest.raises(ResultsFileError, match="nowhere.jsonl.*does not exist"):
        results.load(tmp_path / "nowhere.jsonl")


def test_empty_file(tmp_path):
    (tmp_path / "empty.jsonl").write_bytes(b"")
    with pytest.raises(ResultsFileError, match="empty.jsonl is empty"):
        results.load(tmp_path / "empty.jsonl")


def test_directory_without_results(tmp_path):
    (tmp_path / "nothing-here").mkdir()
    with pytest.raises(ResultsFileError, match="nothing-here"):
        results.load([tmp_path / "nothing-here"])


@pytest.mark.parametrize("order", ["good first", "corrupt first"])
def test_one_corrupt_file_spoils_the_load(tmp_path, order):
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    write_file(good, MACHINE_A)
    write_file(bad, MACHINE_B)
    with open(bad, "ab") as handle:
        handle.write(b"\x00garbage\n")
    paths = [good, bad] if order == "good first" else [bad, good]
    with pytest.raises(ResultsFileError) as info:
        results.load(paths)
    assert "bad.jsonl" in str(info.value) and "good.jsonl" not in str(info.value)
    assert "line 4" in str(info.value)


def test_a_corrupt_file_in_a_directory_spoils_the_load(tmp_path):
    write_file(tmp_path / "a.jsonl", MACHINE_A)
    (tmp_path / "b.jsonl").write_text('{"kind": "run", "schema": 1}\n')
    with pytest.raises(ResultsFileError, match="b.jsonl, line 1.*'run_id'"):
        results.load(tmp_path)


# --- the writer refuses incomplete records ------------------------------------------------


@pytest.mark.parametrize("key", results.REQUIRED["run"])
def test_run_record_missing_a_key(tmp_path, key):
    record = run_record(MACHINE_A)
    del record[key]
    with pytest.raises(ValueError, match=f"'{key}'"):
        ResultsWriter(tmp_path / "r.jsonl").write_run(record)
    assert not (tmp_path / "r.jsonl").exists()


def test_run_record_without_machine_id(tmp_path):
    machine = {key: value for key, value in MACHINE_A.items() if key != "machine_id"}
    with pytest.raises(ValueError, match="machine.machine_id"):
        ResultsWriter(tmp_path / "r.jsonl").write_run(run_record(machine))


@pytest.mark.parametrize("key", results.REQUIRED["cell"])
def test_cell_record_missing_a_key(tmp_path, key):
    writer = ResultsWriter(tmp_path / "r.jsonl")
    run = run_record(MACHINE_A)
    writer.write_run(run)
    record = cell_record(run, "c1")
    del record[key]
    with pytest.raises(ValueError, match=f"'{key}'"):
        writer.write_cell(record)
    assert results.completed_cell_ids(tmp_path / "r.jsonl") == set()


def test_cell_with_an_unknown_status(tmp_path):
    writer = ResultsWriter(tmp_path / "r.jsonl")
    run = run_record(MACHINE_A)
    writer.write_run(run)
    with pytest.raises(ValueError, match="'done'"):
        writer.write_cell(cell_record(run, "c1", status="done"))


def test_results_file_error_is_a_value_error():
    assert issubclass(ResultsFileError, ValueError)


#: A results file as attnbench wrote it before schema 2 (commit 78e696e): fixed sampling, no
#: calibration, no load record.
SCHEMA_1 = Path(__file__).with_name("schema-1.jsonl")


def test_schema_1_files_are_upgraded_as_they_are_read(tmp_path):
    """An old file still loads (with the rel_ci of its samples, no stability verdict, no calibration),
    reports and compares; a run resumed into it appends schema 2 lines that read alongside."""
    from harness.measuring.stats import median_rel_ci
    from harness.report import build_report
    from harness.results import load, read_records
    from harness.results.compare import compare

    old = tmp_path / "old.jsonl"
    old.write_text(SCHEMA_1.read_text())
    records = read_records(old)
    assert {record["schema"] for record in records} == {2} and records[0]["machine"]["calibration"] is None
    assert records[1]["metrics"]["rel_ci"] == median_rel_ci([0.00059, 0.00054, 0.00472, 0.00061, 0.00055])
    assert "unstable" not in records[1]["metrics"] and "rel_ci" not in records[2]["metrics"]
    frame = load(old)
    assert list(frame["status"]) == ["ok", "error"] and frame["metrics.rel_ci"].notna().sum() == 1
    assert build_report([old], tmp_path / "report").is_file()
    lines = [json.loads(line) for line in SCHEMA_1.read_text().splitlines()]
    lines[1]["metrics"]["samples_s"] = [3 * sample for sample in lines[1]["metrics"]["samples_s"]]
    new = tmp_path / "new.jsonl"
    new.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = compare(old, new)
    assert result.table.set_index("variant").loc["softmax", "mark"] == "worse" and result.exit_code == 1
    ResultsWriter(old).write_cell({**records[2], "cell_id": "c3", "status": "skipped", "error": "later"})
    assert [record["schema"] for record in read_records(old)] == [2, 2, 2, 2] and len(load(old)) == 3

"""Files and inputs under hostile use, fourth round (issue 55, items 7 to 9): what report and history write
is readable as the user's umask says; no CSV cell is a spreadsheet formula; a scenario reads only files
under its own directory, of a plausible size, and no error quotes their content; every results field is
typed on read; a checkpoint of another cell is never continued. No cell is measured."""

from __future__ import annotations

import csv
import json
import os
import shutil
import stat
import tracemalloc

import pandas as pd
import pytest
from helpers import attnbench_here, make_cell, within
from histories import repository, template, write_history
from test_tasks.test_training import RegressionStream, make_model, mse

from harness.common.formatting import spreadsheet_safe
from harness.history.changes import Step
from harness.history.changes import write_csv as write_steps_csv
from harness.report import build_report, write_cells_csv
from harness.results.results_schema import Axes
from harness.scenarios import axes as axis_table
from harness.scenarios.lengths import MAX_HISTOGRAM_BYTES, read_histogram
from harness.tasks.training import TrainConfig, TrainResult, cell_checkpoints, latest_checkpoint, load_checkpoint, save_checkpoint, train

# --- 7. files written with the user's umask -------------------------------------------------------------------


@pytest.fixture
def umask():
    """``umask(mask)`` sets the process's umask until the test ends."""
    before = os.umask(0o022)
    try:
        yield os.umask
    finally:
        os.umask(before)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """A results file of one cell (a report's input) and a history of 5 commits on one machine, a cell 50 % slower from the third."""
    root = tmp_path_factory.mktemp("umask")
    commits = repository(root / "repo", 5)
    run, cells = template()
    (root / "report.jsonl").write_text("".join(json.dumps(line) + "\n" for line in [run, cells[0]]))
    return root, write_history(root / "results", commits, lambda number, _machine, cell: 1.5 if cell == 0 and number >= 2 else 1.0, machines={"box": "a" * 16})


def _modes(directory) -> dict[str, str]:
    return {str(path.relative_to(directory)): oct(stat.S_IMODE(path.stat().st_mode)) for path in directory.rglob("*") if path.is_file()}


def _history(root, files, out) -> dict[str, str]:
    done = attnbench_here("history", str(files), "--out", str(out), "--repo", str(root / "repo"))
    assert done.returncode == 1, done.stderr  # the step fails the history, and its page is written
    modes = _modes(out)
    assert {"index.html", "steps.csv"} <= modes.keys() and any(name.startswith("plots/") for name in modes), modes
    return modes


def test_every_file_of_a_report_and_a_history_page_is_0644_under_umask_022(results, tmp_path, umask):
    root, files = results
    umask(0o022)
    build_report([root / "report.jsonl"], tmp_path / "report")
    report = _modes(tmp_path / "report")
    assert {"index.html", "cells.csv"} <= report.keys() and any(name.startswith("plots/") for name in report), report
    assert set(report.values()) == set(_history(root, files, tmp_path / "history").values()) == {"0o644"}, report


def test_every_file_of_a_history_page_is_0600_under_umask_077(results, tmp_path, umask):
    root, files = results
    umask(0o077)
    assert set(_history(root, files, tmp_path / "history").values()) == {"0o600"}


def test_a_checkpoint_has_the_umasks_mode(tmp_path, umask):
    umask(0o027)
    save_checkpoint(tmp_path, 3, {"step": 3})
    assert oct(stat.S_IMODE(latest_checkpoint(tmp_path).stat().st_mode)) == "0o640"


# --- 8. no CSV cell is a formula ---------------------------------------------------------------------------------

HOSTILE = ['=HYPERLINK("http://x","y")', "+1+cmd|' /C calc'!A0", "-2+3", "@SUM(A1)", "\tx", "\rx"]


def test_text_a_spreadsheet_would_evaluate_gets_a_quote_and_numbers_stay_numbers():
    assert [spreadsheet_safe(value) for value in HOSTILE] == ["'" + value for value in HOSTILE]
    assert [spreadsheet_safe(value) for value in (-1.5, -3, 0.0, True, None, "softmax", "a=b", "", "'=x")] == [
        -1.5,
        -3,
        0.0,
        True,
        None,
        "softmax",
        "a=b",
        "",
        "'=x",
    ]


def _rows(path) -> list[dict]:
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def test_cells_csv_quotes_formulas_in_cells_and_headers_and_keeps_negative_numbers(tmp_path):
    frame = pd.DataFrame({"variant": HOSTILE, "metrics.median_s": [-0.5, 1.0, 2.0, -3.0, 4.0, 5.0], "=cmd": ["-x", "a", "b", "c", "d", "e"]})
    write_cells_csv(frame, tmp_path / "cells.csv")
    rows = _rows(tmp_path / "cells.csv")
    assert [row["variant"] for row in rows] == ["'" + value for value in HOSTILE]
    assert [row["metrics.median_s"] for row in rows][:2] == ["-0.5", "1.0"]
    assert rows[0]["'=cmd"] == "'-x"


def test_steps_csv_quotes_formulas(tmp_path):
    step = Step("m", "box", "=scenario", "@variant", "+backend", "forward", "-cell", "g", "b", 3, 1, 1.5, 1.2, 1.8, ("=cmd",))
    write_steps_csv([step], tmp_path / "steps.csv")
    (row,) = _rows(tmp_path / "steps.csv")
    assert (row["scenario"], row["variant"], row["backend"], row["cell"], row["commands"], row["ratio"]) == (
        "'=scenario",
        "'@variant",
        "'+backend",
        "'-cell",
        "'=cmd",
        "1.5",
    )


# --- 9c. every results field typed on read -------------------------------------------------------------------------

RUN = {"kind": "run", "schema": 2, "run_id": "r", "started_at": "2026-12-01T00:00:00+00:00", "scenario": "s", "machine": {"machine_id": "m"}}
CELL = {"kind": "cell", "schema": 2, "run_id": "r", "cell_id": "c", "scenario": "s", "variant": "softmax", "backend": "torch", "params": {},
        "axes": {"seq_len": 16, "batch": 1, "dtype": "float32", "device": "cpu"}, "mode": "forward", "target": "core", "status": "ok",
        "error": None, "metrics": {"median_s": 0.1, "samples_s": [0.1, 0.1, 0.2], "tokens": 16}, "started_at": "2026-12-01T00:00:01+00:00"}  # fmt: skip
CALIBRATION = {"matmul_flops_per_s": {"float32": 1e10}, "bandwidth_bytes_per_s": 1e10, "torch_threads": 2}


def _machine(**fields) -> dict:
    return {**RUN, "machine": {**RUN["machine"], **fields}}


def _metrics(**fields) -> dict:
    return {**CELL, "metrics": {**CELL["metrics"], **fields}}


@pytest.mark.parametrize(
    "line, where, expected",
    [
        ({**CELL, "axes": {**CELL["axes"], "seq_len": "abc"}}, "line 2 (cell line): axes.seq_len", 'expected a number, got "abc"'),
        ({**CELL, "axes": {**CELL["axes"], "S": "abc"}}, "line 2 (cell line): axes.S", 'expected a number, got "abc"'),
        ({**CELL, "axes": {**CELL["axes"], "dtype": 32}}, "line 2 (cell line): axes.dtype", "expected a string, got 32"),
        (_metrics(load={"other_cores": "abc"}), "line 2 (cell line): metrics.load.other_cores", 'expected a number, got "abc"'),
        (_metrics(timed_load={"loadavg_after": "high"}), "line 2 (cell line): metrics.timed_load.loadavg_after", 'expected a list, got "high"'),
        (_machine(memory_bytes="abc"), "line 1 (run line): machine.memory_bytes", 'expected a number, got "abc"'),
        (_machine(cpu={"usable_cores": "2"}), "line 1 (run line): machine.cpu.usable_cores", 'expected an integer, got "2"'),
        (_machine(gpu={"memory_bytes": -1}), "line 1 (run line): machine.gpu.memory_bytes", "expected a number >= 0, got -1"),
        (_machine(calibration={"torch_threads": 2}), "line 1 (run line): machine.calibration.matmul_flops_per_s", "expected a value (required), got nothing"),
        (_machine(calibration={**CALIBRATION, "datasheet": {"name": "X", "bandwidth_bytes_per_s": 1, "float16": "fast"}}),
         "line 1 (run line): machine.calibration.datasheet.float16", 'expected a number, got "fast"'),
    ],
    ids=["axis seq_len", "task axis", "text axis", "load", "timed_load", "memory_bytes", "cpu cores", "gpu memory", "calibration", "datasheet"],
)  # fmt: skip
@pytest.mark.parametrize("command", ["report", "compare"])
def test_a_field_of_the_wrong_type_anywhere_is_one_line_naming_file_line_field_and_type(tmp_path, line, where, expected, command):
    run, cell = (line, CELL) if line["kind"] == "run" else (RUN, line)
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text(json.dumps(RUN) + "\n" + json.dumps(CELL) + "\n")
    bad.write_text(json.dumps(run) + "\n" + json.dumps(cell) + "\n")
    args = ["report", str(bad), "-o", str(tmp_path / "out")] if command == "report" else ["compare", str(good), str(bad)]
    done = attnbench_here(*args)
    assert done.returncode == 2 and done.stderr == f"error: {bad}, {where}: {expected}\n", done.stderr
    assert not (tmp_path / "out").exists()


def test_the_text_axes_of_a_results_line_are_those_no_plot_puts_on_an_x_axis():
    assert set(Axes.model_fields) == {axis.name for axis in axis_table.TABLE if not axis.x}


# --- 9a, 9b. a scenario reads only its own files, of a plausible size, and quotes none -------------------------------

SECRET = "AWS_SECRET=hunter2"
SCENARIO = {"name": "v", "variants": {"softmax": {}}, "axes": {"heads": 2, "d_key": 4}, "modes": ["forward"], "measure": {"warmup": 0, "repeats": 1}}


def _scenario(folder, file) -> str:
    folder.mkdir(exist_ok=True)
    path = folder / "v.yaml"
    path.write_text(json.dumps({**SCENARIO, "axes": {**SCENARIO["axes"], "lengths": {"kind": "histogram", "file": str(file), "tokens": 64}}}))
    return str(path)


@pytest.mark.parametrize("where", ["absolute", "dotdot", "link"])
def test_a_histogram_outside_the_scenarios_folder_is_refused_unread_at_dry_run(tmp_path, where):
    secret = tmp_path / "secret.csv"
    secret.write_text(SECRET + "\n")
    folder = tmp_path / "scenario"
    folder.mkdir()
    (folder / "h.csv").symlink_to(secret)
    name = {"absolute": secret, "dotdot": "../secret.csv", "link": "h.csv"}[where]
    done = attnbench_here("run", _scenario(folder, name), "--dry-run")
    assert done.returncode == 2 and "is outside" in done.stderr and "histogram file lies under the scenario's folder" in done.stderr, done.stderr
    assert "hunter2" not in done.stderr + done.stdout


def test_a_histogram_under_the_data_root_the_user_names_is_read(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "h.csv").write_text("8,1\n16,1\n")
    monkeypatch.setenv("ATTNBENCH_DATA", str(tmp_path / "data"))
    lengths_, counts, _ = read_histogram("../data/h.csv", "axes.lengths.file", tmp_path / "scenario")
    assert (lengths_, counts) == ([8, 16], [1, 1])


def test_a_bad_histogram_line_names_file_and_line_never_its_content(tmp_path):
    (tmp_path / "h.csv").write_text(f"8,1\n{SECRET}\n")
    with pytest.raises(ValueError) as info:
        read_histogram("h.csv", "axes.lengths.file", tmp_path)
    assert str(info.value) == f"axes.lengths.file: {tmp_path / 'h.csv'}, line 2: expected 'length,count' (a positive integer, an integer >= 0)"


def test_a_histogram_too_large_to_be_one_is_refused_by_its_size_before_it_is_read(tmp_path):
    size = 64 << 20  # sparse; a multi-GB one, read, would fill the memory
    with open(tmp_path / "h.csv", "wb") as file:
        file.truncate(size)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=rf"h.csv: {size} bytes, more than the {MAX_HISTOGRAM_BYTES} a histogram file may have"):
            read_histogram("h.csv", "axes.lengths.file", tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MAX_HISTOGRAM_BYTES, f"{peak} bytes allocated: the file was read"


def test_a_fifo_as_a_histogram_is_refused_without_waiting(tmp_path):
    os.mkfifo(tmp_path / "h.csv")
    with within(5), pytest.raises(ValueError, match="expected a histogram file, got a special file"):
        read_histogram("h.csv", "axes.lengths.file", tmp_path)


# --- 9d. a checkpoint of another cell is never continued ----------------------------------------------------------


def _cell(cell_id: str, variant: str):
    return make_cell(cell_id=cell_id, variant=variant, params={}, axes={"seq_len": 16}, task={"name": "mqar", "steps": 4})


def _train(directory) -> TrainResult:
    config = TrainConfig(steps=4, lr=0.02, warmup=1, log_every=1, eval_every=4, checkpoint_every=2, checkpoint_dir=str(directory))
    return train(make_model(0, dropout=0.0), mse, RegressionStream(0), config, progress=False)


def test_a_checkpoint_copied_from_another_variants_cell_is_set_aside_and_the_cell_trains_afresh(tmp_path, capsys):
    with cell_checkpoints(_cell("a", "linear")):
        _train(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    with cell_checkpoints(_cell("b", "softmax")):
        copied, fresh = _train(tmp_path / "b"), _train(tmp_path / "fresh")
    assert copied.resumed_from is None and copied.losses == fresh.losses
    assert sorted(path.name for path in (tmp_path / "b").iterdir()) == ["foreign-step-000000004.pt", "step-000000004.pt"]
    err = capsys.readouterr().err
    assert f"note: {tmp_path / 'b' / 'step-000000004.pt'}: a checkpoint of another cell: cell_id 'a' (this cell: 'b'), variant 'linear'" in err, err
    assert "set aside as foreign-step-000000004.pt, the cell trains afresh" in err
    with cell_checkpoints(_cell("b", "softmax")):  # its own checkpoint is continued
        assert load_checkpoint(latest_checkpoint(tmp_path / "b"), "cpu")["cell"]["cell_id"] == "b"


EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "reports", "examples", "cpu-dev-vm", "cuda-variants-20261205T083558Z.jsonl")


@pytest.mark.parametrize(
    "drop",
    [("axes",), ("axes", "dtype"), ("axes", "seq_len"), ("metrics", "rel_error_tolerance"), ("metrics", "rel_error")],
    ids=".".join,
)
def test_a_cell_without_an_optional_field_the_plots_read_is_reported(tmp_path, drop):
    """Fields the plots read (a decode cell's length, a cell's dtype, its accuracy and tolerance) read as absent, as
    the report reads any optional field: the page is written, no "(an attnbench bug?)"."""
    run, *records = [json.loads(line) for line in open(EXAMPLE, encoding="utf-8")]
    cells = [cell for mode in ("forward", "train", "decode") for cell in [cell for cell in records if cell["mode"] == mode][:2]]
    for cell in cells:
        parent = cell if len(drop) == 1 else cell[drop[0]]
        parent.pop(drop[-1], None)
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in [run, *cells]), encoding="utf-8")
    assert build_report([path], tmp_path / "report").is_file()

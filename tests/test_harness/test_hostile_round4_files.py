"""Files and inputs under hostile use, fourth round (issue 55, items 7 to 9): what report and history write
is readable as the user's umask says; no CSV cell is a spreadsheet formula; a scenario reads only files
under its own directory, of a plausible size, and no error quotes their content; every results field is
typed on read; a checkpoint of another cell is never continued. No cell is measured."""

from __future__ import annotations

import csv
import json
import os
import stat

import pandas as pd
import pytest
from helpers import attnbench_here
from histories import repository, template, write_history

from harness.common.formatting import spreadsheet_safe
from harness.history.changes import Step
from harness.history.changes import write_csv as write_steps_csv
from harness.report import build_report, write_cells_csv
from harness.tasks.training import latest_checkpoint, save_checkpoint

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

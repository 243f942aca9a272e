"""Report output is written like results are (issue 46, class 4, and round two's remainder of class 8):
``index.html``, ``cells.csv`` and the plots never through a link planted at their names; every string of a
results file is plain text in a plot; a results file holding an integer too large for a float, or a minimal
valid cell line, gives a report or one line naming the file. Each test takes seconds (a report of one cell)."""

from __future__ import annotations

import json

import pytest

from harness.cli import main
from harness.report import build_report

RUN = {"kind": "run", "schema": 2, "run_id": "r", "started_at": "2026-12-01T00:00:00+00:00", "scenario": "s", "machine": {"machine_id": "m"}}
CELL = {"kind": "cell", "schema": 2, "run_id": "r", "cell_id": "c", "scenario": "s", "variant": "softmax", "backend": "torch", "params": {},
        "axes": {"seq_len": 16, "batch": 1, "dtype": "float32", "device": "cpu"}, "mode": "forward", "target": "core", "status": "ok",
        "error": None, "metrics": {"median_s": 0.1, "samples_s": [0.1, 0.1, 0.2], "tokens": 16}, "started_at": "2026-12-01T00:00:01+00:00"}  # fmt: skip
#: Strings matplotlib's mathtext cannot parse: each failed a whole report when it reached a label.
MATHTEXT = ("a$_$c", "x$^^$z", "q$}$s", "f$\\frac$o")


def _results(path, *cells: dict):
    path.write_text("".join(json.dumps(record) + "\n" for record in (RUN, *cells)))
    return path


def _victim(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("someone else's data\n")
    return victim


@pytest.mark.parametrize("name", ["index.html", "cells.csv", "plots/s-time.png"])
def test_a_link_planted_at_an_output_name_is_replaced_not_followed(tmp_path, name):
    victim, out = _victim(tmp_path), tmp_path / "out"
    (out / "plots").mkdir(parents=True)
    (out / name).symlink_to(victim)
    index = build_report(_results(tmp_path / "r.jsonl", CELL), out)
    assert victim.read_text() == "someone else's data\n"
    assert not (out / name).is_symlink() and (out / name).stat().st_size > 0 and index == out / "index.html"


def test_a_link_planted_as_the_plots_folder_is_refused_in_one_line(tmp_path, capsys):
    elsewhere, out = tmp_path / "elsewhere", tmp_path / "out"
    elsewhere.mkdir()
    out.mkdir()
    (out / "plots").symlink_to(elsewhere)
    assert main(["report", str(_results(tmp_path / "r.jsonl", CELL)), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "plots is a symbolic link" in err and "attnbench bug" not in err, err
    assert list(elsewhere.iterdir()) == []


def test_strings_of_a_results_file_are_plain_text_in_the_plots(tmp_path):
    variant, backend, parameter, dtype = MATHTEXT
    cells = [{**CELL, "cell_id": f"c{length}", "variant": variant, "backend": backend, "params": {"p": parameter},
              "axes": {**CELL["axes"], "seq_len": length, "dtype": dtype}} for length in (16, 32)]  # fmt: skip
    cells.append({**cells[0], "cell_id": "other", "variant": "m$_$n", "backend": "torch", "machine_id": "m"})
    index = build_report(_results(tmp_path / "r.jsonl", *cells), tmp_path / "out")
    assert "a$_$c" in index.read_text() and list((tmp_path / "out" / "plots").glob("*.png"))


def _report(tmp_path, capsys, *cells: dict) -> tuple[int, str]:
    code = main(["report", str(_results(tmp_path / "r.jsonl", *cells)), "-o", str(tmp_path / "out")])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "cell",
    [
        {key: CELL[key] for key in ("kind", "schema", "run_id", "cell_id", "scenario", "variant", "mode", "status")},
        {key: CELL[key] for key in ("kind", "schema", "run_id", "cell_id", "scenario", "variant", "mode")} | {"status": "error"},
        {key: CELL[key] for key in ("kind", "schema", "run_id", "cell_id", "scenario", "variant", "status")} | {"mode": "quality", "target": "mqar"},
    ],
    ids=["ok", "error", "quality"],
)
def test_a_minimal_valid_cell_line_gives_a_report(tmp_path, capsys, cell):
    code, err = _report(tmp_path, capsys, cell)
    assert code == 0 and err == "", err
    assert (tmp_path / "out" / "index.html").is_file() and "softmax" in (tmp_path / "out" / "cells.csv").read_text()


#: Stands in a cell line for the integer written in its place (JSON digits Python may not even convert).
SENTINEL = 123456789


@pytest.mark.parametrize(
    "field, cell, digits",
    [
        ("metrics.median_s", {**CELL, "metrics": {**CELL["metrics"], "median_s": SENTINEL}}, 400),
        ("metrics.tokens", {**CELL, "metrics": {**CELL["metrics"], "tokens": SENTINEL}}, 400),
        ("metrics.samples_s.1", {**CELL, "metrics": {**CELL["metrics"], "samples_s": [0.1, SENTINEL]}}, 310),
        ("axes.seq_len", {**CELL, "axes": {**CELL["axes"], "seq_len": SENTINEL}}, 400),
        ("duration_s", {**CELL, "duration_s": SENTINEL}, 5000),
    ],
    ids=["median", "tokens", "samples", "axis", "over 4300 digits"],
)
def test_an_integer_too_large_for_a_float_is_one_line_naming_file_line_and_field(tmp_path, capsys, field, cell, digits):
    path = _results(tmp_path / "r.jsonl", cell)
    path.write_text(path.read_text().replace(str(SENTINEL), "9" * digits))
    code = main(["report", str(path), "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "attnbench bug" not in err, err
    assert f"r.jsonl, line 2 (cell line): {field}: expected a number a float can hold, got an integer of {digits} digits" in err, err
    assert not (tmp_path / "out" / "index.html").exists()

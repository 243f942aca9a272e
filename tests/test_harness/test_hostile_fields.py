"""Every field of every input typed and bounded (issue 46, class 6): a results file's fields of the wrong JSON
type, numeric options outside their domain on the commands ``run``'s scenario schema does not cover, and a
``--set`` key of thousands of dotted parts each get one line naming the file or option, the field and what was
expected, exit code 2, within seconds. Each test takes a second or two (no cell is measured)."""

from __future__ import annotations

import json

import pytest
from helpers import within

from harness.cli import main
from harness.results.compare import CompareError, compare

RUN = {"kind": "run", "schema": 2, "run_id": "r", "started_at": "2026-12-01T00:00:00+00:00", "scenario": "s", "machine": {"machine_id": "m"}}
CELL = {"kind": "cell", "schema": 2, "run_id": "r", "cell_id": "c", "scenario": "s", "variant": "softmax", "backend": "torch", "params": {},
        "axes": {"seq_len": 16, "batch": 1, "dtype": "float32", "device": "cpu"}, "mode": "forward", "target": "core", "status": "ok",
        "error": None, "metrics": {"median_s": 0.1, "samples_s": [0.1, 0.1, 0.2], "tokens": 16}, "started_at": "2026-12-01T00:00:01+00:00"}  # fmt: skip
#: Seconds any bad input may take to be refused.
ANSWER_S = 20


def _results(path, run: dict = RUN, cell: dict = CELL):
    path.write_text(json.dumps(run) + "\n" + json.dumps(cell) + "\n")
    return str(path)


def _one_line(capsys, *args: str) -> str:
    """``attnbench ARGS`` in this process: exit code 2 (returned or argparse's), one line on stderr, no blame on attnbench."""
    with within(ANSWER_S):
        try:
            code = main(list(args))
        except SystemExit as exc:
            code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "attnbench bug" not in err, err
    return err


# --- results files --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "line, field, expected",
    [
        ({**CELL, "metrics": {**CELL["metrics"], "tokens": "many"}}, "metrics.tokens", 'expected a number, got "many"'),
        ({**CELL, "metrics": {**CELL["metrics"], "peak_mem_bytes": [1, 2]}}, "metrics.peak_mem_bytes", "expected a number, got [1, 2]"),
        ({**CELL, "metrics": {**CELL["metrics"], "unstable": "no"}}, "metrics.unstable", 'expected true or false, got "no"'),
        ({**CELL, "metrics": {**CELL["metrics"], "load": [0.5]}}, "metrics.load", "expected a JSON object, got [0.5]"),
        ({**CELL, "axes": [16, 1]}, "axes", "expected a JSON object, got [16, 1]"),
        ({**CELL, "axes": {**CELL["axes"], "seq_len": [16]}}, "axes.seq_len", "got [16]"),
        ({**CELL, "params": ["m", 32]}, "params", "expected a JSON object"),
        ({**CELL, "variant": 7}, "variant", "expected a string, got 7"),
        ({**CELL, "duration_s": "2.5"}, "duration_s", 'expected a number, got "2.5"'),
        ({**CELL, "duration_s": -1}, "duration_s", "expected a number >= 0, got -1"),
        ({**CELL, "error": {"message": "x"}}, "error", "expected a string"),
    ],
    ids=[
        "string for number",
        "list for number",
        "string for bool",
        "list for mapping",
        "axes a list",
        "axis a list",
        "params a list",
        "number for string",
        "duration a string",
        "negative duration",
        "mapping for string",
    ],  # fmt: skip
)
@pytest.mark.parametrize("command", ["report", "compare"])
def test_a_cell_field_of_the_wrong_type_is_one_line_naming_file_line_and_field(tmp_path, capsys, line, field, expected, command):
    good, bad = _results(tmp_path / "good.jsonl"), _results(tmp_path / "bad.jsonl", cell=line)
    args = ["report", bad, "-o", str(tmp_path / "out")] if command == "report" else ["compare", good, bad]
    err = _one_line(capsys, *args)
    assert f"bad.jsonl, line 2 (cell line): {field}: " in err and expected in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "run, field, expected",
    [
        ({**RUN, "machine": ["m"]}, "machine", "expected a JSON object"),
        ({**RUN, "machine": {"machine_id": 5}}, "machine.machine_id", "expected a string, got 5"),
        ({**RUN, "overrides": "seq_len=16"}, "overrides", 'expected a list, got "seq_len=16"'),
        ({**RUN, "dirty": "yes"}, "dirty", 'expected true or false, got "yes"'),
    ],
    ids=["machine a list", "machine id a number", "overrides a string", "dirty a string"],
)
def test_a_run_field_of_the_wrong_type_is_one_line_naming_file_line_and_field(tmp_path, capsys, run, field, expected):
    err = _one_line(capsys, "report", _results(tmp_path / "bad.jsonl", run=run), "-o", str(tmp_path / "out"))
    assert f"bad.jsonl, line 1 (run line): {field}: " in err and expected in err, err


# --- options of the commands ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, option, expected",
    [
        (["compare", "a", "b", "--factor", "nan"], "--factor", "expected a finite number in [1, 1000], got 'nan'"),
        (["compare", "a", "b", "--factor", "inf"], "--factor", "got 'inf'"),
        (["compare", "a", "b", "--factor", "0"], "--factor", "got '0'"),
        (["compare", "a", "b", "--factor", "-2"], "--factor", "got '-2'"),
        (["compare", "a", "b", "--alpha", "1.5"], "--alpha", "expected a finite number in (0, 1), got '1.5'"),
        (["compare", "a", "b", "--seed", "-1"], "--seed", "expected an integer from 0 to"),
        (["report", "a", "-o", "x", "--factor", "nan"], "--factor", "got 'nan'"),
        (["report", "a", "-o", "x", "--alpha", "0"], "--alpha", "got '0'"),
        (["regress", "--base", "HEAD", "--rounds", "0"], "--rounds", "expected an integer from 1 to 100, got '0'"),
        (["regress", "--base", "HEAD", "--threads", "-1"], "--threads", "got '-1'"),
        (["regress", "--base", "HEAD", "--factor", "nan"], "--factor", "got 'nan'"),
        (["bisect", "--good", "a", "--bad", "b", "--rounds", "10000000000"], "--rounds", "got '10000000000'"),
        (["bisect", "--good", "a", "--bad", "b", "--alpha", "nan"], "--alpha", "got 'nan'"),
        (["kernels", "--jobs", "0"], "--jobs", "expected an integer from 1 to 4096, got '0'"),
        (["demo", "--seq-len", "0"], "--seq-len", "expected an integer from 1 to 8192, got '0'"),
        (["demo", "--batch", "-3"], "--batch", "got '-3'"),
        (["demo", "--heads", "1e9"], "--heads", "got '1e9'"),
        (["demo", "--d-key", "1"], "--d-key", "expected an integer from 2 to 1024, got '1'"),
        (["demo", "--repeats", "0"], "--repeats", "got '0'"),
        (["env", "--device", "gpu9"], "--device", "expected cpu, cuda or cuda:N, got 'gpu9'"),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else None,
)
def test_an_option_outside_its_domain_is_one_line_naming_it(capsys, args, option, expected):
    err = _one_line(capsys, *args)
    assert f"argument {option}" in err and expected in err, err


def test_a_demo_too_large_for_a_small_cpu_input_is_refused(capsys):
    err = _one_line(capsys, "demo", "--batch", "64", "--heads", "64", "--seq-len", "8192")
    assert "--batch 64 --heads 64 --seq-len 8192" in err and "attention scores" in err, err


def test_compare_with_a_nan_factor_marks_nothing_unchanged(tmp_path):
    good = _results(tmp_path / "good.jsonl")
    for factor in (float("nan"), float("inf"), 0.5):
        with pytest.raises(CompareError, match="factor must be a finite number >= 1"):
            compare(good, good, factor=factor)


# --- --set --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", [".".join(["measure"] * 5000), "measure..repeats", "."])
def test_a_set_key_of_thousands_of_parts_or_an_empty_one_is_one_line(capsys, key):
    err = _one_line(capsys, "run", "smoke-cpu", "--dry-run", "--set", f"{key}=3")
    assert "smoke-cpu.yaml: --set " in err and "expected a KEY of at most 64 dotted names, none empty" in err, err

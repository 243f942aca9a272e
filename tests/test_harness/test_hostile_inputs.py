"""Scenario inputs that would hang, take all memory or fail late (issue 36, classes 2, 4 and 5):
each answers within seconds with one line naming the file and field, and exit code 2."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest
from helpers import within

from harness.cli import main

#: Nine levels of nine aliases, each level a list of nine of the one before: 9^9 values.
LAUGHS = [f"&l{level} [{', '.join(['x'] * 9 if level == 0 else [f'*l{level - 1}'] * 9)}]" for level in range(9)]
#: The "billion laughs" scenario lines (under 500 bytes).
BILLION_LAUGHS = "".join(f"l{level}: {laugh}\n" for level, laugh in enumerate(LAUGHS))
#: Seconds any input may take to be refused.
ANSWER_S = 20


def _write(tmp_path, text: str, name: str = "hostile") -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return str(path)


def _tiny(extra: str = "", *, variants: str = "softmax: {}", axes: str = "seq_len: [16], batch: 1, heads: 1, d_key: 8") -> str:
    return f"name: tiny\nvariants: {{{variants}}}\naxes: {{{axes}}}\n{extra}"


def _refused(capsys, *args: str) -> str:
    """Run ``attnbench run ARGS --dry-run`` in this process: exit 2, one error naming the scenario, no blame on attnbench."""
    with within(ANSWER_S):
        code = main(["run", *args, "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and args[0] in err and "attnbench bug" not in err, err
    return err


def test_billion_laughs_is_refused_quickly(tmp_path, capsys):
    """Shared aliases are counted once each: a file of under 500 bytes that expands to 9^9 values is refused at once, with the limit."""
    assert len(BILLION_LAUGHS) < 700
    path = _write(tmp_path, _tiny(BILLION_LAUGHS))
    assert "more than 100000 values" in _refused(capsys, path)


def test_billion_laughs_through_set_is_refused_quickly(tmp_path, capsys):
    err = _refused(capsys, _write(tmp_path, _tiny()), "--set", f"description=[{', '.join(LAUGHS)}]")
    assert "--set" in err and "more than 100000 values" in err


def test_deep_nesting_names_the_file(tmp_path, capsys):
    """Nesting deeper than Python can parse (or than MAX_DEPTH) is bad input, not a RecursionError blamed on attnbench."""
    for depth in (100, 20_000):
        err = _refused(capsys, _write(tmp_path, _tiny(f"description: {'[' * depth}{']' * depth}\n"), f"deep{depth}"))
        assert "nested" in err


def test_cell_count_is_capped_before_expanding(tmp_path, capsys, monkeypatch):
    """10^9 cells are counted from the list lengths, refused with the count, and the cap is configurable."""
    thousand = json.dumps(list(range(1, 1001)))
    huge = _write(tmp_path, _tiny(axes=f"seq_len: {thousand}, batch: {thousand}, heads: {thousand}, d_key: 8"))
    assert "1000000000 cells" in _refused(capsys, huge)
    monkeypatch.setenv("ATTNBENCH_MAX_CELLS", "2")
    err = _refused(capsys, _write(tmp_path, _tiny(axes="seq_len: [8, 16, 32], batch: 1, heads: 1, d_key: 8")))
    assert "3 cells" in err and "ATTNBENCH_MAX_CELLS" in err


def test_scenario_file_size_is_capped(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ATTNBENCH_MAX_SCENARIO_BYTES", "50")
    assert "larger than 50 bytes" in _refused(capsys, _write(tmp_path, _tiny()))


def test_fifo_and_device_are_refused_without_reading(tmp_path, capsys):
    """A FIFO would block forever and a device read without end: both are refused as special files."""
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    device = tmp_path / "zero.yaml"
    device.symlink_to("/dev/zero")
    for path in (fifo, device):
        assert "special file" in _refused(capsys, str(path))


def test_errors_quote_a_short_prefix_of_a_value(tmp_path, capsys):
    err = _refused(capsys, _write(tmp_path, _tiny(variants="softmax: {}", axes=f"seq_len: [16], dtype: {'x' * 100_000}")))
    assert "(100002 characters)" in err and len(err) < 2000


def test_duplicate_keys_are_refused_with_key_and_line(tmp_path, capsys):
    err = _refused(capsys, _write(tmp_path, _tiny() + "measure: {repeats: 3}\nmeasure: {repeats: 5}\n"))
    assert 'duplicate key "measure"' in err and "line 5" in err


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ("measure: {timeout_s: 1.0e7}", "measure.timeout_s"),
        ("measure: {max_time_s: 1.0e9}", "measure.max_time_s"),
        ("measure: {repeats: 1000000000}", "measure.repeats"),
        ("measure: {repeats: true}", "measure.repeats"),
        ("measure: {timeout_s: '60'}", "measure.timeout_s"),
        ("decode: {new_tokens: true}", "decode.new_tokens"),
    ],
)
def test_numbers_the_code_cannot_hold_are_refused(tmp_path, capsys, setting, expected):
    assert expected in _refused(capsys, _write(tmp_path, _tiny(setting + "\n")))


@pytest.mark.parametrize(
    ("variants", "axes", "expected"),
    [
        ("softmax: {}", "seq_len: [16], dtype: []", "axes.dtype"),
        ("softmax: {}", "seq_len: [16], device: []", "axes.device"),
        ("linear: {chunk_size: []}", "seq_len: [16]", "variants.linear.chunk_size"),
        ("linear: []", "seq_len: [16]", "variants.linear"),
    ],
)
def test_zero_cell_scenarios_are_refused(tmp_path, capsys, variants, axes, expected):
    err = _refused(capsys, _write(tmp_path, _tiny(variants=variants, axes=axes)))
    assert expected in err and "at least one" in err


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("{preset: huge}", "model.preset"),
        ("{preset: cpu, overrides: {n_layerz: 2}}", "n_layerz"),
        ("{preset: cpu, overrides: {variant: linear}}", "model.overrides.variant"),
    ],
)
def test_unknown_model_presets_and_overrides_are_refused(tmp_path, capsys, model, expected):
    assert expected in _refused(capsys, _write(tmp_path, _tiny(f"target: model\nmodel: {model}\n")))


def test_a_name_too_long_for_a_file_name_is_refused(tmp_path, capsys):
    err = _refused(capsys, _write(tmp_path, _tiny().replace("name: tiny", f"name: {'n' * 250}")))
    assert "name" in err and "at most 200" in err


@pytest.mark.parametrize("presets", ["{fast: 5}", "[fast]"])
def test_a_preset_that_is_not_a_mapping_is_refused(tmp_path, capsys, presets):
    assert "presets" in _refused(capsys, _write(tmp_path, _tiny(f"presets: {presets}\n")), "--preset", "fast")


def test_plugin_import_errors_name_the_plugin_and_line(tmp_path, capsys):
    broken = tmp_path / "broken_plugin.py"
    broken.write_text("x = 1\nraise RuntimeError('no GPU here')\n")
    with within(ANSWER_S):
        code = main(["run", _write(tmp_path, _tiny()), "--dry-run", "--plugin", str(broken)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and "attnbench bug" not in err, err
    assert f"plugin {broken}, line 2: RuntimeError: no GPU here" in err


@pytest.mark.parametrize("stem", ["json", "variants"])
def test_a_plugin_named_like_a_module_does_not_replace_it(tmp_path, capsys, stem):
    before = sys.modules[stem]
    plugin = tmp_path / f"{stem}.py"
    plugin.write_text("LOADED = True\n")
    with within(ANSWER_S):
        assert main(["run", _write(tmp_path, _tiny()), "--dry-run", "--plugin", str(plugin)]) == 0
    assert sys.modules[stem] is before
    assert sys.modules[f"attnbench_plugin_{stem}"].LOADED


def _address_space_3gb():
    resource.setrlimit(resource.RLIMIT_AS, (3 * 2**30, 3 * 2**30))


@pytest.mark.slow
def test_hostile_inputs_answer_within_seconds_under_3gb(tmp_path):
    """The issue's check, as a user runs it: ``attnbench run`` under a 3 GB address-space limit
    refuses a billion laughs and 10^9 cells in seconds (about 20 s in all on 2 cores, most of it importing torch)."""
    thousand = json.dumps(list(range(1, 1001)))
    inputs = {"laughs": _tiny(BILLION_LAUGHS), "cells": _tiny(axes=f"seq_len: {thousand}, batch: {thousand}, heads: {thousand}, d_key: 8")}
    for name, text in inputs.items():
        path = _write(tmp_path, text, name)
        command = [sys.executable, "-m", "harness.cli", "run", path, "--dry-run"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, preexec_fn=_address_space_3gb)
        assert done.returncode == 2 and done.stderr.startswith("error: ") and path in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr

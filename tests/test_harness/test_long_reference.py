"""A reference that stays independent at long T (issue 56, item 3): beyond the 1,024 tokens up to which a core
cell is judged against ``core.reference``, its float64 parallel form is checked against its float64 step loop
(``accuracy.step_loop_error``), ``attnbench check`` runs the forms at ``checking.LONGEST`` tokens, and the
report says in words what each cell was checked against and that a cell is inaccurate. The planted variant
(long_bug_plugin.py) is linear attention whose parallel form is 1 % off from token 1,024 on."""

from __future__ import annotations

import html
import re
import sys
from pathlib import Path

import jinja2
import pandas as pd
import pytest
import torch
from helpers import attnbench_here, make_cell

import variants.backends  # noqa: F401 - the shipped variants registered before a test copies the registry
from harness.measuring import accuracy
from harness.measuring.builders import BUILDERS
from harness.report.tables import CHECKED_AGAINST, PARALLEL_FORM, TWIN, timing_table
from harness.scenarios.plugins import load_plugins, module_name
from variants import base
from variants.checking import LONGEST, check_variant

PLUGIN = str(Path(__file__).with_name("long_bug_plugin.py"))
WRONG = "wrong_beyond_1024"
#: A page (the frame of every attnbench page) of one table.
PAGE = '{% extends "page.html.j2" %}{% from "table.html.j2" import render_table %}{% block body %}{{ render_table(table) }}{% endblock %}'
#: Just beyond accuracy.REFERENCE_MAX_TOKENS (the plugin is wrong from token 1,024 on).
T = 1040


@pytest.fixture(autouse=True)
def own_registry(monkeypatch):
    """The plugin's variant, registered by a test (or the command it runs), is gone after it."""
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    monkeypatch.delitem(sys.modules, module_name(PLUGIN), raising=False)
    yield
    sys.modules.pop(module_name(PLUGIN), None)


@pytest.fixture
def wrong() -> str:
    load_plugins([PLUGIN])
    return WRONG


def _forward_metrics(variant: str, seq_len: int = T) -> dict:
    cell = make_cell(variant=variant, axes={"seq_len": seq_len, "batch": 1, "heads": 1, "d_key": 8, "d_value": 8, "device": "cpu", "dtype": "float32"})
    device = torch.device("cpu")
    return accuracy.measure(cell, device, torch.float32, BUILDERS["core"](cell, device, torch.float32))


def test_a_cell_whose_parallel_form_is_wrong_only_at_long_t_is_inaccurate(wrong):
    """Against its own float64 parallel form alone the cell would be accurate; its step loop tells."""
    metrics = _forward_metrics(wrong)
    assert metrics["inaccurate"] and metrics["rel_error_reference"] == accuracy.WITH_STEP_LOOP, metrics
    assert metrics["rel_error"] == metrics["rel_error_step_loop"] > metrics["rel_error_tolerance"], metrics
    right = _forward_metrics("linear")
    assert not right["inaccurate"] and right["rel_error_reference"] == accuracy.WITH_STEP_LOOP and right["rel_error_step_loop"] < 1e-12, right


def test_beyond_the_step_loops_limit_a_cell_says_it_is_judged_by_its_own_form(monkeypatch, wrong):
    """Where the step loop would cost too much, the planted bug passes, and the record says against what."""
    monkeypatch.setattr(accuracy, "STEP_REFERENCE_MAX_TOKENS", T - 1)
    metrics = _forward_metrics(wrong)
    assert not metrics["inaccurate"] and metrics["rel_error_reference"] == accuracy.TORCH_FLOAT64 and "rel_error_step_loop" not in metrics, metrics


def test_check_names_a_parallel_form_wrong_only_at_long_t():
    done = attnbench_here("check", WRONG, "--plugin", PLUGIN, "--set", "chunk_size=16", "--set", "scan=loop")
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAIL")]
    assert done.returncode == 1 and len(failed) == 1, done.stdout + done.stderr
    assert failed[0].startswith(f"FAIL  float64 T={LONGEST} (long) B=1 H=1: parallel form vs float64 reference: output  max rel error"), failed
    assert "the step loop agrees with the reference: the parallel form differs; wrong only at long T: every check passed up to T=100" in failed[0]


def test_a_correct_variant_passes_the_long_checks():
    lines = [check.line() for check in check_variant("linear", {"chunk_size": 16, "scan": "loop"}, dtypes=(torch.float64,)).checks]
    long = [line for line in lines if f"T={LONGEST} (long)" in line]
    assert [line.split(":")[1].strip() for line in long] == ["step loop vs float64 reference", "parallel form vs float64 reference"], lines
    assert all(line.startswith("ok") for line in long), long


def _record(series: str, target: str, reference, inaccurate=False, error=8.1e-2, mode="forward") -> dict:
    return {"series": series, "target": target, "mode": mode, "axes.dtype": "bfloat16", "metrics.rel_error": error,
            "metrics.rel_error_tolerance": 5e-2, "metrics.inaccurate": inaccurate, "metrics.rel_error_reference": reference}  # fmt: skip


def test_the_table_of_timed_cells_says_in_words_what_a_cell_was_checked_against_and_that_it_is_inaccurate():
    """The page's text: the table rendered as every page renders it, read back cell by cell."""
    records = [_record("short", "core", "reference"), _record("long", "core", accuracy.WITH_STEP_LOOP, inaccurate=True),
               _record("longest", "core", accuracy.TORCH_FLOAT64), _record("layer", "layer", accuracy.TORCH_FLOAT64),
               _record("decode", "core", accuracy.TORCH_FLOAT64, mode="decode"), _record("unchecked", "core", None, error=None)]  # fmt: skip
    common = {"status": "ok", "machine": "m", "axes_text": "T", "x_axis": "seq_len", "axes.seq_len": 1, "metrics.unstable": False}
    shown = timing_table(pd.DataFrame([{**common, **record} for record in records]))
    environment = jinja2.Environment(loader=jinja2.PackageLoader("harness", "templates"), autoescape=True, undefined=jinja2.StrictUndefined)
    page = environment.from_string(PAGE).render(title="t", table=shown)
    headers = [html.unescape(header) for header in re.findall(r"<th>(.*?)</th>", page)]
    rows = [dict(zip(headers, map(html.unescape, re.findall(r"<td>(.*?)</td>", row)))) for row in re.findall(r"<tr[^>]*>(.*?)</tr>", page) if "<td>" in row]
    shown_as = {row["variant"]: (row["error"], row["checked against"]) for row in rows}
    assert shown_as == {
        "short": ("8.1e-02", "its reference"),
        "long": ("inaccurate: 8.1e-02 > 5e-02 (its bfloat16 tolerance)", "own parallel form + step loop"),
        "longest": ("8.1e-02", "own parallel form only"),
        "layer": ("8.1e-02", TWIN),
        "decode": ("8.1e-02", PARALLEL_FORM),
        "unchecked": ("-", "-"),
    }
    for words in (*CHECKED_AGAINST.values(), TWIN, PARALLEL_FORM, "inaccurate: 8.1e-02 > 5e-02"):
        assert f"'{words}'" in html.unescape(page), words

"""The report end to end: real results of tiny scenarios, written by the runner in
subprocesses (with failing cells from tests/test_harness/fault_plugin.py), turned into HTML, CSV and PNG
files; checked by parsing the files and by opening the page in headless Chromium."""

from __future__ import annotations

import base64
import csv
import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from html.parser import HTMLParser
from pathlib import Path

import pytest
from PIL import Image

from harness.report import build_report, prepare
from harness.report.machines import machine_pairs
from harness.results import load, read_records
from harness.results.compare import UNDECIDED, UNSTABLE, compare

PLUGIN = str(Path(__file__).with_name("fault_plugin.py"))
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CORE_SCENARIO = """
name: tiny-report
variants: {softmax: {}, linear: {}, fault_error: {}, fault_oom: {}}
axes: {seq_len: [16, 32], batch: 1, heads: 2, d_key: 8}
modes: [forward, train, decode]
decode: {new_tokens: 4}
measure: {warmup: 1, repeats: 3, timeout_s: 60, fresh_worker: false}
"""
MODEL_SCENARIO = """
name: tiny-lm
variants: {softmax: {}, linear: {}}
target: model
model: {preset: small, vocab_size: 500, overrides: {n_layers: 1, d_ff: 256}}
axes: {seq_len: 32, batch: 2, heads: 8, d_key: 16}
modes: [train]
measure: {warmup: 1, repeats: 2, timeout_s: 60}
"""
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def measure(tmp_path: Path, text: str, *args: str) -> Path:
    """Write scenario ``text``, run it through the CLI and return its results file."""
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(textwrap.dedent(text))
    command = [sys.executable, "-m", "harness.cli", "run", str(scenario), "--out", str(tmp_path / "out"), "--no-progress", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == (1 if "fault_error" in text else 0), done.stderr  # failing cells on purpose: exit code 1
    (path,) = (tmp_path / "out").glob("*.jsonl")
    return path


def as_other_machine(source: Path, target: Path) -> Path:
    """A copy of ``source`` whose run lines say it was measured on another machine, a GPU
    machine that reported power throttling during its first ok cell."""
    other = {"hostname": "gpu-box-b", "machine_id": "b0b0b0b0b0b0b0b0", "gpu": {"name": "Simulated GPU B", "memory_bytes": 2**34}}
    throttle = {"throttled": True, "throttle_before": None, "throttle_after": {"throttled": True, "reasons": ["SwPowerCap"]}}
    lines, first_ok = [], True
    for record in read_records(source):
        if record["kind"] == "run":
            record["machine"] = {**record["machine"], **other}
        else:
            record["machine_id"] = other["machine_id"]
            if record["status"] == "ok" and first_ok:
                record["metrics"].update(throttle)
                first_ok = False
        lines.append(json.dumps(record) + "\n")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("".join(lines))
    return target


class Page(HTMLParser):
    """What the tests read from a page: its text, <img> sources, tables and tag balance."""

    VOID = {"meta", "img", "br", "hr", "link", "input"}

    def __init__(self, text: str):
        super().__init__()
        self.text, self.images, self.tables, self.open, self.by_id = [], [], [], Counter(), {}
        self._row, self._in_cell = None, False
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag not in self.VOID:
            self.open[tag] += 1
        if "id" in attrs:
            self.by_id[attrs["id"]] = attrs
        if tag == "img":
            self.images.append(attrs["src"])
        elif tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self._row = []
            self.tables[-1].append(self._row)
        elif tag in ("td", "th"):
            self._row.append("")
            self._in_cell = True

    def handle_endtag(self, tag):
        self.open[tag] -= 1
        if tag in ("td", "th"):
            self._in_cell = False

    def handle_data(self, data):
        self.text.append(data)
        if self._in_cell:
            self._row[-1] += data.strip()

    @property
    def all_text(self) -> str:
        return " ".join(" ".join(self.text).split())


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, Path]:
    """Real results: a core scenario with errors and OOMs in three modes, and a model scenario."""
    with ThreadPoolExecutor(2) as pool:
        core = pool.submit(measure, tmp_path_factory.mktemp("core"), CORE_SCENARIO, "--plugin", PLUGIN)
        model = pool.submit(measure, tmp_path_factory.mktemp("model"), MODEL_SCENARIO)
        return {"core": core.result(), "model": model.result()}


@pytest.fixture(scope="module")
def report(results, tmp_path_factory) -> Path:
    return build_report([results["core"], results["model"]], tmp_path_factory.mktemp("report") / "out")


@pytest.fixture(scope="module")
def page(report) -> Page:
    return Page(report.read_text(encoding="utf-8"))


def cells_of(path: Path) -> list[dict]:
    return [record for record in read_records(path) if record["kind"] == "cell"]


@pytest.mark.slow
def test_the_page_parses_and_its_tags_balance(page):
    unbalanced = {tag: count for tag, count in page.open.items() if count}
    assert not unbalanced, f"unclosed or stray tags: {unbalanced}"
    assert page.all_text.startswith("attnbench report: tiny-lm, tiny-report")


@pytest.mark.slow
def test_every_plot_is_a_png_file_and_embedded_in_the_page(report, page):
    files = sorted((report.parent / "plots").glob("*.png"))
    names = {path.stem for path in files}
    assert {"tiny-report-time", "tiny-report-throughput", "tiny-report-memory", "tiny-report-decode-latency", "tiny-lm-time"} <= names
    assert all(path.stat().st_size > 1000 for path in files)
    assert len(page.images) == len(files)
    embedded = []
    for source in page.images:
        assert source.startswith("data:image/png;base64,"), source[:40]
        data = base64.b64decode(source.split(",", 1)[1], validate=True)
        assert data.startswith(PNG_SIGNATURE)
        assert Image.open(io.BytesIO(data)).size[0] > 100
        embedded.append(data)
    assert sorted(embedded) == sorted(path.read_bytes() for path in files), "the page and plots/ hold different images"


@pytest.mark.slow
def test_cells_csv_has_one_row_per_cell_with_its_status(report, results):
    with open(report.parent / "cells.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    cells = cells_of(results["core"]) + cells_of(results["model"])
    assert sorted(row["cell_id"] for row in rows) == sorted(cell["cell_id"] for cell in cells)
    assert Counter(row["status"] for row in rows) == Counter(cell["status"] for cell in cells)
    assert {"ok", "error", "oom"} <= {row["status"] for row in rows}
    ok = next(row for row in rows if row["status"] == "ok")
    assert len(json.loads(ok["metrics.samples_s"])) >= 2


@pytest.mark.slow
def test_failed_cells_are_listed_with_their_messages(page, results):
    failed = [cell for cell in cells_of(results["core"]) if cell["status"] != "ok"]
    table = next(table for table in page.tables if table and "message" in table[0])
    header, rows = table[0], table[1:]
    assert len(rows) == len(failed)
    listed = Counter((row[header.index("variant")], row[header.index("status")]) for row in rows)
    assert listed == Counter((cell["variant"], cell["status"]) for cell in failed)
    assert listed[("fault_oom", "oom")] >= 4 and listed[("fault_error", "error")] >= 4  # forward and train, two seq_len each
    assert "CUDA out of memory. Tried to allocate 1.00 TiB" in page.all_text
    assert "RuntimeError: injected failure" in page.all_text


@pytest.mark.slow
def test_the_header_says_where_and_how_it_was_measured(page, results):
    run = next(record for record in read_records(results["core"]) if record["kind"] == "run")
    text = page.all_text
    assert "What was measured where" in text
    assert run["machine"]["hostname"] in text and run["machine"]["machine_id"] in text
    assert str(run["machine"]["cpu"]["model"]) in text and run["machine"]["versions"]["torch"] in text
    assert run["command"].startswith("attnbench run ") and run["command"] in text
    assert "no cell reported throttling" in text


@pytest.mark.slow
def test_the_model_table_has_words_per_second_and_memory(page, results):
    table = next(table for table in page.tables if table and "words/s" in table[0])
    header, rows = table[0], table[1:]
    assert [row[header.index("variant")] for row in rows] == ["linear", "softmax"]
    assert all(row[header.index("words/s")] not in ("", "-") for row in rows)
    assert all(row[header.index("memory")].endswith("MiB") for row in rows)


@pytest.mark.slow
def test_a_second_machine_gets_a_side_by_side_section_with_ratios_and_its_throttling(results, tmp_path):
    other = as_other_machine(results["core"], tmp_path / "b" / "tiny-report-b.jsonl")
    index = build_report([results["core"], other], tmp_path / "report")
    page = Page(index.read_text(encoding="utf-8"))
    pairs = machine_pairs(prepare(load([results["core"], other])))
    ok = [cell for cell in cells_of(results["core"]) if cell["status"] == "ok" and cell["mode"] != "quality"]
    assert len(pairs) == len(ok) and (pairs["ratio"] == 1.0).all()
    assert set(pairs["b"]) == {"gpu-box-b (Simulated GPU B)"}
    assert "Machines side by side" in page.all_text and "B = gpu-box-b (Simulated GPU B)" in page.all_text
    assert "1 cell ran while the GPU was throttled" in page.all_text and "SwPowerCap" in page.all_text
    table = next(table for table in page.tables if table and "B / A" in table[0])
    ratio, verdict = table[0].index("B / A"), table[0].index("verdict")
    assert len(table) - 1 == len(ok) and {row[ratio] for row in table[1:]} == {"1.000"}
    unsteady = sum(cell["metrics"].get("unstable") is True or cell["metrics"].get("disturbed") is True for cell in ok)
    assert sum("A unstable" in row[verdict] or "A disturbed" in row[verdict] for row in table[1:]) == unsteady  # issue 36, 57
    assert {row[verdict] for row in table[1:] if not row[verdict].startswith("not compared")} <= {"no clear difference"}


@pytest.mark.slow
def test_a_comparison_becomes_a_section(results, tmp_path):
    index = build_report([results["core"]], tmp_path / "report", title="with a comparison", compare_base=compare(results["core"], results["core"]))
    page = Page(index.read_text(encoding="utf-8"))
    table = next(table for table in page.tables if table and "mark" in table[0])
    marks = Counter(row[table[0].index("mark")] for row in table[1:])
    # A file against itself: no cell changed. Whether the interval is narrow enough to say
    # "unchanged" depends on how noisy the machine was while the fixture measured it; a cell
    # measured unstable is not judged at all (issue 36).
    ok = [cell for cell in cells_of(results["core"]) if cell["status"] == "ok"]
    assert marks["unchanged"] + marks[UNDECIDED] + marks[UNSTABLE] == len(ok), marks
    assert marks[UNSTABLE] == sum(cell["metrics"].get("unstable") is True for cell in ok), marks
    assert "Comparison of two commits" in page.all_text and page.all_text.startswith("with a comparison")


def _chromium() -> str:
    found = shutil.which("chromium")
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium is not installed, and CI must run the browser test (apt-get install chromium)")
        pytest.skip("chromium is not installed (apt-get install chromium); CI runs this test")
    return found


def _browse(report: Path, profile: Path, *args: str) -> subprocess.CompletedProcess:
    command = [_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args, report.resolve().as_uri()]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_the_page_renders_in_headless_chromium(report, page, tmp_path):
    """Every image decodes, no script error or console message, and the screenshot is not blank;
    the screenshot and the page are kept in $ATTNBENCH_ARTIFACTS (default: this test's tmp_path)."""
    dom = _browse(report, tmp_path / "profile-dom", "--enable-logging=stderr", "--v=0", "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    check = Page(dom.stdout).by_id["render-check"]
    total = str(len(page.images))
    assert (check["data-images-loaded"], check["data-images-total"], check["data-errors"]) == (total, total, "0"), check
    console = [line for line in dom.stderr.splitlines() if ":CONSOLE" in line]
    assert not console, console
    artifacts = Path(os.environ.get("ATTNBENCH_ARTIFACTS", tmp_path))
    artifacts.mkdir(parents=True, exist_ok=True)
    shutil.copy(report, artifacts / "report.html")
    screenshot = artifacts / "report-screenshot.png"
    shot = _browse(report, tmp_path / "profile-shot", f"--screenshot={screenshot}", "--window-size=1400,4000")
    assert shot.returncode == 0 and screenshot.stat().st_size > 10_000, shot.stderr[-2000:]
    image = Image.open(screenshot).convert("RGB")
    assert image.size == (1400, 4000)
    colours = image.getcolors(maxcolors=1 << 20)
    assert len(colours) > 50, "the screenshot is (nearly) one colour"
    white = {colour: count for count, colour in colours}.get((255, 255, 255), 0)
    assert white < 0.97 * image.size[0] * image.size[1], "the screenshot is almost all white"


def test_a_report_of_speed_cells_reads_the_results_files_alone(tmp_path):
    """It imports neither the runner, the scenario loader, the variants nor torch (issue 33): a
    report is made from results files, on any machine."""
    results = Path(__file__).with_name("schema-1.jsonl")
    program = (
        "import sys; from harness.report import build_report; build_report([sys.argv[1]], sys.argv[2]); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('variants', 'torch') "
        "or m in ('harness.running.runner', 'harness.scenarios.scenario')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", program, str(results), str(tmp_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH")]))},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]" and (tmp_path / "index.html").exists()


def test_labels_order_numbers_by_value_and_name_a_variants_own_d_key():
    from harness.report.cells import base_label
    from harness.report.figures import natural

    labels = ["rwkv(chunk_size=32)", "rwkv(chunk_size=4)", "rwkv(chunk_size=16)", "linear"]
    assert sorted(labels, key=natural) == ["linear", "rwkv(chunk_size=4)", "rwkv(chunk_size=16)", "rwkv(chunk_size=32)"]
    record = {"variant": "based", "params_text": "", "backend": "torch", "axes.d_key": 16.0, "axes.d_value": 64.0}
    assert base_label(record, show_backend=False) == "based(d_key=16)"
    assert base_label({**record, "axes.d_key": 64.0}, show_backend=True) == "based[torch]"
    assert base_label({**record, "params_text": "d_key=16", "axes.d_key": None}, show_backend=False) == "based(d_key=16)"


def test_the_variants_are_ranked_per_length_distribution():
    """Per mode and batch (distribution and packing), the ok cells fastest first by tokens/s (issue 35 item 3);
    a failed cell is left out, an unstable rate marked; no table without cells of variable length."""
    import pandas as pd

    from harness.report.tables import ranking_table

    def cell(variant, lengths, rate, status="ok", unstable=False, mode="forward"):
        axes = f"T=9 L={lengths} packing=packed"
        return {
            "variant": variant,
            "params_text": "",
            "backend": "torch",
            "axes.d_key": 4.0,
            "axes.d_value": 4.0,
            "status": status,
            "mode": mode,
            "machine": "m",
            "timing": "events",
            "axes.lengths": lengths,
            "axes_text": axes,
            "metrics.tokens_per_s": rate,
            "metrics.unstable": unstable,
        }

    cells = pd.DataFrame(
        [
            cell("linear", "[3,9]", 2e3),
            cell("softmax", "[3,9]", 5e3),
            cell("delta", "[3,9]", 1e3, "error"),
            cell("delta", "[8,1]", 4e3, unstable=True),
            cell("linear", "[8,1]", 3e3),
            cell("linear", "[8,1]", 7e3, mode="decode"),
        ]
    )
    ranking = ranking_table(cells)
    rows = {(row[0], row[1]): row[2] for row in ranking.rows}
    assert rows == {
        ("decode", "T=9 L=[8,1] packing=packed"): "linear 7k",
        ("forward", "T=9 L=[3,9] packing=packed"): "softmax 5k > linear 2k",
        ("forward", "T=9 L=[8,1] packing=packed"): "delta 4k * > linear 3k",
    }
    assert ranking_table(cells.assign(**{"axes.lengths": None})) is None


@pytest.mark.slow
def test_timed_cells_show_their_fraction_of_the_roofline_and_stability(report, page):
    table = next(table for table in page.tables if table and "roofline" in table[0])
    header, rows = table[0], table[1:]
    assert {"±CI", "stability", "bound", "other cores"} <= set(header) and rows
    assert all(0 < float(row[header.index("roofline")]) <= 1 for row in rows), rows
    assert {row[header.index("stability")] for row in rows} <= {"", "unstable", "unstable (disturbed)"}
    assert (report.parent / "plots" / "tiny-report-roofline.png").is_file()
    assert "calibrated peaks" in page.all_text and "FLOP/s" in page.all_text


@pytest.mark.slow
def test_a_speed_only_report_has_no_quality_table(page):
    assert "Quality" not in page.all_text


def test_unstable_cells_are_flagged_in_the_table_and_the_plots(tmp_path):
    """Constructed cells, one of them unstable: its row carries the class and the flag, the plots' captions warn."""
    from harness.results import ResultsWriter

    writer = ResultsWriter(tmp_path / "r.jsonl")
    writer.write_run({"run_id": "r", "started_at": "2026-12-01T00:00:00+00:00", "scenario": "s", "machine": {"machine_id": "m", "hostname": "h"}})
    for seq_len, unstable in ((16, False), (32, True)):
        metrics = {
            "median_s": 1e-3,
            "p20_s": 1e-3,
            "p80_s": 1e-3,
            "iqr_s": 0.0,
            "samples_s": [1e-3] * 3,
            "tokens": seq_len,
            "tokens_per_s": seq_len / 1e-3,
            "rel_ci": 0.2 if unstable else 0.01,
            "unstable": unstable,
            "roofline_fraction": 0.25,
        }
        writer.write_cell(
            {
                "run_id": "r",
                "cell_id": str(seq_len),
                "scenario": "s",
                "variant": "softmax",
                "backend": "torch",
                "params": {},
                "axes": {"seq_len": seq_len, "device": "cpu"},
                "mode": "forward",
                "target": "core",
                "status": "ok",
                "error": None,
                "machine_id": "m",
                "started_at": f"2026-12-01T00:00:0{seq_len // 16}+00:00",
                "metrics": metrics,
            }
        )
    index = build_report([tmp_path / "r.jsonl"], tmp_path / "report")
    html = index.read_text()
    assert html.count('<tr class="unstable">') == 1 and html.count('<tr class="stable">') == 1
    assert "1 unstable cell(s), ringed" in html and "1 unstable" in html


@pytest.mark.slow
def test_run_with_report_writes_the_report_of_that_run(tmp_path):
    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(
        "name: tiny\nvariants: {softmax: {}}\naxes: {seq_len: [16, 32], batch: 1, heads: 2, d_key: 8}\nmodes: [forward]\n"
        "measure: {warmup: 1, repeats: 3, max_time_s: 0.2}\n"
    )
    command = [sys.executable, "-m", "harness.cli", "run", str(scenario), "--out", str(tmp_path / "out"), "--report", str(tmp_path / "rep"), "--no-progress"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert last == f"report: {(tmp_path / 'rep' / 'index.html').resolve()}" and (tmp_path / "rep" / "index.html").is_file()

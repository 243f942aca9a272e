"""Hostile caches (issue 46, item 1): a cache is data that may be wrong. The calibration cache and the
WikiText token cache are validated when read; one that does not validate is ignored with one warning
line naming it and rebuilt, and each is keyed by what it was built from (a token cache by the content
of its files, not their paths, sizes or mtimes)."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from harness.measuring import roofline
from harness.measuring.machine import fingerprint
from harness.results import read_records
from harness.running import runner
from harness.scenarios.scenario import load_scenario
from harness.tasks import wikitext

# --- the calibration cache ------------------------------------------------------------------------


@pytest.fixture
def small_calibration(tmp_path, monkeypatch):
    """Calibration in this process, in milliseconds, with its cache in ``tmp_path``."""
    monkeypatch.setenv("ATTNBENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(roofline, "FIRST_CALIBRATION_S", 0.02)
    monkeypatch.setattr(roofline, "CACHED_CALIBRATION_S", 0.01)
    monkeypatch.setitem(roofline.MATMUL_SIDE, "cpu", 64)
    monkeypatch.setitem(roofline.COPY_BYTES, "cpu", 2**18)
    return tmp_path / "calibration.json"


def _finite(calibration: dict) -> bool:
    figures = [*calibration["matmul_flops_per_s"].values(), calibration["bandwidth_bytes_per_s"]]
    return all(math.isfinite(value) and value > 0 for value in figures)


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ('{"version": 2, "entries": {"KEY": {"matmul_flops_per_s.float32": NaN, "bandwidth_bytes_per_s": 1e9}}}', "finite number"),
        ('{"version": 2, "entries": {"KEY": {"matmul_flops_per_s.float32": Infinity, "bandwidth_bytes_per_s": 1e9}}}', "finite number"),
        ('{"version": 2, "entries": {"KEY": {"matmul_flops_per_s.float32": -1e9, "bandwidth_bytes_per_s": 1e9}}}', "greater than 0"),
        ('{"version": 2, "entries": {"KEY": {"matmul_flops_per_s.float32": "fast"}}}', "valid number"),
        ('{"version": 2, "entries": {"KEY": [1e9, 1e9]}}', "object"),
        ("[1e9, 1e9]", "object"),
        ('{"m/cpu/2 threads": {"matmul_flops_per_s.float32": 1e9}}', "version"),
        ('{"version": 2, "entries": {"KEY": {', "Invalid JSON"),
    ],
    ids=["nan", "infinity", "negative", "string", "list-entry", "list", "old-layout", "truncated"],
)
def test_a_calibration_cache_that_does_not_validate_is_ignored_with_one_warning_and_rebuilt(small_calibration, capsys, content, says):
    key = roofline.cache_key("m", torch.device("cpu"), torch.get_num_threads(), sorted(os.sched_getaffinity(0)))
    small_calibration.write_text(content.replace("KEY", key))
    calibration = roofline.calibrate("m", ["float32"])
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and str(small_calibration) in warning[0] and says in warning[0], warning
    assert _finite(calibration) and calibration["this_run"]["seconds_each"] == roofline.FIRST_CALIBRATION_S  # measured afresh
    rebuilt = roofline.CalibrationCache.model_validate_json(small_calibration.read_text())
    assert rebuilt.entries[key]["matmul_flops_per_s.float32"] == calibration["matmul_flops_per_s"]["float32"]
    roofline.calibrate("m", ["float32"])
    assert capsys.readouterr().err == ""


def test_a_cached_figure_counts_only_for_what_it_was_measured_on(small_calibration, capsys):
    """A figure of another machine, thread count, CPU set or matmul size never raises this one's roof."""
    threads, cpus = torch.get_num_threads(), sorted(os.sched_getaffinity(0))
    others = [
        roofline.cache_key("other machine", torch.device("cpu"), threads, cpus),
        roofline.cache_key("m", torch.device("cpu"), threads + 1, cpus),
        roofline.cache_key("m", torch.device("cpu"), threads, [*cpus, 999]),
    ]
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(roofline.MATMUL_SIDE, "cpu", 32)
        others.append(roofline.cache_key("m", torch.device("cpu"), threads, cpus))
    huge = {"matmul_flops_per_s.float32": 1e30, "bandwidth_bytes_per_s": 1e30}
    small_calibration.write_text(json.dumps({"version": 2, "entries": dict.fromkeys(others, huge)}))
    assert roofline.calibrate("m", ["float32"])["matmul_flops_per_s"]["float32"] < 1e30
    own = roofline.cache_key("m", torch.device("cpu"), threads, cpus)
    assert roofline.calibrate("m", ["float32"])["this_run"]["seconds_each"] == roofline.CACHED_CALIBRATION_S  # its own entry is used
    cache = json.loads(small_calibration.read_text())
    cache["entries"][own]["matmul_flops_per_s.float32"] = 1e30
    small_calibration.write_text(json.dumps(cache))
    assert roofline.calibrate("m", ["float32"])["matmul_flops_per_s"]["float32"] == 1e30
    assert capsys.readouterr().err == ""


def _old_layout_with_infinity() -> str:
    """A cache in the layout of attnbench before issue 46 whose every thread count holds Infinity."""
    machine_id = fingerprint("cpu")["machine_id"]
    entry = {"matmul_flops_per_s.float32": float("inf"), "bandwidth_bytes_per_s": float("inf")}
    return json.dumps({f"{machine_id}/cpu/{threads} threads": entry for threads in range(1, os.cpu_count() + 1)})


@pytest.mark.parametrize("content", [_old_layout_with_infinity, lambda: "[1, 2]"], ids=["infinity", "wrong-shape"])
@pytest.mark.slow  # about 20 s: a run with its worker
def test_a_run_after_a_bad_calibration_cache_writes_its_results_with_a_roofline(tmp_path, monkeypatch, capfd, content):
    monkeypatch.setenv("ATTNBENCH_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "calibration.json").write_text(content())
    path = tmp_path / "tiny.yaml"
    path.write_text(
        "name: tiny\nvariants: {softmax: {}}\naxes: {seq_len: [16], batch: 1, heads: 1, d_key: 8}\nmeasure: {warmup: 0, repeats: 2, fresh_worker: false}\n"
    )
    runner.run(load_scenario(str(path)), tmp_path / "out", progress=False)
    records = read_records(next((tmp_path / "out").glob("tiny-*.jsonl")))
    run, cell = records
    assert _finite(run["machine"]["calibration"]) and cell["status"] == "ok"
    assert 0 < cell["metrics"]["roofline_fraction"] < math.inf
    warnings = [line for line in capfd.readouterr().err.splitlines() if "calibration.json" in line]
    assert len(warnings) == 1 and "ignoring the cache" in warnings[0], warnings


# --- the WikiText token cache ---------------------------------------------------------------------


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    """A small WikiText layout, its token cache in ``tmp_path / "cache"``."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    directory = tmp_path / "wikitext"
    directory.mkdir()
    for split, text in (("train", " the cat sat \n the <unk> sat \n"), ("valid", " the dog \n"), ("test", " the cat \n <unk> \n")):
        (directory / f"wiki.{split}.tokens").write_text(text)
    return directory


def _cache_file(tmp_path):
    (path,) = (tmp_path / "cache" / "attnbench").glob("wikitext-*.pt")
    return path


def test_a_token_cache_of_other_content_with_the_same_path_size_and_mtime_is_not_used(corpus, tmp_path):
    first = wikitext.load_wikitext(corpus)
    train = corpus / "wiki.train.tokens"
    stat = train.stat()
    train.write_text(" the cat ran \n the <unk> ran \n")  # as long as before
    os.utime(train, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert train.stat().st_size == stat.st_size and train.stat().st_mtime_ns == stat.st_mtime_ns
    second = wikitext.load_wikitext(corpus)
    assert "ran" in second.vocab and "sat" not in second.vocab and second.vocab != first.vocab
    assert second.vocab == wikitext._read(corpus).vocab and torch.equal(second["train"], wikitext._read(corpus)["train"])


@pytest.mark.parametrize(
    ("payload", "says"),
    [
        (
            lambda key: {
                "key": key,
                "vocab": ["a"],
                "train": torch.zeros(2, 2, dtype=torch.long),
                "valid": torch.zeros(1, dtype=torch.long),
                "test": torch.zeros(1, dtype=torch.long),
            },
            "1-D tensor",
        ),
        (
            lambda key: {
                "key": key,
                "vocab": ["a"],
                "train": torch.tensor([0, 7]),
                "valid": torch.zeros(1, dtype=torch.long),
                "test": torch.zeros(1, dtype=torch.long),
            },
            "outside the vocabulary",
        ),
        (lambda key: {"vocab": ["a"], "splits": {"train": torch.zeros(3, dtype=torch.long)}}, "key"),
        (lambda key: {"key": "0" * 64, "vocab": ["a"], **dict.fromkeys(wikitext.SPLITS, torch.zeros(1, dtype=torch.long))}, "other files"),
        (lambda key: [1, 2, 3], "valid dictionary"),
    ],
    ids=["wrong-shape", "ids-outside", "old-layout", "other-key", "a-list"],
)
def test_a_token_cache_that_does_not_validate_is_ignored_with_one_warning_and_rebuilt(corpus, tmp_path, capsys, payload, says):
    expected = wikitext.load_wikitext(corpus)
    path = _cache_file(tmp_path)
    torch.save(payload(wikitext.cache_key(corpus)), path)
    loaded = wikitext.load_wikitext(corpus)
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and str(path) in warning[0] and says in warning[0], warning
    assert loaded.vocab == expected.vocab and all(torch.equal(loaded[split], expected[split]) for split in wikitext.SPLITS)
    wikitext.load_wikitext(corpus)  # rebuilt: read without a word
    assert capsys.readouterr().err == ""


def test_a_token_cache_that_is_not_a_torch_file_or_runs_code_is_ignored(corpus, tmp_path, capsys):
    expected = wikitext.load_wikitext(corpus)
    path = _cache_file(tmp_path)
    for content in (b"not a cache", path.read_bytes()[:100]):
        path.write_bytes(content)
        assert wikitext.load_wikitext(corpus).vocab == expected.vocab
        warning = capsys.readouterr().err.strip().splitlines()
        assert len(warning) == 1 and str(path) in warning[0], warning

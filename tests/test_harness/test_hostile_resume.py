"""Resume loses no finished cell (issue 46, class 5): ``--resume``'s tail repair cuts only a last line that is
not whole JSON; a whole record that lacks only its final newline gets it and is kept. Seconds (one tiny run)."""

from __future__ import annotations

import json

from harness.results import ResultsWriter, read_records, repair_tail
from harness.running import runner
from harness.scenarios.scenario import load_scenario

RUN = {"run_id": "r", "started_at": "2026-12-01T00:00:00+00:00", "scenario": "s", "machine": {"machine_id": "m"}}
CELL = {"run_id": "r", "cell_id": "c1", "scenario": "s", "variant": "softmax", "mode": "forward", "status": "skipped", "error": "why"}


def _file(path):
    with ResultsWriter(path) as writer:
        writer.write_run(RUN)
        writer.write_cell(CELL)
    return path


def test_a_whole_last_record_without_its_newline_gets_it_and_is_kept(tmp_path):
    path = _file(tmp_path / "r.jsonl")
    whole = path.read_bytes()
    path.write_bytes(whole[:-1])
    assert repair_tail(path) is False
    assert path.read_bytes() == whole
    assert [record.get("cell_id") for record in read_records(path)] == [None, "c1"]


def test_an_incomplete_last_line_is_cut_back_to_the_last_whole_one(tmp_path):
    path = _file(tmp_path / "r.jsonl")
    whole = path.read_bytes()
    for tail in (b'{"kind": "cell", "cell_id": "c2"', b'{"kind": "cell"}x', b"\xff\xfe", b"[" * 100_000):
        path.write_bytes(whole + tail)
        assert repair_tail(path) is True
        assert path.read_bytes() == whole


def test_resume_keeps_a_measured_cell_whose_newline_was_never_written(tmp_path, capsys):
    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(
        "name: tiny\nvariants: {softmax: {}}\naxes: {seq_len: [16, 32], batch: 1, heads: 1, d_key: 8}\n"
        "modes: [forward]\nmeasure: {warmup: 0, repeats: 2, target_rel_ci: null, fresh_worker: false}\n"
    )
    loaded = load_scenario(str(scenario))
    path = runner.run(loaded, tmp_path / "out", progress=False).path
    measured = [record for record in read_records(path) if record["kind"] == "cell"]
    path.write_bytes(path.read_bytes()[:-1])  # the last cell's line, written whole but for its newline
    runner.run(loaded, tmp_path / "out", resume=str(path), progress=False)
    cells = [record for record in read_records(path) if record["kind"] == "cell"]
    assert cells == measured and len(cells) == 2, json.dumps(cells)[:400]
    assert "dropped" not in capsys.readouterr().err

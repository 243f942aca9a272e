"""Two machines on one plot of points: the speed-against-accuracy plot tells them apart by marker fill (a line style
does not show on a point) and keys the fills below its panels; the committed example results of two machines
(reports/examples/cpu-dev-vm and cpu-xeon-vm, the same scenario) drawn into one report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from matplotlib.figure import Figure

from harness.report import build_report
from harness.report.figures import MACHINE_FILLS, Figures

EXAMPLES = Path(__file__).parents[2] / "reports" / "examples"
RESULTS = [EXAMPLES / "cpu-dev-vm" / "cuda-variants-20261205T083558Z.jsonl", EXAMPLES / "cpu-xeon-vm" / "cuda-variants-20261206T060435Z.jsonl"]


def _forward_cells(path: Path, folder: Path) -> Path:
    """``path``'s run lines and forward cells (a figure of points per mode is drawn alike; three modes cost 3x)."""
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    kept = folder / path.name
    kept.write_text("".join(json.dumps(r) + "\n" for r in records if r["kind"] == "run" or r["mode"] == "forward"), encoding="utf-8")
    return kept


@pytest.fixture(scope="module")
def accuracy(tmp_path_factory) -> Figure:
    folder = tmp_path_factory.mktemp("results")
    saved, save = {}, Figures.save

    def keep(self, figure, name, title, caption):
        saved[name] = (figure, caption)
        return save(self, figure, name, title, caption)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Figures, "save", keep)
        build_report([_forward_cells(path, folder) for path in RESULTS], tmp_path_factory.mktemp("report"))
    (name,) = [name for name in saved if name.endswith("-accuracy")]
    return saved[name]


def test_each_machine_has_its_own_marker_fill_and_a_key_below(accuracy):
    figure, caption = accuracy
    fills = {line.get_fillstyle() for ax in figure.axes for line in ax.get_lines() if line.get_marker() not in (None, "None", "")}
    assert fills == set(MACHINE_FILLS[:2])
    keys = {legend.get_title().get_text(): [text.get_text() for text in legend.get_texts()] for legend in figure.legends}
    assert len(keys["marker fill: machine"]) == 2 and "line style: machine" not in keys, keys
    assert "their fill: the machine" in caption

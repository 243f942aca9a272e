"""History at scale and on odd data (issues 54 and 55): the rates of issue 54 measured on generated histories (one
series a cell, one results file a commit and machine, read and fitted as ``attnbench history`` reads and fits them:
``series.build`` then ``changes.find``), two-level noise among them; a long series fitted whole; a jump at the newest
commit shown unconfirmed; a time of 0 set aside with a note, one slow night beside a step, cells without the optional
``backend`` and ``target``."""

from __future__ import annotations

import csv
import json
import re
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from helpers import attnbench_here
from histories import repository, two_levels, write_series

from harness.history import history
from harness.history.changes import find
from harness.history.series import build
from harness.history.steps import fit

SERIES = 50  #: series (cells) of each family
NOISE = 0.03


def family(kind: str, n: int, rng: np.random.Generator) -> tuple[np.ndarray, list[int]]:
    """``SERIES`` series of ``n`` commits of one kind (log times, [commit, 1, cell]) and where their steps are."""
    if kind == "two levels":
        return two_levels(rng, (n, 1, SERIES)), []
    log_times = rng.normal(0.0, NOISE, (n, 1, SERIES))
    if kind == "outlier +50 %":
        log_times[rng.integers(2, n - 2, SERIES), 0, np.arange(SERIES)] += np.log(1.5)
        return log_times, []
    if kind == "fixed later +20 %":
        log_times[n // 3 : 2 * n // 3] += np.log(1.2)
        return log_times, [n // 3, 2 * n // 3]
    if kind.startswith("step"):
        log_times[n // 2 :] += np.log1p(float(kind.split()[1]) / 100)
        return log_times, [n // 2]
    return log_times, []


#: (kind, commits, bound): the Done-when of issue 54; a bound below 0.5 is the most series with a step, above it the least found right.
CASES = [
    ("two levels", 30, 0.07),
    ("two levels", 100, 0.07),
    ("noise 3 %", 30, 0.01),
    ("outlier +50 %", 30, 0.02),
    ("step +10 %", 30, 0.70),
    ("step +30 %", 10, 0.95),
    ("fixed later +20 %", 30, 0.75),
]


@pytest.fixture(scope="module")
def rates(tmp_path_factory) -> dict[tuple[str, int], tuple[float, float]]:
    """Per case, the share of series with any step and the share with exactly the made steps (direction, within 3 commits)."""
    root, table = tmp_path_factory.mktemp("rates"), {}
    for n in sorted({n for _, n, _ in CASES}):
        kinds = [kind for kind, length, _ in CASES if length == n]
        made = [family(kind, n, np.random.default_rng([n, index])) for index, kind in enumerate(kinds)]
        results = write_series(root / f"n{n}", [f"{number:040x}" for number in range(n)], np.concatenate([log for log, _ in made], axis=2))
        by_cell = defaultdict(list)  # write_series's cell c is at batch c + 1
        for step in find(build([results], None)):
            by_cell[int(re.search(r"B=(\d+)", step.cell)[1]) - 1].append(step)
        for index, (kind, (_, wanted)) in enumerate(zip(kinds, made)):
            found = [[step for step in by_cell[index * SERIES + c] if step.confirmed] for c in range(SERIES)]
            right = [
                len(own) == len(wanted)
                and all(abs(step.position - at) <= 3 and step.direction == way for step, at, way in zip(own, wanted, ["slower", "faster"]))
                for own in found
            ]
            table[kind, n] = (np.mean([bool(own) for own in found]), np.mean(right))
    print(f"\nseries with a step found / with the made steps found right, of {SERIES} per row, through series.build and changes.find:")
    for (kind, n), (any_step, right) in table.items():
        print(f"{kind:<20}{n:>5} commits{any_step:>9.1%}{right:>9.1%}")
    return table


@pytest.mark.parametrize("kind, n, bound", CASES, ids=[f"{kind}-{n}" for kind, n, _ in CASES])
def test_issue_54_rates(rates, kind, n, bound):
    any_step, right = rates[kind, n]
    assert (any_step <= bound) if bound < 0.5 else (right >= bound), (any_step, right)


def test_ten_thousand_commits_fit_whole():
    """One series of 10,000 points with a +10 % step and a regression fixed later: the steps in place, nothing else."""
    rng = np.random.default_rng(1)
    log_times = rng.normal(0.0, NOISE, 10_000)
    log_times[6000:] += np.log(1.1)
    log_times[2000:2050] += np.log(1.3)
    assert fit(np.exp(log_times), np.full(10_000, 0.02)).changes == [2000, 2050, 6000]


def test_a_small_step_between_long_levels_is_found():
    """A +5 % step in 3 % noise: its levels overlap (87 % of the pairs across it ordered its way), too little for
    short levels, enough for two of 100 points; two-level noise of that length never steps (test_steps.py's table)."""
    rng = np.random.default_rng(4)
    found = [fit(np.exp(rng.normal(0.0, NOISE, 200) + np.log(1.05) * (np.arange(200) >= 100)), np.full(200, 0.03)).changes for _ in range(20)]
    assert sum(len(changes) == 1 and abs(changes[0] - 100) <= 3 for changes in found) >= 16, found


@pytest.fixture
def repo(tmp_path) -> tuple[Path, list[str]]:
    return tmp_path / "repo", repository(tmp_path / "repo", 12)


def csv_rows(path: Path) -> list[dict]:
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def test_a_jump_at_the_newest_commit_is_shown_unconfirmed(repo, tmp_path):
    """Cell 0 is 40 % slower at the newest commit only: a step with its ratio, status unconfirmed; it fails only with fail_unconfirmed."""
    path, commits = repo
    log_times = np.random.default_rng(2).normal(0.0, 0.01, (12, 1, 2))
    log_times[-1, 0, 0] += np.log(1.4)
    results = write_series(tmp_path / "results", commits, log_times)
    result = history([results], tmp_path / "page", repo=path)
    (row,) = csv_rows(tmp_path / "page" / "steps.csv")
    assert (row["status"], row["direction"], row["good_commit"], row["bad_commit"]) == ("unconfirmed", "slower", commits[-2], commits[-1])
    assert 1.3 < float(row["ci_low"]) < float(row["ratio"]) < float(row["ci_high"]) < 1.5
    assert result.exit_code == 0 and result.lines(1.1)[0].startswith("history: 0 steps (0 slower by more than 1.1, 0 faster), 1 unconfirmed")
    assert any(line.startswith("unconfirmed (slower, the next commit confirms it or not): ") for line in result.lines(1.1))
    assert "1 unconfirmed" in (tmp_path / "page" / "index.html").read_text(encoding="utf-8")
    command = ["history", results, "--repo", path, "--out"]
    assert attnbench_here(*map(str, [*command, tmp_path / "cli"])).returncode == 0
    assert attnbench_here(*map(str, [*command, tmp_path / "strict", "--fail-unconfirmed"])).returncode == 1
    log_times = np.concatenate([log_times, log_times[-1:]])  # the next night confirms it
    confirmed = history([write_series(tmp_path / "next", [*commits, "f" * 40], log_times)], tmp_path / "next-page", repo=path)
    assert [(step.status, step.position) for step in confirmed.steps] == [("confirmed", 11)] and confirmed.exit_code == 1


def stepped(tmp_path: Path, commits: list[str], night: int | None = None, slow: float = 1.0) -> Path:
    """Two cells of ``commits``, cell 0 50 % slower from commit 6 (``night``, if given, ``slow`` times slower in both cells)."""
    log_times = np.random.default_rng(3).normal(0.0, 0.01, (len(commits), 1, 2))
    log_times[6:, 0, 0] += np.log(1.5)
    if night is not None:
        log_times[night] += np.log(slow)
    return write_series(tmp_path / f"results-{night}-{slow}", commits, log_times)


@pytest.mark.parametrize("slow", [3.0, 10.0])
def test_one_slow_night_beside_a_step_moves_neither_its_ratio_nor_its_interval(repo, tmp_path, slow):
    path, commits = repo
    result = history([stepped(tmp_path, commits, night=5, slow=slow)], tmp_path / "page", repo=path)
    (step,) = [step for step in result.steps if step.cell.split()[2] == "B=1"]
    assert 1.4 < step.ci_low < step.ratio < step.ci_high < 1.6 and result.exit_code == 1, step


def test_each_results_file_is_read_once(repo, tmp_path, monkeypatch):
    path, commits = repo
    results, read = stepped(tmp_path, commits), []
    monkeypatch.setattr(Path, "read_bytes", lambda file, reader=Path.read_bytes: read.append(file) or reader(file))  # how the reader reads
    history([results], tmp_path / "page", repo=path)
    assert sorted(str(file) for file in read if file.suffix == ".jsonl") == sorted(map(str, results.glob("*.jsonl")))


def test_a_time_of_zero_is_set_aside_with_a_note(repo, tmp_path):
    path, commits = repo
    results = stepped(tmp_path, commits)
    night = results / "box-a-00008.jsonl"
    lines = [json.loads(line) for line in night.read_text().splitlines()]
    lines[1]["metrics"]["median_s"] = 0
    night.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = history([results], tmp_path / "page", repo=path)
    assert result.notes[0].startswith("1 timed cell with metrics.median_s 0 set aside") and str(night) in result.notes[0], result.notes
    (step,) = result.steps
    assert (step.position, step.direction, result.exit_code) == (6, "slower", 1) and 1.4 < step.ci_low


def test_cells_without_backend_or_target_read_as_the_report_reads_them(repo, tmp_path):
    """Every cell without them, then only the later nights without them: no error, every point drawn (a series of its own)."""
    path, commits = repo
    for first in (0, 4):
        results = stepped(tmp_path / str(first), commits)
        for night in sorted(results.glob("*.jsonl"))[first:]:
            lines = [json.loads(line) for line in night.read_text().splitlines()]
            night.write_text("".join(json.dumps({k: v for k, v in line.items() if k not in ("backend", "target")}) + "\n" for line in lines))
        built = build([results], path)
        assert len(built.points) == 2 * len(commits) and set(built.points["backend"]) == ({""} if first == 0 else {"torch", ""})
        result = history([results], tmp_path / str(first) / "page", repo=path)
        assert [(step.backend, step.position) for step in result.steps] == [("", 6)] and result.exit_code == 1

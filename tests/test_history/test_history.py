"""``attnbench history`` on histories of real results lines (tests/histories.py): 12 commits
of a scratch repository on two machines, one cell 30 % slower from one commit on one machine, another
25 % faster, a single outlier and noise elsewhere; the page, steps.csv and the exit codes."""

from __future__ import annotations

import csv
import json
import subprocess

import pytest
from helpers import attnbench_here
from histories import MACHINES, repository, write_history
from test_harness.test_report import Page, _browse

COMMITS = 12
SLOWER_AT, FASTER_AT, OUTLIER_AT = 6, 4, 8


def stepped(number: int, machine: str, cell: int) -> float:
    """Cell 0 (softmax forward) 30 % slower from SLOWER_AT on box-a, cell 1 (softmax train) 25 % faster
    from FASTER_AT on box-a, cell 2 (softmax decode) one point 50 % slower on box-b; the rest noise."""
    if cell == 0 and machine == "box-a" and number >= SLOWER_AT:
        return 1.3
    if cell == 1 and machine == "box-a" and number >= FASTER_AT:
        return 0.75
    if cell == 2 and machine == "box-b" and number == OUTLIER_AT:
        return 1.5
    return 1.0


def history(*args) -> subprocess.CompletedProcess:
    """``attnbench history ARGS`` in this process."""
    return attnbench_here("history", *map(str, args))


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("history")
    commits = repository(root / "repo", COMMITS)
    results = write_history(root / "results", commits, stepped)
    done = history(results, "--out", root / "page", "--repo", root / "repo")
    return {"root": root, "commits": commits, "results": results, "done": done, "page": root / "page"}


@pytest.fixture(scope="module")
def steps(built) -> list[dict]:
    with open(built["page"] / "steps.csv", newline="") as file:
        return list(csv.DictReader(file))


def test_a_slower_step_fails_the_history(built):
    assert built["done"].returncode == 1, built["done"].stderr
    assert "1 slower" in built["done"].stdout and "softmax" in built["done"].stdout


def test_the_steps_are_the_made_ones_with_their_commits(built, steps):
    commits = built["commits"]
    found = {(row["machine_id"], row["variant"], row["mode"]): row for row in steps}
    assert set(found) == {(MACHINES["box-a"], "softmax", "forward"), (MACHINES["box-a"], "softmax", "train")}, steps
    slower, faster = found[MACHINES["box-a"], "softmax", "forward"], found[MACHINES["box-a"], "softmax", "train"]
    assert (slower["good_commit"], slower["bad_commit"], slower["direction"]) == (commits[SLOWER_AT - 1], commits[SLOWER_AT], "slower")
    assert (faster["good_commit"], faster["bad_commit"], faster["direction"]) == (commits[FASTER_AT - 1], commits[FASTER_AT], "faster")
    assert 1.2 < float(slower["ci_low"]) < float(slower["ratio"]) < float(slower["ci_high"]) < 1.4
    assert 0.7 < float(faster["ratio"]) < 0.8 and float(faster["ci_high"]) < 1
    assert slower["commits_between"] == "0" and "bisect" not in slower["commands"]
    good, bad = commits[SLOWER_AT - 1][:12], commits[SLOWER_AT][:12]
    assert slower["commands"] == f"attnbench regress --base {good} --head {bad} cuda-variants --preset cpu --all-variants"


def test_the_page_lists_the_steps_and_draws_every_group(built):
    page = Page((built["page"] / "index.html").read_text(encoding="utf-8"))
    assert not any(page.open.values()), page.open
    table = next(table for table in page.tables if table and "first after" in table[0])
    header = table[0]
    rows = {(row[header.index("mode")], row[header.index("first after")]) for row in table[1:]}
    assert rows == {("forward", built["commits"][SLOWER_AT][:10]), ("train", built["commits"][FASTER_AT][:10])}
    assert len(page.images) == 2 and all(image.startswith("data:image/png;base64,") for image in page.images)  # softmax, linear
    assert {path.name for path in (built["page"] / "plots").iterdir()} == {"history-cuda-variants-softmax.png", "history-cuda-variants-linear.png"}
    points = [table for table in page.tables if table and table[0][:3] == ["cell", "machine", "commit"]]
    assert [len(table) - 1 for table in points] == [COMMITS * len(MACHINES), 3 * COMMITS * len(MACHINES)]  # linear; softmax: forward, train, decode


def test_noise_only_exits_0_and_since_skips_older_steps(built, tmp_path):
    quiet = write_history(tmp_path / "quiet", built["commits"], lambda *_: 1.0, seed=3)
    done = history(quiet, "--out", tmp_path / "page", "--repo", built["root"] / "repo")
    assert done.returncode == 0, done.stderr
    with open(tmp_path / "page" / "steps.csv") as file:
        assert len(list(csv.DictReader(file))) == 0
    since = history(built["results"], "--out", tmp_path / "since", "--repo", built["root"] / "repo", "--since", built["commits"][SLOWER_AT])
    assert since.returncode == 0, since.stdout + since.stderr
    before = history(built["results"], "--out", tmp_path / "before", "--repo", built["root"] / "repo", "--since", built["commits"][SLOWER_AT - 1])
    assert before.returncode == 1
    loose = history(built["results"], "--out", tmp_path / "loose", "--repo", built["root"] / "repo", "--factor", "1.5")
    assert loose.returncode == 0  # a 30 % step is within a factor of 1.5


def test_two_machines_are_never_one_series(built, tmp_path):
    """The same cell on two machines of one hostname, one 30 % slower throughout: no step, two lines told apart by their ids."""
    results = write_history(tmp_path / "two", built["commits"], lambda number, machine, cell: 1.3 if machine == "box-b" else 1.0, seed=2)
    for path in results.glob("box-b-*.jsonl"):
        path.write_text(path.read_text().replace('"hostname": "box-b"', '"hostname": "box-a"'))
    done = history(results, "--out", tmp_path / "page", "--repo", built["root"] / "repo")
    assert done.returncode == 0, done.stdout + done.stderr
    page = Page((tmp_path / "page" / "index.html").read_text(encoding="utf-8"))
    points = next(table for table in page.tables if table and table[0][:3] == ["cell", "machine", "commit"])
    assert {row[1] for row in points[1:]} == {f"box-a (AMD EPYC) #{MACHINES['box-a'][:6]}", f"box-a (AMD EPYC) #{MACHINES['box-b'][:6]}"}


def test_runs_without_a_commit_are_ordered_by_time_and_said(built, tmp_path):
    results = write_history(tmp_path / "null", [None] * 10, stepped, seed=3)
    done = history(results, "--out", tmp_path / "page", "--repo", built["root"] / "repo")
    assert done.returncode == 1, done.stderr
    assert "10 runs have no commit" in done.stderr or "commit null" in done.stderr
    with open(tmp_path / "page" / "steps.csv") as file:
        rows = list(csv.DictReader(file))
    slower = next(row for row in rows if row["direction"] == "slower")
    assert slower["bad_commit"] == "no commit 2026-11-07T00:00:00+00:00" and slower["commands"] == ""  # the run's start, not the cell's
    faster = next(row for row in rows if row["direction"] == "faster")
    assert (faster["good_commit"], faster["bad_commit"]) == ("no commit 2026-11-04T00:00:00+00:00", "no commit 2026-11-05T00:00:00+00:00")


def test_scenarios_are_kept_apart(built, tmp_path):
    """The same cells under two scenario names are two series each: the renamed one, noise only, has no step."""
    results = write_history(tmp_path / "mixed", built["commits"], stepped, seed=4)
    write_history(tmp_path / "mixed" / "other", built["commits"], lambda *_: 1.0, seed=5, scenario="renamed")
    done = history(results, results / "other", "--out", tmp_path / "page", "--repo", built["root"] / "repo")
    with open(tmp_path / "page" / "steps.csv") as file:
        assert {row["scenario"] for row in csv.DictReader(file)} == {"cuda-variants"}
    assert done.returncode == 1


@pytest.mark.parametrize("case", ["empty directory", "bad field", "unknown since", "no such file"])
def test_bad_input_is_one_line_and_exit_2(built, tmp_path, case):
    out = tmp_path / "page"
    if case == "empty directory":
        (tmp_path / "empty").mkdir()
        args, named = [tmp_path / "empty"], str(tmp_path / "empty")
    elif case == "bad field":
        bad = tmp_path / "bad.jsonl"
        lines = (built["results"] / "box-a-00.jsonl").read_text().splitlines()
        cell = json.loads(lines[1])
        cell["metrics"]["median_s"] = "fast"
        bad.write_text("\n".join([lines[0], json.dumps(cell), *lines[2:]]) + "\n")
        args, named = [bad], "median_s"
    elif case == "unknown since":
        args, named = [built["results"], "--since", "no-such-rev"], "no-such-rev"
    else:
        args, named = [tmp_path / "missing.jsonl"], "missing.jsonl"
    done = history(*args, "--out", out, "--repo", built["root"] / "repo")
    assert done.returncode == 2, done.stdout + done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and named in done.stderr, done.stderr
    assert not (out / "index.html").exists()


@pytest.mark.slow
def test_the_page_renders_in_headless_chromium(built, tmp_path):
    """Every image decodes, no script error or console message (the report's browser test)."""
    index = built["page"] / "index.html"
    dom = _browse(index, tmp_path / "profile", "--enable-logging=stderr", "--v=0", "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    check = Page(dom.stdout).by_id["render-check"]
    assert (check["data-images-loaded"], check["data-images-total"], check["data-errors"]) == ("2", "2", "0"), check
    assert not [line for line in dom.stderr.splitlines() if ":CONSOLE" in line]

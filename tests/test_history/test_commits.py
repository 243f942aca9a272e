"""``attnbench run SCENARIO --commits RANGE``: the range read from git (bad ranges: one line, exit 2), and,
slow, three commits of a copy of this project measured in their own worktrees: the scenario is the
newest commit's (the older ones do not have its file), a commit whose variants do not import is
recorded with its reason, a second call measures nothing new, and ``history`` draws the result."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import attnbench_here, commit, git, project_repository
from histories import repository

from harness.common.checkouts import RegressError
from harness.results import read_records
from harness.revisions.commits import range_commits

ROOT = Path(__file__).parents[2]
TINY = "variants: {softmax: {}}\naxes: {seq_len: 16, batch: 1, heads: 2, d_key: 8}\nmodes: [forward]\nmeasure: {warmup: 1, repeats: 5}\n"


def attnbench(*args, cwd=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "harness.cli", *map(str, args)], capture_output=True, text=True, env=env, cwd=cwd, timeout=600)


def test_the_range_is_read_from_git(tmp_path):
    commits = repository(tmp_path / "repo", 7)
    assert range_commits(tmp_path / "repo", "HEAD~3..HEAD") == commits[-3:]
    assert range_commits(tmp_path / "repo", f"{commits[0]}..HEAD", every=2) == [commits[2], commits[4], commits[6]]
    for spec in ("HEAD", "..HEAD", "HEAD~2...HEAD", "HEAD.."):
        with pytest.raises(RegressError, match="not a range"):
            range_commits(tmp_path / "repo", spec)
    with pytest.raises(RegressError, match="holds no commit"):
        range_commits(tmp_path / "repo", "HEAD..HEAD~2")
    with pytest.raises(RegressError, match="no-such-rev"):
        range_commits(tmp_path / "repo", "no-such-rev..HEAD")


@pytest.mark.parametrize("spec, named", [("HEAD~2", "not a range"), ("nope..HEAD", "nope")])
def test_a_bad_range_is_one_line_and_exit_2(tmp_path, spec, named):
    repository(tmp_path / "repo", 3)
    done = attnbench_here("run", "smoke-cpu", "--commits", spec, "--repo", str(tmp_path / "repo"), "--out", str(tmp_path / "out"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and named in done.stderr and "--commits" in done.stderr
    assert not (tmp_path / "out").exists()


def test_a_revision_git_would_read_as_an_option_is_refused(tmp_path):
    """``--commits=--output=FILE..HEAD``: each end is resolved before git sees the range, so git writes no FILE."""
    repository(tmp_path / "repo", 3)
    written = tmp_path / "written"
    with pytest.raises(RegressError, match="'--output=.*' is not a revision"):
        range_commits(tmp_path / "repo", f"--output={written}..HEAD")
    assert not list(tmp_path.glob("written*"))


@pytest.mark.slow
def test_each_commit_is_measured_once_by_its_own_code(tmp_path):
    repo, out = tmp_path / "repo", tmp_path / "results"
    first = project_repository(repo)
    package = repo / "variants" / "__init__.py"
    source = package.read_text()
    package.write_text(source + 'raise ImportError("broken on purpose by test_commits")\n')
    broken = commit(repo, "variants do not import")
    package.write_text(source)
    (repo / "scenarios" / "tiny-history.yaml").write_text(TINY)
    newest = commit(repo, "fixed; a tiny scenario")
    done = attnbench("run", "tiny-history", "--commits", f"{first}~0..HEAD", "--repo", repo, "--out", out, "--no-progress")
    assert done.returncode == 1 and f"{broken[:10]}: cannot run the scenario" in done.stdout, done.stdout + done.stderr
    files = sorted(out.glob("tiny-history-*.jsonl"))
    assert len(files) == 2, done.stdout  # first..HEAD: the broken commit and the newest
    by_commit = {read_records(path)[0]["commit"]: read_records(path) for path in files}
    assert set(by_commit) == {broken, newest}
    (cell,) = [record for record in by_commit[broken] if record["kind"] == "cell"]
    assert cell["status"] == "error" and "broken on purpose" in cell["error"]
    assert [record["status"] for record in by_commit[newest] if record["kind"] == "cell"] == ["ok"]
    assert git(repo, "worktree", "list").count("\n") == 0  # the worktrees are gone

    again = attnbench("run", "tiny-history", "--commits", f"{first}..HEAD", "--repo", repo, "--out", out, "--no-progress")
    assert "0 to measure" in again.stdout and sorted(out.glob("*.jsonl")) == files, again.stdout + again.stderr

    page = attnbench("history", out, "--out", tmp_path / "page", "--repo", repo)
    assert page.returncode == 0, page.stdout + page.stderr
    with open(tmp_path / "page" / "steps.csv") as file:
        assert list(csv.DictReader(file)) == []
    assert (tmp_path / "page" / "plots" / "history-tiny-history-softmax.png").exists()

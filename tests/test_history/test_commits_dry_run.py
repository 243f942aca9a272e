"""``attnbench run SCENARIO --commits A..B --dry-run``: the commits of the range (``--every`` applied), which of them
are measured on this machine already (in whole or in part, from the results files under ``--out``) and the estimated
duration (each commit's cells as ``run --dry-run`` estimates them, and its worktree and import check); nothing is
measured, no worktree is left and no file is written."""

from __future__ import annotations

import pytest
from helpers import attnbench_here, commit, git

from harness.revisions.commits import CHECKOUT_S, _record_failure, commit_range, dry_run, results_file
from harness.running.estimate import Estimator, Measured, format_duration, roofs_for

#: Two cells (softmax at two lengths), cheap to estimate.
TINY = "variants: {softmax: {}}\naxes: {seq_len: [16, 32], batch: 1, heads: 2, d_key: 8}\nmodes: [forward]\nmeasure: {warmup: 1, repeats: 5}\n"


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> tuple:
    """A repository of six commits, the scenario ``tiny`` in each; its hashes, oldest first."""
    path = tmp_path_factory.mktemp("dry-run") / "repo"
    (path / "scenarios").mkdir(parents=True)
    git(path, "init", "-q")
    (path / "scenarios" / "tiny.yaml").write_text(TINY)
    commits = [commit(path, "the scenario")]
    for number in range(5):
        git(path, "commit", "-q", "--allow-empty", "-m", f"change {number}")
        commits.append(git(path, "rev-parse", "HEAD"))
    return path, commits


def test_the_dry_run_lists_the_range_and_measures_nothing(repo, tmp_path):
    path, commits = repo
    done = attnbench_here("run", "tiny", "--commits", "HEAD~4..HEAD", "--every", "2", "--dry-run", "--repo", str(path), "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"tiny: 3 commits of HEAD~4..HEAD, 3 to measure -> {tmp_path / 'out'}/ (dry run: nothing is measured)"
    assert [line.split()[0] for line in lines[1:4]] == [commits[2][:10], commits[4][:10], commits[5][:10]]  # every 2nd from the root, the newest
    assert " change 1: to measure: 2 cells, ~" in lines[1] and " change 4: to measure: 2 cells, ~" in lines[3]
    assert lines[4].startswith("estimated ") and "for 3 commits to measure" in lines[4] and lines[5].startswith("roof (cpu): ")
    assert not (tmp_path / "out").exists() and git(path, "worktree", "list").count("\n") == 0


def test_commits_measured_on_this_machine_are_named_and_not_estimated(repo, tmp_path):
    """One commit recorded whole, one in part (one of its two cells): the first is measured, the second has one cell left;
    the total is the estimate of the cells left and a checkout per commit to measure; --force measures them all again."""
    path, commits = repo
    out = tmp_path / "out"
    out.mkdir()
    chosen = commit_range(path, "tiny", "HEAD~3..HEAD", out)
    for number in (3, 4):
        fingerprint = {**chosen.here, "git": {"commit": commits[number], "dirty": False, "describe": None}}
        _record_failure(
            results_file(out, chosen.loaded, commits[number], chosen.here["machine_id"]), chosen.loaded, fingerprint, "test", "recorded by the test"
        )
    part = results_file(out, chosen.loaded, commits[4], chosen.here["machine_id"])
    part.write_text("".join(part.read_text().splitlines(keepends=True)[:-1]))  # its last cell left out
    chosen = commit_range(path, "tiny", "HEAD~3..HEAD", out)
    lines = dry_run(chosen)
    assert chosen.done == {commits[3]} and lines[0].startswith("tiny: 3 commits of HEAD~3..HEAD, 2 to measure")
    states = {line.split()[0]: line.split(": ", 1)[1] for line in lines[1:4]}
    assert states[commits[3][:10]] == "measured on this machine"
    assert states[commits[4][:10]].startswith("to measure: 1 of 2 cells measured; 1 cell, ~")
    assert states[commits[5][:10]].startswith("to measure: 2 cells, ~")
    cells = chosen.loaded.cells()
    estimator = Estimator(roofs_for(cells))
    left = [cell for cell in cells if cell.cell_id not in chosen.recorded[commits[4]]]
    total = estimator.sweep(left).seconds() + estimator.sweep(cells).seconds() + 2 * CHECKOUT_S
    assert lines[4].startswith(f"estimated {format_duration(total)} for 2 commits to measure"), lines[4]
    forced = dry_run(commit_range(path, "tiny", "HEAD~3..HEAD", out, force=True))
    assert forced[0].startswith("tiny: 3 commits of HEAD~3..HEAD, 3 to measure") and "for 3 commits to measure" in forced[4]


@pytest.mark.parametrize("spec, said", [("HEAD~2", "not a range of commits"), ("nope..HEAD", "'nope' is not a revision")])
def test_a_bad_range_is_refused_before_anything_is_estimated(repo, tmp_path, spec, said):
    path, _ = repo
    done = attnbench_here("run", "tiny", "--commits", spec, "--dry-run", "--repo", str(path), "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and done.stdout == "", done.stdout
    assert done.stderr == f"error: --commits {spec}: {said}" + done.stderr.split(said, 1)[1] and len(done.stderr.splitlines()) == 1


def test_the_dry_run_learns_from_this_machines_earlier_nights(repo, tmp_path):
    """A night's cells recorded ok at one commit (here, 2 s a call): the other commits' estimates come from them, as
    `run --dry-run` learns from this machine's results, and the dry run says so; the model alone estimates far less."""
    import json

    path, commits = repo
    out = tmp_path / "out"
    out.mkdir()
    chosen = commit_range(path, "tiny", "HEAD~3..HEAD", out)
    fingerprint = {**chosen.here, "git": {"commit": commits[3], "dirty": False, "describe": None}}
    night = results_file(out, chosen.loaded, commits[3], chosen.here["machine_id"])
    _record_failure(night, chosen.loaded, fingerprint, "test", "rewritten below as measured")
    records = [json.loads(line) for line in night.read_text().splitlines()]
    for record in records[1:]:
        record.update(status="ok", error=None, metrics={**record["metrics"], "median_s": 2.0, "flops": 1e6, "samples_s": [2.0]})
    night.write_text("".join(json.dumps(record) + "\n" for record in records))
    learned = dry_run(commit_range(path, "tiny", "HEAD~3..HEAD", out))
    assert any(line.startswith(f"estimates from {out} (this machine's results of 1 file)") for line in learned), learned
    cells, roofs = chosen.loaded.cells(), roofs_for(chosen.loaded.cells())
    expected = Estimator(roofs, measured=Measured([night], machine_id=chosen.here["machine_id"])).sweep(cells).seconds() + CHECKOUT_S
    (newest,) = [line for line in learned if line.split()[0] == commits[5][:10]]
    assert newest.endswith(f"change 4: to measure: 2 cells, ~{format_duration(expected)}"), (newest, expected)
    assert expected > 2 * (Estimator(roofs).sweep(cells).seconds() + CHECKOUT_S)

"""``run --commits`` measures a commit only with its own code (harness.revisions.commits.cannot_import): a commit whose
import hangs is stopped after ``IMPORT_CHECK_TIMEOUT_S`` and recorded against that commit, and the range goes on; a commit
without ``variants/``, which the installed attnbench (``pip install -e``) would serve, is recorded as unable to run rather
than measured with today's code."""

from __future__ import annotations

import pytest
from helpers import attnbench_here, commit, git

from harness.results import read_records
from harness.revisions import commits

TINY = "variants: {softmax: {}}\naxes: {seq_len: 16, batch: 1, heads: 2, d_key: 8}\nmodes: [forward]\nmeasure: {warmup: 1, repeats: 5}\n"


@pytest.mark.slow
def test_a_commit_whose_import_hangs_or_is_not_its_own_is_recorded_against_it(tmp_path, monkeypatch):
    monkeypatch.setattr(commits, "IMPORT_CHECK_TIMEOUT_S", 3)
    repo, scenario, out = tmp_path / "repo", tmp_path / "tiny-own.yaml", tmp_path / "out"
    scenario.write_text(TINY)
    (repo / "harness" / "running").mkdir(parents=True)
    git(repo, "init", "-q")
    (repo / "README").write_text("a project of its own\n")
    commit(repo, "first")
    for package in ("harness", "harness/running"):
        (repo / package / "__init__.py").write_text("")
    (repo / "harness" / "running" / "worker.py").write_text("def serve(conn, plugins):\n    pass\n")  # its own worker loop
    (repo / "variants").mkdir()
    (repo / "variants" / "__init__.py").write_text("import time\n\ntime.sleep(600)\n")
    hangs = commit(repo, "variants hang on import")
    git(repo, "rm", "-q", "-r", "variants")
    lacks = commit(repo, "no variants of its own")

    done = attnbench_here("run", str(scenario), "--commits", "HEAD~2..HEAD", "--repo", str(repo), "--out", str(out), "--no-progress")
    assert done.returncode == 1, done.stdout + done.stderr
    errors = {}
    for path in out.glob("tiny-own-*.jsonl"):
        records = read_records(path)
        errors[records[0]["commit"]] = [(record["status"], record["error"]) for record in records if record["kind"] == "cell"]
    assert set(errors) == {hangs, lacks}, done.stdout
    ((status, error),) = errors[hangs]
    assert status == "error" and "its code did not import within 3 s" in error
    ((status, error),) = errors[lacks]
    assert status == "error" and "variants imported from" in error and "not from the commit" in error
    assert git(repo, "worktree", "list").count("\n") == 0

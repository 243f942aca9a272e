"""Issue 55, items 1, 3 and 5: the nightly job ``run --commits`` over hostile revisions, changing scenarios and
failures of the moment. Every revision of every command goes to git through ``checkouts.commit_of`` (one line
naming the option and the value, exit 2, nothing written); a nightly's results are keyed by what was measured
(the scenario's content, preset, ``--set``), ``--force`` appends under the lock and ``--retry-failed`` takes a
range; a dirty run is no commit's measurement and ``--every`` is a grid anchored at the root commit. The commits
are measured by a fake executor in worktrees of tiny repositories: no worker starts."""

from __future__ import annotations

import pytest
from helpers import LocalTestExecutor, attnbench_here, commit, git

from harness.common.checkouts import RegressError, commit_of
from harness.history.series import HistoryError, resolve
from harness.results import ResultsWriter, cell_record, read_records, run_header
from harness.results.locking import LockedError, ResultsDirectoryLock
from harness.revisions import commits as nightly
from harness.running import runner
from harness.running.executors import unmeasured
from harness.scenarios.scenario import load_scenario

TINY = "variants: {softmax: {}}\naxes: {seq_len: [16], batch: 1, heads: 2, d_key: 8}\nmodes: [forward]\nmeasure: {warmup: 1, repeats: 5}\n"
#: ``TINY`` with a second cell: the scenario file changed between two nights.
GROWN = TINY.replace("seq_len: [16]", "seq_len: [16, 32]")


@pytest.fixture
def repo(tmp_path):
    """A repository of four commits, the scenario ``tiny`` in each; its path and hashes, oldest first."""
    path = tmp_path / "repo"
    (path / "scenarios").mkdir(parents=True)
    git(path, "init", "-q")
    (path / "scenarios" / "tiny.yaml").write_text(TINY)
    hashes = [commit(path, "the scenario")]
    for number in range(3):
        git(path, "commit", "-q", "--allow-empty", "-m", f"change {number}")
        hashes.append(git(path, "rev-parse", "HEAD"))
    return path, hashes


class Night(LocalTestExecutor):
    """Measures each cell at once with the status ``statuses`` gives its (commit, cell_id) (default ``ok``), records it
    with the commit's ``fingerprint`` (as ``LocalExecutor(fingerprint=...)`` does) and counts it in ``measured``."""

    def __init__(self, statuses: dict, measured: list, fingerprint: dict):
        self.statuses, self.measured, self.fingerprint = statuses, measured, fingerprint

    def start(self, todo, fingerprint):
        return [self.fingerprint]

    def measure(self, todo, starting):
        commit = self.fingerprint["git"]["commit"]
        for cell in todo:
            starting(cell)
            status, error = self.statuses.get((commit, cell.cell_id), ("ok", None))
            observation = unmeasured(status, error)
            if status == "ok":
                observation["result"]["metrics"] = {"median_s": 0.001, "samples_s": [0.001, 0.001, 0.001]}
            self.measured.append((commit, cell.cell_id))
            yield cell, {**observation, "machine": self.fingerprint, "node_id": None}

    def run_fields(self, node_id) -> dict:
        return {}

    def close(self) -> None:
        pass


@pytest.fixture
def night(monkeypatch):
    """``nightly.measure_commits`` of HEAD~3..HEAD with ``Night`` for each commit's worker (its code imports): (statuses, measured, call)."""
    statuses, measured = {}, []
    monkeypatch.setattr(nightly, "cannot_import", lambda root, env: None)
    monkeypatch.setattr(runner, "other_cores_now", lambda: 0.0)  # no load sampled: a quiet machine's run, at once
    monkeypatch.setattr(nightly, "LocalExecutor", lambda plugins, *, code_root, env, fingerprint: Night(statuses, measured, fingerprint))

    def call(repo, out, **options):
        return nightly.measure_commits(repo, str(repo / "scenarios" / "tiny.yaml"), "HEAD~3..HEAD", out, progress=False, say=lambda line: None, **options)

    return statuses, measured, call


# item 1: every revision through one door


#: Each command that takes a revision or a range: its arguments around REV (a revision git would read as an option).
TAKING_REVISIONS = {
    "run --commits REV..HEAD": ["run", "tiny", "--commits=REV..HEAD"],
    "run --commits HEAD~1..REV --dry-run": ["run", "tiny", "--commits=HEAD~1..REV", "--dry-run"],
    "regress --base": ["regress", "--base=REV"],
    "regress --head": ["regress", "--base", "HEAD", "--head=REV"],
    "bisect --good": ["bisect", "--good=REV", "--bad", "HEAD"],
    "bisect --bad": ["bisect", "--good", "HEAD~1", "--bad=REV"],
    "kernels --compare": ["kernels", "--compare=REV"],
}


@pytest.mark.parametrize("command", TAKING_REVISIONS)
def test_a_revision_git_would_read_as_an_option_is_one_line_naming_the_option(repo, tmp_path, monkeypatch, command):
    path, _ = repo
    file = tmp_path / "truncated"
    file.write_text("kept\n")
    monkeypatch.chdir(path)  # the repository of each command (kernels --compare takes the one here)
    args = [arg.replace("REV", f"--output={file}") for arg in TAKING_REVISIONS[command]]
    done = attnbench_here(*args, *([] if command.startswith("kernels") else ["--out", str(tmp_path / "out")]))
    assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
    (line,) = done.stderr.splitlines()
    option = command.split()[1] if not command.startswith("run") else "--commits"
    assert option in line and f"'--output={file}' is not a revision of the repository at {path}" in line, line
    assert "usage" not in line and file.read_text() == "kept\n" and not (tmp_path / "out").exists()


@pytest.mark.parametrize("spec", ["HEAD~1\n--output=x..HEAD", "HEAD~1..HEAD\n--all", "\n"])
def test_a_range_of_several_lines_is_one_line(repo, tmp_path, spec):
    path, _ = repo
    done = attnbench_here("run", "tiny", f"--commits={spec}", "--dry-run", "--repo", str(path), "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1 and f"--commits {spec!r}: " in done.stderr, done.stderr


@pytest.mark.parametrize("revision", ["-h", "--all", "--output=x", "", "HEAD --all", "nope"])
def test_the_one_door_names_the_option_and_the_value(repo, revision):
    path, hashes = repo
    with pytest.raises(RegressError, match=f"^--base: {revision!r} is not a revision of the repository at "):
        commit_of(path, revision, "--base")
    with pytest.raises(HistoryError, match=f"^--since: {revision!r} is not a revision"):
        resolve(path, revision)
    assert commit_of(path, "HEAD~3", "--base") == hashes[0] and resolve(path, "HEAD") == hashes[-1]


# item 3: keyed by what was measured; --force under the lock; failures of the moment; --retry-failed


def test_a_changed_scenario_measures_its_cells_and_keeps_the_old_files(repo, tmp_path, night):
    path, hashes = repo
    statuses, measured, call = night
    out = tmp_path / "out"
    call(path, out)
    old = {file: file.read_bytes() for file in out.glob("*.jsonl")}
    assert len(old) == 3 and len(measured) == 3
    (path / "scenarios" / "tiny.yaml").write_text(GROWN)
    runs = call(path, out)  # before issue 55: '--resume: ... measured for another scenario', exit 2, every night
    assert [run.outcome for run in runs] == ["measured"] * 3 and len(measured) == 3 + 6
    assert {file: file.read_bytes() for file in old} == old and len(list(out.glob("*.jsonl"))) == 6
    assert [run.outcome for run in call(path, out)] == ["skipped"] * 3  # both versions measured: nothing left


def test_force_appends_to_its_own_files_under_the_lock(repo, tmp_path, night):
    path, _ = repo
    statuses, measured, call = night
    out = tmp_path / "out"
    call(path, out)
    call(path, out, overrides=["measure.repeats=7"])
    files = {file: file.read_bytes() for file in out.glob("*.jsonl")}
    assert len(files) == 6
    with ResultsDirectoryLock(out, {"pid": 0, "scenario": "another run"}), pytest.raises(LockedError):
        call(path, out, force=True)
    assert {file: file.read_bytes() for file in out.glob("*.jsonl")} == files  # before issue 55: deleted before the lock
    call(path, out, force=True)
    changed = {file for file, data in files.items() if file.read_bytes() != data}
    assert len(changed) == 3 and all(file.read_bytes().startswith(files[file]) for file in changed)  # appended, nothing removed
    assert all(read_records(file)[0]["overrides"] == [] for file in changed)  # the --set run's files are untouched
    assert len(measured) == 3 + 3 + 3


def test_a_failure_of_the_moment_is_measured_again_next_night(repo, tmp_path, night):
    path, hashes = repo
    statuses, measured, call = night
    out = tmp_path / "out"
    (cell,) = load_scenario(str(path / "scenarios" / "tiny.yaml")).cells()
    cell_id = cell.cell_id
    statuses[(hashes[1], cell_id)] = ("crashed", "the worker process died: killed by signal SIGKILL")
    statuses[(hashes[2], cell_id)] = ("error", "timed out after 60 s (cell stopped; measure.timeout_s)")
    statuses[(hashes[3], cell_id)] = ("error", "RuntimeError: the variant's own bug")
    call(path, out)
    for night_number in range(2, nightly.PASSING_TRIES + 2):
        measured.clear()
        call(path, out)  # before issue 55: nothing again, the crash and the timeout counted as measured forever
        again = [commit for commit, _ in measured]
        assert again == (hashes[1:3] if night_number <= nightly.PASSING_TRIES else []), night_number
    measured.clear()
    runs = call(path, out, retry_failed=True)
    assert [commit for commit, _ in measured] == hashes[1:] and [run.outcome for run in runs] == ["measured"] * 3
    statuses.clear()
    call(path, out, retry_failed=True)
    measured.clear()
    assert [run.outcome for run in call(path, out, retry_failed=True)] == ["skipped"] * 3 and measured == []


@pytest.mark.parametrize("passing, record", [
    (True, {"status": "crashed", "error": "the worker process died: killed by signal SIGSEGV"}),
    (True, {"status": "oom", "error": "the worker was killed by the out-of-memory killer (exit code -9)"}),
    (True, {"status": "error", "error": "timed out after 600 s (cell stopped; measure.timeout_s)"}),
    (False, {"status": "oom", "error": "CUDA out of memory. Tried to allocate 2.00 GiB"}),
    (False, {"status": "error", "error": "this commit cannot run the scenario: No module named 'variants'"}),
    (False, {"status": "nan", "error": None}),
    (False, {"status": "ok", "error": None}),
])  # fmt: skip
def test_which_failures_pass(passing, record):
    assert nightly.passing_failure(record) is passing


def test_retry_failed_takes_a_range(repo, tmp_path):
    path, _ = repo
    done = attnbench_here("run", "tiny", "--commits", "HEAD~1..HEAD", "--retry-failed", "--dry-run", "--repo", str(path), "--out", str(tmp_path / "out"))
    assert done.returncode == 0 and "1 commit of HEAD~1..HEAD, 1 to measure" in done.stdout, done.stdout + done.stderr
    refused = attnbench_here("run", "tiny", "--retry-failed", "--dry-run")
    assert refused.returncode == 2 and "use it with --resume or --commits" in refused.stderr


# item 5: a dirty run is no commit's measurement; --every anchored


@pytest.mark.parametrize("dirty", [True, False])
def test_a_dirty_run_does_not_stand_in_for_its_commit(repo, tmp_path, dirty):
    """A plain ``attnbench run`` of the same scenario file at HEAD, recorded as HEAD: only a clean one counts."""
    path, hashes = repo
    out = tmp_path / "out"
    chosen = nightly.commit_range(path, str(path / "scenarios" / "tiny.yaml"), "HEAD~1..HEAD", out)
    fingerprint = {**chosen.here, "git": {"commit": hashes[-1], "dirty": dirty, "describe": hashes[-1][:7]}}
    with ResultsWriter(out / "tiny-20261206T080000Z.jsonl") as writer:
        writer.write_run(run_header(chosen.loaded, "plain", "attnbench run scenarios/tiny.yaml", fingerprint))
        for cell in chosen.loaded.cells():
            writer.write_cell(cell_record(cell, unmeasured("skipped", "recorded by the test"), "plain", fingerprint))
    again = nightly.commit_range(path, str(path / "scenarios" / "tiny.yaml"), "HEAD~1..HEAD", out)
    assert again.done == (set() if dirty else {hashes[-1]})  # before issue 55: the dirty run made HEAD measured


def test_every_is_a_grid_anchored_at_the_root(tmp_path):
    path = tmp_path / "repo"
    path.mkdir()
    git(path, "init", "-q")
    for number in range(12):
        git(path, "commit", "-q", "--allow-empty", "-m", f"commit {number}")
    hashes = git(path, "rev-list", "--reverse", "HEAD").split()  # hashes[k]: k commits from the root
    grid = {hashes[k] for k in range(0, 12, 3)}
    tonight = nightly.range_commits(path, "HEAD~6..HEAD", every=3)
    assert tonight == [hashes[6], hashes[9], hashes[11]]  # on the grid, and the newest
    git(path, "commit", "-q", "--allow-empty", "-m", "a new commit")
    tomorrow = nightly.range_commits(path, "HEAD~7..HEAD", every=3)  # before issue 55: the grid moved by one
    assert set(tomorrow[:-1]) <= grid and set(tonight[:-1]) <= set(tomorrow) and tomorrow[-1] == git(path, "rev-parse", "HEAD")
    assert nightly.range_commits(path, f"{hashes[0]}..HEAD", every=3)[:-1] == [hashes[3], hashes[6], hashes[9]]

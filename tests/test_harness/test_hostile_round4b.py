"""Issue 55, a hostile user's pass over what landed on its morning: ``run --commits`` over odd ranges and hand-edited
results, ``check``/``list`` with hostile plugins, ``--dry-run`` estimates learning from a results directory of garbage,
and commits read from results files reaching git. The commits are measured by ``test_commits_round4``'s fake
executor: no worker starts."""

from __future__ import annotations

import json

import pytest
import test_commits_round4 as round4
from helpers import attnbench_here, git

from harness.revisions import commits as nightly
from harness.running.runner import RunError

TINY = round4.TINY
#: The import check as the night fixture finds it.
CANNOT_IMPORT = nightly.cannot_import
repo, night = round4.repo, round4.night  # its fixtures: a repository of four commits, a night measured by a fake executor


def call_range(call, path, out, **options):
    return [run.outcome for run in call(path, out, **options)]


def newest_file(call, path, hashes, out):
    """A night measured into ``out``: the results file of the range's newest commit."""
    call(path, out)
    (file,) = [f for f in out.glob("*.jsonl") if hashes[-1][:12] in f.name]
    return file


# run --commits: results files edited by hand


def test_a_keyed_file_edited_to_another_preset_is_one_line_naming_file_and_field(repo, tmp_path, night):
    """Held: the file is not the nightly's to overwrite; the run stops at that commit, naming it."""
    path, hashes = repo
    _, measured, call = night
    out = tmp_path / "out"
    file = newest_file(call, path, hashes, out)
    lines = file.read_text().splitlines()
    header = json.loads(lines[0])
    header["preset"] = "edited"
    file.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    with pytest.raises(RunError, match=f"^--resume: {file} was measured for another scenario: preset 'edited' \\(this run: None\\)"):
        call(path, out)


def test_a_truncated_last_line_does_not_stop_the_nightly(repo, tmp_path, night):
    path, hashes = repo
    _, measured, call = night
    out = tmp_path / "out"
    file = newest_file(call, path, hashes, out)
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 20])
    measured.clear()
    outcomes = call_range(call, path, out)
    assert outcomes == ["skipped", "skipped", "measured"], outcomes


def test_a_cell_of_another_scenario_pasted_in_counts_for_nothing(repo, tmp_path, night):
    """Held: a cell record of another cell (another scenario's) under the run's id is no cell of this scenario."""
    path, hashes = repo
    _, measured, call = night
    out = tmp_path / "out"
    file = newest_file(call, path, hashes, out)
    lines = file.read_text().splitlines()
    cell = json.loads(lines[-1])
    file.write_text("\n".join([lines[0], json.dumps({**cell, "cell_id": "another-scenario-cell"})]) + "\n")
    measured.clear()
    assert call_range(call, path, out) == ["skipped", "skipped", "measured"] and len(measured) == 1


@pytest.mark.parametrize(
    "first, then, again",
    [
        (["measure.repeats=7", "measure.warmup=2"], ["measure.warmup=2", "measure.repeats=7"], False),  # the same scenario: nothing to measure
        (["measure.repeats=7", "measure.repeats=9"], ["measure.repeats=9", "measure.repeats=7"], True),  # the last one counts: another scenario
        (["seq_len=[16]", "axes.seq_len=[32]"], ["axes.seq_len=[32]", "seq_len=[16]"], True),  # one field under two names
        (["measure.repeats=7"], ["measure.repeats=7", "measure.warmup=2"], True),
    ],
)
def test_the_order_of_set_overrides_counts_only_where_it_changes_the_scenario(repo, tmp_path, night, first, then, again):
    """Before, a nightly whose --set options were written in another order measured every commit of its range again."""
    path, _ = repo
    _, measured, call = night
    out = tmp_path / "out"
    call(path, out, overrides=first)
    measured.clear()
    assert call_range(call, path, out, overrides=then) == (["measured"] * 3 if again else ["skipped"] * 3)
    assert len(list(out.glob("*.jsonl"))) == (6 if again else 3)


@pytest.mark.parametrize("commits", [[], ["--commits", "HEAD~1..HEAD"]])
def test_a_scenario_name_of_several_lines_is_one_line(repo, tmp_path, commits):
    """Before, the name went into the error as it was: two lines (and with --commits the temporary worktree's path)."""
    path, _ = repo
    done = attnbench_here("run", "tiny\nsecond line", *commits, "--dry-run", "--repo", str(path), "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1 and '"tiny\\nsecond line"' in done.stderr, done.stderr
    assert "attnbench-regress-" not in done.stderr and not (tmp_path / "out").exists()


def test_a_scenario_the_newest_commit_lacks_is_named_with_the_commit(repo, tmp_path):
    """Before: '/tmp/attnbench-regress-…/scenario/scenarios/nope.yaml: no such scenario file', a path removed as it was printed."""
    path, hashes = repo
    done = attnbench_here("run", "nope", "--commits", "HEAD~1..HEAD", "--dry-run", "--repo", str(path), "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and "attnbench-regress-" not in done.stderr, done.stderr
    assert (
        done.stderr == f"error: --commits HEAD~1..HEAD: nope: no such scenario file here, nor in scenarios/ at {hashes[-1][:10]}, the range's newest commit\n"
    )


# run --commits: odd ranges


def test_a_range_over_merges_measures_the_first_parent_line(tmp_path):
    path = tmp_path / "repo"
    path.mkdir()
    git(path, "init", "-q", "-b", "main")
    git(path, "commit", "-q", "--allow-empty", "-m", "root")
    git(path, "checkout", "-q", "-b", "side")
    for number in range(3):
        git(path, "commit", "-q", "--allow-empty", "-m", f"side {number}")
    git(path, "checkout", "-q", "main")
    git(path, "commit", "-q", "--allow-empty", "-m", "main 1")
    git(path, "merge", "-q", "--no-ff", "-m", "merge side", "side")
    main = git(path, "rev-list", "--first-parent", "--reverse", "HEAD").split()
    assert nightly.range_commits(path, "HEAD~2..HEAD") == main[1:]
    assert nightly.range_commits(path, "HEAD~2..HEAD", every=2) == [main[2]]


def test_another_root_anchors_its_own_grid(tmp_path):
    """Held: a history joined from two roots (an orphan branch merged) counts first-parent distance from HEAD's root."""
    path = tmp_path / "repo"
    path.mkdir()
    git(path, "init", "-q", "-b", "main")
    for number in range(4):
        git(path, "commit", "-q", "--allow-empty", "-m", f"main {number}")
    git(path, "checkout", "-q", "--orphan", "other")
    git(path, "commit", "-q", "--allow-empty", "-m", "other root")
    git(path, "checkout", "-q", "main")
    git(path, "merge", "-q", "--allow-unrelated-histories", "-m", "join", "other")
    main = git(path, "rev-list", "--first-parent", "--reverse", "HEAD").split()
    assert nightly.range_commits(path, f"{main[0]}..HEAD", every=2) == [main[2], main[4]]


def test_every_in_a_shallow_clone_is_refused(tmp_path):
    """A shallow clone (CI's checkout of the last N commits) has no root: the grid would be anchored at its shallow
    boundary, which moves with each new commit, so every night would measure other commits."""
    origin = tmp_path / "origin"
    origin.mkdir()
    git(origin, "init", "-q")
    for number in range(8):
        git(origin, "commit", "-q", "--allow-empty", "-m", f"commit {number}")
    shallow = tmp_path / "shallow"
    git(tmp_path, "clone", "-q", "--depth", "4", f"file://{origin}", str(shallow))
    with pytest.raises(nightly.RegressError, match=f"--every 2 counts commits from the root commit, and the repository at {shallow} is a shallow clone"):
        nightly.range_commits(shallow, "HEAD~3..HEAD", every=2)
    assert len(nightly.range_commits(shallow, "HEAD~3..HEAD")) == 3  # every commit: no grid to anchor


# run --dry-run: estimates that learn from the results in --out


def _measured_file(tmp_path, metrics: dict, *, name="tiny-20261206T080000Z.jsonl", machine_id=None):
    """``tmp_path/tiny.yaml`` (``TINY``) and, in ``tmp_path/out/name``, a run of it on this machine (or ``machine_id``)
    whose one cell is ok with ``metrics``; the scenario file's path."""
    from harness.measuring import machine
    from harness.results import ResultsWriter, cell_record, run_header
    from harness.running.executors import main_device, unmeasured
    from harness.scenarios.scenario import load_scenario

    spec = tmp_path / "tiny.yaml"
    spec.write_text(TINY)
    loaded = load_scenario(str(spec))
    here = machine.fingerprint(main_device(loaded.cells()))
    fingerprint = {**here, "machine_id": machine_id or here["machine_id"]}
    (tmp_path / "out").mkdir(exist_ok=True)
    with ResultsWriter(tmp_path / "out" / name) as writer:
        writer.write_run(run_header(loaded, "measured", "attnbench run tiny.yaml", fingerprint))
        for cell in loaded.cells():
            observation = unmeasured("ok", None)
            observation["result"]["metrics"] = {"median_s": 0.001, "samples_s": [0.001] * 3, "flops": 1e6}
            record = cell_record(cell, observation, "measured", fingerprint)
            writer.write_cell({**record, "metrics": {**record["metrics"], **metrics}})
    return spec


def _dry_run(tmp_path, spec):
    return attnbench_here("run", str(spec), "--dry-run", "--out", str(tmp_path / "out"))


BAD_NUMBERS = [{"median_s": float("inf")}, {"median_s": float("nan")}, {"median_s": -1.0}, {"flops": float("nan")}, {"flops": float("inf")}, {"flops": -1.0}]


@pytest.mark.parametrize("metrics", [{}, *BAD_NUMBERS])
def test_a_measured_cell_of_no_positive_finite_time_is_not_learned_from(tmp_path, metrics):
    """The reader takes NaN and ±inf (metrics store them): a cell whose time or FLOPs are not a positive finite number
    says nothing of how long a cell takes; before, --dry-run ended in '(an attnbench bug?)' (OverflowError, ValueError)."""
    done = _dry_run(tmp_path, _measured_file(tmp_path, metrics))
    assert done.returncode == 0 and done.stderr == "", done.stderr
    learned = "calls of 1 cell from the nearest measured cells of" in done.stdout and "(measured)" in done.stdout
    assert learned == (not metrics) and (learned or "1 cell from the model" in done.stdout), done.stdout


def test_a_garbage_results_file_is_passed_over_with_one_line(tmp_path):
    """Held: a file of garbage named as the scenario's results: the estimates come from the model, the line says why."""
    spec = _measured_file(tmp_path, {})
    (tmp_path / "out" / "tiny-20261206T090000Z.jsonl").write_bytes(b"\x00garbage\n")
    done = _dry_run(tmp_path, spec)
    assert done.returncode == 0 and "1 cell from the model" in done.stdout, done.stdout + done.stderr
    assert f"measured cells in {tmp_path / 'out'} not used: {tmp_path / 'out' / 'tiny-20261206T090000Z.jsonl'}, line 1" in done.stdout.splitlines()[-1]


def test_another_machines_results_are_not_learned_from(tmp_path):
    """Held: the cells of another machine's run in --out."""
    done = _dry_run(tmp_path, _measured_file(tmp_path, {}, machine_id="another-machine"))
    assert done.returncode == 0 and "no measured cells to learn from" in done.stdout, done.stdout + done.stderr


# check, list and demo with hostile plugins

#: A plugin of softmax copies, each with one form returning what a form must not.
WRONG_FORMS = """
import torch
import variants
from variants.softmax import Softmax


def planted(name, method, change):
    class Wrong(Softmax):
        pass

    def form(self, *args, **kwargs):
        return change(getattr(Softmax, method)(self, *args, **kwargs))

    setattr(Wrong, method, form)
    variants.register(name)(Wrong)


planted("hostile4b_short", "_parallel", lambda y: y[..., :-1, :])
planted("hostile4b_tuple", "_parallel", lambda y: (y, y))
planted("hostile4b_none", "_parallel", lambda y: None)
planted("hostile4b_step_wide", "_step", lambda out: (torch.cat([out[0], out[0]], -1), out[1]))
"""


@pytest.fixture
def wrong_forms(tmp_path, monkeypatch):
    """``WRONG_FORMS`` imported into a copy of the registry (demo, in another test, runs every registered variant)."""
    from harness.scenarios.plugins import load_plugins
    from variants import base

    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    plugin = tmp_path / "wrong_forms.py"
    plugin.write_text(WRONG_FORMS)
    load_plugins([str(plugin)])


@pytest.mark.parametrize(
    "variant, form, got",
    [
        ("hostile4b_short", "prefill", "(2, 2, 16, 6) torch.float64"),
        ("hostile4b_tuple", "prefill", "tuple"),
        ("hostile4b_none", "prefill", "NoneType"),
        ("hostile4b_step_wide", "step", "(2, 2, 12) torch.float64"),
    ],
)
def test_a_form_returning_the_wrong_thing_fails_its_check(wrong_forms, variant, form, got):
    """Before, the padded batch's check indexed what the form returned: '(an attnbench bug?)', exit 2, no FAIL line."""
    import torch

    from variants.checking import check_variant

    report = check_variant(variant, dtypes=(torch.float64,))
    (padded,) = [check for check in report.checks if "padded" in check.what]
    assert padded.cause is not None and padded.cause.startswith(f"{form}: expected a torch.float64 tensor of shape ") and padded.cause.endswith(f", got {got}")


@pytest.mark.parametrize("code", ["0", "1", "'bye'"])
@pytest.mark.parametrize("command", [["check", "softmax"], ["list"], ["demo"]])
def test_a_plugin_that_exits_at_import_is_a_plugin_error(tmp_path, command, code):
    """Before, ``sys.exit(0)`` in a plugin ended ``attnbench check`` with exit 0 and no word: a CI job passed."""
    plugin = tmp_path / "exits.py"
    plugin.write_text(f"import sys\n\nsys.exit({code})\n")
    done = attnbench_here(*command, "--plugin", str(plugin))
    assert done.returncode == 2 and done.stdout == "", done.stdout
    assert done.stderr == f"error: plugin {plugin}, line 3: SystemExit: {code.strip(chr(39))}\n"


@pytest.mark.parametrize(
    "source, error",
    [
        ("raise RuntimeError('boom')\n", "line 1: RuntimeError: boom"),
        (
            "import variants\nfrom variants.softmax import Softmax\nvariants.register('softmax')(Softmax)\n",
            "line 3: VariantError: variant 'softmax' is registered twice",
        ),
        ("def broken(:\n", "line 1: SyntaxError: "),
    ],
)
def test_a_plugin_that_fails_at_import_is_one_line(tmp_path, source, error):
    """Held: raising, registering a shipped variant's name, a syntax error: one line naming the plugin and its line."""
    plugin = tmp_path / "fails.py"
    plugin.write_text(source)
    done = attnbench_here("list", "--plugin", str(plugin))
    assert done.returncode == 2 and done.stderr.startswith(f"error: plugin {plugin}, {error}") and len(done.stderr.splitlines()) == 1, done.stderr


# history: a commit read from a results file reaches git only as a commit


@pytest.mark.parametrize("commit", ["--output=OUT", "-h", "--all"])
def test_a_results_files_commit_never_reaches_git_as_an_option(repo, tmp_path, monkeypatch, commit):
    import subprocess

    from harness.history import series

    path, hashes = repo
    commit = commit.replace("OUT", str(tmp_path / "written"))
    calls, run = [], subprocess.run
    monkeypatch.setattr(subprocess, "run", lambda args, *rest, **options: calls.append(list(args)) or run(args, *rest, **options))
    assert series.is_ancestor(path, commit, hashes[-1]) is False
    assert not [args for args in calls if commit in args], calls
    assert not (tmp_path / "written").exists()


@pytest.mark.parametrize("name", ["bad\nname", "../evil", "-h", "", "two words"])
def test_a_variant_name_that_is_not_one_word_is_refused_at_registration(tmp_path, monkeypatch, name):
    """Before, any string was registered: ``attnbench list`` printed a name of two lines, ``-h`` or nothing at all."""
    from variants import base

    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    plugin = tmp_path / "weird.py"
    plugin.write_text(f"import variants\nfrom variants.softmax import Softmax\n\nvariants.register({name!r})(type('Weird', (Softmax,), {{}}))\n")
    done = attnbench_here("list", "--plugin", str(plugin))
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith(f"error: plugin {plugin}, line 4: VariantError: variant name {name!r}: expected letters, digits"), done.stderr


@pytest.mark.parametrize("plugin", ["a\nb.py", "no\nsuch.module"])
def test_a_plugin_named_over_two_lines_is_one_line(plugin):
    done = attnbench_here("list", "--plugin", plugin)
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1 and done.stderr.startswith(f"error: plugin {json.dumps(plugin)}"), done.stderr


def test_a_second_nightly_at_once_stops_at_the_lock_and_leaves_no_worktree(repo, tmp_path, night):
    """Held: the other night's lock is met at the first commit to measure: LockedError (one line, exit 2), the
    results as they were and no worktree left registered in the repository."""
    from harness.results.locking import LockedError, ResultsDirectoryLock

    path, _ = repo
    _, measured, call = night
    out = tmp_path / "out"
    out.mkdir()
    with ResultsDirectoryLock(out, {"pid": 0, "scenario": "the other nightly"}), pytest.raises(LockedError):
        call(path, out)
    assert measured == [] and list(out.glob("*.jsonl")) == []
    assert len(git(path, "worktree", "list", "--porcelain").split("\n\n")) == 1


@pytest.mark.parametrize("options, error", [(["--preset", "none"], "presets.none: no such preset"), (["--set", "measure.repeats=-1"], "measure.repeats")])
def test_a_mistake_in_the_newest_commits_scenario_is_named_by_its_commit(repo, tmp_path, options, error):
    """Before, the error named the scenario by the temporary worktree's path, removed as it was printed."""
    path, hashes = repo
    done = attnbench_here("run", "tiny", "--commits", "HEAD~1..HEAD", *options, "--dry-run", "--repo", str(path), "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1 and "attnbench-regress-" not in done.stderr, done.stderr
    assert done.stderr.startswith(f"error: --commits HEAD~1..HEAD: scenarios/tiny.yaml at {hashes[-1][:10]}: ") and error in done.stderr, done.stderr


def test_a_huge_results_file_is_passed_over_unread(tmp_path):
    """Before, --dry-run read a 2 GB file named as the scenario's results whole (2.3 GB of memory, 9 s) to learn nothing."""
    import os

    from harness.running import planning

    spec = _measured_file(tmp_path, {})
    huge = tmp_path / "out" / "tiny-20261206T090000Z.jsonl"
    huge.touch()
    os.truncate(huge, planning.LEARN_MAX_BYTES + 1)  # sparse: no disk used
    done = _dry_run(tmp_path, spec)
    assert done.returncode == 0 and "calls of 1 cell from the nearest measured cells of" in done.stdout, done.stdout + done.stderr
    assert (
        done.stdout.splitlines()[-1]
        == f"measured cells in {huge} not used: {planning.LEARN_MAX_BYTES + 1} bytes, more than the {planning.LEARN_MAX_BYTES} of a file to learn from"
    )


def test_an_import_check_that_timed_out_is_tried_again_next_night(repo, tmp_path, night, monkeypatch):
    """A commit's import stopped at IMPORT_CHECK_TIMEOUT_S (a hanging import, or a night's busy machine) is a failure of
    the moment as a cell's timeout is: tried PASSING_TRIES nights in all; before, the first night's stood forever."""
    import subprocess
    import sys

    path, _ = repo
    _, measured, call = night

    run = subprocess.run

    def stopped(args, **options):
        if args[0] != sys.executable:  # git
            return run(args, **options)
        raise subprocess.TimeoutExpired(args, options["timeout"])

    monkeypatch.setattr(nightly, "cannot_import", CANNOT_IMPORT)  # the real import check (night() replaced it) ...
    monkeypatch.setattr(subprocess, "run", stopped)  # ... stopped at its timeout
    out = tmp_path / "out"
    nights = [call_range(call, path, out) for _ in range(nightly.PASSING_TRIES + 1)]
    assert nights == [["cannot run"] * 3] * nightly.PASSING_TRIES + [["skipped"] * 3], nights


def test_demo_names_a_form_that_returns_the_wrong_thing_and_goes_on(wrong_forms, monkeypatch):
    """Before, the first such form ended the demo in '(an attnbench bug?)', exit 2, and no variant after it was shown."""
    from variants import base

    monkeypatch.setattr(base, "_REGISTRY", {name: made for name, made in base._REGISTRY.items() if name.startswith(("hostile4b_", "softmax"))})
    done = attnbench_here("demo", "--batch", "1", "--heads", "1", "--seq-len", "8", "--d-key", "4", "--repeats", "1")
    assert done.returncode == 1 and done.stderr == "", done.stderr
    lines = done.stdout.splitlines()
    assert "FAIL  hostile4b_none parallel: returned NoneType, not a tensor of shape (1, 1, 8, 4) (attnbench check hostile4b_none tells more)" in lines
    assert "FAIL  hostile4b_short parallel: returned a tensor of shape (1, 1, 7, 4), not a tensor of shape (1, 1, 8, 4)" in done.stdout
    shown = {line.split()[0] for line in lines[2:] if not line.startswith(("FAIL", "max_abs_err"))}
    assert shown == {"hostile4b_none", "hostile4b_short", "hostile4b_step_wide", "hostile4b_tuple", "softmax"}, lines  # the forms that work, all ran


def test_force_on_a_file_with_a_truncated_last_line_leaves_it_readable(repo, tmp_path, night):
    from harness.results import read_records

    path, hashes = repo
    _, measured, call = night
    out = tmp_path / "out"
    file = newest_file(call, path, hashes, out)
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 20])
    call(path, out, force=True)
    records = read_records(file)
    assert [record["kind"] for record in records] == ["run", "run", "cell"], records


def test_a_commit_that_cannot_run_again_leaves_its_file_readable(repo, tmp_path, night, monkeypatch):
    """Its failure is appended to its file as a run's is: an incomplete last line cut first."""
    from harness.results import read_records

    path, hashes = repo
    _, _, call = night
    monkeypatch.setattr(nightly, "cannot_import", lambda root, env: "No module named 'variants'")
    out = tmp_path / "out"
    file = newest_file(call, path, hashes, out)
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 20])
    assert call_range(call, path, out, retry_failed=True) == ["cannot run"] * 3
    assert [record["kind"] for record in read_records(file)] == ["run", "run", "cell"]

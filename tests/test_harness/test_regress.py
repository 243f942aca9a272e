"""``attnbench regress`` end to end on a temporary git repository made from this project.

The repository's history (built once per module from ``git archive HEAD``):

    plain    this project as committed
    slow     + 50 ms of ``time.sleep`` in every call of the sum rule's parallel form (linear)
    readme   + a README change only
    wrong    + a sign flipped in the chunked sum rule (linear's torch form is wrong)

The slowed variant's time is then dominated by a sleep of known length, so the verdicts do
not depend on how busy the shared machine is (its µs-scale compute can differ several-fold
between two processes). That ``slow`` is flagged while ``plain`` is its base also shows each
side ran its own revision's code: had both imported one checkout, both would be equally fast
or equally slow.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from helpers import commit, edit, make_cell, project_repository
from helpers import git as _git

import variants
from harness.cli import main
from harness.common.checkouts import Revision, changed_files, worktrees
from harness.results import read_records
from harness.results.compare import EXIT_OK, EXIT_REGRESSION
from harness.revisions import regress as regress_module
from harness.revisions.regress import check_revision, measure_rounds, pool, regress
from harness.scenarios.scenario import load_scenario

SLEEP = "            import time\n            time.sleep(0.05)  # injected by tests/test_harness/test_regress.py\n"


@pytest.fixture(scope="module")
def history(tmp_path_factory):
    """The repository and the commit of each step of its history."""
    repo = tmp_path_factory.mktemp("regress") / "repo"
    commits = {"plain": project_repository(repo)}
    scan = "            scan = sum_rule_parallel\n"  # in SumRule's causal _run (the torch form), not its Triton form's
    edit(repo, "variants/sum_rule.py", scan, SLEEP + scan)
    commits["slow"] = commit(repo, "slow linear")
    (repo / "README.md").write_text((repo / "README.md").read_text() + "\nA line of prose.\n")
    commits["readme"] = commit(repo, "README only")
    right = "read = (features_q.to(wide) @ weights).add_(causal_read(scores.matmul, values))"
    edit(repo, "variants/chunked.py", right, "read = (features_q.to(wide) @ weights).sub_(causal_read(scores.matmul, values))")
    commits["wrong"] = commit(repo, "wrong sign")
    return repo, commits


def _scenario(tmp_path: Path, variants: str):
    path = tmp_path / "tiny.yaml"
    path.write_text(
        f"name: tiny\nvariants: {variants}\naxes: {{seq_len: 16, batch: 1, heads: 1, d_key: 8}}\n"
        # Exactly ``repeats`` samples (target_rel_ci: null): a µs-scale base side on a busy machine
        # would otherwise be measured unstable, and compare does not judge an unstable side (exit 2).
        "modes: [forward]\nmeasure: {warmup: 1, repeats: 5, target_rel_ci: null, timeout_s: 60}\n"
    )
    return load_scenario(str(path))


def _cells(path: Path) -> list[dict]:
    return [record for record in read_records(path) if record["kind"] == "cell"]


@pytest.mark.slow
@pytest.mark.serial  # compares timings
def test_a_slowed_variant_is_flagged_worse_and_only_touched_variants_are_measured(history, tmp_path):
    repo, commits = history
    said = []
    result = regress(
        repo,
        _scenario(tmp_path, "{linear: {}, softmax: {}}"),
        base=commits["plain"],
        head=commits["slow"],
        rounds=2,
        out_dir=tmp_path / "out",
        progress=False,
        say=said.append,
    )
    assert result.changed == ["variants/sum_rule.py"]
    assert result.exit_code == EXIT_REGRESSION
    table = result.comparison.table
    assert set(table["variant"]) == {"linear"}, "softmax does not run sum_rule.py and must not be measured"
    (row,) = table.to_dict("records")
    assert row["mark"] == "worse", result.comparison.format_table()
    for side in ("base", "head"):
        (cell,) = _cells(result.paths[side])
        assert cell["commit"] == commits["plain" if side == "base" else "slow"] and cell["revision"] == side
        rounds = cell["metrics"]["round_samples_s"]
        assert len(rounds) == 2 and all(len(samples) >= 5 for samples in rounds), "measure.repeats is the minimum of each round"
        assert len(cell["metrics"]["samples_s"]) == sum(map(len, rounds)) and len(cell["metrics"]["round_medians_s"]) == 2
    assert len(_git(repo, "worktree", "list").splitlines()) == 1, "a temporary git worktree was not removed"


@pytest.mark.slow
@pytest.mark.serial  # compares timings
def test_an_unchanged_head_is_not_flagged(history, tmp_path, capsys):
    repo, commits = history
    scenario = tmp_path / "tiny.yaml"
    _scenario(tmp_path, "{linear: {}}")
    code = main(["regress", str(scenario), "--repo", str(repo), "--base", commits["slow"], "--head", commits["readme"], "--no-progress"])
    printed = capsys.readouterr().out
    assert code == EXIT_OK
    assert "changed files: README.md" in printed and "nothing to check or measure" in printed
    # Measured anyway: the same code on both sides (50 ms sleeps dominate) is not flagged.
    result = regress(
        repo,
        load_scenario(str(scenario)),
        base=commits["slow"],
        head=commits["readme"],
        all_variants=True,
        rounds=1,
        out_dir=tmp_path / "out",
        progress=False,
        say=lambda line: None,
    )
    assert result.exit_code == EXIT_OK, result.comparison.format_table()
    assert list(result.comparison.table["variant"]) == ["linear"] and result.comparison.regressions.empty


@pytest.mark.slow
def test_a_wrong_variant_is_reported_incorrect_and_not_timed(history, tmp_path):
    repo, commits = history
    said = []
    result = regress(
        repo,
        _scenario(tmp_path, "{linear: {}}"),
        base=commits["readme"],
        head=commits["wrong"],
        rounds=1,
        out_dir=tmp_path / "out",
        progress=False,
        say=said.append,
    )
    assert result.exit_code == EXIT_REGRESSION
    (wrong,) = result.incorrect("head")
    assert (wrong["variant"], wrong["backend"]) == ("linear", "torch") and "forward: max |error|" in wrong["problems"][0]
    assert not result.incorrect("base")
    assert any(line.startswith("  INCORRECT on head: linear[torch]") for line in said), said
    (head_cell,) = _cells(result.paths["head"])
    assert head_cell["status"] == "error" and head_cell["error"].startswith("incorrect, not timed") and head_cell["metrics"] == {}
    (base_cell,) = _cells(result.paths["base"])
    assert base_cell["status"] == "ok"
    assert list(result.comparison.table["mark"]) == ["newly failing"]


@pytest.mark.slow
def test_a_kernel_file_change_is_diffed_statically_compiling_only_what_compiles_differently(tmp_path):
    """Issue 32 item 5 in regress: a diff that touches variants/kernels/ runs the static kernel diff. A change to
    no kernel's code (a docstring of identity.py) takes every rule, records each side's launches in a child of its
    own and compiles nothing: every row's key is the same. About 35 s on the busy 2-core VM (mostly the recording,
    both rules, 3 targets, a child a side)."""
    pytest.importorskip("triton")
    repo = tmp_path / "repo"
    base = project_repository(repo)
    edit(repo, "variants/kernels/identity.py", '"""Which Triton kernels', '"""(A docstring edited.) Which Triton kernels')
    head = commit(repo, "a docstring of a kernel file")
    said = []
    result = regress(repo, _scenario(tmp_path, "{softmax: {}}"), base=base, head=head, rounds=1, out_dir=tmp_path / "out", progress=False, say=said.append)
    (line,) = [line for line in said if line.startswith("kernels")]
    assert line.startswith("kernels (every rule on sm_70,sm_80,sm_90): the diff changes no compilation of the "), said
    assert result.kernel_changes == [] and result.exit_code == EXIT_OK and result.comparison is None


def test_the_working_tree_is_copied_with_its_uncommitted_changes(history):
    repo, commits = history
    (repo / "README.md").write_text("changed\n")
    (repo / "notes.txt").write_text("untracked\n")
    (repo / "scenarios/decode.yaml").unlink()
    try:
        with worktrees(repo, commits["plain"], None) as (base, head):
            assert head.commit == commits["wrong"] and head.dirty_files == 3
            assert head.describe() == f"working tree (dirty: 3 files changed) on {commits['wrong'][:10]}"
            assert (head.root / "README.md").read_text() == "changed\n" and (head.root / "notes.txt").exists()
            assert not (head.root / "scenarios/decode.yaml").exists() and (base.root / "scenarios/decode.yaml").exists()
            assert set(changed_files(base, head)) == {"README.md", "notes.txt", "scenarios/decode.yaml", "variants/sum_rule.py", "variants/chunked.py"}
            roots = (base.root, head.root)
    finally:
        _git(repo, "checkout", "--", ".")
        (repo / "notes.txt").unlink()
    assert not any(root.exists() for root in roots)
    assert len(_git(repo, "worktree", "list").splitlines()) == 1


def test_rounds_are_pooled_into_one_record():
    def record(samples, status="ok"):
        metrics = {"samples_s": samples, "median_s": sorted(samples)[len(samples) // 2], "tokens": 10, "tokens_per_s": 0.0, "peak_mem_bytes": len(samples)}
        return {"status": status, "error": None, "metrics": metrics, "duration_s": 1.0}

    pooled = pool([record([1.0, 2.0, 3.0]), record([4.0, 5.0])])
    assert pooled["metrics"]["samples_s"] == [1.0, 2.0, 3.0, 4.0, 5.0] and pooled["metrics"]["median_s"] == 3.0
    assert pooled["metrics"]["tokens_per_s"] == 10 / 3.0 and pooled["metrics"]["round_medians_s"] == [2.0, 5.0]
    assert pooled["metrics"]["peak_mem_bytes"] == 3 and pooled["duration_s"] == 2.0
    assert pool([record([1.0, 2.0]), record([3.0], status="error")])["status"] == "error"


def test_a_round_that_was_disturbed_leaves_the_pooled_cell_disturbed_and_unstable():
    """A round another process disturbed (``busyness.disturbed``) makes the pooled cell disturbed, and so unstable
    however tight its pooled interval: it is not compared (``next_steps``), as a disturbed cell of a run is not."""

    def record(disturbed):
        metrics = {"samples_s": [1.0, 1.0, 1.0], "median_s": 1.0, "tokens": 1, "target_rel_ci": 0.05, "unstable": False, "disturbed": disturbed}
        return {"status": "ok", "error": None, "metrics": metrics, "duration_s": 1.0}

    assert pool([record(False), record(True)])["metrics"].items() >= {"disturbed": True, "unstable": True}.items()
    assert pool([record(False), record(False)])["metrics"].items() >= {"disturbed": False, "unstable": False}.items()


def test_a_failed_cell_costs_its_worker_and_the_next_cell_gets_a_fresh_one(monkeypatch, tmp_path):
    """As in ``attnbench run`` (issue 36): after an ``error``, a ``nan`` or a ``crashed`` cell the
    revision's worker is replaced (a sticky CUDA error would fail every later cell in it); after
    ``ok`` or ``oom`` it is kept. Each side's round starts a worker of its own; the sides alternate."""
    from harness.running import worker as workers

    log, starts = [], []

    def start(self):
        self.measured, self.start_error, self.process = 0, None, None
        starts.append(self.code_root)

    def measure(self, cell, timeout_s):
        self.measured += 1
        log.append((self.code_root.name, cell.variant, len(starts)))
        return {"status": cell.variant, "error": None if cell.variant == "ok" else "injected", "metrics": {}}

    monkeypatch.setattr(workers.Worker, "_start", start)
    monkeypatch.setattr(workers.Worker, "measure", measure)
    monkeypatch.setattr(workers.Worker, "close", lambda self: None)
    statuses = ["ok", "error", "ok", "nan", "ok", "crashed", "ok", "oom", "ok"]
    cells = [make_cell(cell_id=f"{number}", variant=status, measure={"fresh_worker": None, "timeout_s": 60}) for number, status in enumerate(statuses)]
    revisions = [Revision(side, side, side * 10, tmp_path / side) for side in ("base", "head")]
    fingerprints = {side: {"machine_id": "m", "git": {"commit": side * 10, "dirty": False}} for side in ("base", "head")}
    measured = measure_rounds(revisions, {"base": cells, "head": cells}, 2, fingerprints, {"base": "b", "head": "h"}, progress=False)
    assert [[record["status"] for record in measured["base"][cell.cell_id]] for cell in cells] == [[status] * 2 for status in statuses]
    workers_of = [
        [start - first for _, _, start in log[first_cell : first_cell + len(statuses)]]
        for first_cell, first in zip(range(0, 4 * len(statuses), len(statuses)), (1, 5, 9, 13))
    ]
    # a new worker after the error, the nan and the crash; the same one after ok and oom
    assert workers_of == [[0, 0, 1, 1, 2, 2, 3, 3, 3]] * 4, log
    assert [side for side, _, _ in log[:: len(statuses)]] == ["base", "head", "head", "base"]


def test_each_revision_has_a_triton_cache_of_its_own_in_its_check_and_its_workers(history, monkeypatch, tmp_path):
    """Issue 32 item 4: a kernel compiled for one revision is never loaded for the other. Each side's
    ``TRITON_CACHE_DIR`` is its own, inside the run's scratch directory (removed with it), and reaches the
    check's process and the measuring workers (here a stand-in check script and worker report what they got)."""
    from harness.running import worker as workers

    repo, commits = history
    script = tmp_path / "check.py"
    script.write_text("import json, os, sys\nprint(json.dumps([{**c, 'ok': True, 'files': [os.environ['TRITON_CACHE_DIR']]} for c in json.load(sys.stdin)]))\n")
    monkeypatch.setattr(regress_module, "CHECK_SCRIPT", script)
    started = {}

    def start(self):
        self.measured, self.start_error, self.process = 0, None, None
        started[self.code_root] = self.env["TRITON_CACHE_DIR"]

    monkeypatch.setattr(workers.Worker, "_start", start)
    monkeypatch.setattr(workers.Worker, "measure", lambda self, cell, timeout_s: {"status": "ok", "error": None, "metrics": {}})
    monkeypatch.setattr(workers.Worker, "close", lambda self: None)
    cell = make_cell(cell_id="c", measure={"fresh_worker": None, "timeout_s": 60})
    with worktrees(repo, commits["plain"], commits["slow"]) as revisions:
        caches = [Path(revision.env["TRITON_CACHE_DIR"]) for revision in revisions]
        scratch = revisions[0].root.parent
        assert caches[0] != caches[1] and all(cache.parent == scratch for cache in caches)
        for revision, cache in zip(revisions, caches):
            assert check_revision(revision, {"k": {"variant": "linear"}})["k"]["files"] == [str(cache)]
        fingerprints = {revision.side: {"machine_id": "m", "git": {"commit": revision.commit, "dirty": False}} for revision in revisions}
        measure_rounds(revisions, {"base": [cell], "head": [cell]}, 1, fingerprints, {"base": "b", "head": "h"}, progress=False)
        assert started == {revision.root: str(cache) for revision, cache in zip(revisions, caches)}
    assert not scratch.exists()


def test_a_check_that_hangs_fails_its_revision_within_the_bound(tmp_path, monkeypatch):
    """A revision whose check does not end (an import that hangs) fails every configuration, naming the bound, instead
    of hanging regress."""
    script = tmp_path / "check.py"
    script.write_text("import time\ntime.sleep(60)\n")
    monkeypatch.setattr(regress_module, "CHECK_SCRIPT", script)
    monkeypatch.setattr(regress_module, "CHECK_TIMEOUT_S", 1)
    started = time.monotonic()
    checked = check_revision(Revision("head", "HEAD", "0" * 40, tmp_path), {"k": {"variant": "linear"}})
    assert time.monotonic() - started < 30
    assert checked["k"]["ok"] is False and checked["k"]["problems"] == [
        "the check could not run: it did not end within 1 s (regress.CHECK_TIMEOUT_S): does the revision's import hang?"
    ]


@pytest.mark.parametrize("name", variants.names())
def test_the_correctness_check_passes_every_registered_variant(name):
    """regress_check feeds each variant what it needs (β, the gated rule's log gate): a correct
    revision must not be reported INCORRECT (gated_delta was, before the check passed its gate)."""
    from harness.revisions.regress_check import FileTrace, check

    config = {"variant": name, "params": {}, "backend": "torch", "d_key": 8, "decode": True}
    assert check(config, torch.device("cpu"), FileTrace(Path.cwd())) == []

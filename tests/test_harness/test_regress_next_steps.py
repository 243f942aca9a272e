"""What regress says once it has compared (issue 57, items 5 and 6): the controls, the verdict they allow and the
command to run next, built from a CompareResult made here (no git history, nothing measured)."""

from __future__ import annotations

import json
import shlex

import pandas as pd
import pytest

from harness.cli import build_parser, main
from harness.results.compare import EXIT_INCOMPARABLE, EXIT_OK, EXIT_REGRESSION, TABLE_COLUMNS, CompareResult, timing_mark
from harness.revisions import next_steps
from harness.revisions.next_steps import Invocation, mark_controls, trusted, verdict_lines
from harness.revisions.regress import RegressResult, _say_untimed, scenario_cells, shared_flags
from harness.scenarios.scenario import load_scenario

AXES = "T=128 B=2 H=4 Dk=32 Dv=32 float32 cpu"


def _row(variant: str, mark: str, ratio: float = 1.0, low: float = 0.95, high: float = 1.05, *, mode="forward", note="", backend="torch") -> dict:
    return {
        **dict.fromkeys(TABLE_COLUMNS),
        **dict(scenario="regress-cpu", variant=variant, backend=backend, params="", axes=AXES, mode=mode, target="core"),
        **dict(base_median_s=0.01, head_median_s=0.01 * ratio, base_unstable=False, head_unstable=False),
        **dict(ratio=ratio, ci_low=low, ci_high=high, mark=mark, note=note),
    }


def _comparison(*rows: dict, touched=(("delta", "torch", ""),)) -> CompareResult:
    comparison = CompareResult(pd.DataFrame(list(rows), columns=TABLE_COLUMNS), factor=1.1, alpha=0.05)
    mark_controls(comparison, set(touched))
    return comparison


def _invocation(**changes) -> Invocation:
    fields = dict(base="v0.3", head="main", scenario="regress-cpu", preset="ci", overrides=["heads=2"], flags=["--factor", "1.5"])
    commits = [(f"{index:040x}", f"commit {index}") for index in range(5)]
    return Invocation(**{**fields, "commits": commits, **changes})


WORSE = _row("delta", "worse", 1.2, 1.15, 1.25)


def test_a_worse_touched_cell_ends_with_the_bisect_command_of_the_range_and_the_cells_it_follows():
    lines = next_steps.next_steps(_comparison(WORSE, _row("softmax", "unchanged")), _invocation(), rounds=3, rounds_noisy=3)
    assert lines[0] == "next: find which of the 5 commits made the 1 worse cells worse:"
    command = lines[1].strip()
    assert shlex.split(command) == shlex.split("attnbench bisect --good v0.3 --bad main regress-cpu --preset ci --set heads=2 --rounds 3 --factor 1.5"), (
        "the exact command, with the scenario, preset, overrides and thresholds of the run"
    )
    assert build_parser().parse_args(shlex.split(command)[1:]).handler.__name__ == "_bisect", "the command parses"
    assert lines[2:] == ["  it follows these cells:", f"  delta[torch] {AXES} forward/core"]


def test_nothing_to_bisect_is_said_plainly_for_one_commit_a_dirty_tree_on_base_and_an_unrelated_base():
    comparison = _comparison(WORSE)
    one = next_steps.next_steps(comparison, _invocation(commits=[("a" * 40, "the change")]), 3, 3)
    assert one == ["next: nothing to bisect: aaaaaaaaaa (the change) is the only commit in v0.3..main"]
    dirty = next_steps.next_steps(comparison, _invocation(head=None, dirty_files=2, commits=[]), 3, 3)
    assert dirty == ["next: the 1 worse cells come from the working tree's uncommitted changes, the only difference from v0.3: nothing to bisect"]
    dirty_on_commits = next_steps.next_steps(comparison, _invocation(head=None, dirty_files=2), 3, 3)
    assert dirty_on_commits[0].startswith("next: commit the working tree's changes, then") and "--bad HEAD" in dirty_on_commits[1]
    unrelated = next_steps.next_steps(comparison, _invocation(commits=None), 3, 3)
    assert "is not an ancestor of main" in unrelated[0] and "git merge-base v0.3 main" in unrelated[0]


def test_cells_still_noisy_after_the_automatic_rounds_get_the_command_with_twice_their_rounds():
    comparison = _comparison(_row("delta", "unstable: not compared"), _row("delta", "too few samples to decide", mode="train"))
    (line,) = next_steps.next_steps(comparison, _invocation(), rounds=3, rounds_noisy=12)
    assert "2 touched cells stay undecided after 12 rounds" in line
    assert line.endswith("attnbench regress --base v0.3 --head main regress-cpu --preset ci --set heads=2 --rounds 24 --factor 1.5")
    assert next_steps.noisy_rows(comparison)["mode"].tolist() == ["forward", "train"]
    assert next_steps.MAX_DOUBLINGS == 2, "docs/regress.md states the bound: at most 4x --rounds"


def test_a_control_that_moves_makes_the_verdict_not_trusted_instead_of_a_regression():
    comparison = _comparison(WORSE, _row("softmax", "worse", 1.146, 1.012, 1.256), _row("linear", "unchanged"))
    control = next_steps.controls(comparison)
    assert control["variant"].tolist() == ["softmax", "linear"]
    assert control["note"].str.startswith(next_steps.CONTROL_NOTE).all(), "the table says which rows are controls"
    assert not trusted(comparison)
    lines = verdict_lines(comparison)
    assert lines[0] == "touched cells (their code changed): 1: 1 worse (factor 1.1, alpha 0.05)"
    assert lines[1] == "controls (code unchanged): 2: 1 worse, 1 unchanged"
    assert lines[2] == f"  control moved: softmax[torch] {AXES} forward/core 1.146 [1.012, 1.256] worse"
    assert lines[3].startswith("not trusted: the controls moved (1 of 2)")
    result = RegressResult((None, None), ["variants/delta_rule.py"], {"base": {}, "head": {}}, {}, comparison, {"base": "b.jsonl", "head": "h.jsonl"})
    assert result.exit_code == EXIT_INCOMPARABLE, "a moved control is 'cannot tell' (2), not a regression (1)"
    (step,) = next_steps.next_steps(comparison, _invocation(), 3, 3)
    assert step.startswith("next: measure again on a quieter machine") and step.endswith("--rounds 6 --factor 1.5")
    steady = _comparison(WORSE, _row("softmax", "unchanged"))
    assert trusted(steady) and RegressResult((None, None), [], {"base": {}, "head": {}}, {}, steady).exit_code == EXIT_REGRESSION


def test_without_controls_the_verdict_says_how_to_get_them():
    comparison = _comparison(_row("delta", "unchanged"))
    assert verdict_lines(comparison)[-1].startswith("controls: none measured (--all-variants")
    assert RegressResult((None, None), [], {"base": {}, "head": {}}, {}, comparison).exit_code == EXIT_OK


def test_the_ending_is_the_table_the_verdict_the_exit_code_then_the_next_step():
    comparison = _comparison(WORSE, _row("softmax", "unchanged"))
    result = RegressResult(
        (None, None), [], {"base": {}, "head": {}}, {}, comparison, {"base": "b.jsonl", "head": "h.jsonl"}, invocation=_invocation(), rounds=3
    )
    lines = result.ending().splitlines()
    exit_line = lines.index("attnbench regress: exit code 1")
    assert lines[exit_line + 1].startswith("next: find which") and lines[-1].endswith(f"delta[torch] {AXES} forward/core")
    assert "results: b.jsonl and h.jsonl" in lines[:exit_line]
    assert not any("exit code" in line for line in lines[:exit_line]), "compare's own summary (and its exit code) is not printed"


def test_a_ratio_shown_as_1_100_is_not_worse_at_factor_1_1():
    assert timing_mark(1.1004, 1.05, 1.15, 1.1) != "worse", "shown as 1.100: not beyond the factor 1.1"
    assert timing_mark(1.1006, 1.05, 1.15, 1.1) == "worse", "shown as 1.101"
    assert timing_mark(1 / 1.1 - 4e-4, 0.85, 0.95, 1.1) != "better", "shown as 0.909, as 1/1.1 is"


def test_the_terminal_table_wraps_long_notes_and_cuts_none():
    note = "head measured on a busy machine (other processes used 1.4 cores); " * 4 + "the end of the note"
    text = _comparison(_row("delta", "worse", 1.2, 1.15, 1.25, note=note)).format_table()
    joined = " ".join(line.split("  ")[-1].strip() for line in text.splitlines()[2:-1])
    assert "the end of the note" in text and "..." not in text
    assert joined.endswith("the end of the note") and all(len(line.split("  ")[-1]) <= 100 for line in text.splitlines()[2:-1])


def test_the_options_of_the_next_command_are_those_that_differ_from_their_defaults(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    defaults = dict(all_variants=False, threads=1, factor=1.1, alpha=0.05, out_dir="results", repo=".")
    assert shared_flags(**defaults) == []
    changed = shared_flags(
        **{**defaults, "all_variants": True, "threads": None, "factor": 1.5, "alpha": 0.01, "out_dir": "out", "repo": "/r", "plugins": ("/p.py",)}
    )
    assert changed == ["--plugin", "/p.py", "--all-variants", "--threads", "0", "--factor", "1.5", "--alpha", "0.01", "--out", "out", "--repo", "/r"]


def test_a_touched_triton_configuration_the_cpu_preset_does_not_time_is_named_with_where_it_is_timed():
    loaded = load_scenario("regress-cpu")
    key = json.dumps(["linear", "triton", {}], sort_keys=True)
    checks = {side: {key: {"variant": "linear", "backend": "triton", "params": {}, "ok": True}} for side in ("base", "head")}
    result = RegressResult((None, None), ["variants/kernels/sum_rule.py"], checks, {key: ["variants/kernels/sum_rule.py"]})
    said = []
    assert _say_untimed(result, scenario_cells(loaded), loaded, False, said.append) == ["linear[triton]"]
    assert said == ["nothing to measure: the diff touches linear[triton], which regress-cpu does not time; use --preset gpu on a GPU"]


@pytest.mark.parametrize("command", ["regress", "bisect", "compare", "kernels"])
def test_every_option_of_the_comparison_commands_states_its_default(command):
    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices[command]
    for action in sub._actions:
        if action.default in (None, False, "==SUPPRESS==") or action.required or not action.option_strings or action.help == "==SUPPRESS==":
            continue
        assert "default" in (action.help or ""), f"attnbench {command} {action.option_strings[0]}: its help does not state its default {action.default!r}"


@pytest.mark.slow
@pytest.mark.serial  # compares timings (a 50 ms sleep against 100 ms)
def test_regress_ends_with_the_bisect_command_and_that_bisect_reuses_its_measurement(tmp_path, capsys):
    """End to end on a repository of GOOD (linear sleeps 50 ms), a commit with a long subject, then linear sleeping
    100 ms and a README commit: regress GOOD..BAD ends with the bisect command; run as printed, bisect reuses regress's
    results instead of measuring the pair again, and names the commit. The subjects are shortened at a word."""
    from helpers import commit, edit, project_repository

    scan = "            scan = sum_rule_parallel\n"
    repo = tmp_path / "repo"
    project_repository(repo)
    edit(repo, "variants/sum_rule.py", scan, "            import time\n            time.sleep(0.05)\n" + scan)
    good = commit(repo, "good: linear sleeps 50 ms")
    (repo / "README.md").write_text((repo / "README.md").read_text() + "\nA line of prose.\n")
    commit(repo, "a README change whose subject is long enough to be shortened somewhere in the middle of its words")
    edit(repo, "variants/sum_rule.py", "time.sleep(0.05)", "time.sleep(0.1)")
    slower = commit(repo, "linear sleeps 100 ms")
    (repo / "README.md").write_text((repo / "README.md").read_text() + "\nAnother line.\n")
    bad = commit(repo, "readme again")
    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(
        "name: tiny\nvariants: {linear: {}, softmax: {}}\naxes: {seq_len: 16, batch: 1, heads: 1, d_key: 8}\n"
        "modes: [forward]\nmeasure: {warmup: 1, repeats: 5, target_rel_ci: null, timeout_s: 60}\n"
    )
    out = tmp_path / "out"
    common = [str(scenario), "--repo", str(repo), "--rounds", "1", "--factor", "1.5", "--out", str(out), "--no-progress"]
    assert main(["regress", "--base", good, "--head", bad, *common]) == EXIT_REGRESSION
    printed = capsys.readouterr().out.splitlines()
    exit_line = printed.index("attnbench regress: exit code 1")
    assert printed[exit_line + 1] == "next: find which of the 3 commits made the 1 worse cells worse:", printed
    command = shlex.split(printed[exit_line + 2])
    assert command[:6] == ["attnbench", "bisect", "--good", good, "--bad", bad] and printed[-1].startswith("  linear[torch] T=16")
    assert main([*command[1:], "--no-progress"]) == 0
    said = capsys.readouterr().out
    assert f"reusing regress --base {good} --head {bad}: {out}/regress-tiny-" in said, said
    assert f"first bad commit: {slower} linear sleeps 100 ms" in said
    assert "a README change whose subject is long enough to be ...: good" in said, "probed, its subject cut at a word"


@pytest.mark.parametrize(("noisy_after", "rounds_noisy"), [([True, False], 6), ([True, True, True], 12), ([False], 3)])
def test_noisy_touched_cells_alone_are_measured_again_doubling_their_rounds_at_most_twice(monkeypatch, tmp_path, noisy_after, rounds_noisy):
    """Each attempt's comparison (made up) marks the touched cell ``noisy`` unstable or not; the control ``calm`` is
    never measured again; each further attempt measures as many rounds again as the cell has."""
    from types import SimpleNamespace

    from harness.common.checkouts import Revision
    from harness.revisions import regress as regress_module

    revisions = tuple(Revision(side, side, side * 10, tmp_path / side, threads=1) for side in ("base", "head"))
    cells = [SimpleNamespace(cell_id=name, variant=variant, backend="torch", params={}) for name, variant in (("noisy", "delta"), ("calm", "softmax"))]
    key = lambda variant: regress_module._config_key(variant, "torch", {})  # noqa: E731
    checks = {side: {key(variant): {"ok": True} for variant in ("delta", "softmax")} for side in ("base", "head")}
    calls, attempts = [], iter(noisy_after)

    def measure_rounds(revisions, cells, rounds, fingerprints, run_ids, progress):
        calls.append(({side: [cell.cell_id for cell in side_cells] for side, side_cells in cells.items()}, rounds))
        return {side: {cell.cell_id: [{}] * rounds for cell in side_cells} for side, side_cells in cells.items()}

    def fake_compare(self, cells, measured, rounds, factor, alpha):
        mark = "unstable: not compared" if next(attempts) else "unchanged"
        return _comparison(_row("delta", mark), _row("softmax", "unchanged")), {"base": "b", "head": "h"}

    monkeypatch.setattr(regress_module, "measure_rounds", measure_rounds)
    monkeypatch.setattr(regress_module.Measuring, "_compare", fake_compare)
    monkeypatch.setattr(regress_module, "row_cell_ids", lambda comparison, path: ["noisy", "calm"])
    monkeypatch.setattr(regress_module.machine, "fingerprint", lambda device: {})
    monkeypatch.setattr(regress_module, "main_device", lambda cells: "cpu")
    said = []
    loaded = SimpleNamespace(name="tiny")
    measuring = regress_module.Measuring(revisions, checks, loaded, tmp_path, "", False, said.append, {"all_variants": True}, {("delta", "torch", "")})
    comparison, paths, done = measuring.run(cells, 3, 1.1, 0.05)
    assert done == rounds_noisy
    both = {"base": ["noisy", "calm"], "head": ["noisy", "calm"]}
    again = [({"base": ["noisy"], "head": ["noisy"]}, rounds) for rounds in (3, 6)][: len(noisy_after) - 1]
    assert calls == [(both, 3), *again], "the control is measured once; the noisy cell 3 rounds more, then 6"
    assert [line for line in said if "rounds more" in line][:1] == ["1 touched cells undecided or unstable after 3 rounds: measuring them 3 rounds more"][
        : len(again)
    ]


def test_bisect_reuses_only_a_regress_run_of_the_same_commits_scenario_and_options(tmp_path, monkeypatch):
    """Run lines only (the comparison of the files is made up): the newest folder whose sides name the two commits,
    without uncommitted changes, with the scenario, rounds, threads and --all-variants asked for."""
    from harness.results import ResultsWriter, run_header
    from harness.revisions import bisect as bisect_module

    scenario = tmp_path / "tiny.yaml"
    scenario.write_text("name: tiny\nvariants: {linear: {}, softmax: {}}\naxes: {seq_len: 16}\nmodes: [forward]\n")
    loaded, out = load_scenario(str(scenario)), tmp_path / "out"

    def regress_run(stamp: str, base="g" * 40, head="b" * 40, rounds=3, dirty=0) -> None:
        for side, commit in (("base", base), ("head", head)):
            regress = {"rounds": rounds, "threads": 1, "all_variants": False, "touched": [["linear", "torch", ""]]}
            revision = {"side": side, "commit": commit, "dirty_files": dirty if side == "head" else 0}
            machine = {"machine_id": "m", "git": {"commit": commit, "dirty": bool(dirty)}}
            header = run_header(loaded, "r", "", machine, revision=revision, regress=regress)
            with ResultsWriter(out / f"regress-tiny-{stamp}" / f"{side}.jsonl") as writer:
                writer.write_run(header)

    regress_run("20261201T000000Z")
    regress_run("20261202T000000Z", rounds=2)
    regress_run("20261203T000000Z", dirty=1)
    regress_run("20261204T000000Z", head="c" * 40)
    made = []
    monkeypatch.setattr(bisect_module, "commit_of", lambda repo, revision, option=None: revision * 40)
    monkeypatch.setattr(
        bisect_module,
        "compare",
        lambda base, head, factor, alpha: (
            made.append(base[0].parent.name)
            or CompareResult(pd.DataFrame([_row("linear", "worse"), _row("softmax", "worse")], columns=TABLE_COLUMNS), 1.1, 0.05)
        ),
    )
    found = bisect_module.reusable(out, loaded, ".", "g", "b", 3, {})
    assert made == ["regress-tiny-20261201T000000Z"], "not the dirty one, nor another head, nor other rounds"
    assert found.comparison.table["control"].tolist() == [False, True], "the touched configurations of the run line"
    assert bisect_module.reusable(out, loaded, ".", "g", "b", 3, {"all_variants": True}) is None
    assert bisect_module.reusable(out, loaded, ".", "g", "b", 2, {}) is not None and made[-1] == "regress-tiny-20261202T000000Z"
    assert bisect_module.reusable(out, loaded, ".", "g", "b", 3, {"threads": None}) is None

"""``attnbench kernels --compare REV`` (harness.kernels.kernel_diff) and the ``--kernel`` filter of ``attnbench kernels``.

The verdicts on rows are checked on made-up rows; the command end to end (``slow``: it compiles) on a temporary
git repository holding this project's ``variants/``: one kernel (the sum rule's ``forward_scan``), one target
(sm_80), one shape (fp32, d = 16, chunk 16, with and without the normaliser: one compilation a side).
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="attnbench kernels compiles with triton's compiler: pip install 'attnbench[triton]'")

from harness.cli import main  # noqa: E402
from harness.kernels import kernel_diff as kd  # noqa: E402
from harness.kernels import kernel_table as kt  # noqa: E402
from variants.kernels import delta_rule  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ROW = kt.Row("output", "bf16 F64 Dv64 C64", "sm_80", 128, spill_bytes=0, shared_bytes=32768, num_warps=4, occupancy_warps=16, programs=2048, mma="mma bf16")


def _with(**changes) -> kt.Row:
    return dataclasses.replace(ROW, **changes)


def test_a_row_is_worse_for_spill_occupancy_a_lost_16_bit_mma_or_a_new_limit():
    assert kd.diff([ROW], [ROW]) == []
    assert kd.regressions(ROW, _with(registers=96, occupancy_warps=20, spill_bytes=0)) == ()  # better: changed, not worse
    assert kd.regressions(ROW, _with(spill_bytes=24)) == ("more spill (0 -> 24 B a thread)",)
    assert kd.regressions(ROW, _with(num_warps=2, occupancy_warps=8)) == ("fewer warps per SM (16 -> 8)",)
    assert kd.regressions(_with(mma="mma bf16+wgmma bf16"), _with(mma="mma bf16")) == ("16-bit MMA lost (wgmma bf16; now mma bf16)",)
    assert kd.regressions(ROW, _with(mma="fma")) == ("16-bit MMA lost (mma bf16; now fma)",)
    assert kd.regressions(_with(mma="mma tf32"), _with(mma="fma")) == ()  # a 32-bit MMA is not judged
    over = _with(shared_bytes=200000, problem="shared memory 200000 B > 166912 B per block")
    assert kd.regressions(ROW, over) == ("newly over a limit: shared memory 200000 B > 166912 B per block",)
    assert kd.regressions(over, over) == ()  # over before too: not new
    assert kd.regressions(None, _with(pruned="too many registers")) == ("newly over a limit: too many registers",)
    assert kd.regressions(ROW, None) == ()  # gone: nothing to judge


def test_changed_rows_are_printed_old_beside_new():
    gone, added = _with(kernel="ut_transform"), _with(kernel="backward_chunk")
    changes = kd.diff([ROW, gone], [_with(num_warps=2, occupancy_warps=8), added])
    assert [(change.row.kernel, bool(change.regressions)) for change in changes] == [("output", True), ("backward_chunk", False), ("ut_transform", False)]
    lines = kd.format_changes(changes, "HEAD~1").splitlines()
    assert lines[0].split() == ["kernel", "config", "arch", "regs", "spill", "B", "smem", "B", "warps", "occ", "warps/SM", "mma", "verdict"]
    assert lines[1] == "-- sm_80 bf16: 3 rows changed, 1 worse"
    assert "4 -> 2" in lines[2] and "16 -> 8" in lines[2] and lines[2].endswith("WORSE: fewer warps per SM (16 -> 8)")
    assert lines[3].endswith("only in HEAD~1") and "128 -> -" in lines[3]
    assert lines[4].endswith("only in the working tree") and "- -> 128" in lines[4]


def test_the_kernel_filter_keeps_the_named_kernels_and_refuses_unknown_ones(tmp_path, monkeypatch):
    """``--kernel``: every candidate of an autotuned kernel, nothing else (figures from a made-up cache: nothing
    compiles); a name no selected configuration launches is an error listing those it launches."""
    selected = kt.jobs(["delta_rule"], ["bf16"], [64], [64])[:1]
    for launch in delta_rule.record_launches(delta_rule.compile_configs()[selected[0][1]], 80):
        kt._write_cache(tmp_path, kt.compile_key(launch, 80), dict(registers=96, spill_bytes=0, shared_bytes=1024, mma="mma bf16", cpu_s=0.0))
    monkeypatch.setattr(kt.concurrent.futures, "ProcessPoolExecutor", None)  # compiling would fail
    rows = kt.build_table([kt.ARCHS["sm_80"]], selected, cache=tmp_path, kernels={"output", "state_pass"})
    assert [row.kernel for row in rows] == [f"state_pass[BLOCK_V={b},w={w}]" for b in (16, 32) for w in (4, 8)] + ["output"]
    with pytest.raises(kt.KernelTableError, match="unknown kernel forward_scan: the selected configurations launch backward_chunk, .*, ut_transform"):
        kt.table("sm_80", rules="delta_rule", dtypes="bf16", head_dims="64", chunks="64", kernels="output,forward_scan")


def _git(repo: Path, *args: str) -> str:
    command = ["git", "-C", str(repo), "-c", "user.name=test", "-c", "user.email=test@example.com", *args]
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout


@pytest.mark.slow
def test_compare_head_is_0_unchanged_and_1_naming_the_rows_after_fewer_warps(tmp_path, monkeypatch, capsys):
    """The done-when of issue 32 item 5, on one kernel, target and shape: an unchanged tree exits 0 with no row
    changed; a scan launched with 1 warp instead of 8 keeps 32 warps per SM instead of 48-64 (32 blocks at
    most), so its rows are worse and the command exits 1 naming them. About 20 CPU-seconds (two child processes
    and one compilation a side, twice)."""
    if shutil.which("git") is None or subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("needs git and a git checkout of attnbench")
    repo = tmp_path / "repo"
    repo.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "HEAD", "variants"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(repo)], input=archive, check=True)
    _git(repo, "init", "-q")
    _git(repo, "add", "--all")
    _git(repo, "commit", "-q", "-m", "kernels")
    monkeypatch.chdir(repo)
    args = ["kernels", "--compare", "HEAD", "--arch", "sm_80", "--rule", "sum_rule", "--dtype", "fp32", "--d", "16", "--chunk", "16"]
    args += ["--kernel", "forward_scan", "--jobs", "1"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert out.startswith("no row changed between HEAD") and "2 rows of HEAD" in out and "0 changed, 0 worse" in out

    source = repo / "variants" / "kernels" / "sum_rule.py"
    old = 'options=tiles.options(), name=f"{name}_scan"'
    assert source.read_text().count(old) == 1, "sum_rule.py no longer launches its scan so: update the test's edit"
    source.write_text(source.read_text().replace(old, old.replace("tiles.options()", "dict(tiles.options(), num_warps=1)")))
    assert main([*args, "--json", str(tmp_path / "diff.json")]) == 1
    out, err = capsys.readouterr()
    for config in ("fp32 F16 Dv16 C16 norm", "fp32 F16 Dv16 C16 plain"):
        (line,) = [line for line in out.splitlines() if line.startswith("forward_scan") and config in line]
        assert "sm_80" in line and "8 -> 1" in line and "-> 32" in line and "WORSE: fewer warps per SM (" in line, out
    assert "error:" not in err, "each worse row is printed once, in the table"
    assert out.splitlines()[-2].endswith("2 changed, 2 worse; 0 over a limit in the working tree"), "the summary after the rows"
    assert out.splitlines()[-1].endswith("attnbench regress --base HEAD regress-cpu --preset gpu")
    assert len(_git(repo, "worktree", "list").splitlines()) == 1, "a temporary git worktree was not removed"


def test_regress_diffs_the_kernels_of_the_changed_rules_only():
    assert kd.changed_rules(["README.md", "variants/sum_rule.py"]) == []
    assert kd.changed_rules(["variants/kernels/delta_rule.py", "harness/cli.py"]) == ["delta_rule"]
    assert kd.changed_rules(["variants/kernels/delta_rule.py", "variants/kernels/_common.py"]) is None  # shared helpers: every rule
    assert kd.for_regress(None, None, ["variants/delta_rule.py"], print) is None


@pytest.mark.parametrize("fine", [True, False])
def test_regress_compiles_only_the_rows_whose_compilation_differs(monkeypatch, fine):
    """Each side's rows are keyed first (nothing compiled); only rows whose key differs, or that one side lacks, are
    compiled and compared. The fine key (the kernel's own source and the helpers it calls) where both revisions
    have it, else the coarse one (every kernel source of its module): there row "a", whose kernel is unchanged but
    whose module changed, is compiled too."""
    from types import SimpleNamespace

    from harness.revisions.regress import RegressResult

    keys = {
        "base": {"a|C|sm_80": ["m1", "a"], "output|C|sm_80": ["m1", "o1"], "gone|C|sm_80": ["m1", "g"]},
        "head": {"a|C|sm_80": ["m2", "a"], "output|C|sm_80": ["m2", "o2"], "new|C|sm_80": ["m2", "n"]},
    }
    if not fine:
        keys["base"]["gone|C|sm_80"][1] = None
    rows = {"base": [_with(kernel="a", config="C"), _with(config="C"), _with(kernel="gone", config="C")],
            "head": [_with(kernel="a", config="C"), _with(config="C", num_warps=2, occupancy_warps=8), _with(kernel="new", config="C")]}  # fmt: skip
    asked = []

    def revision_rows(revision, request, scratch):
        asked.append((revision.side, request["action"], request.get("wanted")))
        if request["action"] == "keys":
            return keys[revision.side]
        return [row for row in rows[revision.side] if kd._row_id(row.kernel, row.config, row.arch) in request["wanted"]]

    monkeypatch.setattr(kd, "revision_rows", revision_rows)
    said = []
    base, head = (SimpleNamespace(side=side, root=Path("/scratch") / side, label=label) for side, label in (("base", "HEAD~1"), ("head", "working tree")))
    changes = kd.for_regress(base, head, ["variants/kernels/sum_rule.py"], said.append)
    unchanged = [] if fine else ["a|C|sm_80"]
    wanted = {"base": sorted([*unchanged, "gone|C|sm_80", "output|C|sm_80"]), "head": sorted([*unchanged, "new|C|sm_80", "output|C|sm_80"])}
    assert asked[2:] == [(side, "rows", wanted[side]) for side in ("base", "head")]
    assert said[0] == f"kernels (sum_rule on sm_70,sm_80,sm_90): {3 + (not fine)} of 3 rows compile differently; compiling them in each revision ..."
    assert [(change.row.kernel, bool(change.regressions)) for change in changes] == [("output", True), ("new", False), ("gone", False)]
    assert "only in head" in said[1] and "only in base" in said[1] and said[-2] == "kernels: 3 rows changed, 1 worse"
    assert said[-1] == "to time the worse kernels on a GPU, run there: attnbench regress --base 'HEAD~1' regress-cpu --preset gpu"
    result = RegressResult((base, head), [], {"base": {}, "head": {}}, {}, kernel_changes=changes)
    assert result.exit_code == 1 and [change.row.kernel for change in result.kernels_worse] == ["output"]


def test_row_keys_key_every_launch_of_a_configuration_without_compiling(monkeypatch):
    """The keys a side reports: per (kernel, configuration, arch), the coarse compile key and the fine one. Within one
    revision both tell the same compilations apart (launches that compile alike, e.g. a pass the backward runs
    again, share both), and the arch is part of each."""
    monkeypatch.setattr(kt, "jobs", lambda rules: [("sum_rule", 0)])
    keys = kd.row_keys("sm_80,sm_90", ["sum_rule"])
    assert keys and all(coarse and fine for coarse, fine in keys.values())
    assert {name.split("|")[2] for name in keys} == {"sm_80", "sm_90"}
    assert len({fine for _, fine in keys.values()}) == len({coarse for coarse, _ in keys.values()}) == len(set(map(tuple, keys.values())))
    assert not {fine for name, (_, fine) in keys.items() if name.endswith("sm_80")} & {fine for name, (_, fine) in keys.items() if name.endswith("sm_90")}


def test_keyed_rows_compile_the_named_rows_only(tmp_path, monkeypatch):
    """What a side compiles for regress: exactly the rows named, of their configurations, kernels and arch
    (figures from a made-up cache: nothing compiles)."""
    selected = kt.jobs(["delta_rule"], ["bf16"], [64], [64])[:1]
    label = delta_rule.config_label(delta_rule.compile_configs()[selected[0][1]])
    for launch in delta_rule.record_launches(delta_rule.compile_configs()[selected[0][1]], 80):
        kt._write_cache(tmp_path, kt.compile_key(launch, 80), dict(registers=96, spill_bytes=0, shared_bytes=1024, mma="mma bf16", cpu_s=0.0))
    monkeypatch.setenv("ATTNBENCH_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(kt.concurrent.futures, "ProcessPoolExecutor", None)  # compiling would fail
    wanted = [f"output|{label}|sm_80", f"state_pass[BLOCK_V=16,w=4]|{label}|sm_80"]
    rows = kd.keyed_rows(wanted, ["delta_rule"])
    assert sorted(kd._row_id(row.kernel, row.config, row.arch) for row in rows) == sorted(wanted)
    assert all(row.registers == 96 and row.occupancy_warps for row in rows)

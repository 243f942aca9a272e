"""scripts/gpu-session.sh, the one prepared script of a session lent a GPU, in its dry mode (GPU_SESSION_DRY=1):
the plan line of each step, the commands it would run, and what its deadline skips."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu-session.sh"


def dry(tmp_path: Path, *args: str, root: Path = ROOT, steps: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, GPU_SESSION_DRY="1", OUT=str(tmp_path / "out"), GPU_SESSION_WORK=str(tmp_path / "work"))
    if steps is not None:
        env["GPU_SESSION_STEPS"] = steps
    return subprocess.run(["bash", str(root / "scripts" / "gpu-session.sh"), *args], capture_output=True, text=True, env=env, timeout=60)


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


def test_the_plan_runs_by_priority_and_the_deadline_skips_the_rest(tmp_path):
    done = dry(tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    planned = [line.split("plan: ")[1].split()[0] for line in lines if "plan: " in line]
    assert planned == ["setup", "kernels", "variants", "fla-kernels", "quick-sweeps", "lm"]
    commands = [line.strip() for line in lines if line.startswith("  timeout")]
    assert any("pytest tests/test_kernels -m not slow -n 8" in c and "ATTNBENCH_TEST_DEVICE=cuda" in c for c in commands)
    assert any("run cuda-variants --preset quick --budget" in c for c in commands)
    # within 570 s: the kernel tests and cuda-variants run; what follows does not fit and is skipped, then the report
    assert [line.split("skipped ")[1].split(":")[0] for line in lines if "skipped " in line] == ["fla-kernels", "quick-sweeps", "lm"]
    assert "report" in commands[-1] and "is missing" not in done.stdout and "has no preset" not in done.stdout
    assert (tmp_path / "out" / "gpu-session.log").read_text().count("+ timeout") == len(commands)


def test_a_long_deadline_runs_every_shipped_step(tmp_path):
    done = dry(tmp_path, "3000")
    assert done.returncode == 0, done.stderr
    assert "skipped" not in done.stdout
    for scenario in (
        "kernels-vs-fla --preset done-when",
        "seq-sweep --preset gpu-quick",
        "decode --preset gpu-quick",
        "paper-small-lm --preset gpu ",
        "quality/lm-wikitext --preset gpu ",
    ):
        assert f"run {scenario}" in done.stdout, scenario


def test_a_missing_scenario_is_skipped_and_an_unknown_step_refused(tmp_path):
    (tmp_path / "tree" / "scripts").mkdir(parents=True)
    (tmp_path / "tree" / "scenarios").mkdir()
    shutil.copy(SCRIPT, tmp_path / "tree" / "scripts")
    shutil.copy(ROOT / "scenarios" / "cuda-variants.yaml", tmp_path / "tree" / "scenarios")
    done = dry(tmp_path, "3000", root=tmp_path / "tree", steps="variants fla-kernels")
    assert done.returncode == 0, done.stderr
    assert "run cuda-variants --preset quick" in done.stdout
    assert "skipped kernels-vs-fla: scenarios/kernels-vs-fla.yaml is missing" in done.stdout
    refused = dry(tmp_path, root=tmp_path / "tree", steps="variants nope")
    assert refused.returncode == 2 and "unknown step nope" in refused.stdout


def test_prepare_copies_the_kit_into_an_ignored_folder(tmp_path):
    """``prepare`` (here, before the call): the kit's wheels and WikiText-2 in .gpu-kit, which git ignores."""
    tree, kit, data = tmp_path / "tree", tmp_path / "kit" / "wheels-cp312", tmp_path / "data" / "wikitext-2"
    for folder, name in ((kit, "pydantic.whl"), (data, "wiki.train.tokens")):
        folder.mkdir(parents=True)
        (folder / name).write_text("x")
    (tree / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, tree / "scripts")
    subprocess.run(["git", "init", "-q", str(tree)], check=True)
    env = dict(os.environ, GPU_KIT=str(kit.parent), GPU_DATA=str(data.parent))
    done = subprocess.run(["bash", "scripts/gpu-session.sh", "prepare"], cwd=tree, capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "carry ['.gpu-kit']" in done.stdout
    assert (tree / ".gpu-kit" / "wheels-cp312" / "pydantic.whl").exists() and (tree / ".gpu-kit" / "wikitext-2" / "wiki.train.tokens").exists()
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=tree, capture_output=True, text=True).stdout
    assert ".gpu-kit" not in status and "scripts/gpu-session.sh" in status

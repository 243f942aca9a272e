"""``attnbench check VARIANT``: a plugin's variant checked form by form against its float64 reference, each
planted mistake named with its cause (exit 1), a correct one and a built-in passing (exit 0); plugins in
``list`` and ``demo`` as in ``run`` (issue 56, items 1 and 2). Run in this process (``attnbench_here``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers import attnbench_here, project_repository

import variants.backends  # noqa: F401 - the shipped variants registered before a test copies the registry
import variants.params
from harness import tasks
from harness.cli import main
from harness.scenarios.plugins import module_name
from variants import base
from variants.checking import check_variant

HERE = Path(__file__).parent
PLUGIN = str(HERE / "check_plugin.py")
TOY = str(HERE / "toy_plugin.py")


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    """Each test registers the plugins' variants anew (a command loads them) and leaves none behind."""
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    monkeypatch.setattr(tasks, "_TASKS", dict(tasks._TASKS))
    for plugin in (PLUGIN, TOY):
        monkeypatch.delitem(sys.modules, module_name(plugin), raising=False)
    yield
    for plugin in (PLUGIN, TOY):
        sys.modules.pop(module_name(plugin), None)


def check(variant: str, *args: str):
    return attnbench_here("check", variant, "--plugin", PLUGIN, *args)


def failed(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("FAIL")]


def test_a_correct_plugin_variant_passes():
    done = check("check_mirrored")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == "check_mirrored: 61 checks, all ok"
    for what in ("float64 T=1:", "T=15 chunk_size=4", "T=17 chunk_size=16", "T=37", "T=100", "bfloat16", "packed T=5+12+23", "prefill, prefill, steps"):
        assert any(what in line for line in lines), what
    assert any(line.startswith("ok    float32 T=37: step loop vs float64 reference: output, d/dq, d/dk, d/dv  max rel error") for line in lines)


def test_a_forgotten_normaliser_in_the_step_is_named():
    done = check("check_no_normaliser_step")
    assert done.returncode == 1
    lines = failed(done.stdout)
    assert lines and all("step" in line for line in lines)
    assert "FAIL  float64 T=15: step loop vs float64 reference: output, d/dq, d/dk, d/dv  max rel error" in lines[1]
    assert lines[1].endswith("the parallel form agrees with the reference: the step loop differs (its _step or init_state)")
    assert not any("parallel form vs" in line for line in lines)


def test_a_halved_gradient_is_named_with_its_input():
    done = check("check_half_k_grad")
    assert done.returncode == 1
    lines = failed(done.stdout)
    assert lines and all(": parallel form vs float64 reference" in line for line in lines)
    assert all("the output is right, d/dk is not: the backward of the parallel form is wrong" in line for line in lines)
    assert "max rel error 5.0e-01 > 1e-09" in lines[0]


def test_a_detached_k_is_named():
    lines = failed(check("check_k_detached").stdout)
    assert lines and all(line.endswith("the gradient to k is not connected: does the parallel form use k through a detached tensor "
                                       "(.detach(), .data, torch.no_grad(), a new tensor made from its values)?") for line in lines)  # fmt: skip


def test_a_missing_method_is_named_with_what_the_interface_expects():
    done = check("check_no_state_numel")
    assert done.returncode == 1
    [line] = failed(done.stdout)
    assert line.startswith("FAIL  interface: state_numel: NotImplementedError: check_no_state_numel: NoStateNumel does not implement state_numel")
    assert "Elements of the decoding state after ``length`` tokens" in line and "(at base.py:" in line


def test_an_unset_d_dot_is_named_before_the_shape_errors():
    done = check("check_d_dot_unset")
    assert done.returncode == 1
    lines = failed(done.stdout)
    assert lines[0].startswith("FAIL  interface: d_dot = 8: d_dot is unset: still d_key = 8, AttentionCore's default")
    assert "Set self.d_dot in the constructor" in lines[0]
    assert "must match the size of tensor b (16)" in lines[1] and "(at check_plugin.py:" in lines[1]


def test_forms_that_agree_with_each_other_against_the_reference_question_the_reference():
    lines = [line for line in failed(check("check_wrong_reference").stdout) if " packed " not in line]  # packed: one form, nothing to agree with
    assert lines and all(line.endswith(": is _reference right?") for line in lines)
    [step] = [line for line in lines if line.startswith("FAIL  float64 T=15: step loop vs float64 reference: output, d/dq, d/dk, d/dv  max rel error")]
    assert "> 1e-09: output, d/dq, d/dk, d/dv wrong; the parallel form agrees with it (rel error" in step


def test_a_builtin_passes_and_a_parameter_is_set():
    done = attnbench_here("check", "delta", "--set", "chunk_size=16")
    assert done.returncode == 0, done.stdout
    assert done.stdout.startswith("attnbench check delta (chunk_size=16): B=2 H=2 d_key=8 d_value=6 on the CPU")
    assert "chunk_size=4" not in done.stdout and "scan=parallel" in done.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["no_such_rule"], "error: unknown variant 'no_such_rule'"),
        (["delta", "--set", "chunk_size"], "error: --set 'chunk_size': expected KEY=VALUE"),
        (["delta", "--set", "chunk_size=0"], "error: delta: chunk_size must be a positive int, got 0"),
    ],
)
def test_bad_usage_is_one_line_and_exit_2(args, message):
    done = attnbench_here("check", *args)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith(message) and done.stderr.count("\n") == 1


def test_the_pytest_helper_fails_with_the_failed_lines():
    attnbench_here("list", "--plugin", PLUGIN)  # registers the plugin's variants
    with pytest.raises(AssertionError, match=r"(?s)check_k_detached: 61 checks, \d+ failed\nFAIL .*the gradient to k is not connected"):
        check_variant("check_k_detached").assert_ok()


@pytest.mark.parametrize("how", ["--plugin", "ATTNBENCH_PLUGINS"])
def test_list_names_a_plugins_variants_with_their_file_and_parameters(how):
    done = attnbench_here("list", "--plugin", TOY) if how == "--plugin" else attnbench_here("list", env={"ATTNBENCH_PLUGINS": f"{TOY},{PLUGIN}"})
    assert done.returncode == 0
    variants_line, *plugin_lines = done.stdout.splitlines()[:-1]
    assert "toy_tempered" in variants_line.split(": ")[1].split(", ")
    assert f"  toy_tempered (from {TOY}): parameters: none" in plugin_lines
    if how == "ATTNBENCH_PLUGINS":
        assert f"  check_mirrored (from {PLUGIN}): parameters: chunk_size (a positive int)" in plugin_lines


def test_demo_runs_a_plugins_variant():
    done = attnbench_here("demo", "--plugin", TOY, "--batch", "1", "--heads", "1", "--seq-len", "8", "--d-key", "4", "--repeats", "1")
    assert done.returncode == 0, done.stderr
    assert {"toy_tempered", "softmax"} <= {line.split()[0] for line in done.stdout.splitlines()[2:-1]}


@pytest.mark.slow
def test_regress_checks_and_measures_a_plugins_variant_in_each_revision(tmp_path, capsys, monkeypatch):
    """regress --plugin (a path relative to here): each revision's check and workers import it in their worktree."""
    repo = tmp_path / "repo"
    plain = project_repository(repo)
    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(
        "name: tiny\nvariants: {check_mirrored: {}}\naxes: {seq_len: 16, batch: 1, heads: 1, d_key: 8}\n"
        "modes: [forward]\nmeasure: {warmup: 1, repeats: 3, target_rel_ci: null, timeout_s: 60}\n"
    )
    monkeypatch.chdir(HERE)
    args = ["regress", str(scenario), "--repo", str(repo), "--base", plain, "--head", plain, "--all-variants", "--rounds", "1", "--no-progress"]
    code = main([*args, "--out", str(tmp_path / "out"), "--plugin", Path(PLUGIN).name])
    printed = capsys.readouterr().out
    assert code in (0, 1, 2) and "INCORRECT" not in printed, printed
    assert "base: 1 configurations correct" in printed and "head: 1 configurations correct" in printed, printed
    for side in ("base", "head"):
        (jsonl,) = (tmp_path / "out").glob(f"regress-tiny-*/{side}.jsonl")
        cells = [json.loads(line) for line in jsonl.read_text().splitlines() if '"kind": "cell"' in line]
        assert [(cell["variant"], cell["status"]) for cell in cells] == [("check_mirrored", "ok")], cells


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(variants.params.SHIPPED))
def test_every_shipped_variant_passes_its_check(name):
    check_variant(name).assert_ok()

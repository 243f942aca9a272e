"""Mistakes are answered at once and in the user's words (issue 53, item 5): a misspelled scenario, preset,
variant, parameter, field or ``--set`` value is refused before torch, triton or a variant is imported (the
scenario's names, fields and parameters are checked against torch-free tables: ``variants.params``), with
"did you mean", the known names, and what the field accepts in plain words, not pydantic's or Python's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import variants
from harness.cli import main
from harness.scenarios.plugins import load_plugins, module_name
from harness.scenarios.scenario import ScenarioError, check_scenario, load_scenario
from variants import backends, base, params

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = """\
variants:
  softmax: {}
  dpfp: {nu: [1, 2]}
axes: {seq_len: 8, batch: 1, heads: 1, d_key: 8}
presets:
  ci: {measure: {repeats: 3}}
"""
#: Each mistake (arguments of ``attnbench`` after the scenario file, ``{file}``) and what its one line of stderr says.
MISTAKES = [
    (["run", "smoke-cpuu"], ["smoke-cpuu: no such scenario file (did you mean 'smoke-cpu'?)"]),
    (["run", "scenarios/quality/mqr.yaml"], ["scenarios/quality/mqr.yaml: no such scenario file (did you mean 'quality/mqar'?)"]),
    (["run", "{file}", "--preset", "cii"], ["presets.cii: no such preset (did you mean 'ci'?) (this file has: ci)"]),
    (["run", "{file}", "--set", "seq_len=abc"], ['axes.seq_len: expected an integer or a list of them, got "abc" (from --set seq_len=abc)']),
    (["run", "{file}", "--set", "batch=[1, x]"], ['axes.batch: expected an integer or a list of them, got [1, "x"] (from --set batch=[1, x])']),
    (["run", "{file}", "--set", "seq_len=-4"], ["axes.seq_len: expected positive integers, got -4 (from --set seq_len=-4)"]),
    (["run", "{file}", "--set", "variants.dpfp.nuu=2"], ["variants.dpfp: no parameter 'nuu' (did you mean 'nu'?); its parameters: chunk_size, d_dot, m,"]),
    (["run", "{file}", "--set", "variants.dpf={}"], ["variants.dpf: unknown variant (did you mean 'dpfp'?); known: based, delta, deltanet, dpfp,"]),
    (["run", "{file}", "--set", "variants.performer={phi: favor}"], ["variants.performer: phi is set by the variant itself, not a parameter of it"]),
    (["run", "{file}", "--set", "variants.dpfp.nu=0"], ["variants.dpfp: nu must be a positive int, got 0"]),
    (["run", "{file}", "--set", "variants.linear={phi: dpf}"], ["variants.linear: phi must be one of 'identity', 'elu1',", "got 'dpf' (did you mean 'dpfp'?)"]),
    (["run", "{file}", "--set", "measure.repeatz=3"], ["measure.repeatz: not a field (got 3) (did you mean 'repeats'?); the fields here: warmup, repeats,"]),
    (["run", "{file}", "--set", "modes=[forwrd]"], ["modes.0: expected 'forward', 'train', 'decode' or 'quality' (did you mean 'forward'?)"]),
    (["run", "{file}", "--set", "backends=[tritn]"], ['backends: expected backends among torch, triton, compile, fla, got "tritn"']),
    (["run", "{file}", "--set", "exclude=[{variant: softmx}]"], ["exclude.0.variant: expected one of based,", "(did you mean 'softmax'?)"]),
]
#: Run in a fresh interpreter: each mistake through ``harness.cli.main``, then which heavy modules were imported.
REFUSE = """
import contextlib, io, json, sys
from harness.cli import main
answers = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        answers.append((main(argv), err.getvalue()))
loaded = sorted(m for m in ("torch", "triton", "variants.base", "variants.backends", "harness.running.runner") if m in sys.modules)
print(json.dumps({"answers": answers, "loaded": loaded}))
"""


@pytest.fixture
def scenario_file(tmp_path) -> str:
    path = tmp_path / "mistakes.yaml"
    path.write_text(SCENARIO)
    return str(path)


def _argv(args: list[str], path: str) -> list[str]:
    return [arg.replace("{file}", path) for arg in args]


def test_every_mistake_is_refused_before_torch_or_a_variant_is_imported(scenario_file):
    """The proof of "at once": in a fresh interpreter, after every refusal, neither torch, triton nor a variant module is loaded."""
    argvs = [_argv(args, scenario_file) for args, _ in MISTAKES]
    done = subprocess.run([sys.executable, "-c", REFUSE, json.dumps(argvs)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    for (args, _), (code, err) in zip(MISTAKES, result["answers"]):
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, (args, err)
    assert result["loaded"] == [], f"a refusal waited for {result['loaded']}"


@pytest.mark.parametrize(("args", "said"), MISTAKES, ids=[" ".join(args[1:]) for args, _ in MISTAKES])
def test_a_mistake_is_one_line_in_the_users_words(scenario_file, capsys, args, said):
    assert main(_argv(args, scenario_file)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(part in err for part in said), err
    for words in ("Input should", "Extra inputs", "__init__()", "unexpected keyword", "{...}", ".int:", "list[int]"):
        assert words not in err, err


def test_a_scenario_with_a_valid_configuration_loads_and_expands(scenario_file):
    """The torch-free checks refuse nothing that is right: the file's cells (2 variants' configurations) expand."""
    loaded = load_scenario(scenario_file, preset="ci")
    assert sorted({(cell.variant, tuple(cell.params.items())) for cell in loaded.cells()}) == [("dpfp", (("nu", 1),)), ("dpfp", (("nu", 2),)), ("softmax", ())]


def test_a_check_that_needs_a_core_is_still_made_at_expansion(tmp_path):
    """A d_dot the variant cannot reach is found when its core is built (``cells()``), not when the file is checked."""
    path = tmp_path / "d.yaml"
    path.write_text("variants: {dpfp: {d_dot: 100}}\naxes: {seq_len: 8, d_key: 8}\n")
    checked = check_scenario(str(path))
    with pytest.raises(ScenarioError, match=r"variants.dpfp: parameters \{\"d_dot\": 100\} at d_key=8: phi='dpfp': d_dot=100 is not reachable"):
        checked.cells()


def test_create_refuses_an_unknown_parameter_in_the_words_the_scenario_uses():
    """One check of a variant's parameters (``params.refusal``): ``variants.create`` and the scenario say the same."""
    with pytest.raises(variants.VariantError) as info:
        variants.create("dpfp", 8, nuu=2)
    assert str(info.value) == "dpfp: " + params.refusal("dpfp", {"nuu": 2})
    assert (
        str(info.value) == "dpfp: no parameter 'nuu' (did you mean 'nu'?); its parameters: chunk_size, d_dot, m, normalize, nu, precision, scan, seed, sum_norm"
    )
    with pytest.raises(variants.VariantError, match=r"^unknown variant 'dpf' \(did you mean 'dpfp'\?\); known variants: based, delta,"):
        variants.create("dpf", 8)


def test_the_torch_free_table_is_what_the_variants_register():
    """``params.SHIPPED`` (the parameters checked before torch loads) is each shipped variant's registration: its
    core class's ``PARAMS`` and the parameters its factory sets itself; ``params.BACKENDS`` names the backends built."""
    assert set(params.SHIPPED) <= set(variants.names())
    for name, shipped in params.SHIPPED.items():
        factory = base.registered(name)
        assert params.declared(factory) == shipped.params, name
        assert tuple(getattr(factory, "fixed_params", ())) == shipped.fixes, name
    assert tuple(backends._REGISTRY) == params.BACKENDS == variants.BACKENDS


@pytest.fixture
def plugin_variant(monkeypatch):
    """The inaccurate plugin's variant, registered for one test (``load_plugins``), gone after it."""
    plugin = str(Path(__file__).with_name("inaccurate_plugin.py"))
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    monkeypatch.delitem(sys.modules, module_name(plugin), raising=False)
    load_plugins([plugin])
    yield "off_by_one_percent"
    sys.modules.pop(module_name(plugin), None)


def test_a_plugins_variant_is_known_once_the_plugin_loaded(tmp_path, plugin_variant):
    """With a plugin the names are the registry's; its class may take more than it declares, so only the
    constructor refuses a parameter it does not take (a declared one's value is checked at once)."""
    path = tmp_path / "p.yaml"
    path.write_text(f"variants: {{{plugin_variant}: {{}}}}\naxes: {{seq_len: 8, d_key: 8}}\n")
    assert check_scenario(str(path)).scenario.variants == {plugin_variant: {}}
    with pytest.raises(ScenarioError, match=rf"variants.{plugin_variant}: nu must be a positive int, got 0"):
        check_scenario(str(path), overrides=[f"variants.{plugin_variant}.nu=0"])
    with pytest.raises(ScenarioError, match=rf"{plugin_variant}: .*unexpected keyword argument 'nuu'"):
        load_scenario(str(path), overrides=[f"variants.{plugin_variant}.nuu=2"])

"""Scenario files: parsing, every validation error (naming file, field, value and what was
expected), presets, --set overrides and the expansion into cells."""

from __future__ import annotations

import pytest
import yaml

import variants
from harness.scenarios.scenario import ScenarioError, load_scenario, shipped

BASE = {
    "name": "t",
    "variants": {"softmax": {}, "dpfp": {"nu": [1, 2, 3]}},
    "axes": {"seq_len": [64, 128], "batch": 2, "heads": 2, "d_key": 8},
    "modes": ["forward", "train"],
}


def write(tmp_path, data, name="t.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False) if isinstance(data, dict) else data)
    return str(path)


def error_of(tmp_path, data, **kwargs) -> str:
    path = write(tmp_path, data)
    with pytest.raises(ScenarioError) as info:
        load_scenario(path, **kwargs).cells()
    message = str(info.value)
    assert path in message, message
    return message


@pytest.mark.parametrize("name", shipped())
@pytest.mark.parametrize("preset", [None, "ci"])
def test_shipped_scenarios_validate_and_expand(name, preset):
    cells = load_scenario(name, preset=preset).cells()
    assert cells and len({cell.cell_id for cell in cells}) == len(cells)


def test_expansion_counts_and_order(tmp_path):
    cells = load_scenario(write(tmp_path, BASE)).cells()
    # (1 softmax + 3 dpfp) configurations x 2 modes x 2 lengths
    assert len(cells) == 16
    assert [c.params.get("nu") for c in cells[:4]] == [None] * 4
    assert {c.axes["d_value"] for c in cells} == {8}, "d_value defaults to d_key"
    assert sorted({(c.variant, c.params.get("nu")) for c in cells}, key=str) == sorted([("softmax", None), ("dpfp", 1), ("dpfp", 2), ("dpfp", 3)], key=str)


def test_cell_ids_are_stable_and_ignore_repeats(tmp_path):
    first = load_scenario(write(tmp_path, BASE)).cells()
    more_repeats = dict(BASE, measure={"repeats": 20})
    second = load_scenario(write(tmp_path, more_repeats, "u.yaml")).cells()
    assert [c.cell_id for c in first] == [c.cell_id for c in second]


def test_exclude_leaves_out_the_cells_matching_every_field(tmp_path):
    """``exclude`` drops the cells that match every field of an entry (a name or a list of names); the other
    cells keep their ids; an unknown name or an empty entry is an error naming the field."""
    whole = load_scenario(write(tmp_path, BASE)).cells()
    data = dict(BASE, exclude=[{"variant": "dpfp", "mode": "train"}, {"variant": ["softmax"], "mode": ["forward"]}])
    cells = load_scenario(write(tmp_path, data, "e.yaml")).cells()
    assert {(c.variant, c.mode) for c in cells} == {("softmax", "train"), ("dpfp", "forward")}
    assert [c.cell_id for c in cells] == [c.cell_id for c in whole if (c.variant, c.mode) in {("softmax", "train"), ("dpfp", "forward")}]
    assert 'exclude.0.mode: expected one of forward, train, decode, quality, got "trian"' in error_of(tmp_path, dict(BASE, exclude=[{"mode": "trian"}]))
    assert "exclude.0: expected at least one of variant, backend, mode" in error_of(tmp_path, dict(BASE, exclude=[{}]))


def test_list_of_parameter_sets_and_d_dot_axis(tmp_path):
    data = dict(BASE, variants={"performer": {}, "dpfp": {}}, axes={"seq_len": 32, "d_key": 8, "d_dot": [16, 32]})
    cells = load_scenario(write(tmp_path, data)).cells()
    assert sorted((c.variant, c.params["d_dot"]) for c in cells if c.mode == "forward") == [
        ("dpfp", 16),
        ("dpfp", 32),
        ("performer", 16),
        ("performer", 32),
    ]
    data["variants"] = {"delta": [{}, {"phi": "dpfp", "nu": [1, 2]}]}
    data["axes"] = {"seq_len": 32, "d_key": 8}
    cells = load_scenario(write(tmp_path, data, "v.yaml")).cells()
    assert [c.params for c in cells if c.mode == "forward"] == [{}, {"phi": "dpfp", "nu": 1}, {"phi": "dpfp", "nu": 2}]


def test_unreachable_d_dot_is_a_clear_error(tmp_path):
    data = dict(BASE, variants={"linear": {}}, axes={"seq_len": 32, "d_key": 8, "d_dot": [16]})
    message = error_of(tmp_path, data)
    assert "variants.linear" in message and "d_dot" in message and "16" in message
    data = dict(BASE, variants={"dpfp": {"d_dot": 100}}, axes={"seq_len": 32, "d_key": 64})
    message = error_of(tmp_path, data)
    assert "variants.dpfp" in message and "d_dot=100" in message and "multiple of 128" in message


def test_tokens_per_batch_rule_scales_batch(tmp_path):
    data = dict(BASE, variants={"softmax": {}}, modes=["forward"], axes={"seq_len": [512, 1024, 4096], "batch": 1}, rules={"tokens_per_batch": 8192})
    cells = load_scenario(write(tmp_path, data)).cells()
    assert [(c.axes["seq_len"], c.axes["batch"]) for c in cells] == [(512, 16), (1024, 8), (4096, 2)]


def test_preset_and_set_overrides(tmp_path):
    data = dict(BASE, presets={"ci": {"axes": {"seq_len": [16]}, "measure": {"repeats": 2}}})
    path = write(tmp_path, data)
    cells = load_scenario(path, preset="ci").cells()
    assert {c.axes["seq_len"] for c in cells} == {16} and cells[0].measure["repeats"] == 2
    cells = load_scenario(path, overrides=["seq_len=[256, 512]", "measure.repeats=4", "dtype=float64"]).cells()
    assert {c.axes["seq_len"] for c in cells} == {256, 512}
    assert cells[0].measure["repeats"] == 4 and cells[0].axes["dtype"] == "float64"


@pytest.mark.parametrize(
    "change, field, shown",
    [
        ({"colour": "red"}, "colour", "red"),
        ({"axes": {"seq_len": 8, "sequence": 3}}, "axes.sequence", "3"),
        ({"axes": {"seq_len": [0, 8]}}, "axes.seq_len", "0"),
        ({"axes": {"seq_len": 8, "dtype": "float8"}}, "axes.dtype", "float8"),
        ({"axes": {"seq_len": 8, "device": "tpu"}}, "axes.device", "tpu"),
        ({"axes": {"seq_len": "long"}}, "axes.seq_len", "long"),
        ({"modes": ["forwards"]}, "modes.0", "forwards"),
        ({"measure": {"repeats": 0}}, "measure.repeats", "0"),
        ({"measure": {"repetitions": 5}}, "measure.repetitions", "5"),
        ({"backends": ["cuda-graphs"]}, "backends", "cuda-graphs"),
        ({"target": "model"}, "(top level)", ""),
    ],
)
def test_validation_errors_name_field_and_value(tmp_path, change, field, shown):
    message = error_of(tmp_path, {**BASE, **change})
    assert field in message and shown in message, message


def test_unknown_variant_lists_known_ones(tmp_path):
    message = error_of(tmp_path, dict(BASE, variants={"softmaxx": {}}))
    assert "variants" in message and "softmaxx" in message
    assert all(name in message.split("known:")[1] for name in variants.names())


def test_unknown_variant_parameter(tmp_path):
    message = error_of(tmp_path, dict(BASE, variants={"linear": {"feature_map": "elu1"}}))
    assert "variants.linear" in message and "feature_map" in message


def test_unknown_preset_missing_file_bad_yaml_bad_set(tmp_path):
    message = error_of(tmp_path, BASE, preset="nightly")
    assert "presets.nightly" in message and "none" in message
    with pytest.raises(ScenarioError, match="no such scenario file"):
        load_scenario(str(tmp_path / "missing.yaml"))
    message = error_of(tmp_path, "variants: [unclosed")
    assert "not valid YAML" in message
    message = error_of(tmp_path, "- just\n- a list\n")
    assert "mapping" in message
    with pytest.raises(ScenarioError, match="KEY=VALUE"):
        load_scenario(write(tmp_path, BASE), overrides=["seq_len"])


TASK = {
    "name": "r",
    "variants": {"softmax": {}, "dpfp": {"nu": [1, 2]}},
    "task": {"name": "retrieval", "setting": 1, "max_steps": 10},
    "target": "retrieval",
    "modes": ["quality"],
    "axes": {"S": [4, 8], "d_key": 8},
}


def test_task_scenario_expands_over_s(tmp_path):
    cells = load_scenario(write(tmp_path, TASK)).cells()
    assert len(cells) == 6 and {c.axes["S"] for c in cells} == {4, 8}
    assert set(cells[0].axes) == {"S", "d_key", "dtype", "device"}
    assert cells[0].task["max_steps"] == 10 and cells[0].mode == "quality"


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"axes": {"d_key": 8}}, "axes.S"),
        ({"modes": ["forward"]}, "modes: [quality]"),
        ({"task": {"name": "retrieval", "setting": 3}}, "task.setting: expected 1 or 2, got 3"),
        ({"task": {"name": "wikitext"}}, "'mqar'"),
    ],
)
def test_task_scenario_errors(tmp_path, change, expected):
    message = error_of(tmp_path, {**TASK, **change})
    assert expected in message, message


def test_quality_mode_needs_a_task(tmp_path):
    message = error_of(tmp_path, dict(BASE, modes=["quality"]))
    assert "task" in message


def test_a_preset_replaces_the_variants(tmp_path):
    data = dict(BASE, presets={"small": {"variants": {"linear": {}}}})
    cells = load_scenario(write(tmp_path, data), preset="small").cells()
    assert {c.variant for c in cells} == {"linear"}


def test_mqar_task_scenario(tmp_path):
    data = {**TASK, "task": {"name": "mqar", "steps": 5}, "target": "mqar", "axes": {"seq_len": [32, 64], "d_model": 16}}
    cells = load_scenario(write(tmp_path, data)).cells()
    assert len(cells) == 6 and set(cells[0].axes) == {"seq_len", "d_model", "dtype", "device"}
    message = error_of(tmp_path, {**data, "axes": {"seq_len": 32}})
    assert "axes.d_model" in message


def test_a_variant_configuration_with_its_own_axes(tmp_path):
    """``axes`` inside a configuration replace the scenario's for its cells only (S placed
    around each variant's capacity); the other configurations keep the scenario's."""
    data = {
        **TASK,
        "axes": {"S": [4, 300], "d_key": 8, "seed": [0, 1]},
        "variants": {"softmax": {}, "linear": {"axes": {"S": [4, 8]}}, "dpfp": [{"nu": 1, "axes": {"S": 16}}, {"nu": 2, "axes": {"S": [32, 48], "seed": 7}}]},
    }
    cells = load_scenario(write(tmp_path, data)).cells()
    grid = {(c.variant, c.params.get("nu"), c.axes["S"], c.axes["seed"]) for c in cells}
    assert grid == {("softmax", None, S, seed) for S in (4, 300) for seed in (0, 1)} | {("linear", None, S, seed) for S in (4, 8) for seed in (0, 1)} | {
        ("dpfp", 1, 16, 0),
        ("dpfp", 1, 16, 1),
        ("dpfp", 2, 32, 7),
        ("dpfp", 2, 48, 7),
    }
    assert len(cells) == len(grid)
    assert all("axes" not in c.params for c in cells)
    assert {c.task["seed"] for c in cells if c.params.get("nu") == 2} == {7}
    # the cells of a configuration without its own axes keep their ids
    plain = {**data, "variants": {"softmax": {}}}
    softmax_ids = {c.cell_id for c in cells if c.variant == "softmax"}
    assert {c.cell_id for c in load_scenario(write(tmp_path, plain, "p.yaml")).cells()} == softmax_ids


@pytest.mark.parametrize(
    "variant_spec, expected",
    [
        ({"axes": {"T": 4}}, "variants.linear.axes.T: the scenario has no such axis to replace (its axes: S, d_key, dtype, device, seed)"),
        ({"axes": {"S": [0]}}, "variants.linear.axes.S: expected positive integers"),
        ({"axes": {"seed": [1, 1]}}, "variants.linear.axes.seed: a seed is listed twice"),
        ({"axes": {"dtype": "float8"}}, "variants.linear.axes.dtype: expected one of float32"),
        ({"axes": 3}, "variants.linear.axes: expected a mapping of axis names to values, got 3"),
        ({"nu": {"a": 1}}, "variants.linear.nu: expected a value or a list of values, got a mapping"),
    ],
)
def test_a_configurations_axes_are_checked_like_the_scenarios(tmp_path, variant_spec, expected):
    data = {**TASK, "axes": {"S": 4, "d_key": 8, "seed": 0}, "variants": {"linear": variant_spec}}
    message = error_of(tmp_path, data)
    assert expected in message, message


def test_a_speed_scenario_configuration_may_have_its_own_lengths(tmp_path):
    data = dict(BASE, variants={"softmax": {"axes": {"seq_len": 32}}, "linear": {}})
    lengths = {(c.variant, c.axes["seq_len"]) for c in load_scenario(write(tmp_path, data)).cells()}
    assert lengths == {("softmax", 32), ("linear", 64), ("linear", 128)}
    message = error_of(tmp_path, dict(BASE, variants={"linear": {"axes": {"S": 4}}}))
    assert "variants.linear.axes.S: the scenario has no such axis" in message and "seq_len" in message


def test_a_variant_of_its_own_d_key(tmp_path):
    """Based's 16-dimensional keys beside 64-dimensional heads: the core's d_key axis is the
    variant's, values keep the axis width; a task's layer receives d_key as a parameter."""
    data = dict(BASE, variants={"linear": {}, "based": {"d_key": 16}}, axes={"seq_len": 32, "d_key": 64})
    cells = [c for c in load_scenario(write(tmp_path, data)).cells() if c.mode == "forward"]
    shapes = {c.variant: (c.axes["d_key"], c.axes["d_value"], c.params) for c in cells}
    assert shapes == {"linear": (64, 64, {}), "based": (16, 64, {})}
    mqar = {**TASK, "task": {"name": "mqar", "steps": 5}, "target": "mqar", "axes": {"seq_len": 32, "d_model": 64}, "variants": {"rebased": {"d_key": 16}}}
    (cell,) = load_scenario(write(tmp_path, mqar, "m.yaml")).cells()
    assert cell.params == {"d_key": 16} and cell.axes["d_model"] == 64
    message = error_of(tmp_path, dict(data, variants={"based": {"d_key": 0}}))
    assert "variants.based" in message and "d_key must be a positive int" in message


@pytest.mark.parametrize("target", ["core", "layer"])
def test_cells_of_a_variant_with_its_own_d_key_measure(tmp_path, target):
    from harness.running.workloads import measure_cell

    data = dict(
        BASE,
        variants={"rebased": {"d_key": 4}},
        axes={"seq_len": 16, "batch": 1, "heads": 2, "d_key": 8},
        target=target,
        modes=["forward", "train", "decode"],
        decode={"new_tokens": 2},
        measure={"warmup": 0, "repeats": 1, "max_time_s": 0},
    )
    for cell in load_scenario(write(tmp_path, data)).cells():
        result = measure_cell(cell)
        assert result["status"] == "ok", (cell.mode, result)
    # the decoding state holds d_dot x d_value = 16 x 8 per head
    assert result["metrics"]["state_numel"] == 2 * (16 * 8 + 16)

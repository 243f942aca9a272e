"""Task configs (a scenario's ``task:`` section) are strict and bounded: an unknown key, a value
of the wrong type or a size that would take the machine's memory is refused when the scenario
loads, in one line naming the field (issue 36). Every shipped scenario and preset stays within
the bounds (tests/test_harness/test_scenario.py expands each)."""

from __future__ import annotations

import pytest

from harness.scenarios.scenario import ScenarioError, load_scenario


@pytest.mark.parametrize(
    ("scenario", "override", "expected"),
    [
        ("quality/mqar", "task.bogus=1", "task.bogus: not a field (got 1)"),
        ("quality/mqar", "task.steps=true", "task.steps: expected an integer, got true"),
        ("quality/mqar", "task.lr='1e-3'", 'task.lr: expected a number, got "1e-3"'),
        ("quality/mqar", "task.vocab_size=1000000000000", "task.vocab_size: expected at most 1048576, got 1000000000000"),
        ("quality/mqar", "task.batch=1000000000", "task.batch: expected at most 65536, got 1000000000"),
        ("quality/mqar", "task.seed=-1", "task.seed: expected at least 0, got -1"),
        ("quality/retrieval-capacity", "task.lr=.inf", "task.lr: expected a finite number"),
        ("quality/retrieval-capacity", "task.max_steps=10000000000", "task.max_steps: expected at most 1000000000, got 10000000000"),
        ("quality/copy", "task.d_model=100000000", "task.d_model: expected at most 65536, got 100000000"),
        ("quality/copy", "task.n_symbols=1000000000000", "task.n_symbols: expected at most 1048576, got 1000000000000"),
        ("quality/image-gen", "task.speed_pixels=[1000000000]", "task.speed_pixels.0: expected at most 1048576, got 1000000000"),
        ("quality/lm-wikitext", "task.model_overrides.n_layers=abc", "task.model_overrides: n_layers: expected an integer from 1 to 1024"),
        ("quality/lm-wikitext", "task.model_overrides.d_model=1000000000", "task.model_overrides: d_model: expected an integer from 1 to 65536"),
        ("quality/lm-wikitext", "task.segment={kind: rmt, memory: 100000000}", "task.segment: segment.memory: expected at most 1048576"),
        ("quality/mt-multi30k", "task.vocab_size=1000000000", "task.vocab_size: expected at most 1048576, got 1000000000"),
        ("decode", "decode.new_tokens=1000000000", "decode.new_tokens: expected at most 65536, got 1000000000"),
    ],
)
def test_a_task_setting_out_of_bounds_or_of_the_wrong_type_is_refused_in_one_line(scenario, override, expected):
    with pytest.raises(ScenarioError) as caught:
        load_scenario(scenario, preset="ci", overrides=[override])
    message = str(caught.value)
    assert expected in message, message
    assert len(message.splitlines()) == 1, "one line naming the file and the field"

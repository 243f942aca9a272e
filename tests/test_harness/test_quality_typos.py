"""A quality scenario is checked before torch loads, as a speed scenario is (issue 53, item 5): each shipped task's
config (``harness.tasks.<task>_config``), the decoder's presets (``harness.models.configs``) and the training dtypes
(``harness.tasks.precision``) import no torch, so a mistake in a ``task:`` section is answered at once."""

from __future__ import annotations

import json
import subprocess
import sys

from test_harness.test_refusals import REFUSE, ROOT

#: Each mistake (``attnbench`` arguments) and what its one line of stderr says: one for each shipped task.
MISTAKES = [
    (["run", "quality/mqar", "--set", "task.bogus=1"], "mqar.yaml: task.bogus: not a field (got 1)"),
    (["run", "quality/mqar", "--set", "axes.dtype=float64"], "axes.dtype: a quality task trains in float32, bfloat16, float16"),
    (["run", "quality/retrieval-capacity", "--set", "task.setting=3"], "task.setting: expected 1 or 2, got 3"),
    (["run", "quality/copy", "--set", "task.n_symbols=0"], "task.n_symbols: expected at least 1, got 0"),
    (["run", "quality/image-gen", "--set", "task.dataset=mnits"], "task.dataset: expected 'digits', 'mnist' or 'cifar10' (did you mean 'mnist'?)"),
    (["run", "quality/lm-wikitext", "--set", "task.preset=cpuu"], 'task.preset: expected a model preset among small, medium, cpu, got "cpuu"'),
    (["run", "quality/lm-wikitext", "--set", "task.segment={kind: nope}"], "task.segment: segment.kind must be one of none, xl, rmt, carry_state"),
    (["run", "quality/mt-multi30k", "--set", "task.encoder=softmx"], "task.encoder: unknown variant 'softmx'"),
]
#: Every shipped quality scenario checked as it is (no mistake), then the mistakes (``REFUSE``), in one fresh interpreter.
CHECK_THEN_REFUSE = (
    "from harness.scenarios.scenario import check_scenario, shipped\n"
    "for name in shipped():\n"
    "    if name.startswith('quality/'):\n"
    "        check_scenario(name)\n"
) + REFUSE


def test_checking_a_quality_scenario_and_refusing_its_mistakes_loads_no_torch():
    argvs = [[*args, "--dry-run"] for args, _ in MISTAKES]
    done = subprocess.run([sys.executable, "-c", CHECK_THEN_REFUSE, json.dumps(argvs)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    for (args, said), (code, err) in zip(MISTAKES, result["answers"]):
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and said in err, (args, err)
    assert result["loaded"] == [], f"a quality scenario's check waited for {result['loaded']}"

"""Multi-query associative recall (Arora et al. 2023, "Zoology"): data, model, training."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import attnbench

from harness.models.mqar import MQARModel
from harness.scenarios.scenario import ScenarioError, load_scenario
from harness.tasks.mqar import IGNORE, MQARConfig, make_batch, run_mqar, train


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- data ------------------------------------------------------------------------------


@pytest.mark.parametrize("T, N, V", [(32, 4, 64), (64, None, 256), (16, 4, 16)])
def test_batch_shapes(seed, T, N, V):
    inputs, targets = make_batch(T, N, V, 5, gen(seed))
    assert inputs.shape == targets.shape == (5, T), f"seed={seed}"
    assert inputs.dtype == targets.dtype == torch.long, f"seed={seed}"
    assert inputs.min() >= 0 and inputs.max() < V, f"seed={seed}"
    n = T // 8 if N is None else N
    assert ((targets != IGNORE).sum(dim=1) == n).all(), f"N query targets per sequence, seed={seed}"


def test_pairs_queries_and_targets(seed):
    T, N, V = 48, 6, 40
    inputs, targets = make_batch(T, N, V, 100, gen(seed))
    for row, target in zip(inputs.tolist(), targets.tolist()):
        keys, values = row[0 : 2 * N : 2], row[1 : 2 * N : 2]
        assert len(set(keys)) == N and all(1 <= k < V // 2 for k in keys), f"distinct key-half keys, seed={seed}"
        assert all(V // 2 <= v < V for v in values), f"value-half values, seed={seed}"
        binding = dict(zip(keys, values))
        rest = row[2 * N :]
        queried = [t for t, tok in enumerate(rest) if tok in binding]
        assert sorted(rest[t] for t in queried) == sorted(keys), f"every key queried exactly once, seed={seed}"
        for t in queried:
            p = 2 * N + t
            assert target[p] == binding[row[p]], f"target at a query is its bound value, seed={seed}"
            assert row[p + 1] == binding[row[p]], f"the token after a query is its value, seed={seed}"
        allowed = {2 * N + t for t in queried}
        assert all(tok == IGNORE for p, tok in enumerate(target) if p not in allowed), f"seed={seed}"
        filler = {2 * N + t for t in queried} | {2 * N + t + 1 for t in queried}
        assert all(tok == 0 for p, tok in enumerate(row) if p >= 2 * N and p not in filler), f"seed={seed}"


def test_deterministic_per_generator_seed(seed):
    a = make_batch(32, 4, 64, 8, gen(seed))
    b = make_batch(32, 4, 64, 8, gen(seed))
    c = make_batch(32, 4, 64, 8, gen(seed + 1))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), f"seed={seed}"
    assert not torch.equal(a[0], c[0]), f"seed={seed}"


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(seq_len=32, num_pairs=9, vocab_size=64), "num_pairs"),  # 4N > T
        (dict(seq_len=32, num_pairs=0, vocab_size=64), "num_pairs"),
        (dict(seq_len=64, num_pairs=8, vocab_size=16), "num_pairs"),  # more pairs than keys
        (dict(seq_len=2, num_pairs=None, vocab_size=64), "seq_len"),
        (dict(seq_len=32, num_pairs=4, vocab_size=2), "vocab_size"),
        (dict(seq_len=32.0, num_pairs=4, vocab_size=64), "seq_len"),
        (dict(seq_len=32, num_pairs=4, vocab_size=64, batch=0), "batch"),
        (dict(seq_len=32, num_pairs=4, vocab_size=64, generator=3), "generator"),
    ],
)
def test_bad_parameters_name_the_parameter(kwargs, name):
    call = dict(batch=2, generator=gen(0)) | kwargs
    with pytest.raises(ValueError, match=name):
        make_batch(**call)


def test_train_rejects_bad_parameters():
    model = MQARModel(64, 16, "softmax", n_layers=1, max_len=32)
    with pytest.raises(ValueError, match="vocab_size"):
        train(model, MQARConfig(name="mqar", num_pairs=4, vocab_size=128, steps=1), 32)
    with pytest.raises(ValueError, match="seq_len=64 exceeds the model's max_len=32"):
        train(model, MQARConfig(name="mqar", num_pairs=4, vocab_size=64, steps=1), 64)
    for field, value in (("lr", 0), ("steps", 0)):
        with pytest.raises(ValueError, match=field):
            MQARConfig(name="mqar", **{field: value})


# --- model -----------------------------------------------------------------------------

VARIANTS = [("softmax", {}), ("linear", {}), ("delta", {})]


@pytest.mark.parametrize("variant, params", VARIANTS)
def test_model_output_shape(seed, variant, params):
    torch.manual_seed(seed)
    model = MQARModel(64, 32, variant, n_heads=2, **params)
    inputs, _ = make_batch(32, 4, 64, 3, gen(seed))
    logits = model(inputs)
    assert logits.shape == (3, 32, 64) and torch.isfinite(logits).all(), f"seed={seed}"


@pytest.mark.parametrize("variant, params", VARIANTS)
def test_causal(seed, variant, params):
    torch.manual_seed(seed)
    model = MQARModel(64, 32, variant, conv_size=4, **params).double()
    inputs, _ = make_batch(32, 4, 64, 2, gen(seed))
    t = int(torch.randint(1, 31, (1,), generator=gen(seed)))
    changed = inputs.clone()
    changed[:, t + 1 :] = torch.randint(64, changed[:, t + 1 :].shape, generator=gen(seed + 1))
    with torch.no_grad():
        a, b = model(inputs), model(changed)
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], msg=f"seed={seed}, t={t}")
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :]), f"later logits depend on later inputs, seed={seed}"


# --- training --------------------------------------------------------------------------


@pytest.mark.slow
def test_softmax_learns_mqar():
    """The pipeline learns: softmax attention solves a small MQAR within 300 steps. Whether a
    short run passes MQAR's phase transition depends on the seed (seed 643 stayed at 0.33), so
    this test trains from a fixed seed; the generator and model tests use fresh ones."""
    seed = 0
    config = MQARConfig(name="mqar", num_pairs=4, vocab_size=64, steps=300, lr=4e-3, eval_every=75, seed=seed)
    result = run_mqar("softmax", {}, config, seq_len=32, d_model=64)
    assert json.loads(json.dumps(result)) == result
    assert result["steps"] == 300 and result["evaluations"][-1][0] == 300
    assert result["accuracy"] >= result["final_accuracy"]
    # training throughput: 300 steps of 64 sequences of 32 tokens, in less time than the whole run
    assert result["words_per_s"] > 300 * 64 * 32 / result["wall_s"]
    # chance is 1/32 (values are the upper half of 64 tokens)
    assert result["accuracy"] > 0.5, f"seed={seed}: {result['evaluations']}"


# --- mixed precision, through the scenario and the command line -------------------------------


def test_a_quality_scenario_takes_the_dtypes_of_the_policy_and_refuses_others():
    """``dtype`` of a quality scenario is checked when it loads (harness.tasks.precision)."""
    cells = load_scenario("quality/mqar", preset="ci", overrides=["dtype=[bfloat16, float16]"]).cells()
    assert {cell.axes["dtype"] for cell in cells} == {"bfloat16", "float16"}
    with pytest.raises(ScenarioError, match=r"axes\.dtype: a quality task trains in float32, bfloat16, float16 .*not 'float64'"):
        load_scenario("quality/mqar", preset="ci", overrides=["dtype=float64"])


@pytest.mark.slow
def test_the_ci_preset_trains_in_bfloat16_through_attnbench_run(tmp_path):
    """The issue's check: ``attnbench run quality/mqar --preset ci --set dtype=bfloat16`` trains, every cell ok."""
    from harness.results import load

    done = attnbench(
        "run",
        "quality/mqar",
        "--preset",
        "ci",
        "--set",
        "dtype=bfloat16",
        "--set",
        "task.steps=4",
        "--set",
        "task.eval_every=2",
        "--out",
        str(tmp_path),
        "--no-progress",
    )
    assert done.returncode == 0, done.stderr
    table = load([tmp_path])
    assert set(table["status"]) == {"ok"} and set(table["axes.dtype"]) == {"bfloat16"}, table[["variant", "error"]]
    assert table["metrics.loss"].between(0, 10).all() and table["metrics.accuracy"].between(0, 1).all()

"""The associative retrieval task of Schlag et al. 2021, §6.1: data, model, training."""

from __future__ import annotations

import json

import pytest
import torch

from harness.models.retrieval import RetrievalModel
from harness.tasks.retrieval import RetrievalConfig, evaluate, make_batch, make_eval_batch, retrieval_loss, run_retrieval, train


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- data ------------------------------------------------------------------------------


@pytest.mark.parametrize("setting, length_factor", [(1, 1), (2, 2)])
def test_batch_shapes(seed, setting, length_factor):
    S, B = 7, 5
    batch = make_batch(setting, S, B, gen(seed))
    assert batch.keys.shape == batch.values.shape == (B, length_factor * S), f"seed={seed}"
    assert batch.query.shape == batch.answer.shape == (B,), f"seed={seed}"
    for t in (batch.keys, batch.values, batch.query, batch.answer):
        assert t.dtype == torch.long and t.min() >= 0 and t.max() < S, f"seed={seed}"


def test_setting1_samples_without_replacement(seed):
    S = 9
    batch = make_batch(1, S, 50, gen(seed))
    expected = torch.arange(S).expand(50, S)
    assert torch.equal(batch.keys.sort(dim=1).values, expected), f"every key once per sequence, seed={seed}"
    assert torch.equal(batch.values.sort(dim=1).values, expected), f"every value once per sequence, seed={seed}"


def brute_force_answer(keys, values, query) -> int:
    answer = None
    for key, value in zip(keys.tolist(), values.tolist()):
        if key == query:
            answer = value
    assert answer is not None, "the query key does not occur in the sequence"
    return answer


@pytest.mark.parametrize("setting", [1, 2])
def test_answer_is_most_recent_binding(seed, setting):
    batch = make_batch(setting, 6, 200, gen(seed))
    for keys, values, query, answer in zip(batch.keys, batch.values, batch.query, batch.answer):
        assert answer.item() == brute_force_answer(keys, values, query.item()), f"seed={seed}"


def test_setting2_samples_with_replacement(seed):
    batch = make_batch(2, 6, 200, gen(seed))
    repeats = [len(set(keys)) < len(keys) for keys in batch.keys.tolist()]
    assert all(repeats), f"L = 2S keys out of S must repeat, seed={seed}"
    values_repeat = [len(set(values)) < len(values) for values in batch.values.tolist()]
    assert all(values_repeat), f"seed={seed}"
    # Keys are drawn with replacement: the number of distinct keys varies between sequences.
    assert len({len(set(keys)) for keys in batch.keys.tolist()}) > 1, f"seed={seed}"


@pytest.mark.parametrize("setting", [1, 2])
def test_deterministic_per_generator_seed(seed, setting):
    a, b = make_batch(setting, 8, 16, gen(seed)), make_batch(setting, 8, 16, gen(seed))
    for name in ("keys", "values", "query", "answer"):
        assert torch.equal(getattr(a, name), getattr(b, name)), f"{name}, seed={seed}"
    c = make_batch(setting, 8, 16, gen(seed + 1))
    assert not torch.equal(a.keys, c.keys), f"seed={seed}"
    e1, e2 = make_eval_batch(setting, 8, generator=gen(seed)), make_eval_batch(setting, 8, generator=gen(seed))
    assert torch.equal(e1.keys, e2.keys) and torch.equal(e1.query, e2.query), f"seed={seed}"


@pytest.mark.parametrize("setting", [1, 2])
def test_eval_batch_queries_every_distinct_key(seed, setting):
    S, sequences = 7, 20
    batch = make_eval_batch(setting, S, sequences, generator=gen(seed))
    if setting == 1:
        assert batch.query.shape == (sequences * S,), f"S queries per sequence, seed={seed}"
    # Group the rows by sequence: each distinct key of the sequence is queried exactly once.
    groups: dict[tuple, list[int]] = {}
    for keys, values, query in zip(batch.keys.tolist(), batch.values.tolist(), batch.query.tolist()):
        groups.setdefault((tuple(keys), tuple(values)), []).append(query)
    assert len(groups) == sequences, f"seed={seed}"
    for (keys, _), queries in groups.items():
        assert sorted(queries) == sorted(set(keys)), f"seed={seed}"
    for keys, values, query, answer in zip(batch.keys, batch.values, batch.query, batch.answer):
        assert answer.item() == brute_force_answer(keys, values, query.item()), f"seed={seed}"


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: make_batch(1, 0, 4, gen(0)), "S"),
        (lambda: make_batch(3, 4, 4, gen(0)), "setting"),
        (lambda: make_batch(1, 4, 0, gen(0)), "batch"),
        (lambda: make_batch(1, 4, 4, 0), "generator"),
        (lambda: make_eval_batch(2, 4, 0, generator=gen(0)), "sequences"),
        (lambda: RetrievalModel(0, "softmax"), "S"),
        (lambda: RetrievalModel(4, "softmax", d_emb=0), "d_emb"),
        (lambda: train(RetrievalModel(4, "softmax", d_key=8), RetrievalConfig(max_steps=1), 5), "S"),
    ],
)
def test_bad_parameters_name_the_parameter(call, name):
    with pytest.raises(ValueError, match=rf"^{name} must"):
        call()


# --- model -----------------------------------------------------------------------------

VARIANTS = [("softmax", {}), ("linear", {}), ("delta", {})]


@pytest.mark.parametrize("variant, params", VARIANTS)
@pytest.mark.parametrize("setting", [1, 2])
def test_model_output_shape(seed, variant, params, setting):
    torch.manual_seed(seed)
    model = RetrievalModel(5, variant, d_key=16, **params)
    batch = make_batch(setting, 5, 3, gen(seed))
    v_hat = model(batch)
    assert v_hat.shape == (3, 5) and torch.isfinite(v_hat).all(), f"seed={seed}"


@pytest.mark.parametrize("variant, params", VARIANTS)
def test_read_ignores_queries_before_the_last_position(seed, variant, params):
    torch.manual_seed(seed)
    model = RetrievalModel(6, variant, d_key=16, **params).double()
    batch = make_batch(2, 6, 4, gen(seed))
    q, k, v, beta = model.sequences(batch)
    assert torch.equal(q[:, :, :-1], torch.zeros_like(q[:, :, :-1])), f"seed={seed}"
    noisy = q.clone()
    noisy[:, :, :-1] = torch.randn(q[:, :, :-1].shape, generator=gen(seed), dtype=q.dtype)
    read = model.core(noisy, k, v, beta=beta)[:, 0, -1]
    torch.testing.assert_close(read, model(batch), msg=lambda m: f"{m}, seed={seed}")
    # The read is the step-by-step recurrent form after all L writes.
    state = model.core.init_state(q.shape[0], 1, v.shape[-1], dtype=q.dtype)
    for t in range(q.shape[2]):
        out, state = model.core.step(q[:, :, t], k[:, :, t], v[:, :, t], state, beta_t=None if beta is None else beta[:, :, t])
    torch.testing.assert_close(out[:, 0], model(batch), msg=lambda m: f"{m}, seed={seed}")


@pytest.mark.parametrize("variant, params", [*VARIANTS, ("performer", {"m": 8}), ("dpfp", {"nu": 2})])
@pytest.mark.parametrize("setting", [1, 2])
@pytest.mark.parametrize("S", [1, 7])
def test_evaluation_reads_each_sequence_once_and_matches_the_forward(seed, variant, params, setting, S):
    """``evaluate`` writes each distinct sequence once and answers its queries with one recurrent
    step: the same loss as the training forward run on every (sequence, query) row, in float64 to
    rounding, over chunks that split a sequence's queries; and on a batch of distinct sequences.
    S = 1 in setting 1 is a one-pair sequence: nothing to prefill, the step writes it."""
    torch.manual_seed(seed)
    model = RetrievalModel(S, variant, d_key=8, **params).double()
    for batch in (make_eval_batch(setting, S, sequences=5, generator=gen(seed)), make_batch(setting, S, 9, gen(seed))):
        with torch.no_grad():
            rows = retrieval_loss(model(batch), batch.answer).item()
        assert evaluate(model, batch, chunk=4) == pytest.approx(rows, rel=1e-12, abs=1e-15), f"seed={seed}"


def test_delta_beta_gets_gradients(seed):
    torch.manual_seed(seed)
    model = RetrievalModel(6, "delta", d_key=16)
    batch = make_batch(2, 6, 8, gen(seed))
    retrieval_loss(model(batch), batch.answer).backward()
    for p in model.W_beta.parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"seed={seed}"
    assert RetrievalModel(6, "linear", d_key=16).W_beta is None


def test_loss_definition():
    v_hat = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])
    answer = torch.tensor([0, 1])
    # Row 0: ½(0.25 + 0.25) = 0.25; row 1: ½(1 + 1) = 1; mean 0.625.
    assert retrieval_loss(v_hat, answer).item() == pytest.approx(0.625)


# --- training --------------------------------------------------------------------------


def test_softmax_learns_setting1(seed):
    result = run_retrieval("softmax", {}, RetrievalConfig(setting=1, max_steps=1500, eval_every=100, seed=seed), S=8)
    assert result["loss"] < 0.05, f"best eval loss {result['loss']} after {result['steps']} steps, seed={seed}"
    assert result["stopped"] in ("target", "patience", "max_steps"), f"seed={seed}"
    assert result["evaluations"][-1] == [result["steps"], result["final_loss"]], f"seed={seed}"
    assert result["loss"] == min(loss for _, loss in result["evaluations"]), f"seed={seed}"
    assert set(result) == {"loss", "final_loss", "steps", "wall_s", "stopped", "words_per_s", "seed", "evaluations", "resumed_from"}
    assert result["resumed_from"] is None
    assert result["words_per_s"] > 0
    json.dumps(result)


def test_linear_attention_loss_decreases(seed):
    torch.manual_seed(seed)
    model = RetrievalModel(8, "linear", d_key=64)
    held_out = make_eval_batch(1, 8, generator=gen(seed))
    before = evaluate(model, held_out)
    result = train(model, RetrievalConfig(max_steps=200, eval_every=100, target_loss=1e-12, seed=seed), 8)
    after = evaluate(model, held_out)
    assert result.steps == 200 and result.stopped == "max_steps", f"seed={seed}"
    assert after < 0.5 * before, f"loss {before} -> {after}, seed={seed}"

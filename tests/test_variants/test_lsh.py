"""LSH attention (Reformer) beyond what every variant's tests check: the sorted-chunk algorithm
against the exact same-bucket attention, its masks, the rounds and the shared-QK layer."""

from __future__ import annotations

import pytest
import torch

import variants


def _inputs(core, length, seed, d_value=5):
    return core.example_inputs(2, 3, length, d_value, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _largest_bucket(core, q) -> int:
    buckets = core.buckets(q)
    return max(int(torch.bincount(row).max()) for row in buckets.reshape(-1, buckets.shape[-1]))


@pytest.mark.parametrize(("n_rounds", "seed"), [(1, 0), (1, 3), (3, 2), (3, 7)])
def test_chunked_equals_the_reference_when_no_bucket_overflows_its_window(n_rounds, seed):
    """Fixed draws in which every bucket fits its chunk (checked), with several chunks."""
    core = variants.create("lsh", 8, n_rounds=n_rounds, n_buckets=64, chunk_size=16, seed=seed)
    inputs = _inputs(core, 61, seed)
    assert _largest_bucket(core, inputs["q"]) <= core.chunk_size, "the draw overflowed a window: the test says nothing"
    assert -(-61 // core.chunk_size) > 2, "several chunks, or the window is the whole sequence"
    torch.testing.assert_close(core(**inputs), core.reference(**inputs), rtol=1e-12, atol=1e-12)


def test_chunked_only_approximates_the_reference_when_buckets_overflow(seed):
    """Two buckets for 128 tokens in chunks of 8: most bucket-mates fall outside the window."""
    core = variants.create("lsh", 8, n_buckets=2, chunk_size=8, seed=seed % 1000)
    inputs = _inputs(core, 128, seed)
    assert _largest_bucket(core, inputs["q"]) > 2 * core.chunk_size
    chunked, exact = core(**inputs), core.reference(**inputs)
    assert torch.isfinite(chunked).all()
    relative = (chunked - exact).norm() / exact.norm()
    assert 1e-3 < relative < 1, relative


def test_the_step_form_is_the_exact_definition(seed):
    core = variants.create("lsh", 8, n_rounds=2, n_buckets=2, chunk_size=4, seed=seed % 1000)
    inputs = _inputs(core, 40, seed)
    torch.testing.assert_close(core.step_loop(inputs)[0], core.reference(**inputs), rtol=1e-12, atol=1e-12)


def test_a_query_sees_only_earlier_tokens_of_its_bucket_and_itself_only_alone(seed):
    core = variants.create("lsh", 8, n_buckets=4, chunk_size=64, seed=seed % 1000)
    inputs = _inputs(core, 30, seed)
    buckets = core.buckets(inputs["q"])[0, 0, 0]
    out = core.reference(**inputs)
    torch.testing.assert_close(out[:, :, 0], inputs["v"][:, :, 0])  # the first token has no earlier one
    t = 20
    others = [j for j in range(30) if j == t or j > t or buckets[j] != buckets[t]]
    changed = dict(inputs, v=inputs["v"].clone(), k=inputs["k"].clone())
    changed["v"][0, 0, others] += 5.0
    changed["k"][0, 0, [j for j in others if j != t]] += 5.0
    torch.testing.assert_close(core.reference(**changed)[0, 0, t], out[0, 0, t])
    mates = [j for j in range(t) if buckets[j] == buckets[t]]
    if mates:
        changed["v"][0, 0, mates[0]] += 5.0
        assert not torch.allclose(core.reference(**changed)[0, 0, t], out[0, 0, t])


def test_rounds_are_combined_by_their_log_sum_exp():
    """Two rounds equal the lse-weighted mix of the two single rounds (the rotations of round r
    are the r-th draw of the seed's generator)."""
    two = variants.create("lsh", 8, n_rounds=2, n_buckets=4, chunk_size=64, seed=5)
    inputs = _inputs(two, 24, 0)
    outs, lses = [], []
    for r in range(2):
        one = variants.create("lsh", 8, n_buckets=4, chunk_size=64, seed=5)
        one.rotations = two.rotations[r : r + 1].clone()
        outs.append(one.reference(**inputs))
        scores = (inputs["q"] @ inputs["k"].transpose(-1, -2)) * one.scale
        buckets = one.buckets(inputs["q"])[:, :, 0]
        T = 24
        allowed = (buckets[..., :, None] == buckets[..., None, :]) & torch.ones(T, T, dtype=torch.bool).tril(-1)
        allowed |= torch.eye(T, dtype=torch.bool) & ~allowed.any(-1, keepdim=True)
        lses.append(torch.logsumexp(scores.masked_fill(~allowed, -torch.inf), -1))
    weights = torch.softmax(torch.stack(lses), dim=0).unsqueeze(-1)
    torch.testing.assert_close(two.reference(**inputs), (weights * torch.stack(outs)).sum(0))


def test_the_layer_shares_queries_and_keys():
    layer = variants.AttentionLayer(12, 3, "lsh", n_buckets=4, chunk_size=64)
    assert layer.key is None and not any(name.startswith("key.") for name, _ in layer.named_parameters())
    q, k, _, _ = layer._project(torch.randn(2, 5, 12))
    torch.testing.assert_close(k, torch.nn.functional.normalize(q, dim=-1))
    with pytest.raises(variants.VariantError, match="shared_qk"):
        layer.cross(torch.randn(1, 4, 12), torch.randn(1, 4, 12))


@pytest.mark.parametrize(("params", "message"), [({"n_buckets": 3}, "even"), ({"n_rounds": 0}, "n_rounds"), ({"chunk_size": 0}, "chunk_size")])
def test_bad_parameters_are_refused(params, message):
    with pytest.raises(variants.VariantError, match=message):
        variants.create("lsh", 8, **params)

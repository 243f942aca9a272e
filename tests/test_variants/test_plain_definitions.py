"""The switches that turn normalisation off and φ into the identity give the textbook rules,
written out here independently of the library, so other libraries' plain definitions can be
checked against attnbench's variants."""

from __future__ import annotations

import torch

import variants


def _random(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_plain_linear_attention_is_masked_qk_v(seed):
    q, k, v = _random(seed, 2, 3, 45, 6), _random(seed + 1, 2, 3, 45, 6), _random(seed + 2, 2, 3, 45, 4)
    core = variants.create("linear", 6, phi="identity", normalize=False, chunk_size=16)
    expected = torch.tril(q @ k.transpose(-1, -2)) @ v
    torch.testing.assert_close(core(q, k, v), expected, rtol=1e-10, atol=1e-10, msg=lambda m: f"seed {seed}: {m}")


def test_plain_delta_rule_is_the_textbook_recurrence(seed):
    batch, heads, length, d_key, d_value = 2, 2, 50, 5, 3
    q, k, v = _random(seed, batch, heads, length, d_key), _random(seed + 1, batch, heads, length, d_key), _random(seed + 2, batch, heads, length, d_value)
    k = k / k.norm(dim=-1, keepdim=True)
    beta = torch.rand(batch, heads, length, generator=torch.Generator().manual_seed(seed + 3), dtype=torch.float64)
    expected = torch.empty(batch, heads, length, d_value, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            W = torch.zeros(d_value, d_key, dtype=torch.float64)
            for t in range(length):
                W = W + beta[b, h, t] * torch.outer(v[b, h, t] - W @ k[b, h, t], k[b, h, t])
                expected[b, h, t] = W @ q[b, h, t]
    core = variants.create("delta", d_key, phi="identity", sum_norm=False, chunk_size=16)
    torch.testing.assert_close(core(q, k, v, beta=beta), expected, rtol=1e-10, atol=1e-10, msg=lambda m: f"seed {seed}: {m}")


def test_softmax_matches_the_textbook_formula(seed):
    q, k, v = _random(seed, 1, 2, 30, 8), _random(seed + 1, 1, 2, 30, 8), _random(seed + 2, 1, 2, 30, 3)
    scores = (q @ k.transpose(-1, -2)) / 8**0.5
    scores = scores + torch.full((30, 30), float("-inf"), dtype=torch.float64).triu(1)
    expected = torch.softmax(scores, -1) @ v
    torch.testing.assert_close(variants.create("softmax", 8)(q, k, v), expected, rtol=1e-10, atol=1e-10)


def test_normalised_linear_attention_is_katharopoulos(seed):
    """y_t = φ(q_t)ᵀ Σ_{i≤t} φ(k_i) v_iᵀ / φ(q_t)ᵀ Σ_{i≤t} φ(k_i) with φ = elu + 1 (K eq. 7, 9)."""
    q, k, v = _random(seed, 1, 2, 40, 6), _random(seed + 1, 1, 2, 40, 6), _random(seed + 2, 1, 2, 40, 5)
    phi_q, phi_k = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
    numerator = torch.einsum("bhtd,bhtv->bhtdv", phi_k, v).cumsum(2)
    expected = torch.einsum("bhtd,bhtdv->bhtv", phi_q, numerator) / (torch.einsum("bhtd,bhtd->bht", phi_q, phi_k.cumsum(2)).unsqueeze(-1) + 1e-6)
    torch.testing.assert_close(variants.create("linear", 6, chunk_size=16)(q, k, v), expected, rtol=1e-10, atol=1e-10)


def test_flop_counts_match_torch_flop_counter():
    """core.flops agrees with torch's FlopCounterMode on the matmuls it sees (it does not
    count the delta rule's triangular solve, which core.flops includes)."""
    from torch.utils.flop_counter import FlopCounterMode

    batch, heads, length, d = 2, 3, 100, 16
    for name, params in [("linear", {}), ("linear", {"normalize": False}), ("dpfp", {"nu": 2}), ("delta", {})]:
        core = variants.create(name, d, **params)
        inputs = core.example_inputs(batch, heads, length, d)
        with FlopCounterMode(display=False) as counter:
            core(**inputs)
        solve = 0
        if name == "delta":
            chunks = [core.chunk_size] * (length // core.chunk_size) + [length % core.chunk_size]
            solve = batch * heads * sum(n * n * (d + core.d_dot) for n in chunks)
        assert counter.get_total_flops() == core.flops(batch, heads, length, d) - solve, (name, params)

"""The gated delta rule (Yang, Kautz, Hatamizadeh 2024) beyond what tests/test_variants/test_equivalence.py
checks for every variant (forms == float64 reference, forward and backward including d/dβ and
d/dg, prefill chaining): the paper's recurrence written out here, α ≡ 1 == the delta rule,
FLOPs and errors."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close, make_inputs
from torch.nn.functional import normalize

import variants


def test_the_papers_recurrence(seed):
    """S_t = α_t S_{t-1} (I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ, o_t = S_t q_t with L2-normalised q, k
    (Yang, Kautz, Hatamizadeh 2024, eq. 10), written out per batch row and head."""
    batch, heads, length, d_key, d_value = 2, 2, 40, 5, 3
    core = variants.create("gated_delta", d_key, chunk_size=16).double()
    inputs = make_inputs(core, batch, heads, length, d_value, dtype=torch.float64, seed=seed)
    q, k, v, beta, log_gate = (inputs[name] for name in ("q", "k", "v", "beta", "log_gate"))
    expected = torch.empty(batch, heads, length, d_value, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            S = torch.zeros(d_value, d_key, dtype=torch.float64)
            for t in range(length):
                k_t, q_t = normalize(k[b, h, t], dim=0), normalize(q[b, h, t], dim=0)
                erase = torch.eye(d_key, dtype=torch.float64) - beta[b, h, t] * torch.outer(k_t, k_t)
                S = torch.exp(log_gate[b, h, t]) * S @ erase + beta[b, h, t] * torch.outer(v[b, h, t], k_t)
                expected[b, h, t] = S @ q_t
    assert_close(core(**inputs), expected, torch.float64, "chunked vs the paper", seed)


@pytest.mark.parametrize("params", [{"phi": "l2", "sum_norm": False}, {}, {"phi": "dpfp", "nu": 2}], ids=str)
def test_no_decay_is_exactly_the_delta_rule(params, seed):
    """α ≡ 1 (g = 0) reduces the gated scan to the delta rule's, for the same φ."""
    delta = variants.create("delta", 6, chunk_size=16, **params).double()
    gated = variants.create("gated_delta", 6, chunk_size=16, **{"phi": "elu1", "sum_norm": True, **params}).double()
    inputs = make_inputs(gated, 2, 2, 45, 4, dtype=torch.float64, seed=seed)
    no_decay = dict(inputs, log_gate=torch.zeros_like(inputs["log_gate"]))
    expected = delta(**{name: x for name, x in inputs.items() if name != "log_gate"})
    torch.testing.assert_close(gated(**no_decay), expected, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(gated.step_loop(no_decay)[0], expected, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(gated(**inputs), expected), f"seed {seed}: the gate changed nothing"


def test_flops_match_torch_flop_counter():
    """As for the delta rule: FlopCounterMode sees every matmul but not the triangular solve."""
    from torch.utils.flop_counter import FlopCounterMode

    batch, heads, length, d = 2, 3, 100, 16
    core = variants.create("gated_delta", d)
    inputs = core.example_inputs(batch, heads, length, d)
    with FlopCounterMode(display=False) as counter:
        core(**inputs)
    solve = batch * heads * sum(n * n * (d + core.d_dot) for n in (64, 36))
    assert counter.get_total_flops() == core.flops(batch, heads, length, d) - solve
    assert core.step_flops(batch, heads, d, 10) == batch * heads * 6 * d * d
    assert core.state_numel(batch, heads, d, 10) == batch * heads * d * d


def test_errors():
    core = variants.create("gated_delta", 4).double()
    q = torch.randn(2, 3, 5, 4, dtype=torch.float64)
    beta = torch.rand(2, 3, 5, dtype=torch.float64)
    with pytest.raises(variants.VariantError, match=r"^gated_delta: the gated delta rule needs the log decay gate log α log_gate \[B, H, T\], ≤ 0"):
        core(q, q, q, beta=beta)
    with pytest.raises(variants.VariantError, match=r"log_gate must have shape \[B, H, T\] = \(2, 3, 5\), got \(2, 3\)"):
        core(q, q, q, beta=beta, log_gate=torch.zeros(2, 3, dtype=torch.float64))
    state = core.init_state(2, 3, 4, dtype=torch.float64)
    with pytest.raises(variants.VariantError, match=r"needs the log decay gate log α log_gate_t \[B, H\]"):
        core.step(q[:, :, 0], q[:, :, 0], q[:, :, 0], state, beta_t=beta[:, :, 0])
    with pytest.raises(variants.VariantError, match=r"^delta: this variant takes no log_gate \(only the gated delta rule does\); it takes beta$"):
        variants.create("delta", 4).double()(q, q, q, beta=beta, log_gate=torch.zeros_like(beta))
    with pytest.raises(variants.VariantError, match=r"gated_delta: normalize=True is not defined"):
        variants.create("gated_delta", 4, normalize=True)

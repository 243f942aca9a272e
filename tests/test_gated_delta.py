"""The gated delta rule (Yang, Kautz, Hatamizadeh 2024): chunked == step loop == float64
reference, forward and backward (including d/dβ and d/dg), the paper's recurrence written out
here, α ≡ 1 == the delta rule, prefill chaining, FLOPs and errors."""

from __future__ import annotations

import pytest
import torch
from conftest import make_inputs, run_steps
from torch.nn.functional import normalize

import variants

TOLERANCES = {torch.float64: (1e-9, 1e-10), torch.float32: (2e-4, 1e-4)}
CONFIGS = [{}, {"chunk_size": 5}, {"phi": "elu1", "sum_norm": True, "chunk_size": 16}]
#: (batch, heads, T, d_key, d_value): T = 1, T not a multiple of the chunk, T over two chunks of 64
SHAPES = [(1, 1, 1, 4, 4), (2, 3, 17, 5, 3), (1, 2, 70, 6, 7)]


def inputs(core, batch, heads, length, d_value, seed, dtype=torch.float64, requires_grad=False):
    """q, k, v, β from conftest, and a log gate g ≤ 0 with decays α from about 0.05 to 1."""
    q, k, v, beta = make_inputs(core, batch, heads, length, d_value, dtype=dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed + 7)
    log_gate = -3 * torch.rand(batch, heads, length, generator=gen, dtype=torch.float64) ** 2
    return [t.to(dtype).requires_grad_(requires_grad) for t in (q, k, v, beta, log_gate)]


def close(actual, expected, dtype, what, seed):
    rtol, atol = TOLERANCES[dtype]
    scale = max(1.0, expected.abs().max().item())
    torch.testing.assert_close(actual, expected.to(dtype), rtol=rtol, atol=atol * scale, msg=lambda m: f"{what} (seed {seed}): {m}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("params", CONFIGS, ids=str)
def test_forms_agree_forward_and_backward(params, shape, dtype, seed):
    batch, heads, length, d_key, d_value = shape
    core = variants.create("gated_delta", d_key, **params).to(dtype)
    leaves = inputs(core, batch, heads, length, d_value, seed, requires_grad=True)
    cotangent = torch.randn(batch, heads, length, d_value, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    q, k, v, beta, log_gate = leaves
    reference = core.double().reference(q, k, v, beta=beta, log_gate=log_gate)
    expected = torch.autograd.grad((reference * cotangent).sum(), leaves)
    core = core.to(dtype)
    low = [t.detach().to(dtype).requires_grad_() for t in leaves]
    q, k, v, beta, log_gate = low
    for form, out in [("chunked", core(q, k, v, beta=beta, log_gate=log_gate)), ("step loop", run_steps(core, q, k, v, beta, log_gate=log_gate)[0])]:
        close(out, reference, dtype, f"{params} {form} forward", seed)
        grads = torch.autograd.grad((out * cotangent.to(dtype)).sum(), low)
        for label, grad, want in zip(("q", "k", "v", "β", "g"), grads, expected):
            close(grad, want, dtype, f"{params} {form} d/d{label}", seed)
    if length > 1:  # the first token decays an empty memory
        assert expected[4].abs().max() > 0, f"seed {seed}: the gate has no gradient; the test says nothing about it"


def test_the_papers_recurrence(seed):
    """S_t = α_t S_{t-1} (I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ, o_t = S_t q_t with L2-normalised q, k
    (Yang, Kautz, Hatamizadeh 2024, eq. 10), written out per batch row and head."""
    batch, heads, length, d_key, d_value = 2, 2, 40, 5, 3
    core = variants.create("gated_delta", d_key, chunk_size=16).double()
    q, k, v, beta, log_gate = inputs(core, batch, heads, length, d_value, seed)
    expected = torch.empty(batch, heads, length, d_value, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            S = torch.zeros(d_value, d_key, dtype=torch.float64)
            for t in range(length):
                k_t, q_t = normalize(k[b, h, t], dim=0), normalize(q[b, h, t], dim=0)
                erase = torch.eye(d_key, dtype=torch.float64) - beta[b, h, t] * torch.outer(k_t, k_t)
                S = torch.exp(log_gate[b, h, t]) * S @ erase + beta[b, h, t] * torch.outer(v[b, h, t], k_t)
                expected[b, h, t] = S @ q_t
    close(core(q, k, v, beta=beta, log_gate=log_gate), expected, torch.float64, "chunked vs the paper", seed)


@pytest.mark.parametrize("params", [{"phi": "l2", "sum_norm": False}, {}, {"phi": "dpfp", "nu": 2}], ids=str)
def test_no_decay_is_exactly_the_delta_rule(params, seed):
    """α ≡ 1 (g = 0) reduces the gated scan to the delta rule's, for the same φ."""
    delta = variants.create("delta", 6, chunk_size=16, **params).double()
    gated = variants.create("gated_delta", 6, chunk_size=16, **{"phi": "elu1", "sum_norm": True, **params}).double()
    q, k, v, beta, log_gate = inputs(gated, 2, 2, 45, 4, seed)
    no_decay = torch.zeros_like(log_gate)
    expected = delta(q, k, v, beta=beta)
    torch.testing.assert_close(gated(q, k, v, beta=beta, log_gate=no_decay), expected, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(run_steps(gated, q, k, v, beta, log_gate=no_decay)[0], expected, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(gated(q, k, v, beta=beta, log_gate=log_gate), expected), f"seed {seed}: the gate changed nothing"


def test_prefill_then_step_continues_the_sequence(seed):
    core = variants.create("gated_delta", 6, chunk_size=16).double()
    q, k, v, beta, log_gate = inputs(core, 2, 2, 45, 5, seed)
    whole = core(q, k, v, beta=beta, log_gate=log_gate)
    part = lambda a, b: [t[:, :, a:b] for t in (q, k, v, beta, log_gate)]  # noqa: E731
    first, state = core.prefill(*part(0, 20)[:3], beta=part(0, 20)[3], log_gate=part(0, 20)[4])
    q2, k2, v2, beta2, gate2 = part(20, 33)
    second, state = core.prefill(q2, k2, v2, beta=beta2, log_gate=gate2, state=state)
    q3, k3, v3, beta3, gate3 = part(33, None)
    third, _ = run_steps(core, q3, k3, v3, beta3, state, gate3)
    close(torch.cat([first, second, third], 2), whole, torch.float64, "prefill chain", seed)


def test_flops_match_torch_flop_counter():
    """As for the delta rule: FlopCounterMode sees every matmul but not the triangular solve."""
    from torch.utils.flop_counter import FlopCounterMode

    batch, heads, length, d = 2, 3, 100, 16
    core = variants.create("gated_delta", d)
    q, k, v = (torch.randn(batch, heads, length, d) for _ in range(3))
    with FlopCounterMode(display=False) as counter:
        core(q, k, v, beta=torch.rand(batch, heads, length), log_gate=-torch.rand(batch, heads, length))
    solve = batch * heads * sum(n * n * (d + core.d_dot) for n in (64, 36))
    assert counter.get_total_flops() == core.flops(batch, heads, length, d) - solve
    assert core.step_flops(batch, heads, d, 10) == batch * heads * 6 * d * d
    assert core.state_numel(batch, heads, d, 10) == batch * heads * d * d


def test_errors():
    core = variants.create("gated_delta", 4).double()
    q = torch.randn(2, 3, 5, 4, dtype=torch.float64)
    beta = torch.rand(2, 3, 5, dtype=torch.float64)
    with pytest.raises(variants.VariantError, match=r"^gated_delta: the gated rule needs the log decay gate log_gate \[B, H, T\]"):
        core(q, q, q, beta=beta)
    with pytest.raises(variants.VariantError, match=r"log_gate must have shape \[B, H, T\] = \(2, 3, 5\), got \(2, 3\)"):
        core(q, q, q, beta=beta, log_gate=torch.zeros(2, 3, dtype=torch.float64))
    state = core.init_state(2, 3, 4, dtype=torch.float64)
    with pytest.raises(variants.VariantError, match=r"needs the log decay gate log_gate_t \[B, H\]"):
        core.step(q[:, :, 0], q[:, :, 0], q[:, :, 0], state, beta_t=beta[:, :, 0])
    with pytest.raises(variants.VariantError, match=r"^delta: this variant takes no log_gate \(only the gated delta rule does\)"):
        variants.create("delta", 4).double()(q, q, q, beta=beta, log_gate=torch.zeros_like(beta))
    with pytest.raises(variants.UnsupportedBackend, match=r"gated_delta: backend must be one of torch, got 'triton'"):
        variants.create("gated_delta", 4, backend="triton")
    with pytest.raises(variants.VariantError, match=r"gated_delta: attn_norm=True is not defined"):
        variants.create("gated_delta", 4, attn_norm=True)

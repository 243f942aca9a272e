"""Every form of every variant computes the same function, forward and backward.

parallel (chunked / SDPA) == recurrent step loop == reference (O(T²) or token loop),
in float64 with tight tolerances and in float32 with tolerances that fit, on fresh random
inputs and awkward shapes (T = 1, T not a multiple of the chunk, Dk != Dv, odd dims).
"""

from __future__ import annotations

import pytest
import torch
from conftest import CONFIGS, build, config_id, make_inputs, run_steps

#: rtol and atol; atol is scaled by the largest magnitude of the expected tensor (at least 1).
TOLERANCES = {torch.float64: (1e-9, 1e-10), torch.float32: (2e-4, 1e-4)}
#: (batch, heads, T, d_key, d_value)
SHAPES = [(1, 1, 1, 4, 4), (2, 3, 17, 5, 3), (1, 2, 63, 8, 8), (2, 1, 130, 6, 7)]


def assert_close(actual, expected, dtype, what, seed):
    rtol, atol = TOLERANCES[dtype]
    scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol * scale, msg=lambda m: f"{what} (seed {seed}): {m}")


def forms(core, q, k, v, beta):
    yield "parallel", core(q, k, v, beta=beta)
    yield "step loop", run_steps(core, q, k, v, beta)[0]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_forward_forms_agree(config, shape, dtype, seed):
    batch, heads, length, d_key, d_value = shape
    core = build(config, d_key, dtype)
    q, k, v, beta = make_inputs(core, batch, heads, length, d_value, dtype=dtype, seed=seed)
    expected = build(config, d_key).reference(*(t.double() if t is not None else None for t in (q, k, v)), beta=beta if beta is None else beta.double())
    for form, out in forms(core, q, k, v, beta):
        assert out.shape == (batch, heads, length, d_value)
        assert out.dtype == dtype
        assert_close(out, expected.to(dtype), dtype, f"{config_id(config)} {form} vs float64 reference", seed)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("shape", SHAPES[1:], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_gradients_agree(config, shape, dtype, seed):
    batch, heads, length, d_key, d_value = shape
    core = build(config, d_key, dtype)
    inputs = make_inputs(core, batch, heads, length, d_value, dtype=torch.float64, seed=seed, requires_grad=True)
    leaves = [t for t in inputs if t is not None]
    cotangent = torch.randn(batch, heads, length, d_value, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    reference = build(config, d_key).reference(inputs[0], inputs[1], inputs[2], beta=inputs[3])
    expected = torch.autograd.grad((reference * cotangent).sum(), leaves)
    low = [t.detach().to(dtype).requires_grad_() if t is not None else None for t in inputs]
    low_leaves = [t for t in low if t is not None]
    for form, out in forms(core, *low):
        grads = torch.autograd.grad((out * cotangent.to(dtype)).sum(), low_leaves)
        for label, grad, want in zip("qkvβ", grads, expected):
            assert_close(grad, want.to(dtype), dtype, f"{config_id(config)} {form}: d/d{label}", seed)


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_prefill_then_step_continues_the_sequence(config, seed):
    """A prefill of the first part, then prefill/step from its state == parallel over the whole."""
    core = build(config, 6)
    q, k, v, beta = make_inputs(core, 2, 2, 45, 5, dtype=torch.float64, seed=seed)
    whole = core(q, k, v, beta=beta)
    cut, cut2 = 20, 33
    part = lambda t, a, b: None if t is None else t[:, :, a:b]  # noqa: E731
    first, state = core.prefill(*(part(t, 0, cut) for t in (q, k, v)), beta=part(beta, 0, cut))
    second, state = core.prefill(*(part(t, cut, cut2) for t in (q, k, v)), beta=part(beta, cut, cut2), state=state)
    third, _ = run_steps(core, *(part(t, cut2, None) for t in (q, k, v, beta)), state=state)
    assert_close(torch.cat([first, second, third], 2), whole, torch.float64, f"{config_id(config)} prefill chain", seed)


@pytest.mark.parametrize("config", [c for c in CONFIGS if c[0] != "delta"], ids=config_id)
def test_noncausal_forms_agree(config, seed):
    core = build(config, 5)
    q, k, v, beta = make_inputs(core, 2, 3, 37, 4, dtype=torch.float64, seed=seed)
    assert_close(core(q, k, v, causal=False), core.reference(q, k, v, causal=False), torch.float64, "non-causal", seed)


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_causality(config, seed):
    """Changing inputs at positions > t leaves every output at positions <= t unchanged."""
    core = build(config, 6)
    q, k, v, beta = make_inputs(core, 1, 2, 40, 4, dtype=torch.float64, seed=seed)
    t = 23
    changed = [x.clone() if x is not None else None for x in (q, k, v, beta)]
    for x in changed:
        if x is not None:
            x[:, :, t + 1 :] = torch.rand_like(x[:, :, t + 1 :])
    before, after = core(q, k, v, beta=beta), core(*changed[:3], beta=changed[3])
    torch.testing.assert_close(after[:, :, : t + 1], before[:, :, : t + 1], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(after[:, :, t + 1 :], before[:, :, t + 1 :]), "the perturbation changed nothing"


@pytest.mark.parametrize("config", [c for c in CONFIGS if c[0] != "delta"], ids=config_id)
def test_noncausal_sees_the_future(config, seed):
    """The counterpart of test_causality: without the mask, early outputs do depend on later inputs."""
    core = build(config, 6)
    q, k, v, _ = make_inputs(core, 1, 2, 40, 4, dtype=torch.float64, seed=seed)
    v2 = v.clone()
    v2[:, :, 1:] += 1.0
    assert not torch.allclose(core(q, k, v, causal=False)[:, :, 0], core(q, k, v2, causal=False)[:, :, 0])

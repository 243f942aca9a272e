"""The Triton backend through the variant interface: ``create(..., backend='triton')``
computes the same function as the float64 torch reference, forward and backward, and its
prefill state continues into the recurrent step. Runs through Triton's interpreter on a CPU
(tests/conftest.py sets TRITON_INTERPRET=1 there) and natively on a GPU."""

from __future__ import annotations

import pytest
import torch
from conftest import config_id, make_inputs, run_steps

import variants

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CONFIGS = [
    ("linear", {}),
    ("linear", {"phi": "identity", "normalize": False}),
    ("performer", {"m": 8}),
    ("dpfp", {"nu": 2}),
    ("delta", {}),
    ("delta", {"phi": "dpfp", "nu": 1}),
]


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_triton_backend_matches_the_reference(config, seed):
    name, params = config
    reference = variants.create(name, 8, **params).double()
    kernel = variants.create(name, 8, backend="triton", **params).to(DEVICE)
    inputs = make_inputs(reference, 2, 3, 37, 6, dtype=torch.float64, seed=seed, requires_grad=True)
    leaves = [t for t in inputs if t is not None]
    cotangent = torch.randn(2, 3, 37, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    expected = reference.reference(*inputs[:3], beta=inputs[3])
    want = torch.autograd.grad((expected * cotangent).sum(), leaves)
    low = [t.detach().float().to(DEVICE).requires_grad_() if t is not None else None for t in inputs]
    out = kernel(*low[:3], beta=low[3])
    got = torch.autograd.grad((out * cotangent.float().to(DEVICE)).sum(), [t for t in low if t is not None])
    for label, actual, target in zip(["out", "dq", "dk", "dv", "dβ"], [out, *got], [expected, *want]):
        scale = max(1.0, target.abs().max().item())
        torch.testing.assert_close(actual.double().cpu(), target, rtol=2e-4, atol=1e-4 * scale, msg=lambda m: f"{label} (seed {seed}): {m}")


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[4]], ids=config_id)
def test_triton_prefill_state_continues_into_steps(config, seed):
    name, params = config
    core = variants.create(name, 8, backend="triton", **params).to(DEVICE)
    q, k, v, beta = (t.to(DEVICE) if t is not None else None for t in make_inputs(core, 1, 2, 30, 8, dtype=torch.float32, seed=seed))
    whole = core(q, k, v, beta=beta)
    cut = 19
    head, state = core.prefill(q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], beta=None if beta is None else beta[:, :, :cut])
    tail, _ = run_steps(core, q[:, :, cut:], k[:, :, cut:], v[:, :, cut:], None if beta is None else beta[:, :, cut:], state=state)
    torch.testing.assert_close(torch.cat([head, tail], 2), whole, rtol=1e-4, atol=1e-5)


def test_triton_backend_refusals():
    with pytest.raises(variants.UnsupportedBackend, match="only the 'torch' backend"):
        variants.create("softmax", 8, backend="triton")
    with pytest.raises(variants.UnsupportedBackend, match="attention normalisation"):
        variants.create("delta", 8, backend="triton", attn_norm=True)
    with pytest.raises(variants.VariantError, match="backend must be one of"):
        variants.create("linear", 8, backend="cuda")
    with pytest.raises(variants.UnsupportedBackend, match="d_dot=384 exceeds the Triton kernels' limit of 256"):
        variants.create("dpfp", 64, nu=3, backend="triton")

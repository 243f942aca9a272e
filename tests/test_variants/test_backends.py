"""The Triton backend through the variant interface: ``create(..., backend='triton')``
computes the same function as the float64 torch reference, forward and backward, and its
prefill state continues into the recurrent step. Runs through Triton's interpreter on a CPU
(tests/conftest.py sets TRITON_INTERPRET=1 there) and natively on a GPU."""

from __future__ import annotations

import pytest
import torch
from helpers import config_id, make_inputs, to

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
    cotangent = torch.randn(2, 3, 37, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    expected = reference.reference(**inputs)
    want = torch.autograd.grad((expected * cotangent).sum(), list(inputs.values()))
    low = {name: x.to(DEVICE) for name, x in to(inputs, torch.float32).items()}
    low = {name: x.requires_grad_() for name, x in low.items()}
    out = kernel(**low)
    got = torch.autograd.grad((out * cotangent.float().to(DEVICE)).sum(), list(low.values()))
    for label, actual, target in zip(["out", *(f"d{name}" for name in inputs)], [out, *got], [expected, *want], strict=True):
        scale = max(1.0, target.abs().max().item())
        torch.testing.assert_close(actual.double().cpu(), target, rtol=2e-4, atol=1e-4 * scale, msg=lambda m: f"{label} (seed {seed}): {m}")


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[4]], ids=config_id)
def test_triton_prefill_state_continues_into_steps(config, seed):
    name, params = config
    core = variants.create(name, 8, backend="triton", **params).to(DEVICE)
    inputs = {name: x.to(DEVICE) for name, x in make_inputs(core, 1, 2, 30, 8, dtype=torch.float32, seed=seed).items()}
    whole = core(**inputs)
    cut = 19
    head, state = core.prefill(**variants.time_slice(inputs, 0, cut))
    tail, _ = core.step_loop(variants.time_slice(inputs, cut), state)
    torch.testing.assert_close(torch.cat([head, tail], 2), whole, rtol=1e-4, atol=1e-5)


def test_triton_backend_refusals():
    with pytest.raises(variants.UnsupportedBackend, match="only the 'torch' backend"):
        variants.create("softmax", 8, backend="triton")
    with pytest.raises(variants.UnsupportedBackend, match="attention normalisation"):
        variants.create("delta", 8, backend="triton", normalize=True)
    with pytest.raises(variants.VariantError, match="backend must be one of"):
        variants.create("linear", 8, backend="cuda")
    with pytest.raises(variants.UnsupportedBackend, match="d_dot=384 exceeds the Triton kernels' limit of 256"):
        variants.create("dpfp", 64, nu=3, backend="triton")

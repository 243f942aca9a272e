"""Every variant's PyTorch forms in every dtype a GPU runs them in: float32, bfloat16 and float16.

The parallel form, the step loop and ``prefill``, forward and every gradient, against the float64
reference on the same inputs (drawn in float64 and rounded to the dtype, so that only the
arithmetic is judged), within ``variants.precision.REL_ERROR_TOLERANCE`` in relative L2 error. A
variant that cannot run in 16 bits fails here. The state of every linear-time form is float32 for
16-bit inputs (``variants.precision.state_dtype``).
"""

from __future__ import annotations

import pytest
import torch
from helpers import CONFIGS, build, config_id, make_inputs, to

import variants
from variants.fast_weights import FastWeightState
from variants.precision import REL_ERROR_TOLERANCE, rel_error, state_dtype

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
#: (batch, heads, T, d_key, d_value): T spans several chunks of every config and is not a multiple of them
SHAPE = (1, 2, 40, 16, 12)


def _forms(core, inputs):
    """Each form's output over the whole sequence: parallel, step loop, prefill of a part then the rest."""
    yield "parallel", core(**inputs)
    yield "step loop", core.step_loop(inputs)[0]
    first, state = core.prefill(**variants.time_slice(inputs, 0, 23))
    yield "prefill chain", torch.cat([first, core.prefill(**variants.time_slice(inputs, 23), state=state)[0]], 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_every_form_in_every_dtype_matches_float64(config, dtype, seed):
    batch, heads, length, d_key, d_value = SHAPE
    core, reference = build(config, d_key, dtype), build(config, d_key)
    inputs = make_inputs(core, batch, heads, length, d_value, dtype=dtype, seed=seed)
    exact = to(inputs, torch.float64, requires_grad=True)
    expected = reference.reference(**exact)
    cotangent = torch.randn(expected.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    wanted = torch.autograd.grad((expected * cotangent).sum(), list(exact.values()))
    tolerance = REL_ERROR_TOLERANCE[dtype]
    low = to(inputs, dtype, requires_grad=True)
    for form, out in _forms(core, low):
        what = f"{config_id(config)} {form} in {dtype} (seed {seed})"
        assert out.dtype == dtype, f"{what}: output dtype {out.dtype}"
        assert rel_error(out, expected) <= tolerance, f"{what}: relative error {rel_error(out, expected):.3g} > {tolerance}"
        grads = torch.autograd.grad((out * cotangent.to(dtype)).sum(), list(low.values()))
        for name, grad, target in zip(low, grads, wanted, strict=True):
            error = rel_error(grad, target)
            assert error <= tolerance, f"{what}: d/d{name} relative error {error:.3g} > {tolerance}"


@pytest.mark.parametrize("dtype", [torch.float64, *DTYPES], ids=str)
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_steps_without_autograd_match_float64(config, dtype, seed):
    """Under no_grad a step writes its state in place (the fast weights by ``addcmul_``, softmax's KV
    cache): a prefill then steps still compute the float64 reference's function, and a fast weight
    state passed in is the one returned (no new state per step)."""
    batch, heads, length, d_key, d_value = SHAPE
    core, reference = build(config, d_key, dtype), build(config, d_key)
    inputs = make_inputs(core, batch, heads, length, d_value, dtype=dtype, seed=seed)
    expected = reference.reference(**to(inputs, torch.float64))
    with torch.no_grad():
        head, given = core.prefill(**variants.time_slice(inputs, 0, 23))
        tail, state = core.step_loop(variants.time_slice(inputs, 23), given)
    error, what = rel_error(torch.cat([head, tail], 2), expected), f"{config_id(config)} prefill then steps under no_grad in {dtype} (seed {seed})"
    assert error <= REL_ERROR_TOLERANCE[dtype], f"{what}: relative error {error:.3g} > {REL_ERROR_TOLERANCE[dtype]}"
    if isinstance(state, FastWeightState):
        assert state.weights is given.weights, f"{what}: a step without autograd allocated new fast weights"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", [c for c in CONFIGS if build(c, 4).supports_noncausal], ids=config_id)
def test_the_noncausal_form_in_every_dtype_matches_float64(config, dtype, seed):
    batch, heads, length, d_key, d_value = SHAPE
    core, reference = build(config, d_key, dtype), build(config, d_key)
    inputs = make_inputs(core, batch, heads, length, d_value, dtype=dtype, seed=seed)
    exact, low = to(inputs, torch.float64, requires_grad=True), to(inputs, dtype, requires_grad=True)
    expected, out = reference.reference(**exact, causal=False), core(**low, causal=False)
    what = f"{config_id(config)} non-causal in {dtype} (seed {seed})"
    assert out.dtype == dtype and rel_error(out, expected) <= REL_ERROR_TOLERANCE[dtype], f"{what}: {rel_error(out, expected):.3g}"
    cotangent = torch.randn(expected.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    wanted = torch.autograd.grad((expected * cotangent).sum(), list(exact.values()))
    grads = torch.autograd.grad((out * cotangent.to(dtype)).sum(), list(low.values()))
    for name, grad, target in zip(low, grads, wanted, strict=True):
        assert rel_error(grad, target) <= REL_ERROR_TOLERANCE[dtype], f"{what}: d/d{name} {rel_error(grad, target):.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_time_states_are_float32_for_16_bit_inputs(dtype):
    """The decoding state after a 16-bit prefill is float32 (a 16-bit state rounds away late writes)."""
    for name in ("linear", "delta", "gated_delta"):
        core = variants.create(name, 8).to(dtype)
        _, state = core.prefill(**core.example_inputs(1, 2, 20, 8, dtype=dtype))
        assert state.weights.dtype == state_dtype(dtype) == torch.promote_types(dtype, torch.float32), name


def test_rel_error_sees_an_error():
    expected = torch.randn(100, dtype=torch.float64)
    assert rel_error(expected, expected) == 0.0
    assert rel_error(expected * 1.01, expected) == pytest.approx(0.01)
    assert rel_error(torch.ones(3), torch.zeros(3)) == float("inf")

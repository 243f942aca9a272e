"""Hostile inputs to the variants (issue 16, item 6): per-token inputs out of range are refused
with a clear message, and a non-finite value in k or v never travels backwards in time (a NaN
at position p leaves every output before p finite and exactly as without it), in every form of
every registered variant."""

from __future__ import annotations

import math
import re

import pytest
import torch
from helpers import CONFIGS, build, config_id, make_inputs

import variants
from variants.base import checks_due
from variants.chunked import causal_read

LENGTH, POSITION = 40, 23  #: the bad token sits inside a chunk (default 64, or 16 / 5 / 8 in CONFIGS)


def poisoned(inputs: dict, name: str, value: float) -> dict:
    changed = dict(inputs, **{name: inputs[name].clone()})
    changed[name][:, :, POSITION, 0] = value
    return changed


def sequence_forms(core, inputs):
    """Every form over a sequence: parallel, reference, prefill (whole, and after a prefix) and the step loop."""
    yield "parallel", core(**inputs)
    yield "reference", core.reference(**inputs)
    yield "prefill", core.prefill(**inputs)[0]
    _, state = core.prefill(**variants.time_slice(inputs, 0, 7))
    yield "prefill after a prefix", torch.cat([core(**variants.time_slice(inputs, 0, 7)), core.prefill(**variants.time_slice(inputs, 7), state=state)[0]], 2)
    yield "step loop", core.step_loop(inputs)[0]


@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_a_non_finite_input_does_not_reach_earlier_outputs(config, where, value, seed):
    core = build(config, 6)
    inputs = make_inputs(core, 2, 2, LENGTH, 5, dtype=torch.float64, seed=seed)
    # The query meeting the bad key is positive in its channel: softmax's score q·k is then +inf (a NaN
    # output), where a negative q_0 makes it −inf, the key's weight exactly 0 and the output rightly finite.
    inputs["q"][:, :, POSITION, 0] = inputs["q"][:, :, POSITION, 0].abs()
    bad = poisoned(inputs, where, value)
    for (form, clean), (_, out) in zip(sequence_forms(core, inputs), sequence_forms(core, bad), strict=True):
        assert torch.isfinite(out[:, :, :POSITION]).all(), f"{config_id(config)} {form}: a {value} in {where} at {POSITION} reached earlier outputs"
        torch.testing.assert_close(out[:, :, :POSITION], clean[:, :, :POSITION], rtol=1e-12, atol=1e-12, msg=lambda m: f"{form}: {m}")
        assert not torch.isfinite(out[:, :, POSITION]).all(), f"{config_id(config)} {form}: the {value} vanished at its own position"


def test_causal_read_leaves_finite_values_alone():
    """Both paths of causal_read: finite values (even ones whose sum overflows, which takes the
    guarded path) give exactly the plain product."""
    lower = torch.tril(torch.rand(3, 8, 8, dtype=torch.float64))
    values = torch.randn(3, 8, 4, dtype=torch.float64)
    torch.testing.assert_close(causal_read(lower.matmul, values, dim=1), lower @ values, rtol=0, atol=0)
    huge = torch.full((1, 8, 4), 1e308, dtype=torch.float64)
    torch.testing.assert_close(causal_read(lower[:1].matmul, huge, dim=1), lower[:1] @ huge, rtol=0, atol=0)
    values[1, 5, 2] = math.nan
    out = causal_read(lower.matmul, values, dim=1)
    assert torch.isfinite(out[1, :5]).all() and torch.isfinite(out[1, 5:, [0, 1, 3]]).all() and torch.isnan(out[1, 5:, 2]).all()


#: (input, bad value, what the message says): β must be in [0, 1] (β = −1 gave outputs of 9e12
#: at T = 512, β = 50 NaN), log α ≤ 0, and both finite.
OUT_OF_RANGE = [
    ("beta", -1.0, "beta must be finite and in [0, 1] (the write strength), got values from -1 to"),
    ("beta", 50.0, "beta must be finite and in [0, 1] (the write strength), got values from"),
    ("beta", math.nan, "beta must be finite and in [0, 1]"),
    ("log_gate", 0.5, "log_gate must be finite and ≤ 0 (the log decay gate log α), got values from"),
    ("log_gate", -math.inf, "log_gate must be finite and ≤ 0"),
]


@pytest.mark.parametrize("name, value, message", OUT_OF_RANGE, ids=[f"{n}={v}" for n, v, _ in OUT_OF_RANGE])
def test_token_inputs_out_of_range_are_refused_in_every_form(name, value, message):
    core = variants.create("gated_delta", 4).double()
    inputs = make_inputs(core, 2, 3, 9, 4, dtype=torch.float64, seed=0)
    inputs[name][:, :, 5] = value
    match = "^gated_delta: " + re.escape(message)
    for form in (core, core.reference, core.prefill):
        with pytest.raises(variants.VariantError, match=match):
            form(**inputs)
    at_t = variants.token_slice(inputs, 0)
    at_t[f"{name}_t"] = torch.full_like(at_t[f"{name}_t"], value)
    with pytest.raises(variants.VariantError, match=match.replace(name, f"{name}_t", 1)):
        core.step(**at_t, state=core.init_state(2, 3, 4, dtype=torch.float64))


def test_the_bounds_are_inclusive():
    """β ∈ {0, 1} and log α = 0 are valid (no write, a full write, no decay)."""
    core = variants.create("gated_delta", 4).double()
    inputs = make_inputs(core, 1, 2, 6, 4, dtype=torch.float64, seed=0)
    edges = dict(inputs, beta=torch.tensor([0.0, 1.0], dtype=torch.float64).repeat(1, 2, 3), log_gate=torch.zeros(1, 2, 6, dtype=torch.float64))
    torch.testing.assert_close(core(**edges), core.reference(**edges))


def test_where_the_range_check_runs():
    """Always in reference; in the parallel form, prefill and step on CPU tensors (no device sync),
    on an accelerator only under debug_checks."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert checks_due(cpu) and not checks_due(gpu)  # reference checks whatever this says (_check_token_inputs' always)
    with variants.debug_checks():
        assert checks_due(gpu)
    assert not checks_due(gpu)


def test_a_keyword_the_core_does_not_take():
    core = variants.create("delta", 4).double()
    inputs = make_inputs(core, 1, 2, 6, 4, dtype=torch.float64, seed=0)
    with pytest.raises(variants.VariantError, match=r"^delta: this variant takes no betta; it takes beta$"):
        core(**inputs, betta=inputs["beta"])
    state = core.init_state(1, 2, 4, dtype=torch.float64)
    with pytest.raises(variants.VariantError, match=r"^delta: this variant takes no beta; it takes beta_t$"):
        core.step(**variants.token_slice(inputs, 0), beta=inputs["beta"][:, :, 0], state=state)
    with pytest.raises(variants.VariantError, match=r"^delta: beta must have shape \[B, H, T\] = \(1, 2, 6\), got float$"):
        core(**dict(inputs, beta=0.5))


def test_the_causal_guard_stays_out_of_accelerator_calls():
    """``causal_read``'s NaN guard (about ten kernels) runs on an accelerator only under debug_checks:
    without it the read gets the values themselves, with it a cleaned copy ("meta" stands in for a GPU)."""
    from variants.chunked import causal_read

    values = torch.empty(1, 2, 8, 4, device="meta")
    received = []
    read = lambda x: received.append(x) or x  # noqa: E731
    causal_read(read, values)
    assert received[-1] is values
    with variants.debug_checks():
        causal_read(read, values)
    assert received[-1] is not values and received[-1].shape == values.shape

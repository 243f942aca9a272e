"""AttentionLayer: projections around any core; parallel forward == step loop, forward and backward."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import layer_step_loop

import variants

#: every registered variant with its defaults, plus the attention-normalised delta rule
#: and a few settings that exercise more of the layer.
LAYER_CONFIGS = [(name, {}) for name in variants.names() if name != "rebased"] + [
    # randomise() gives ReBased's γ, β unit spread, with which a first-token kernel (q'·k')² near 0
    # leaves the normalised form's gradient only ~1e-9 accurate (tests/test_variants/test_based.py covers it)
    ("rebased", {"normalize": False}),
    ("delta", {"normalize": True}),
    ("delta", {"normalize": True, "chunk_size": 8, "bias": True}),
    ("linear", {"chunk_size": 8, "bias": True}),
    ("performer", {"m": 6, "chunk_size": 8}),
]

#: T crosses the default chunk of 64, so the parallel form carries state between chunks.
BATCH, LENGTH, D_MODEL, N_HEADS = 2, 70, 12, 3


def config_id(config) -> str:
    name, params = config
    return name + "".join(f"-{key}={value}" for key, value in params.items())


def randomise(layer: torch.nn.Module, gen: torch.Generator) -> None:
    """Redraw every parameter from ``gen`` (scaled by fan-in) so the seed fixes the whole test."""
    with torch.no_grad():
        for param in layer.parameters():
            fan_in = param.shape[-1] if param.dim() > 1 else 1
            param.copy_(torch.randn(param.shape, generator=gen, dtype=param.dtype) / math.sqrt(fan_in))


def build(config, seed, d_model=D_MODEL, n_heads=N_HEADS, **extra):
    name, params = config
    layer = variants.AttentionLayer(d_model, n_heads, name, **params, **extra).double()
    gen = torch.Generator().manual_seed(seed)
    randomise(layer, gen)
    x = torch.randn(BATCH, LENGTH, d_model, generator=gen, dtype=torch.float64)
    cotangent = torch.randn(BATCH, LENGTH, d_model, generator=gen, dtype=torch.float64)
    return layer, x, cotangent


def close(actual, expected, what, seed, tol=1e-10):
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol, msg=lambda m: f"{what} (seed {seed}): {m}")


@pytest.mark.parametrize("config", LAYER_CONFIGS, ids=config_id)
def test_parallel_equals_step_loop(config, seed):
    layer, x, _ = build(config, seed)
    parallel = layer(x)
    assert parallel.shape == (BATCH, LENGTH, D_MODEL)
    assert parallel.dtype == torch.float64
    stepped = layer_step_loop(layer, x)
    assert stepped.shape == (BATCH, LENGTH, D_MODEL)
    close(parallel, stepped, f"{config_id(config)} parallel vs step loop", seed)
    assert parallel.abs().max() > 1e-3, f"seed {seed}: output is (almost) zero; the comparison says nothing"


@pytest.mark.parametrize("config", LAYER_CONFIGS, ids=config_id)
def test_parameter_gradients_agree(config, seed):
    layer, x, cotangent = build(config, seed)
    named = dict(layer.named_parameters())
    for spec in layer.core.token_inputs:
        assert any(name.startswith(f"{spec.layer_attribute}.") for name in named), f"no parameters of {spec.layer_attribute}"
    x = x.requires_grad_()
    leaves = list(named.values()) + [x]
    labels = list(named) + ["x"]
    parallel = torch.autograd.grad((layer(x) * cotangent).sum(), leaves)
    stepped = torch.autograd.grad((layer_step_loop(layer, x) * cotangent).sum(), leaves)
    for label, grad_parallel, grad_step in zip(labels, parallel, stepped):
        assert grad_parallel.abs().max() > 0, f"{config_id(config)}: d/d{label} is zero (seed {seed})"
        close(grad_parallel, grad_step, f"{config_id(config)}: d/d{label} parallel vs step loop", seed)


@pytest.mark.parametrize("name", variants.names())
def test_a_projection_per_token_input(name):
    """β's ``write_strength`` for the delta rules, the gate's ``decay_gate`` for the gated rule,
    nothing else; each maps the layer input to one value per head, within its bounds."""
    layer = variants.AttentionLayer(8, 2, name)
    names = {n for n, _ in layer.named_parameters()}
    expected = {"delta": {"write_strength"}, "deltanet": {"write_strength"}, "gated_delta": {"write_strength", "decay_gate"}}.get(name, set())
    assert {spec.layer_attribute for spec in layer.core.token_inputs} == expected
    x = 3 * torch.randn(4, 5, 8)
    for spec in layer.core.token_inputs:
        values = getattr(layer, spec.layer_attribute)(x)
        assert values.shape == (4, 5, 2)
        low, high = spec.bounds
        assert (values >= low).all() and (values <= high).all()
        assert any(n.startswith(f"{spec.layer_attribute}.") for n in names)
    for attribute in {"write_strength", "decay_gate"} - expected:
        assert not hasattr(layer, attribute) and not any(n.startswith(attribute) for n in names)


def test_the_decay_gate_starts_as_gated_deltanet_does():
    """g = −exp(A)·softplus(W_α x + b_dt), A in [1, 16] and softplus(b_dt) in [0.001, 0.1] at
    initialisation (Yang, Kautz, Hatamizadeh 2024, after Mamba2): with a zero projection every
    head's decay α = exp(g) lies in [exp(−1.6), exp(−0.001)], most of them near 1."""
    torch.manual_seed(0)
    gate = variants.DecayGate(16, 64)
    A = gate.log_A.exp()
    step = torch.nn.functional.softplus(gate.step_bias)
    assert (A >= 1).all() and (A <= 16).all()
    assert (step >= 1e-3 * 0.999).all() and (step <= 0.1 * 1.001).all()
    with torch.no_grad():
        gate.linear.weight.zero_()
        alpha = gate(torch.randn(3, 16)).exp()
    torch.testing.assert_close(alpha, (-A * step).exp().expand(3, 64))
    assert alpha.min() > 0.19 and alpha.median() > 0.7


@pytest.mark.parametrize("name", variants.names())
def test_default_head_dims(name):
    layer = variants.AttentionLayer(12, 3, name)
    assert layer.d_key == layer.d_value == 4 and layer.core.d_key == 4
    assert layer.query.weight.shape == (12, 12) and layer.out.weight.shape == (12, 12)


@pytest.mark.parametrize("name", ["softmax", "linear", "performer", "delta"])
@pytest.mark.parametrize("d_model, n_heads, d_key, d_value", [(16, 2, 5, 3), (10, 3, 4, 2)])
def test_d_key_d_value_overrides(name, d_model, n_heads, d_key, d_value, seed):
    layer, x, _ = build((name, {}), seed, d_model=d_model, n_heads=n_heads, d_key=d_key, d_value=d_value)
    assert layer.d_key == d_key and layer.d_value == d_value and layer.core.d_key == d_key
    assert layer.query.weight.shape == (n_heads * d_key, d_model)
    assert layer.key.weight.shape == (n_heads * d_key, d_model)
    assert layer.value.weight.shape == (n_heads * d_value, d_model)
    assert layer.out.weight.shape == (d_model, n_heads * d_value)
    x = x[:, :9]
    parallel = layer(x)
    assert parallel.shape == (BATCH, 9, d_model)
    close(parallel, layer_step_loop(layer, x), f"{name} d_key={d_key} d_value={d_value} parallel vs step loop", seed)

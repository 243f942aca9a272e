"""Every form of every variant computes the same function, forward and backward.

parallel (chunked / SDPA) == recurrent step loop == reference (O(T²) or token loop),
in float64 with tight tolerances and in float32 with tolerances that fit, on fresh random
inputs (``core.example_inputs``: q, k, v and the core's token inputs) and awkward shapes
(T = 1, T not a multiple of the chunk, Dk != Dv, odd dims).
"""

from __future__ import annotations

import pytest
import torch
from helpers import CONFIGS, assert_close, build, check_forms, config_id, make_inputs

import variants

#: (batch, heads, T, d_key, d_value); a per-channel core (RWKV) gets d_value = d_key
SHAPES = [(1, 1, 1, 4, 4), (2, 3, 17, 5, 3), (1, 2, 63, 8, 8), (2, 1, 130, 6, 7)]


def test_every_registered_variant_has_a_config():
    assert set(variants.names()) <= {name for name, _ in CONFIGS}, "add the new variant to tests/helpers.py CONFIGS"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_forward_forms_agree(config, shape, dtype, seed):
    batch, heads, length, d_key, d_value = shape
    core = build(config, d_key, dtype)
    inputs = make_inputs(core, batch, heads, length, d_value, dtype=dtype, seed=seed)
    check_forms(core, build(config, d_key), inputs, dtype, seed, config_id(config), backward=False)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("shape", SHAPES[1:], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_gradients_agree(config, shape, dtype, seed):
    """d/d every input (q, k, v and the token inputs) and every learnable parameter."""
    batch, heads, length, d_key, d_value = shape
    core = build(config, d_key, dtype)
    inputs = make_inputs(core, batch, heads, length, d_value, dtype=torch.float64, seed=seed)
    check_forms(core, build(config, d_key), inputs, dtype, seed, config_id(config))


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_prefill_then_step_continues_the_sequence(config, seed):
    """A prefill of the first part, then prefill/step from its state == parallel over the whole."""
    core = build(config, 6)
    inputs = make_inputs(core, 2, 2, 45, 5, dtype=torch.float64, seed=seed)
    whole = core(**inputs)
    first, state = core.prefill(**variants.time_slice(inputs, 0, 20))
    second, state = core.prefill(**variants.time_slice(inputs, 20, 33), state=state)
    third, _ = core.step_loop(variants.time_slice(inputs, 33), state)
    assert_close(torch.cat([first, second, third], 2), whole, torch.float64, f"{config_id(config)} prefill chain", seed)


NONCAUSAL = [config for config in CONFIGS if build(config, 4).supports_noncausal]


@pytest.mark.parametrize("config", NONCAUSAL, ids=config_id)
def test_noncausal_forms_agree(config, seed):
    core = build(config, 5)
    inputs = make_inputs(core, 2, 3, 37, 4, dtype=torch.float64, seed=seed)
    assert_close(core(**inputs, causal=False), core.reference(**inputs, causal=False), torch.float64, "non-causal", seed)


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_causality(config, seed):
    """Changing inputs at positions > t leaves every output at positions <= t unchanged."""
    core = build(config, 6)
    inputs = make_inputs(core, 1, 2, 40, 4, dtype=torch.float64, seed=seed)
    t = 23
    changed = {name: x.clone() for name, x in inputs.items()}
    for x in changed.values():
        x[:, :, t + 1 :] = torch.rand_like(x[:, :, t + 1 :]) * x[:, :, t + 1 :].sign()  # new values, same signs: β, log α stay valid
    before, after = core(**inputs), core(**changed)
    torch.testing.assert_close(after[:, :, : t + 1], before[:, :, : t + 1], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(after[:, :, t + 1 :], before[:, :, t + 1 :]), "the perturbation changed nothing"


@pytest.mark.parametrize("config", NONCAUSAL, ids=config_id)
def test_noncausal_sees_the_future(config, seed):
    """The counterpart of test_causality: without the mask, early outputs do depend on later inputs."""
    core = build(config, 6)
    inputs = make_inputs(core, 1, 2, 40, 4, dtype=torch.float64, seed=seed)
    later = dict(inputs, v=inputs["v"].clone())
    later["v"][:, :, 1:] += 1.0
    assert not torch.allclose(core(**inputs, causal=False)[:, :, 0], core(**later, causal=False)[:, :, 0])

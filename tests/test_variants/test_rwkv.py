"""RWKV-4's WKV operator and token shift, beyond what tests/test_variants/test_equivalence.py checks for every
variant: the reference is the paper's formula; chunked == running-maximum step loop == reference,
forward and backward (r, k, v, w, u) with random decays and bonuses; numerically stable where the
plain formula overflows float32; the layer with its token shift; FLOPs; errors."""

from __future__ import annotations

import pytest
import torch
from helpers import check_forms, check_layer_forms
from test_layer import randomise

import variants
from variants.conv import TokenShift

SHAPES = [(1, 1, 1, 4), (2, 3, 17, 5), (1, 2, 70, 6)]  # (batch, heads, T, d): T = 1, odd T, several chunks


def randn(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def rwkv(d, seed, dtype=torch.float64, **params):
    """The core with random decays w = e^{w_raw}, w_raw ~ N(−1, 1), and bonus u ~ N(0, 1)."""
    core = variants.create("rwkv", d, **params).double()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        core.log_decay.copy_(torch.randn(d, generator=gen, dtype=torch.float64) - 1)
        core.bonus.copy_(torch.randn(d, generator=gen, dtype=torch.float64))
    return core.to(dtype)


def plain_wkv(r, k, v, decay, bonus):
    """Peng et al. 2023, eq. 14 and o_t = σ(r_t) ⊙ wkv_t, one position and channel at a time."""
    out = torch.empty_like(v)
    batch, heads, length, d = v.shape
    for t in range(length):
        numerator = torch.exp(bonus + k[:, :, t]) * v[:, :, t]
        denominator = torch.exp(bonus + k[:, :, t])
        for i in range(t):
            weight = torch.exp(-(t - 1 - i) * decay + k[:, :, i])
            numerator, denominator = numerator + weight * v[:, :, i], denominator + weight
        out[:, :, t] = torch.sigmoid(r[:, :, t]) * numerator / denominator
    return out


def test_reference_is_the_papers_formula(seed):
    core = rwkv(5, seed)
    r, k, v = (randn(seed + i, 2, 3, 12, 5) for i in range(3))
    expected = plain_wkv(r, k, v, torch.exp(core.log_decay), core.bonus)
    torch.testing.assert_close(core.reference(r, k, v), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("chunk_size", [32, 5])
def test_forms_agree_with_random_decays_and_bonuses(chunk_size, shape, dtype, seed):
    """As tests/test_variants/test_equivalence.py, with w and u drawn (their gradients too); forward only at
    T = 1, where wkv_0 = v_0 whatever k, w, u (zero gradients would test nothing)."""
    batch, heads, length, d = shape
    inputs = {name: randn(seed + i, batch, heads, length, d) for i, name in enumerate("qkv")}
    core = rwkv(d, seed, dtype, chunk_size=chunk_size)
    check_forms(core, rwkv(d, seed, chunk_size=chunk_size), inputs, dtype, seed, f"rwkv chunk_size={chunk_size}", backward=length > 1)


@pytest.mark.parametrize("key_scale", [40.0, 120.0])
def test_stable_where_the_plain_formula_overflows_float32(key_scale, seed):
    """e^{k} overflows float32 beyond k ≈ 88; both fast forms subtract running maxima and stay exact."""
    core = rwkv(4, seed, chunk_size=8)
    r, k, v = randn(seed, 1, 2, 30, 4), key_scale * randn(seed + 1, 1, 2, 30, 4), randn(seed + 2, 1, 2, 30, 4)
    expected = core.reference(r, k, v)  # float64 holds e^{±120·3}
    assert torch.isfinite(expected).all()
    low = rwkv(4, seed, torch.float32, chunk_size=8)
    assert not torch.isfinite(low.reference(r.float(), k.float(), v.float())).all(), "the plain formula should overflow here"
    inputs = {"q": r.float(), "k": k.float(), "v": v.float()}
    for out in (low(**inputs), low.step_loop(inputs)[0]):
        torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)


def test_token_shift_is_the_mix_with_the_previous_input(seed):
    shift = TokenShift(6).double()
    randomise(shift, torch.Generator().manual_seed(seed))
    x, previous = randn(seed, 2, 5, 6), randn(seed + 1, 2, 6)
    mixed = shift(x, previous)
    assert mixed.shape == (3, 2, 5, 6)
    for role in range(3):
        mu = shift.mix[role, 0, 0]
        for t in range(5):
            before = previous if t == 0 else x[:, t - 1]
            torch.testing.assert_close(mixed[role, :, t], mu * x[:, t] + (1 - mu) * before)
    torch.testing.assert_close(shift(x)[:, :, 0], shift.mix[:, 0] * x[:, 0])  # x_{-1} = 0


@pytest.mark.parametrize("short_conv", [None, 2])
def test_layer_parallel_prefill_and_steps_agree(short_conv, seed):
    layer = variants.AttentionLayer(8, 2, "rwkv", chunk_size=4, short_conv=short_conv).double()
    assert isinstance(layer.token_shift, TokenShift) and not hasattr(layer, "write_strength") and not hasattr(layer, "decay_gate")
    gen = torch.Generator().manual_seed(seed)
    randomise(layer, gen)
    x = torch.randn(2, 13, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    grads = check_layer_forms(layer, x, gen, seed)
    for label, grad in grads.items():
        assert grad.abs().max() > 0, f"d/d{label} is zero"
    names = list(grads)
    assert "token_shift.mix" in names and "core.log_decay" in names and "core.bonus" in names


def test_metadata_and_flops():
    from torch.utils.flop_counter import FlopCounterMode

    core = variants.create("rwkv", 16)
    r, k, v = (torch.randn(2, 3, 100, 16) for _ in range(3))
    with FlopCounterMode(display=False) as counter:
        core(r, k, v)
    assert counter.get_total_flops() == core.flops(2, 3, 100, 16)
    assert core.state_numel(2, 3, 16, 100) == 3 * 2 * 3 * 16
    assert core.step_flops(2, 3, 16, 50) == 12 * 2 * 3 * 16
    assert core.d_dot == 1


def test_errors():
    core = variants.create("rwkv", 4).double()
    x = torch.randn(2, 3, 5, 4, dtype=torch.float64)
    with pytest.raises(variants.VariantError, match=r"^rwkv: the operator is per channel; v's last dim must be d_key=4, got 3"):
        core(x, x, x[..., :3])
    with pytest.raises(variants.VariantError, match=r"^rwkv: this variant is causal only"):
        core(x, x, x, causal=False)
    with pytest.raises(variants.VariantError, match=r"^rwkv: this variant takes no beta"):
        core(x, x, x, beta=torch.rand(2, 3, 5, dtype=torch.float64))
    with pytest.raises(variants.UnsupportedBackend, match=r"rwkv: has only the 'torch' backend \(and 'compile' of its PyTorch forms\), got backend='triton'"):
        variants.create("rwkv", 4, backend="triton")
    with pytest.raises(variants.VariantError, match=r"chunk_size must be a positive int, got 0"):
        variants.create("rwkv", 4, chunk_size=0)

"""Based (Taylor feature map, short convolution) and ReBased (learnable normalised quadratic
kernel): the kernels written out by hand, every form against a float64 reference including the
gradients of ReBased's γ, β, the layer's short convolution in parallel and step form, and the
Triton sum-rule kernel on their features."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import check_forms, check_layer_forms
from test_layer import randomise

import variants
from variants.conv import ShortConv
from variants.feature_maps import ReBased, SumNormalized, Taylor


def randn(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def normalised_attention(kernel, q, k, v):
    """y_t = Σ_{i≤t} κ(q_t, k_i) v_i / (Σ_{i≤t} κ(q_t, k_i) + ε), κ given on all pairs [..., T, T]."""
    weights = torch.tril(kernel(q, k))
    return weights @ v / (weights.sum(-1, keepdim=True) + 1e-6)


def test_taylor_kernel_is_the_second_order_expansion_of_exp(seed):
    """φ(q)·φ(k) = 1 + s + s²/2 with s = q·k/√d (Based, eq. 3)."""
    d = 6
    q, k = randn(seed, 7, d), randn(seed + 1, 9, d)
    phi = Taylor(d)
    assert phi.d_dot == 1 + d + d * d and Taylor(16).d_dot == 273
    s = q @ k.T / math.sqrt(d)
    torch.testing.assert_close(phi(q) @ phi(k).T, 1 + s + s * s / 2, msg=lambda m: f"seed {seed}: {m}")


def test_rebased_kernel_is_the_square_of_normalised_affine_products(seed):
    """φ_q(q)·φ_k(k) = (q'·k')², x' = γ ⊙ (x − mean x)/sqrt(var x + 1e-5) + β, γ, β per role."""
    d = 5
    phi = ReBased(d).double()
    randomise(phi, torch.Generator().manual_seed(seed))
    q, k = randn(seed, 7, d), randn(seed + 1, 9, d)

    def affine_normalised(x, side):
        centred = x - x.mean(-1, keepdim=True)
        return side.gamma * centred / torch.sqrt((centred**2).mean(-1, keepdim=True) + 1e-5) + side.beta

    expected = (affine_normalised(q, phi.query) @ affine_normalised(k, phi.key).T) ** 2
    torch.testing.assert_close(phi.for_queries(q) @ phi.for_keys(k).T, expected, msg=lambda m: f"seed {seed}: {m}")
    assert phi.d_dot == d * d
    assert not torch.allclose(phi.for_queries(q), phi.for_keys(q)), "queries and keys should have their own γ, β"


def test_based_is_normalised_attention_with_the_taylor_kernel(seed):
    d = 4
    q, k, v = randn(seed, 2, 3, 45, d), randn(seed + 1, 2, 3, 45, d), randn(seed + 2, 2, 3, 45, 5)
    kernel = lambda a, b: 1 + (a @ b.transpose(-1, -2)) / math.sqrt(d) + (a @ b.transpose(-1, -2)) ** 2 / (2 * d)  # noqa: E731
    core = variants.create("based", d, chunk_size=16).double()
    assert core.d_dot == 21
    torch.testing.assert_close(core(q, k, v), normalised_attention(kernel, q, k, v), rtol=1e-10, atol=1e-10)


def rebased_core(seed, dtype=torch.float64, **params):
    """ReBased with γ, β drawn around their initial 1, 0 (γ = 1 + 0.3 n, β = 0.3 n), as training moves them."""
    core = variants.create("rebased", 5, **params).double()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in core.named_parameters():
            param.copy_((name.endswith("gamma")) + 0.3 * torch.randn(param.shape, generator=gen, dtype=torch.float64))
    return core.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("params", [{}, {"chunk_size": 8}, {"normalize": False, "chunk_size": 16}], ids=str)
def test_rebased_forms_agree_with_learned_gamma_beta(params, dtype, seed):
    """chunked == step loop == reference, forward and backward, for q, k, v and the four γ, β."""
    reference = rebased_core(seed, **params)
    inputs = {"q": randn(seed, 2, 2, 21, 5), "k": randn(seed + 1, 2, 2, 21, 5), "v": randn(seed + 2, 2, 2, 21, 3)}
    cotangent = randn(seed + 3, 2, 2, 21, 3)
    if dtype == torch.float32 and params.get("normalize", True):
        # y_t = num_t / (a_t + ε), a_t = Σ_{i≤t} (q_t'·k_i')² a sum of d² signed feature products, which float32
        # forms to u·ā_t (u = 6e-8, ā_t = Σ_{i≤t} (|q_t'|·|k_i'|)²); d/dq_t is a difference of terms of size
        # 1/√a_t (ε/(a_t + ε)² alone at t = 0), so its float32 error is about u·ā_t / a_t^{3/2} (a = 0.02,
        # ā/a = 400 occurs: 1.8e-4). Positions where that passes a tenth of the float32 atol are left out.
        phi_q, phi_k = reference.phi.for_queries(inputs["q"]), reference.phi.for_keys(inputs["k"])
        mass = torch.tril(phi_q @ phi_k.transpose(-1, -2)).sum(-1, keepdim=True)
        magnitude = torch.tril(phi_q.abs() @ phi_k.abs().transpose(-1, -2)).sum(-1, keepdim=True)
        cotangent = cotangent * (torch.finfo(dtype).eps / 2 * magnitude < 1e-5 * mass**1.5)
    check_forms(rebased_core(seed, dtype, **params), reference, inputs, dtype, seed, f"rebased {params}", cotangent=cotangent)


def test_short_conv_is_the_causal_depthwise_sum(seed):
    """y_t = b + Σ_j w_j ⊙ x_{t−K+1+j} (x = 0 before the start), in the parallel and step forms."""
    conv = ShortConv(6, 4).double()
    randomise(conv, torch.Generator().manual_seed(seed))
    x = randn(seed, 2, 11, 6)
    weight, bias = conv.conv.weight.squeeze(1), conv.conv.bias  # [d, K], [d]
    padded = F.pad(x, (0, 0, 3, 0))
    expected = torch.stack([bias + sum(weight[:, j] * padded[:, t + j] for j in range(4)) for t in range(11)], 1)
    torch.testing.assert_close(conv(x), expected)
    window, steps = conv.init_window(2, dtype=torch.float64), []
    for t in range(11):
        y_t, window = conv.step(x[:, t], window)
        steps.append(y_t)
    torch.testing.assert_close(torch.stack(steps, 1), expected)
    torch.testing.assert_close(window, x[:, -3:])
    first = conv(x[:, :5])
    second = conv(x[:, 5:], conv.next_window(x[:, :5], conv.init_window(2, dtype=torch.float64)))
    torch.testing.assert_close(torch.cat([first, second], 1), expected)


def test_mqar_uses_the_library_short_conv():
    """The MQAR model's convolution is ``variants.conv.ShortConv`` (tested above), not a copy of it."""
    from harness.models.mqar import MQARBlock

    assert type(MQARBlock(8, 2, "softmax", conv_size=3).conv) is ShortConv


@pytest.mark.parametrize(
    "name, params",
    [("based", {"d_key": 3, "chunk_size": 4}), ("rebased", {"normalize": False, "chunk_size": 4}), ("gated_delta", {"chunk_size": 4}), ("softmax", {})],
)
@pytest.mark.parametrize("kernel_size", [1, 3])
def test_layer_with_short_conv(name, params, kernel_size, seed):
    """Parallel == step loop == prefill chain for the whole layer, forward and every gradient."""
    layer = variants.AttentionLayer(8, 2, name, short_conv=kernel_size, **params).double()
    gen = torch.Generator().manual_seed(seed)
    randomise(layer, gen)
    x = torch.randn(2, 13, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    for label, grad in check_layer_forms(layer, x, gen, seed).items():
        assert grad.abs().max() > 0, f"d/d{label} is zero (seed {seed})"


def test_short_conv_feeds_every_projection(seed):
    """layer(x) with short_conv=K is the same layer without it applied to conv(x)."""
    layer = variants.AttentionLayer(8, 2, "gated_delta", short_conv=3).double()
    randomise(layer, torch.Generator().manual_seed(seed))
    plain = variants.AttentionLayer(8, 2, "gated_delta").double()
    plain.load_state_dict({name: value for name, value in layer.state_dict().items() if not name.startswith("short_conv")})
    x = randn(seed, 2, 9, 8)
    torch.testing.assert_close(layer(x), plain(layer.short_conv(x)), rtol=1e-12, atol=1e-12)


def test_metadata():
    based = variants.create("based", 16)
    assert based.d_dot == 273
    assert based.state_numel(2, 3, 8, 100) == 2 * 3 * 273 * 9
    assert based.step_flops(1, 1, 8, 5) == 4 * 273 * 8
    rebased = variants.create("rebased", 16)
    assert rebased.d_dot == 256 and sum(p.numel() for p in rebased.parameters()) == 4 * 16


def test_flops_match_torch_flop_counter():
    from torch.utils.flop_counter import FlopCounterMode

    for name in ("based", "rebased"):
        core = variants.create(name, 6)
        q, k, v = (torch.randn(2, 3, 100, 6) for _ in range(3))
        with FlopCounterMode(display=False) as counter:
            core(q, k, v)
        assert counter.get_total_flops() == core.flops(2, 3, 100, 6), name


def test_errors():
    with pytest.raises(variants.VariantError, match=r"phi='taylor' has d_dot = 1 \+ d_key \+ d_key² = 21; cannot give d_dot=16"):
        variants.create("based", 4, d_dot=16)
    with pytest.raises(variants.VariantError, match=r"sum_norm: ReBased maps queries and keys differently"):
        variants.create("rebased", 4, sum_norm=True)
    with pytest.raises(variants.VariantError, match=r"AttentionLayer: short_conv must be a positive int, got 0"):
        variants.AttentionLayer(8, 2, "based", short_conv=0)
    with pytest.raises(TypeError, match="for_queries"):
        ReBased(4)(torch.zeros(4))
    assert not isinstance(variants.create("based", 4).phi, SumNormalized)


@pytest.mark.parametrize("name", ["based", "rebased"])
def test_triton_sum_rule_kernel_on_their_features(name, seed):
    """The existing sum-rule kernel takes φ(q), φ(k) from PyTorch, so both run on it while d_dot ≤ 256."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    reference = variants.create(name, 4).double()
    randomise(reference, torch.Generator().manual_seed(seed))
    kernel = variants.create(name, 4, backend="triton")
    kernel.load_state_dict(reference.state_dict())
    kernel = kernel.to(device)
    q, k, v = (randn(seed + i, 1, 2, 20, 4) for i in range(3))
    expected = reference.reference(q, k, v)
    got = kernel(*(t.float().to(device) for t in (q, k, v)))
    torch.testing.assert_close(got.double().cpu(), expected, rtol=2e-4, atol=1e-4)
    with pytest.raises(variants.UnsupportedBackend, match="d_dot=273 exceeds the Triton kernels' limit of 256"):
        variants.create("based", 16, backend="triton")

"""Bad input gets a VariantError whose message names what was wrong."""

from __future__ import annotations

import re

import pytest
import torch

import variants

E = variants.VariantError


def test_variant_error_is_a_value_error():
    assert issubclass(variants.VariantError, ValueError)
    with pytest.raises(ValueError):
        variants.create("no-such-variant", 4)


# --- create -----------------------------------------------------------------------------


def test_unknown_variant_lists_the_known_names():
    known = variants.names()
    assert {"softmax", "linear", "performer", "dpfp", "delta"} <= set(known)
    with pytest.raises(E, match="no-such-variant") as info:
        variants.create("no-such-variant", 4)
    for name in known:
        assert re.search(rf"\b{re.escape(name)}\b", str(info.value)), f"{name!r} missing from: {info.value}"


@pytest.mark.parametrize(
    "name, params, bad",
    [
        ("softmax", {"m": 3}, "m"),
        ("linear", {"colour": "red"}, "colour"),
        ("delta", {"scale": 0.5}, "scale"),
    ],
)
def test_unknown_keyword(name, params, bad):
    with pytest.raises(E, match=rf"^{name}: no parameter '{bad}'(.*); its parameters: "):
        variants.create(name, 4, **params)


@pytest.mark.parametrize("d_key", [0, -2, 4.0])
def test_bad_d_key(d_key):
    with pytest.raises(E, match=rf"d_key must be a positive int, got {re.escape(repr(d_key))}"):
        variants.create("linear", d_key)


@pytest.mark.parametrize(
    "name, params, match",
    [
        ("dpfp", {"nu": 2, "d_dot": 8}, r"nu=2.*d_dot=8"),
        ("performer", {"m": 3, "d_dot": 8}, r"m=3.*d_dot=8"),
        ("dpfp", {"d_dot": 100}, r"d_dot=100.*not reachable.*2\*d_key\*nu"),
        ("performer", {"d_dot": 9}, r"d_dot=9.*not reachable.*2m"),
        ("linear", {"phi": "favor"}, r"needs m \(or d_dot"),
        ("linear", {"d_dot": 9}, r"d_dot = d_key = 4.*d_dot=9"),
        ("linear", {"phi": "elu1", "m": 3}, r"neither m nor nu"),
        ("delta", {"phi": "dpfp", "nu": 8}, r"nu must be an int in .*\[1, 7\].*got 8"),
        ("performer", {"m": 0}, r"m must be a positive int, got 0"),
    ],
)
def test_unreachable_feature_dims(name, params, match):
    with pytest.raises(E, match=match):
        variants.create(name, 4, **params)


@pytest.mark.parametrize("name", ["linear", "delta"])
def test_unknown_phi(name):
    with pytest.raises(E, match=rf"^{name}: phi must be one of .*, got 'relu'") as info:
        variants.create(name, 4, phi="relu")
    for known in ("identity", "elu1", "favor", "dpfp"):
        assert known in str(info.value)


@pytest.mark.parametrize("name", ["linear", "performer", "dpfp", "delta"])
@pytest.mark.parametrize("chunk_size", [0, -1, 2.5])
def test_bad_chunk_size(name, chunk_size):
    with pytest.raises(E, match=rf"chunk_size must be a positive int, got {re.escape(repr(chunk_size))}"):
        variants.create(name, 4, chunk_size=chunk_size)


# --- shapes and dtypes ------------------------------------------------------------------------

B, H, T, DK, DV = 2, 3, 5, 4, 6


def tensors(*shape, dtype=torch.float64):
    return torch.rand(*shape, dtype=dtype)


def beta_for(core, *shape):
    return torch.rand(*shape, dtype=torch.float64) if variants.BETA in core.token_inputs else None


NAMES = ["softmax", "linear", "performer", "dpfp", "delta"]


@pytest.mark.parametrize("name", NAMES)
def test_good_inputs_pass(name):
    """The baseline the error tests perturb: these shapes are accepted."""
    core = variants.create(name, DK).double()
    out = core(tensors(B, H, T, DK), tensors(B, H, T, DK), tensors(B, H, T, DV), beta=beta_for(core, B, H, T))
    assert out.shape == (B, H, T, DV)
    state = core.init_state(B, H, DV, dtype=torch.float64)
    out_t, _ = core.step(tensors(B, H, DK), tensors(B, H, DK), tensors(B, H, DV), state, beta_t=beta_for(core, B, H))
    assert out_t.shape == (B, H, DV)


SEQUENCE_CASES = [
    # (what, q shape, k shape, v shape, match)
    ("3-d q", (B, T, DK), (B, H, T, DK), (B, H, T, DV), r"q must be a 4-d tensor \[B, H, T, D\], got \(2, 5, 4\)"),
    ("3-d k", (B, H, T, DK), (B, T, DK), (B, H, T, DV), r"k must be a 4-d tensor"),
    ("3-d v", (B, H, T, DK), (B, H, T, DK), (B, T, DV), r"v must be a 4-d tensor"),
    ("q/k mismatch", (B, H, T, DK), (B, H, T + 1, DK), (B, H, T, DV), r"q and k must have the same shape.*\(2, 3, 5, 4\) and \(2, 3, 6, 4\)"),
    ("v other T", (B, H, T, DK), (B, H, T, DK), (B, H, T + 2, DV), r"v must match q in every dim but the heads and the last.*\(2, 3, 7, 6\)"),
    ("v other B", (B, H, T, DK), (B, H, T, DK), (B + 1, H, T, DV), r"v must match q in every dim but the heads and the last"),
    ("last dim", (B, H, T, DK + 1), (B, H, T, DK + 1), (B, H, T, DV), rf"the last dim of q and k must be d_key={DK}, got {DK + 1}"),
]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("case", SEQUENCE_CASES, ids=[c[0] for c in SEQUENCE_CASES])
def test_bad_sequence_shapes(name, case):
    _, q_shape, k_shape, v_shape, match = case
    core = variants.create(name, DK).double()
    beta = beta_for(core, B, H, T)
    for form in (core.forward, core.reference):
        with pytest.raises(E, match=rf"^{name}: {match}"):
            form(tensors(*q_shape), tensors(*k_shape), tensors(*v_shape), beta=beta)


TOKEN_CASES = [
    ("4-d q_t", (B, H, 1, DK), (B, H, DK), (B, H, DV), r"q_t must be a 3-d tensor \[B, H, D\], got \(2, 3, 1, 4\)"),
    ("4-d v_t", (B, H, DK), (B, H, DK), (B, H, 1, DV), r"v_t must be a 3-d tensor"),
    ("q/k mismatch", (B, H, DK), (B + 1, H, DK), (B, H, DV), r"q and k must have the same shape"),
    ("v other B", (B, H, DK), (B, H, DK), (B + 1, H, DV), r"v must match q in every dim but the heads and the last"),
    ("v other H", (B, H, DK), (B, H, DK), (B, H + 1, DV), r".*(a divisor of|takes no grouped heads).*got q 3, k 3, v 4 heads"),
    ("last dim", (B, H, DK - 1), (B, H, DK - 1), (B, H, DV), rf"the last dim of q and k must be d_key={DK}, got {DK - 1}"),
]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("case", TOKEN_CASES, ids=[c[0] for c in TOKEN_CASES])
def test_bad_token_shapes(name, case):
    _, q_shape, k_shape, v_shape, match = case
    core = variants.create(name, DK).double()
    state = core.init_state(B, H, DV, dtype=torch.float64)
    with pytest.raises(E, match=rf"^{name}: {match}"):
        core.step(tensors(*q_shape), tensors(*k_shape), tensors(*v_shape), state, beta_t=beta_for(core, B, H))


@pytest.mark.parametrize("name", NAMES)
def test_not_a_tensor(name):
    core = variants.create(name, DK)
    with pytest.raises(E, match=r"k must be a 4-d tensor.*got list"):
        core(tensors(B, H, T, DK), [[0.0]], tensors(B, H, T, DV), beta=beta_for(core, B, H, T))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("odd_one", ["q", "k", "v"])
def test_mixed_dtypes(name, odd_one):
    core = variants.create(name, DK).double()
    dtypes = {label: torch.float64 for label in "qkv"}
    dtypes[odd_one] = torch.float32
    q, k, v = tensors(B, H, T, DK, dtype=dtypes["q"]), tensors(B, H, T, DK, dtype=dtypes["k"]), tensors(B, H, T, DV, dtype=dtypes["v"])
    with pytest.raises(E, match=r"q, k and v must share a dtype.*float32"):
        core(q, k, v, beta=beta_for(core, B, H, T))
    state = core.init_state(B, H, DV, dtype=torch.float64)
    with pytest.raises(E, match=r"q, k and v must share a dtype.*float32"):
        core.step(q[:, :, 0], k[:, :, 0], v[:, :, 0], state, beta_t=beta_for(core, B, H))


# --- β and causality -----------------------------------------------------------------------------


def qkv(length=T):
    return tensors(B, H, length, DK), tensors(B, H, length, DK), tensors(B, H, length, DV)


def qkv_t():
    return tensors(B, H, DK), tensors(B, H, DK), tensors(B, H, DV)


def test_delta_is_causal_only():
    core = variants.create("delta", DK).double()
    beta = torch.rand(B, H, T, dtype=torch.float64)
    for form in (core.forward, core.reference):
        with pytest.raises(E, match=r"^delta: .*causal only.*causal=False"):
            form(*qkv(), beta=beta, causal=False)
    assert core(*qkv(), beta=beta, causal=True).shape == (B, H, T, DV)


def test_delta_needs_beta():
    core = variants.create("delta", DK).double()
    with pytest.raises(E, match=r"^delta: the delta rule needs the write strength beta \[B, H, T\]"):
        core(*qkv())
    with pytest.raises(E, match=r"needs the write strength beta"):
        core.prefill(*qkv())
    state = core.init_state(B, H, DV, dtype=torch.float64)
    with pytest.raises(E, match=r"^delta: the delta rule needs the write strength beta_t \[B, H\]"):
        core.step(*qkv_t(), state)


@pytest.mark.parametrize("shape", [(B, H, T - 1), (B, H), (B, H, T, 1), (H, B, T)])
def test_delta_beta_wrong_shape(shape):
    core = variants.create("delta", DK).double()
    beta = torch.rand(*shape, dtype=torch.float64)
    expected = re.escape(f"beta must have shape [B, H, T] = {(B, H, T)}, got {tuple(shape)}")
    with pytest.raises(E, match=expected):
        core(*qkv(), beta=beta)


@pytest.mark.parametrize("shape", [(B, H, 1), (B,), (B, H + 1)])
def test_delta_beta_t_wrong_shape(shape):
    core = variants.create("delta", DK).double()
    state = core.init_state(B, H, DV, dtype=torch.float64)
    expected = re.escape(f"beta_t must have shape [B, H] = {(B, H)}, got {tuple(shape)}")
    with pytest.raises(E, match=expected):
        core.step(*qkv_t(), state, beta_t=torch.rand(*shape, dtype=torch.float64))


@pytest.mark.parametrize("name", ["softmax", "linear", "performer", "dpfp"])
def test_beta_refused_by_variants_without_one(name):
    core = variants.create(name, DK).double()
    with pytest.raises(E, match=rf"^{name}: this variant takes no beta \(only the delta rule does\)"):
        core(*qkv(), beta=torch.rand(B, H, T, dtype=torch.float64))
    state = core.init_state(B, H, DV, dtype=torch.float64)
    with pytest.raises(E, match=rf"^{name}: this variant takes no beta_t"):
        core.step(*qkv_t(), state, beta_t=torch.rand(B, H, dtype=torch.float64))


# --- the layer -------------------------------------------------------------------------------------


@pytest.mark.parametrize("d_model, n_heads", [(16, 3), (10, 4), (7, 2)])
def test_layer_d_model_not_divisible(d_model, n_heads):
    with pytest.raises(E, match=rf"d_model={d_model} is not divisible by n_heads={n_heads}"):
        variants.AttentionLayer(d_model, n_heads, "linear")
    with pytest.raises(E, match=r"not divisible"):
        variants.AttentionLayer(d_model, n_heads, "softmax", d_key=4)  # d_value still defaulted


def test_layer_passes_core_errors_on():
    with pytest.raises(E, match=r"unknown variant 'nope'"):
        variants.AttentionLayer(8, 2, "nope")
    with pytest.raises(E, match=r"softmax: no parameter 'nu'; its parameters: scale"):
        variants.AttentionLayer(8, 2, "softmax", nu=1)


@pytest.mark.parametrize("name", ["softmax", "linear", "delta"])
def test_empty_sequence_is_a_clear_error(name):
    core = variants.create(name, 4)
    q = torch.randn(1, 1, 0, 4)
    beta = torch.rand(1, 1, 0) if variants.BETA in core.token_inputs else None
    with pytest.raises(variants.VariantError, match="empty"):
        core(q, q, q, beta=beta)


def test_dpfp_rejects_d_key_one():
    with pytest.raises(variants.VariantError, match="d_key >= 2"):
        variants.create("dpfp", 1)


@pytest.mark.parametrize("kwargs", [{"n_heads": 0}, {"d_key": 0}, {"d_value": -1}])
def test_layer_rejects_non_positive_sizes(kwargs):
    args = {"d_model": 8, "n_heads": 2, "core_name": "linear", **kwargs}
    with pytest.raises(variants.VariantError, match="positive int"):
        variants.AttentionLayer(**args)


@pytest.mark.parametrize("scale", [0, -1.0, "a"])
def test_softmax_scale_must_be_positive(scale):
    with pytest.raises(variants.VariantError, match="scale"):
        variants.create("softmax", 4, scale=scale)


@pytest.mark.parametrize(
    "name, params, message",
    [
        ("performer", {"nu": 2}, "phi='favor' takes m, not nu"),
        ("linear", {"phi": "favor", "m": 4, "nu": 2}, "phi='favor' takes m, not nu"),
        ("dpfp", {"m": 2}, "phi='dpfp' takes nu, not m"),
        ("delta", {"phi": "dpfp", "m": 2}, "phi='dpfp' takes nu, not m"),
    ],
)
def test_a_parameter_of_the_other_feature_map_is_refused(name, params, message):
    with pytest.raises(variants.VariantError, match=re.escape(message)):
        variants.create(name, 8, **params)

"""The Triton delta-rule kernel (variants/kernels/delta_rule.py) against the float64 chunked
reference ``variants.chunked.delta_rule_chunked``: forward, final state and every gradient.

Without a CUDA GPU the kernels run through Triton's interpreter on the CPU (TRITON_INTERPRET=1
must be set before triton is imported, hence the top of this file); with one, natively on
"cuda". Every test runs with the kernels' POISON flag set, so an output element a
kernel forgets to write is NaN and fails the finiteness checks.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

import variants  # noqa: E402
from variants.chunked import delta_rule_chunked  # noqa: E402
from variants.kernels import _common  # noqa: E402
from variants.kernels import delta_rule as kernel  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA GPU and TRITON_INTERPRET is not 1: the kernels cannot run", allow_module_level=True)

#: float32 kernel against the float64 reference: max |error| ≤ TOL · max(1, max |reference|).
TOL_FP32 = 1e-4


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    """Every buffer the kernels write starts as NaN."""
    monkeypatch.setattr(_common, "POISON", True)


def make_inputs(batch, heads, length, d_dot, d_value, *, initial_state, features, seed):
    """float64 q, k, v, β, S_0 (or None) on the CPU. ``features``: 'unit' (keys and queries of unit
    L2 norm) or 'sumnorm' (positive elu+1 features divided by their sum, as the delta variant feeds)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, length, d_dot, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, heads, length, d_dot, generator=gen, dtype=torch.float64)
    if features == "unit":
        q, k = (x / x.norm(dim=-1, keepdim=True) for x in (q, k))
    else:
        q, k = (torch.nn.functional.elu(x) + 1 for x in (q, k))
        q, k = (x / x.sum(-1, keepdim=True) for x in (q, k))
    v = torch.randn(batch, heads, length, d_value, generator=gen, dtype=torch.float64)
    beta = torch.rand(batch, heads, length, generator=gen, dtype=torch.float64) * 0.98 + 0.01
    weights = 0.5 * torch.randn(batch, heads, d_dot, d_value, generator=gen, dtype=torch.float64) if initial_state else None
    return q, k, v, beta, weights


def reference(q, k, v, beta, weights, dy, ds_final):
    """[y, S_T, dq, dk, dv, dβ, (dS_0)]: float64 forward and gradients of <y, dy> + <S_T, ds_final> (None cotangents count as zero)."""
    leaves = [t.detach().double().cpu().requires_grad_() for t in (q, k, v, beta)]
    state = weights.detach().double().cpu().requires_grad_() if weights is not None else None
    start = state if state is not None else leaves[0].new_zeros(q.shape[0], q.shape[1], q.shape[-1], v.shape[-1])
    y, s_final, _ = delta_rule_chunked(*leaves, start, None, 16)
    loss = 0.0
    if dy is not None:
        loss = loss + (y * dy.double().cpu()).sum()
    if ds_final is not None:
        loss = loss + (s_final * ds_final.double().cpu()).sum()
    inputs = leaves + ([state] if state is not None else [])
    grads = torch.autograd.grad(loss, inputs, allow_unused=True, materialize_grads=True)  # S_T does not depend on q
    return [y.detach(), s_final.detach(), *grads]


def run_kernel(q, k, v, beta, weights, dy, ds_final, *, dtype=torch.float32, chunk_size=None):
    """Kernel forward on DEVICE and the gradients of the same loss as ``reference``, same layout."""
    leaves = [t.detach().to(DEVICE, dtype).requires_grad_() for t in (q, k, v, beta)]
    state = weights.detach().to(DEVICE, torch.float32).requires_grad_() if weights is not None else None
    y, s_final = kernel.delta_rule_triton(*leaves, state, chunk_size=chunk_size)
    assert y.dtype == dtype and y.shape == v.shape
    assert s_final.dtype == torch.float32 and s_final.shape == (q.shape[0], q.shape[1], q.shape[-1], v.shape[-1])
    outputs, cotangents = [], []
    if dy is not None:
        outputs.append(y)
        cotangents.append(dy.to(DEVICE, dtype))
    if ds_final is not None:
        outputs.append(s_final)
        cotangents.append(ds_final.to(DEVICE, torch.float32))
    inputs = leaves + ([state] if state is not None else [])
    grads = torch.autograd.grad(outputs, inputs, cotangents)
    for name, tensor in zip(["y", "S_T", "dq", "dk", "dv", "dbeta", "dS0"], [y, s_final, *grads]):
        assert torch.isfinite(tensor).all(), f"{name} has NaN/inf (an element the kernel did not write?)"
    return [y.detach(), s_final.detach(), *grads]


def max_errors(actual, expected):
    """{name: (max |error|, max |reference|)}."""
    names = ["y", "S_T", "dq", "dk", "dv", "dbeta", "dS0"]
    return {
        name: ((a.double().cpu() - e).abs().max().item(), e.abs().max().item())
        for name, a, e in zip(names, actual, expected)
    }


def assert_close(actual, expected, tol, label=""):
    errors = max_errors(actual, expected)
    print(f"\n{label} max errors: " + ", ".join(f"{name} {err:.1e} (of {scale:.1g})" for name, (err, scale) in errors.items()))
    bad = {name: err for name, (err, scale) in errors.items() if not err <= tol * max(1.0, scale)}
    assert not bad, f"{label}: errors above {tol} (relative to max(1, max|ref|)): {bad}"


CASES = [
    # batch, heads, T, d_dot, d_value, chunk_size, initial state, features
    pytest.param(1, 1, 1, 16, 16, None, False, "unit", id="T1"),
    pytest.param(2, 3, 17, 16, 8, 16, True, "unit", id="T17-bh6-F16-Dv8-c16-s0"),
    pytest.param(1, 1, 63, 5, 7, None, True, "unit", id="T63-F5-Dv7-s0"),
    pytest.param(1, 1, 63, 16, 8, 20, False, "sumnorm", id="T63-c20-sumnorm"),
    pytest.param(2, 3, 130, 16, 8, None, True, "sumnorm", id="T130-bh6-sumnorm-s0"),
    pytest.param(1, 1, 130, 32, 48, 48, False, "unit", id="T130-F32-Dv48-c48"),
    pytest.param(1, 1, 40, 256, 100, None, True, "unit", id="T40-F256-Dv100-s0"),
]


@pytest.mark.parametrize("batch, heads, length, d_dot, d_value, chunk_size, initial_state, features", CASES)
def test_matches_reference(batch, heads, length, d_dot, d_value, chunk_size, initial_state, features, seed):
    q, k, v, beta, weights = make_inputs(batch, heads, length, d_dot, d_value, initial_state=initial_state, features=features, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    dy = torch.randn(v.shape, generator=gen, dtype=torch.float64)
    ds_final = torch.randn(batch, heads, d_dot, d_value, generator=gen, dtype=torch.float64)
    expected = reference(q, k, v, beta, weights, dy, ds_final)
    actual = run_kernel(q, k, v, beta, weights, dy, ds_final, chunk_size=chunk_size)
    assert_close(actual, expected, TOL_FP32, f"T={length} F={d_dot} Dv={d_value} C={chunk_size}")


@pytest.mark.parametrize("cotangent", ["y only", "S_T only"])
def test_gradient_from_one_output(cotangent, seed):
    """A loss on y alone (no gradient arrives on S_T) or on S_T alone (none on y)."""
    q, k, v, beta, weights = make_inputs(1, 2, 33, 16, 16, initial_state=True, features="unit", seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    dy = torch.randn(v.shape, generator=gen, dtype=torch.float64) if cotangent == "y only" else None
    ds_final = torch.randn(1, 2, 16, 16, generator=gen, dtype=torch.float64) if cotangent == "S_T only" else None
    expected = reference(q, k, v, beta, weights, dy, ds_final)
    actual = run_kernel(q, k, v, beta, weights, dy, ds_final, chunk_size=16)
    assert_close(actual, expected, TOL_FP32, cotangent)


def test_chaining_through_the_state(seed):
    """Two calls, the second starting from the first's S_T, equal one call over the whole
    sequence: outputs, final state and every gradient (including through the carried state)."""
    length, split = 63, 40
    q, k, v, beta, weights = make_inputs(1, 2, length, 16, 8, initial_state=True, features="unit", seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    dy = torch.randn(v.shape, generator=gen, dtype=torch.float64).to(DEVICE, torch.float32)
    ds_final = torch.randn(1, 2, 16, 8, generator=gen, dtype=torch.float64).to(DEVICE, torch.float32)

    def leaves():
        return [t.to(DEVICE, torch.float32).requires_grad_() for t in (q, k, v, beta, weights)]

    whole = leaves()
    y, s_final = kernel.delta_rule_triton(*whole, chunk_size=16)
    grads_whole = torch.autograd.grad([y, s_final], whole, [dy, ds_final])

    pieces = leaves()
    first = [t[:, :, :split] for t in pieces[:4]]
    second = [t[:, :, split:] for t in pieces[:4]]
    y1, s_mid = kernel.delta_rule_triton(*first, pieces[4], chunk_size=16)
    y2, s_final2 = kernel.delta_rule_triton(*second, s_mid, chunk_size=16)
    y_chained = torch.cat([y1, y2], dim=2)
    grads_chained = torch.autograd.grad([y_chained, s_final2], pieces, [dy, ds_final])

    expected = reference(q, k, v, beta, weights, dy, ds_final)
    assert_close([y.detach(), s_final.detach(), *grads_whole], expected, TOL_FP32, "whole")
    assert_close([y_chained.detach(), s_final2.detach(), *grads_chained], expected, TOL_FP32, "chained")
    for name, a, b in zip(["y", "S_T", "dq", "dk", "dv", "dbeta", "dS0"], [y, s_final, *grads_whole], [y_chained, s_final2, *grads_chained]):
        assert torch.isfinite(b).all(), name
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: chained != whole: {m}")


def test_forward_without_autograd(seed):
    """Under no_grad (nothing saved for a backward) the forward is the same."""
    q, k, v, beta, weights = make_inputs(2, 1, 45, 16, 24, initial_state=True, features="sumnorm", seed=seed)
    y_ref, s_ref, *_ = reference(q, k, v, beta, weights, torch.zeros_like(v), None)
    with torch.no_grad():
        y, s_final = kernel.delta_rule_triton(*(t.to(DEVICE, torch.float32) for t in (q, k, v, beta, weights)), chunk_size=16)
    assert torch.isfinite(y).all() and torch.isfinite(s_final).all()
    assert_close([y, s_final], [y_ref, s_ref], TOL_FP32, "no_grad")


HALF = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_half_precision_inputs(dtype, seed):
    """fp16 / bf16 inputs accumulate in fp32 (S_T is float32); compared with the float64
    reference on the same rounded inputs, within the output dtype's rounding."""
    q, k, v, beta, weights = make_inputs(1, 2, 70, 32, 16, initial_state=True, features="unit", seed=seed)
    q, k, v, beta = (t.to(dtype).double() for t in (q, k, v, beta))
    gen = torch.Generator().manual_seed(seed + 1)
    dy = torch.randn(v.shape, generator=gen, dtype=torch.float64).to(dtype).double()
    ds_final = torch.randn(1, 2, 32, 16, generator=gen, dtype=torch.float64)
    expected = reference(q, k, v, beta, weights, dy, ds_final)
    try:
        actual = run_kernel(q, k, v, beta, weights, dy, ds_final, dtype=dtype)
    except Exception as exc:  # pragma: no cover - depends on the interpreter's dtype support
        if DEVICE == "cpu":
            pytest.skip(f"Triton's interpreter cannot run {dtype} here: {exc!r}")
        raise
    assert_close(actual, expected, 3e-2 if dtype == torch.bfloat16 else 1e-2, str(dtype))


@pytest.mark.parametrize(
    "d_dot, d_value, message",
    [
        (384, 64, "delta_rule_triton supports d_dot and d_value up to 256, got d_dot=384, d_value=64: use backend='torch'"),
        (64, 320, "got d_dot=64, d_value=320"),
    ],
)
def test_head_dims_above_256_are_refused(d_dot, d_value, message):
    q = torch.zeros(1, 1, 4, d_dot, device=DEVICE)
    v = torch.zeros(1, 1, 4, d_value, device=DEVICE)
    beta = torch.zeros(1, 1, 4, device=DEVICE)
    with pytest.raises(variants.UnsupportedBackend, match=message.replace("(", r"\(").replace(")", r"\)")):
        kernel.delta_rule_triton(q, q, v, beta)


@pytest.mark.parametrize("chunk_size", [0, 129, 16.0])
def test_bad_chunk_size_is_refused(chunk_size):
    q = torch.zeros(1, 1, 4, 16, device=DEVICE)
    with pytest.raises(variants.VariantError, match="chunk_size"):
        kernel.delta_rule_triton(q, q, q, torch.zeros(1, 1, 4, device=DEVICE), chunk_size=chunk_size)


def test_default_chunk_sizes():
    assert [kernel.default_chunk_size(d) for d in (5, 64, 65, 128, 129, 256)] == [64, 64, 32, 32, 16, 16]


def test_float64_is_refused():
    """The kernels compute in float32 (as the sum rule's do): float64 inputs go to backend='torch'."""
    q = torch.zeros(1, 1, 4, 16, device=DEVICE, dtype=torch.float64)
    with pytest.raises(variants.UnsupportedBackend, match="float64: use backend='torch'"):
        kernel.delta_rule_triton(q, q, q, torch.zeros(1, 1, 4, device=DEVICE, dtype=torch.float64))

"""The chunk-parallel Triton sum-rule kernels (variants/kernels/sum_rule.py) against the float64
PyTorch form, forward and the gradient of every input.

The device is ``ATTNBENCH_TEST_DEVICE`` (tests/test_kernels/conftest.py): "cpu" (default) runs the kernels
through Triton's interpreter, where 16-bit dots are emulated with the same rounded operands
(``_common.operand_precision``); "cuda" runs the same tests natively. Every test
runs with ``POISON`` on, so outputs and gradients start as NaN and any element a kernel
fails to write shows up as a NaN.

Tolerances (``TOLERANCE``, elementwise |a − e| ≤ tol·max|e| + tol·|e|): float32 1e-4 (IEEE dots,
errors ~1e-7); fp16 and bf16 three times the dtype's resolution (y and the gradients pass through 16-bit
dot operands: the inputs, and A, P, G and the chunk states rounded once to the input dtype), their
states S_T, z_T 1e-5 (exact 16-bit products summed in float32), against the float64 reference on
the inputs rounded to the dtype.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from helpers import slow_interpreted  # noqa: E402

import variants  # noqa: E402
from variants.chunked import sum_rule_chunked  # noqa: E402
from variants.kernels import _common  # noqa: E402
from variants.kernels import sum_rule as kernel_module  # noqa: E402
from variants.kernels.sum_rule import sum_rule_triton  # noqa: E402

DEVICE = os.environ.get("ATTNBENCH_TEST_DEVICE", "cpu")
F64 = torch.float64


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(_common, "POISON", True)


def _inputs(batch, heads, length, d_dot, d_value, *, normalize, initial, seed):
    """float64 leaves q, k, v (and S_0, z_0 when ``initial``); q, k > 0 when normalising."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, length, d_dot, generator=gen, dtype=F64)
    k = torch.randn(batch, heads, length, d_dot, generator=gen, dtype=F64)
    v = torch.randn(batch, heads, length, d_value, generator=gen, dtype=F64)
    if normalize:
        q, k = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
    else:  # unit scale reads whatever T
        q, k = q / d_dot**0.5, k / d_dot**0.5
    weights = torch.randn(batch, heads, d_dot, d_value, generator=gen, dtype=F64) if initial else None
    normaliser = (torch.rand(batch, heads, d_dot, generator=gen, dtype=F64) * length if initial else None) if normalize else None
    return {"q": q, "k": k, "v": v, "weights": weights, "normaliser": normaliser}


def _reference(q, k, v, weights, normaliser, normalize):
    batch, heads, _, d_dot = q.shape
    if weights is None:
        weights = q.new_zeros(batch, heads, d_dot, v.shape[-1])
    if normalize and normaliser is None:
        normaliser = q.new_zeros(batch, heads, d_dot)
    return sum_rule_chunked(q, k, v, weights, normaliser, 16)


def _leaves(tensors, dtype=torch.float32):
    """Copies on DEVICE in ``dtype`` that require grad (None stays None)."""
    return {n: None if t is None else t.detach().to(DEVICE, dtype).requires_grad_(True) for n, t in tensors.items()}


def _rounded(tensors, dtype):
    """float64 leaves holding the values of ``tensors`` rounded to ``dtype`` (the reference's inputs)."""
    return {n: None if t is None else t.detach().to(dtype).to(F64).requires_grad_(True) for n, t in tensors.items()}


def _max_error(actual, expected):
    return ((actual.detach().to("cpu", F64) - expected.detach()).abs().max() / expected.detach().abs().max().clamp_min(1e-12)).item()


def _assert_close(actual, expected, name, rtol=1e-4, atol=1e-4):
    """Elementwise |a - e| <= atol * max|e| + rtol * |e|, and no NaN (an unwritten element)."""
    assert not torch.isnan(actual).any(), f"{name}: NaN (an element the kernel did not write)"
    actual = actual.detach().to("cpu", F64)
    expected = expected.detach()
    scale = expected.abs().max().clamp_min(1e-12)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol * scale.item(), msg=lambda m: f"{name}: {m}")


#: dtype -> (tolerance of y and every gradient, tolerance of the states S_T, z_T); see the module docstring.
TOLERANCE = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (3 * torch.finfo(torch.float16).eps, 1e-5),
    torch.bfloat16: (3 * torch.finfo(torch.bfloat16).eps, 1e-5),
}
DTYPES = list(TOLERANCE)


def _check_against_reference(case, seed, *, dtype=torch.float32, state_cotangent=True, tolerance=None):
    """Forward and every gradient of the kernels (in ``dtype``) against the float64 reference on the same (rounded) inputs."""
    batch, heads, length, d_dot, d_value, chunk, normalize, initial = case
    tol, state_tol = TOLERANCE[dtype] if tolerance is None else (tolerance, tolerance)
    drawn = _inputs(batch, heads, length, d_dot, d_value, normalize=normalize, initial=initial, seed=seed)
    ref_in, run_in = _rounded(drawn, dtype), _leaves(drawn, dtype)

    y, s_final, z_final = sum_rule_triton(**run_in, normalize=normalize, chunk_size=chunk)
    y_ref, s_ref, z_ref = _reference(**ref_in, normalize=normalize)
    assert y.dtype == dtype and s_final.dtype == torch.float32
    assert y.shape == (batch, heads, length, d_value) and s_final.shape == (batch, heads, d_dot, d_value)
    assert (z_final is None) == (not normalize)
    errors = {"y": _max_error(y, y_ref), "S_T": _max_error(s_final, s_ref)}
    _assert_close(y, y_ref, "y", tol, tol)
    _assert_close(s_final, s_ref, "S_T", state_tol, state_tol)
    if normalize:
        assert z_final.dtype == torch.float32
        errors["z_T"] = _max_error(z_final, z_ref)
        _assert_close(z_final, z_ref, "z_T", state_tol, state_tol)

    gen = torch.Generator().manual_seed(seed + 1)
    outputs, outputs_ref = [y], [y_ref]
    cotangents = [torch.randn(y_ref.shape, generator=gen, dtype=F64).to(dtype).to(F64)]  # dy in y's dtype
    if state_cotangent:
        outputs += [s_final] + ([z_final] if normalize else [])
        outputs_ref += [s_ref] + ([z_ref] if normalize else [])
        cotangents += [torch.randn(t.shape, generator=gen, dtype=F64).float().double() for t in outputs_ref[1:]]
    names = [n for n, t in ref_in.items() if t is not None]
    grads = torch.autograd.grad(outputs, [run_in[n] for n in names], [c.to(DEVICE, o.dtype) for c, o in zip(cotangents, outputs)])
    grads_ref = torch.autograd.grad(outputs_ref, [ref_in[n] for n in names], cotangents)
    for name, grad, grad_ref in zip(names, grads, grads_ref):
        assert grad.dtype == run_in[name].dtype
        errors["d" + name] = _max_error(grad, grad_ref)
        _assert_close(grad, grad_ref, "d" + name, tol, tol)
    print(f"\n{case} {dtype}: max |error| / max |reference|: " + ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))
    return errors


# (B, H, T, F, Dv, chunk_size, normalize, initial state). Not T = 1 normalised from a zero
# state: there y_1 = v_1 (q·k) / (q·k + ε), whose q- and k-gradients are O(ε) and vanish in
# float32 rounding (the kernel correctly returns ~0; a relative test cannot pass on that).
CASES = [
    (1, 1, 1, 16, 8, None, True, True),
    (1, 1, 1, 5, 7, 16, False, False),
    slow_interpreted((2, 3, 17, 16, 8, 16, True, True)),
    (2, 3, 17, 5, 7, None, False, False),
    (1, 1, 63, 5, 7, 16, True, False),
    (1, 1, 63, 16, 8, 32, False, True),
    (1, 1, 130, 16, 8, 32, True, True),
    slow_interpreted((2, 3, 130, 5, 7, 64, False, True)),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}H{}T{}F{}Dv{}-C{}-norm{}-init{}".format(*c))
def test_matches_reference(case, dtype, seed):
    _check_against_reference(case, seed, dtype=dtype)


def test_the_first_tokens_q_gradient_cancels_in_16_bits():
    """At a sequence's first token y_1 ≈ v_1 and dq_1 ≈ 0 (dy·v_1 − dy·y_1, divided by a small q·z): den sums A as
    the A V product rounds it, so the difference cancels. This seed failed dq in CI (10× bf16's resolution) when den
    summed the unrounded A."""
    _check_against_reference((1, 1, 63, 5, 7, 16, True, False), 1633326598, dtype=torch.bfloat16)


@pytest.mark.parametrize("normalize", [True, False])
def test_cotangent_on_output_only(normalize, seed):
    """Only y receives a gradient (S_T, z_T get None): the state cotangents are absent."""
    _check_against_reference((1, 2, 40, 7, 16, 16, normalize, True), seed, state_cotangent=False)


@pytest.mark.parametrize("dtype", [torch.float32, slow_interpreted(torch.bfloat16)], ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("normalize", [True, slow_interpreted(False)])
def test_state_split_into_blocks(monkeypatch, normalize, dtype, seed):
    """State tiles of 16: several programs per (chunk, b·h), loops over F and Dv blocks, ragged last blocks."""
    monkeypatch.setattr(kernel_module, "STATE_BLOCK", 16)
    _check_against_reference((1, 2, 33, 40, 24, 16, normalize, True), seed, dtype=dtype)


@pytest.mark.parametrize(("skipped", "message"), [("forward_scan", "^y: "), ("backward_scan", "^dk: "), ("backward_dv", "^dv: NaN")])
def test_a_wrong_kernel_fails_the_check(monkeypatch, skipped, message, seed):
    """The check can fail: without a scan (the chunk states are never written) or without the dv kernel (dv stays
    poisoned), the comparison with the reference fails."""
    real_launch = kernel_module.launch

    def launch(kernel, grid, *args, name=None, **kwargs):
        if (name or kernel.__name__.strip("_").removesuffix("_kernel")) != skipped:
            real_launch(kernel, grid, *args, name=name, **kwargs)

    monkeypatch.setattr(kernel_module, "launch", launch)
    with pytest.raises(AssertionError, match=message):
        _check_against_reference((1, 1, 40, 8, 8, 16, True, True), seed)


def test_some_inputs_without_grad(seed):
    """Only some inputs need a gradient (the dv kernel, or the dq/dk kernel, is then skipped); those stay right."""
    ref_in = _inputs(1, 2, 30, 8, 8, normalize=True, initial=True, seed=seed)
    run_in = {n: t.detach().to(DEVICE, torch.float32) for n, t in ref_in.items()}
    for wanted in (["v"], ["q"], ["weights"], ["normaliser", "k"]):
        ref = {n: t.detach().requires_grad_(n in wanted) for n, t in ref_in.items()}
        run = {n: t.detach().requires_grad_(n in wanted) for n, t in run_in.items()}
        y, s_final, _ = sum_rule_triton(**run, normalize=True, chunk_size=16)
        y_ref, s_ref, _ = _reference(**ref, normalize=True)
        grads = torch.autograd.grad((y.sum() + s_final.sum()), [run[n] for n in wanted])
        grads_ref = torch.autograd.grad((y_ref.sum() + s_ref.sum()), [ref[n] for n in wanted])
        for name, grad, grad_ref in zip(wanted, grads, grads_ref):
            _assert_close(grad, grad_ref, f"d{name} (only {wanted} need grad)")


@pytest.mark.parametrize("dtype", [torch.float32, slow_interpreted(torch.bfloat16)], ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("normalize", [True, slow_interpreted(False)])
def test_chaining_through_the_state(normalize, dtype, seed):
    """Two calls with the state carried (split inside a chunk) == the float64 reference over the whole
    sequence, forward and backward; in float32 also == one call over the whole sequence, to 1e-5."""
    split = 23
    tol, state_tol = TOLERANCE[dtype]
    drawn = _inputs(1, 2, 50, 7, 5, normalize=normalize, initial=True, seed=seed)
    ref_in, whole_in, piece_in = _rounded(drawn, dtype), _leaves(drawn, dtype), _leaves(drawn, dtype)
    whole = sum_rule_triton(**whole_in, normalize=normalize, chunk_size=16)
    reference = _reference(**ref_in, normalize=normalize)
    q, k, v = piece_in["q"], piece_in["k"], piece_in["v"]
    y1, s1, z1 = sum_rule_triton(
        q[:, :, :split], k[:, :, :split], v[:, :, :split], piece_in["weights"], piece_in["normaliser"],
        normalize=normalize, chunk_size=16,
    )  # fmt: skip
    y2, s2, z2 = sum_rule_triton(q[:, :, split:], k[:, :, split:], v[:, :, split:], s1, z1, normalize=normalize, chunk_size=16)
    pieces = (torch.cat([y1, y2], dim=2), s2, z2)
    for name, a, b, c, t in zip(("y", "S_T", "z_T"), pieces, whole, reference, (tol, state_tol, state_tol)):
        if b is not None:
            _assert_close(a, c, f"chained {name}", t, t)
            if dtype == torch.float32:
                _assert_close(a, b.detach().double().cpu(), f"chained {name} (one call)", rtol=1e-5, atol=1e-5)

    gen = torch.Generator().manual_seed(seed + 1)
    used = [t for t in whole if t is not None]
    cotangents = [torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype).double() for t in used]
    names = [n for n, t in whole_in.items() if t is not None]
    grads_whole = torch.autograd.grad(used, [whole_in[n] for n in names], [c.to(DEVICE, t.dtype) for c, t in zip(cotangents, used)])
    piece_outputs = [t for t in pieces if t is not None]
    grads_pieces = torch.autograd.grad(piece_outputs, [piece_in[n] for n in names], [c.to(DEVICE, t.dtype) for c, t in zip(cotangents, used)])
    grads_ref = torch.autograd.grad([t for t in reference if t is not None], [ref_in[n] for n in names], cotangents)
    for name, a, b, c in zip(names, grads_pieces, grads_whole, grads_ref):
        _assert_close(a, c, f"chained d{name}", tol, tol)
        if dtype == torch.float32:
            _assert_close(a, b.detach().double().cpu(), f"chained d{name} (one call)", rtol=1e-5, atol=1e-5)


def test_tf32_is_asked_for_float32(seed):
    """``precision="tf32"`` reaches the dots of float32 inputs (not on sm_70, which has no TF32; not 16-bit
    inputs); the interpreter multiplies in fp32, a GPU in TF32 (checked at TF32's resolution there)."""
    config = dict(dtype=torch.float32, d_dot=64, d_value=64, chunk_size=None, normalize=True)
    assert {launch.constexprs.get("PRECISION") for launch in kernel_module.record_launches(config, 80)} == {"ieee"}
    for capability, dtype, expected in ((80, torch.float32, "tf32"), (70, torch.float32, "ieee"), (90, torch.bfloat16, "input")):
        with _common.recording(capability) as launches:
            q = _common.meta_tensor(1, 1, 64, 16, dtype=dtype)
            sum_rule_triton(q, q, q, normalize=False, precision="tf32")
        assert {launch.constexprs.get("PRECISION") for launch in launches} == {expected}, capability
    with pytest.raises(variants.VariantError, match="precision must be one of 'ieee', 'tf32'"):
        sum_rule_triton(q, q, q, normalize=False, precision="fp16")
    drawn = _inputs(1, 1, 40, 16, 8, normalize=True, initial=True, seed=seed)
    run_in = _leaves(drawn)
    y, _, _ = sum_rule_triton(**run_in, normalize=True, chunk_size=16, precision="tf32")
    tolerance = 1e-4 if DEVICE == "cpu" else 1e-2
    _assert_close(y, _reference(**_rounded(drawn, torch.float32), normalize=True)[0], "y (tf32)", tolerance, tolerance)


def test_poison_marks_unwritten_elements():
    """The helper the kernels allocate through fills with NaN while POISON is set."""
    like = torch.zeros(1, device=DEVICE)
    assert torch.isnan(_common.new_output((3, 4), like)).all()
    assert _common.new_output((3, 4), like, torch.float16).dtype == torch.float16


@pytest.mark.parametrize(("d_dot", "d_value"), [(384, 64), (64, 320)])
def test_dims_above_256_are_an_error(d_dot, d_value):
    q = torch.rand(1, 1, 4, d_dot, device=DEVICE)
    v = torch.rand(1, 1, 4, d_value, device=DEVICE)
    with pytest.raises(variants.UnsupportedBackend, match=f"up to 256, got d_dot={d_dot}, d_value={d_value}: use backend='torch'"):
        sum_rule_triton(q, q, v, normalize=True)


def test_input_errors():
    q = torch.rand(1, 1, 4, 8, device=DEVICE)
    v = torch.rand(1, 1, 4, 8, device=DEVICE)
    with pytest.raises(variants.VariantError, match="normalize=False"):
        sum_rule_triton(q, q, v, None, torch.zeros(1, 1, 8, device=DEVICE), normalize=False)
    with pytest.raises(variants.VariantError, match="weights must be"):
        sum_rule_triton(q, q, v, torch.zeros(1, 1, 8, 7, device=DEVICE), normalize=False)
    for chunk_size in (0, 20, 256, 16.0, True):
        with pytest.raises(variants.UnsupportedBackend, match=r"chunk_size in \(16, 32, 64, 128\) at d_dot=8, got"):
            sum_rule_triton(q, q, v, normalize=False, chunk_size=chunk_size)
    with pytest.raises(variants.UnsupportedBackend, match="float64"):
        sum_rule_triton(q.double(), q.double(), v.double(), normalize=False)

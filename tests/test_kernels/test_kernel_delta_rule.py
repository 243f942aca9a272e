"""The chunk-parallel Triton delta-rule kernels (variants/kernels/delta_rule.py), ungated and gated, against
the float64 chunked reference ``variants.chunked.delta_rule_chunked``: forward, final state and every gradient.

The device is ``ATTNBENCH_TEST_DEVICE`` (tests/test_kernels/conftest.py): "cpu" (default) runs the kernels
through Triton's interpreter, where 16-bit dots are emulated with the same rounded operands
(``_common.operand_precision``); "cuda" runs them natively. Every test runs with the kernels' POISON flag
set, so an output element a kernel forgets to write is NaN and fails the checks.

Tolerances, against the float64 reference on the inputs rounded to the dtype: float32 max |error| ≤ 1e-4 ·
max(1, max |reference|) per output (``TOLERANCE``; IEEE dots: errors ~1e-7 measured); fp16 and bf16 the relative
L2 error of each output within ``variants.precision.REL_ERROR_TOLERANCE`` (1 %, 5 %): the 16-bit dots round their
fp32 operands (T, the chunk states, U', dU') once to the input dtype, W and U' are stored in it, and the backward
carries that rounding through the recurrence (bf16 dS0 at T = 63, d_dot = 5 reaches 3.5 %, 5 % of its largest
element, for about one seed in four: beyond the elementwise 4 eps this file held before).
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from helpers import slow_interpreted  # noqa: E402

import variants  # noqa: E402
from variants import kernels  # noqa: E402
from variants.chunked import delta_rule_chunked  # noqa: E402
from variants.kernels import _common  # noqa: E402
from variants.kernels import delta_rule as kernel  # noqa: E402
from variants.precision import REL_ERROR_TOLERANCE, rel_error  # noqa: E402

DEVICE = os.environ.get("ATTNBENCH_TEST_DEVICE", "cpu")
F64 = torch.float64
TOLERANCE = {torch.float32: 1e-4}
NAMES = ["y", "S_T", "dq", "dk", "dv", "dbeta", "dlog_gate", "dS0"]


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    """Every buffer the kernels write starts as NaN."""
    monkeypatch.setattr(_common, "POISON", True)


def make_inputs(batch, heads, length, d_dot, d_value, *, initial_state, gated, seed, features="unit"):
    """float64 {q, k, v, beta, log_gate (None ungated), weights (None without S_0)} on the CPU. ``features``:
    'unit' (keys and queries of unit L2 norm) or 'sumnorm' (positive elu+1 features over their sum, as ``delta`` feeds)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, length, d_dot, generator=gen, dtype=F64)
    k = torch.randn(batch, heads, length, d_dot, generator=gen, dtype=F64)
    if features == "unit":
        q, k = (x / x.norm(dim=-1, keepdim=True) for x in (q, k))
    else:
        q, k = (torch.nn.functional.elu(x) + 1 for x in (q, k))
        q, k = (x / x.sum(-1, keepdim=True) for x in (q, k))
    v = torch.randn(batch, heads, length, d_value, generator=gen, dtype=F64)
    beta = torch.rand(batch, heads, length, generator=gen, dtype=F64) * 0.98 + 0.01
    log_gate = -3 * torch.rand(batch, heads, length, generator=gen, dtype=F64) ** 2 if gated else None  # as LOG_GATE draws it
    weights = 0.5 * torch.randn(batch, heads, d_dot, d_value, generator=gen, dtype=F64) if initial_state else None
    return {"q": q, "k": k, "v": v, "beta": beta, "log_gate": log_gate, "weights": weights}


def _rounded(inputs, dtype):
    """The inputs as the kernels see them in ``dtype`` (S_0 stays float32), back in float64."""
    return {n: None if t is None else t.to(torch.float32 if n == "weights" else dtype).double() for n, t in inputs.items()}


def reference(inputs, dy, ds_final):
    """{name: float64 value} of y, S_T and the gradients of <y, dy> + <S_T, ds_final> (None cotangents count as zero)."""
    leaves = {n: t.detach().clone().requires_grad_() for n, t in inputs.items() if t is not None}
    q = leaves["q"]
    start = leaves.get("weights", q.new_zeros(q.shape[0], q.shape[1], q.shape[-1], leaves["v"].shape[-1]))
    y, s_final, _ = delta_rule_chunked(q, leaves["k"], leaves["v"], leaves["beta"], start, None, 16, log_gate=leaves.get("log_gate"))
    loss = sum((out * c).sum() for out, c in ((y, dy), (s_final, ds_final)) if c is not None)
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True, materialize_grads=True)  # S_T does not depend on q
    return {"y": y.detach(), "S_T": s_final.detach(), **{"d" + n.replace("weights", "S0"): g for n, g in zip(leaves, grads)}}


def run_kernel(inputs, dy, ds_final, *, dtype=torch.float32, chunk_size=None, precision="ieee"):
    """The kernels' forward on DEVICE in ``dtype`` and the gradients of the same loss as ``reference``."""
    leaves = {n: t.detach().to(DEVICE, torch.float32 if n == "weights" else dtype).requires_grad_() for n, t in inputs.items() if t is not None}
    y, s_final = kernel.delta_rule_triton(
        leaves["q"], leaves["k"], leaves["v"], leaves["beta"], leaves.get("weights"),
        log_gate=leaves.get("log_gate"), chunk_size=chunk_size, precision=precision,
    )  # fmt: skip
    assert y.dtype == dtype and y.shape == inputs["v"].shape
    assert s_final.dtype == torch.float32 and s_final.shape == (*inputs["q"].shape[:2], inputs["q"].shape[-1], inputs["v"].shape[-1])
    outputs = [(out, c.to(DEVICE, out.dtype)) for out, c in ((y, dy), (s_final, ds_final)) if c is not None]
    grads = torch.autograd.grad([o for o, _ in outputs], list(leaves.values()), [c for _, c in outputs])
    result = {"y": y.detach(), "S_T": s_final.detach(), **{"d" + n.replace("weights", "S0"): g for n, g in zip(leaves, grads)}}
    for name, tensor in result.items():
        assert not torch.isnan(tensor).any(), f"{name} has NaN (an element the kernel did not write?)"
    for name, tensor in inputs.items():
        if tensor is not None and name != "weights":
            assert result["d" + name].dtype == dtype, name
    return result


def assert_close(actual, expected, tol, label=""):
    errors = {name: ((actual[name].double().cpu() - e).abs().max().item(), e.abs().max().item()) for name, e in expected.items()}
    print(f"\n{label} max errors: " + ", ".join(f"{name} {err:.1e} (of {scale:.1g})" for name, (err, scale) in errors.items()))
    bad = {name: err for name, (err, scale) in errors.items() if not err <= tol * max(1.0, scale)}
    assert not bad, f"{', '.join(bad)}: errors above {tol:.1e} (relative to max(1, max|ref|)) in {label}: {bad}"


def assert_rel_close(actual, expected, tol, label=""):
    """Relative L2 errors within ``tol`` (16-bit inputs: ``variants.precision.REL_ERROR_TOLERANCE``). An elementwise
    bound of a few eps is too tight there: the backward carries a 16-bit rounding through every step of the
    recurrence (bf16 dS0 at T = 63, d_dot = 5: 3.5 % in relative L2, 5 % of its largest element)."""
    errors = {name: rel_error(actual[name].cpu(), e) for name, e in expected.items()}
    print(f"\n{label} relative errors: " + ", ".join(f"{name} {err:.1e}" for name, err in errors.items()))
    bad = {name: err for name, err in errors.items() if not err <= tol}
    assert not bad, f"{', '.join(bad)}: relative L2 errors above {tol:.1e} in {label}: {bad}"


def assert_within_dtype(actual, expected, dtype, label=""):
    """The tolerance of ``dtype``: elementwise for float32, relative L2 for 16-bit inputs."""
    if dtype in (torch.float16, torch.bfloat16):
        assert_rel_close(actual, expected, REL_ERROR_TOLERANCE[dtype], label)
    else:
        assert_close(actual, expected, TOLERANCE[dtype], label)


def check(case, seed, *, dtype=torch.float32, gated=False, cotangents=("y", "S_T"), precision="ieee", tol=None):
    batch, heads, length, d_dot, d_value, chunk_size, initial_state, features = case
    inputs = _rounded(make_inputs(batch, heads, length, d_dot, d_value, initial_state=initial_state, gated=gated, seed=seed, features=features), dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    dy = torch.randn(inputs["v"].shape, generator=gen, dtype=F64).to(dtype).double() if "y" in cotangents else None
    ds_final = torch.randn(batch, heads, d_dot, d_value, generator=gen, dtype=F64).float().double() if "S_T" in cotangents else None
    expected = reference(inputs, dy, ds_final)
    actual = run_kernel(inputs, dy, ds_final, dtype=dtype, chunk_size=chunk_size, precision=precision)
    if tol is None:
        assert_within_dtype(actual, expected, dtype, f"{case} {dtype} gated={gated}")
    else:
        assert_close(actual, expected, tol, f"{case} {dtype} gated={gated}")


CASES = [
    # batch, heads, T, d_dot, d_value, chunk_size, initial state, features
    # T = 1 in 6 heads: a head's dq and dβ are each one dot product (dq = β (v·dy) k), whose relative error
    # u·Σ|v_j dy_j| / |v·dy| is unbounded as v ⊥ dy (bf16 dq 64 % with one head, 7 % of seeds failed); the
    # relative L2 over 6 heads' independent products is large only when all 6 cancel at once.
    slow_interpreted((2, 3, 1, 16, 16, None, False, "unit"), id="T1-bh6"),
    pytest.param((1, 1, 1, 8, 8, None, True, "unit"), id="T1-s0"),
    slow_interpreted((2, 3, 17, 16, 8, 16, True, "unit"), id="T17-bh6-F16-Dv8-c16-s0"),
    pytest.param((1, 1, 63, 5, 7, None, True, "unit"), id="T63-F5-Dv7-s0"),
    pytest.param((1, 1, 63, 16, 8, 32, False, "sumnorm"), id="T63-c32-sumnorm"),
    slow_interpreted((1, 2, 130, 32, 48, 64, True, "unit"), id="T130-F32-Dv48-c64-s0"),
]


@pytest.mark.parametrize("gated", [False, True], ids=["delta", "gated"])
@pytest.mark.parametrize("case", CASES)
def test_float32_matches_reference(case, gated, seed):
    check(case, seed, gated=gated)


@pytest.mark.parametrize("gated", [False, True], ids=["delta", "gated"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[5]])
def test_16_bit_matches_reference(case, dtype, gated, seed):
    """fp16 / bf16 inputs: 16-bit dots with fp32 accumulation, S_T in float32, y and gradients in the input dtype."""
    check(case, seed, dtype=dtype, gated=gated)


@pytest.mark.parametrize("gated", [slow_interpreted(False), True], ids=["delta", "gated"])
def test_blocks_of_the_head_dims(monkeypatch, gated, seed):
    """[C, 16] tiles: loops over F and Dv blocks in the chunk kernels, ragged last blocks, and the passes over
    several Dv blocks; d_dot = 256 (the largest) with its default chunk of 32."""
    monkeypatch.setattr(kernel, "TILE", 16)
    check((1, 1, 40, 40, 24, 16, True, "unit"), seed, gated=gated)
    monkeypatch.undo()
    check((1, 1, 20, 256, 20, None, True, "unit"), seed, gated=gated)


@pytest.mark.parametrize("block_v", [16, slow_interpreted(32)])
def test_every_pass_candidate(monkeypatch, block_v, seed):
    """Each autotuning candidate of the two passes (its Dv columns; the interpreter ignores warps) computes the
    same thing: the interpreter keeps one (``_pass_candidates``), so the test forces each in turn."""
    for pass_kernel in (kernel._state_pass_kernel, kernel._backward_pass_kernel):
        chosen = next(config for config in pass_kernel.configs if config.kwargs["BLOCK_V"] == block_v)
        monkeypatch.setattr(pass_kernel, "early_config_prune", lambda configs, args, chosen=chosen, **constexprs: [chosen])
        monkeypatch.setattr(pass_kernel, "cache", {})
    check((1, 1, 40, 24, 40, 16, True, "unit"), seed, gated=True)


@pytest.mark.parametrize("cotangent", [slow_interpreted("y"), "S_T"])
def test_gradient_from_one_output(cotangent, seed):
    """A loss on y alone (no gradient arrives on S_T) or on S_T alone (none on y)."""
    check((1, 2, 33, 16, 16, 16, True, "unit"), seed, gated=True, cotangents=(cotangent,))


def test_tf32_is_asked_for_float32(seed):
    """``precision="tf32"`` reaches the kernels' dots (the interpreter multiplies in fp32, a GPU in TF32:
    checked at TF32's resolution there)."""
    launches = kernel.record_launches(dict(dtype=torch.float32, d_dot=64, d_value=64, chunk_size=None, gated=True), 80)
    assert {launch.constexprs["PRECISION"] for launch in launches} == {"ieee"}
    with _common.recording(80) as launches:
        q = _common.meta_tensor(1, 1, 64, 16)
        kernel.delta_rule_triton(q, q, q, _common.meta_tensor(1, 1, 64), precision="tf32")
    assert {launch.constexprs["PRECISION"] for launch in launches} == {"tf32"}
    check((1, 1, 40, 16, 16, 16, True, "unit"), seed, gated=True, precision="tf32", tol=1e-4 if DEVICE == "cpu" else 1e-2)


@pytest.mark.parametrize("gated", [slow_interpreted(False), True], ids=["delta", "gated"])
@pytest.mark.parametrize("dtype", [slow_interpreted(torch.float32), torch.bfloat16], ids=str)
def test_chaining_through_the_state(gated, dtype, seed):
    """Two calls, the second starting from the first's S_T (split inside a chunk), equal the float64 reference over
    the whole sequence: outputs, final state and every gradient, including through the carried state."""
    length, split = 45, 23
    inputs = _rounded(make_inputs(1, 2, length, 16, 8, initial_state=True, gated=gated, seed=seed), dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    dy = torch.randn(inputs["v"].shape, generator=gen, dtype=F64).to(dtype).double()
    ds_final = torch.randn(1, 2, 16, 8, generator=gen, dtype=F64).float().double()
    expected = reference(inputs, dy, ds_final)

    leaves = {n: t.to(DEVICE, torch.float32 if n == "weights" else dtype).requires_grad_() for n, t in inputs.items() if t is not None}
    tokens = ("q", "k", "v", "beta", "log_gate")

    def call(start, stop, weights):
        part = {n: leaves[n][:, :, start:stop] for n in tokens if n in leaves}
        return kernel.delta_rule_triton(part["q"], part["k"], part["v"], part["beta"], weights, log_gate=part.get("log_gate"), chunk_size=16)

    y1, s_mid = call(0, split, leaves["weights"])
    y2, s_final = call(split, length, s_mid)
    y = torch.cat([y1, y2], dim=2)
    grads = torch.autograd.grad([y, s_final], list(leaves.values()), [dy.to(DEVICE, dtype), ds_final.to(DEVICE, torch.float32)])
    actual = {"y": y, "S_T": s_final, **{"d" + n.replace("weights", "S0"): g for n, g in zip(leaves, grads)}}
    assert_within_dtype(actual, expected, dtype, "chained")


def test_forward_without_autograd(seed):
    """Under no_grad (nothing kept for a backward) the forward is the same."""
    inputs = make_inputs(2, 1, 45, 16, 24, initial_state=True, gated=True, seed=seed, features="sumnorm")
    expected = reference(inputs, torch.zeros_like(inputs["v"]), None)
    with torch.no_grad():
        run = {n: t.to(DEVICE, torch.float32) for n, t in inputs.items()}
        y, s_final = kernel.delta_rule_triton(run["q"], run["k"], run["v"], run["beta"], run["weights"], log_gate=run["log_gate"], chunk_size=16)
    assert_close({"y": y, "S_T": s_final}, {"y": expected["y"], "S_T": expected["S_T"]}, TOLERANCE[torch.float32], "no_grad")


@pytest.mark.parametrize(("skipped", "message"), [("state_pass", "^y has NaN"), ("backward_pass", "^dk has NaN"), ("backward_local", "^dk has NaN")])
def test_a_wrong_kernel_fails_the_check(monkeypatch, skipped, message, seed):
    """The check can fail: without the state pass (chunk states stay poisoned), the backward pass, or the
    local part of dU', the comparison with the reference fails."""
    real_launch = kernel.launch

    def launch(fn, grid, *args, name=None, **kwargs):
        if name != skipped:
            real_launch(fn, grid, *args, name=name, **kwargs)

    monkeypatch.setattr(kernel, "launch", launch)
    with pytest.raises(AssertionError, match=message):
        check((1, 1, 40, 8, 8, 16, True, "unit"), seed, gated=True, cotangents=("y",))


def test_gated_delta_variant_runs_the_kernels(seed):
    """``create('gated_delta', backend='triton')`` (and float32 TF32 asked through ``precision``) computes the
    torch backend's function, forward and backward, and records the precision it was asked for."""
    torch_core = variants.create("gated_delta", 8).double()
    triton_core = variants.create("gated_delta", 8, backend="triton").to(DEVICE)
    gen = torch.Generator().manual_seed(seed)
    shape = (2, 3, 37)
    inputs = {
        "q": torch.randn(*shape, 8, generator=gen, dtype=F64), "k": torch.randn(*shape, 8, generator=gen, dtype=F64),
        "v": torch.randn(*shape, 6, generator=gen, dtype=F64), "beta": torch.rand(*shape, generator=gen, dtype=F64),
        "log_gate": -3 * torch.rand(*shape, generator=gen, dtype=F64) ** 2,
    }  # fmt: skip
    leaves = {n: t.clone().requires_grad_() for n, t in inputs.items()}
    expected = torch_core(**leaves)
    want = torch.autograd.grad(expected.sum(), list(leaves.values()))
    run = {n: t.to(DEVICE, torch.float32).requires_grad_() for n, t in inputs.items()}
    out = triton_core(**run)
    got = torch.autograd.grad(out.sum(), list(run.values()))
    for label, actual, target in zip(["out", *inputs], [out, *got], [expected, *want]):
        torch.testing.assert_close(
            actual.double().cpu(), target, rtol=1e-4, atol=1e-4 * max(1.0, target.abs().max().item()), msg=lambda m, label=label: f"{label}: {m}"
        )
    assert variants.create("gated_delta", 8, backend="triton", precision="tf32").precision == "tf32"
    with pytest.raises(variants.UnsupportedBackend, match="precision='tf32' is a Triton kernel option"):
        variants.create("gated_delta", 8, precision="tf32")
    with pytest.raises(variants.VariantError, match="precision must be one of 'ieee', 'tf32'"):
        variants.create("delta", 8, backend="triton", precision="fp16")


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


def test_bad_arguments_are_refused():
    q = torch.zeros(1, 1, 4, 16, device=DEVICE)
    beta = torch.zeros(1, 1, 4, device=DEVICE)
    for chunk_size in (0, 20, 128, 16.0, True):
        with pytest.raises(variants.UnsupportedBackend, match=r"chunk_size in \(16, 32, 64\) at d_dot=16, got"):
            kernel.delta_rule_triton(q, q, q, beta, chunk_size=chunk_size)
    with pytest.raises(variants.VariantError, match=r"log_gate must be \[B, H_v, T\] = \(1, 1, 4\)"):
        kernel.delta_rule_triton(q, q, q, beta, log_gate=torch.zeros(1, 1, 5, device=DEVICE))
    with pytest.raises(variants.VariantError, match="precision must be one of 'ieee', 'tf32'"):
        kernel.delta_rule_triton(q, q, q, beta, precision="tf16")
    with pytest.raises(variants.UnsupportedBackend, match="float64: use backend='torch'"):
        kernel.delta_rule_triton(q.double(), q.double(), q.double(), beta.double())


def test_chunk_sizes():
    """The delta rule takes 16, 32, 64 up to d_dot = 128 and 16, 32 above (its passes' [C, d_dot] tiles), and
    runs the largest by default."""
    assert [kernels.chunk_sizes("delta_rule", d) for d in (5, 64, 65, 128, 129, 256)] == [(16, 32, 64)] * 4 + [(16, 32)] * 2
    assert [kernels.default_chunk_size("delta_rule", d) for d in (5, 128, 129, 256)] == [64, 64, 32, 32]

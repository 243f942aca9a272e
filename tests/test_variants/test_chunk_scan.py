"""The chunk-parallel scans (``scan='parallel'``, ``variants.chunk_scan``, issue 34): the float64
reference forward and backward, continuing from a state, in every dtype; the affine scan against
its recurrence; a number of operations per call that does not grow with T; the option itself.
(The configurations with ``scan='parallel'`` in helpers.CONFIGS also run every test of every form.)"""

from __future__ import annotations

import pytest
import torch
from helpers import make_inputs, to

import variants
from harness.measuring.profiling import OperationCount
from variants.chunk_scan import affine_scan
from variants.chunked import _solve_unit_lower
from variants.precision import REL_ERROR_TOLERANCE, rel_error

RULES = [("linear", {}), ("linear", {"normalize": False}), ("delta", {}), ("delta", {"normalize": True}), ("gated_delta", {})]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
#: (batch, heads, T, d_key, d_value, chunk, where the second prefill starts): neither part a multiple of the chunk
SHAPE = (2, 2, 75, 8, 6, 16, 21)


def _rule_id(rule) -> str:
    name, params = rule
    return name + "".join(f"-{key}={value}" for key, value in params.items())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rule", RULES, ids=_rule_id)
def test_parallel_scan_from_a_state_matches_float64(rule, dtype, seed):
    """Two parallel prefills, the second from the first's state, against the float64 reference over
    the whole sequence (outputs and every input's gradient, through the state) and its final state
    against the float64 step loop's."""
    name, params = rule
    batch, heads, length, d_key, d_value, chunk, cut = SHAPE
    core = variants.create(name, d_key, scan="parallel", chunk_size=chunk, **params).to(dtype)
    exact_core = variants.create(name, d_key, **params).double()
    inputs = make_inputs(core, batch, heads, length, d_value, dtype=dtype, seed=seed)
    exact = to(inputs, torch.float64, requires_grad=True)
    expected, (_, expected_state) = exact_core.reference(**exact), exact_core.step_loop(to(inputs, torch.float64))
    cotangent = torch.randn(expected.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    wanted = torch.autograd.grad((expected * cotangent).sum(), list(exact.values()))
    low = to(inputs, dtype, requires_grad=True)
    first, state = core.prefill(**variants.time_slice(low, 0, cut))
    second, state = core.prefill(**variants.time_slice(low, cut), state=state)
    out, tolerance, what = torch.cat([first, second], 2), REL_ERROR_TOLERANCE[dtype], f"{_rule_id(rule)} in {dtype} (seed {seed})"
    assert out.dtype == dtype and rel_error(out, expected) <= tolerance, f"{what}: output error {rel_error(out, expected):.3g}"
    for label, got, target in zip(state._fields, state, expected_state, strict=True):
        assert (got is None) == (target is None) and (got is None or rel_error(got, target) <= tolerance), f"{what}: final {label}"
    grads = torch.autograd.grad((out * cotangent.to(dtype)).sum(), list(low.values()))
    for label, grad, target in zip(low, grads, wanted, strict=True):
        assert rel_error(grad, target) <= tolerance, f"{what}: d/d{label} error {rel_error(grad, target):.3g}"


@pytest.mark.parametrize("threads", [1, 2])
def test_the_ut_transforms_solve_matches_float64_on_any_thread_count(threads, seed):
    """``_solve_unit_lower`` solves the transposed system on one CPU thread, the system itself on more:
    both against float64's solve, forward and backward (the forms' tests run on the session's threads)."""
    generator = torch.Generator().manual_seed(seed)
    lower = (torch.randn(2, 3, 16, 16, generator=generator) / 4).tril(-1).requires_grad_()
    rhs = torch.randn(2, 3, 16, 10, generator=generator, requires_grad=True)
    eye = torch.eye(16, dtype=torch.float64)
    expected = torch.linalg.solve(eye + lower.double(), rhs.double())
    torch.set_num_threads(threads)
    got = _solve_unit_lower(lower, rhs, torch.float32)
    assert rel_error(got, expected) <= REL_ERROR_TOLERANCE[torch.float32]
    cotangent = torch.randn(expected.shape, generator=generator, dtype=torch.float64)
    wanted = torch.autograd.grad((torch.linalg.solve(eye + lower.double().tril(-1), rhs.double()) * cotangent).sum(), [lower, rhs])
    for grad, target in zip(torch.autograd.grad((got * cotangent.float()).sum(), [lower, rhs]), wanted, strict=True):
        assert rel_error(grad, target) <= REL_ERROR_TOLERANCE[torch.float32]


@pytest.mark.parametrize("steps", range(1, 10))
def test_affine_scan_is_its_recurrence(steps, seed):
    """X_n = A_n X_{n-1} + B_n, step by step, for every count of steps (odd and even at each level)."""
    generator = torch.Generator().manual_seed(seed)
    transitions, offsets, initial = (torch.randn(*shape, generator=generator, dtype=torch.float64) for shape in ((2, steps, 3, 3), (2, steps, 3, 4), (2, 3, 4)))
    state, expected = initial, []
    for n in range(steps):
        state = transitions[:, n] @ state + offsets[:, n]
        expected.append(state)
    torch.testing.assert_close(affine_scan(transitions, offsets, initial), torch.stack(expected, 1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["linear", "delta", "gated_delta"])
def test_operations_per_call_do_not_grow_with_the_length(name):
    """Issue 34's bound: aten operations of a forward call at T = 8192 at most 1.5x those at T = 1024
    (default chunk 64: 128 chunks against 16; the loop makes 8x as many)."""
    core = variants.create(name, 4, scan="parallel")
    counts = []
    for length in (1024, 8192):
        inputs = core.example_inputs(1, 1, length, 4, generator=torch.Generator().manual_seed(0))
        with torch.no_grad(), OperationCount() as counter:
            core(**inputs)
        counts.append(counter.count)
    assert counts[1] <= 1.5 * counts[0], f"{name}: {counts[0]} operations at T = 1024, {counts[1]} at T = 8192"


def test_the_scan_option():
    core = variants.create("delta", 8)
    inputs = core.example_inputs(1, 2, 10, 8)
    assert core.scan == "auto" and core.implementation_choices(**inputs) == {"scan": "loop"}  # auto on the CPU
    assert variants.create("delta", 8, scan="parallel").implementation_choices(**inputs) == {"scan": "parallel"}
    assert variants.create("linear", 8, backend="compile").implementation_choices(**inputs) == {"scan": "loop"}  # its chunk compiled
    assert "scan=parallel" in repr(variants.create("gated_delta", 8, scan="parallel"))
    with pytest.raises(variants.VariantError, match=r"^linear: scan must be one of auto, loop, parallel, got 'fast'$"):
        variants.create("linear", 8, scan="fast")
    with pytest.raises(variants.UnsupportedBackend, match=r"^delta: scan='loop' picks a PyTorch form; backend='triton' runs its kernels"):
        variants.create("delta", 8, scan="loop", backend="triton")

"""pytest-benchmark micro-benchmarks: each variant's parallel form and decode step.

``nox -s microbench`` times them; the test session runs each once with
``--benchmark-disable`` (a smoke test, no timing). fp32 on the CPU, B=4, H=8, D=64.
"""

from __future__ import annotations

import pytest
import torch

import variants

BENCH_VARIANTS = [("softmax", {}), ("linear", {}), ("performer", {"m": 64}), ("dpfp", {"nu": 1}), ("delta", {})]
BATCH, HEADS, DIM = 4, 8, 64


def _inputs(core, length):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(BATCH, HEADS, length, DIM, generator=gen) for _ in range(3))
    beta = torch.rand(BATCH, HEADS, length, generator=gen) if core.needs_beta else None
    return q, k, v, beta


@pytest.mark.parametrize("length", [1024, 4096])
@pytest.mark.parametrize("name,params", BENCH_VARIANTS, ids=[name for name, _ in BENCH_VARIANTS])
def test_parallel_forward(benchmark, name, params, length):
    core = variants.create(name, DIM, **params)
    q, k, v, beta = _inputs(core, length)
    benchmark.extra_info["tokens"] = BATCH * length
    with torch.no_grad():
        out = benchmark(core, q, k, v, beta=beta)
    assert out.shape == v.shape and torch.isfinite(out).all()


@pytest.mark.parametrize("context", [1024])
@pytest.mark.parametrize("name,params", BENCH_VARIANTS, ids=[name for name, _ in BENCH_VARIANTS])
def test_decode_step(benchmark, name, params, context):
    """One decoding step at position ``context`` + 1, after a prefill and one step (so that a
    KV cache has already grown its buffer and the timed step writes in place)."""
    core = variants.create(name, DIM, **params)
    q, k, v, beta = _inputs(core, context + 2)
    token = lambda t: (q[:, :, t], k[:, :, t], v[:, :, t])  # noqa: E731
    beta_at = lambda t: None if beta is None else beta[:, :, t]  # noqa: E731
    with torch.no_grad():
        _, state = core.prefill(q[:, :, :context], k[:, :, :context], v[:, :, :context], beta=None if beta is None else beta[:, :, :context])
        _, state = core.step(*token(context), state, beta_t=beta_at(context))
        out, _ = benchmark(core.step, *token(context + 1), state, beta_t=beta_at(context + 1))
    assert out.shape == (BATCH, HEADS, DIM) and torch.isfinite(out).all()

"""pytest-benchmark micro-benchmarks: each registered variant's parallel form and decode step.

``nox -s microbench`` times them; the test session runs each once with
``--benchmark-disable`` (a smoke test, no timing; T = 4096 is ``slow``, left out of the quick loop). fp32 on the CPU, B=4, H=8, D=64; every
registered variant with its defaults (Based and ReBased at their own d_key,
``harness.demo.OWN_D_KEY``; values keep D) on its own ``example_inputs``.
"""

from __future__ import annotations

import pytest
import torch

import variants
from harness.demo import OWN_D_KEY

BATCH, HEADS, DIM = 4, 8, 64


def _core_and_inputs(name, length):
    core = variants.create(name, OWN_D_KEY.get(name, DIM))
    return core, core.example_inputs(BATCH, HEADS, length, DIM, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("length", [1024, pytest.param(4096, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", variants.names())
def test_parallel_forward(benchmark, name, length):
    core, inputs = _core_and_inputs(name, length)
    benchmark.extra_info["tokens"] = BATCH * length
    with torch.no_grad():
        out = benchmark(core, **inputs)
    assert out.shape == inputs["v"].shape and torch.isfinite(out).all()


@pytest.mark.parametrize("context", [1024])
@pytest.mark.parametrize("name", variants.names())
def test_decode_step(benchmark, name, context):
    """One decoding step at position ``context`` + 1, after a prefill and one step (so that a
    KV cache has already grown its buffer and the timed step writes in place)."""
    core, inputs = _core_and_inputs(name, context + 2)
    with torch.no_grad():
        _, state = core.prefill(**variants.time_slice(inputs, 0, context))
        _, state = core.step(**variants.token_slice(inputs, context), state=state)
        out, _ = benchmark(core.step, **variants.token_slice(inputs, context + 1), state=state)
    assert out.shape == (BATCH, HEADS, DIM) and torch.isfinite(out).all()

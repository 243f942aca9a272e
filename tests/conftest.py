"""Shared test helpers: the variant configurations under test and fresh random inputs."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

# Triton decides when its kernels are imported whether they run natively or through its
# interpreter; without a GPU, every kernel test runs through the interpreter on the CPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import variants
from harness.tasks.download import SHARED_DATA

#: Skips a test that reads the shared WikiText-2 (``../shared/data`` beside the checkout).
needs_shared = pytest.mark.skipif(
    not (SHARED_DATA / "wikitext-2" / "wiki.train.tokens").is_file(),
    reason=f"the shared WikiText-2 is not at {SHARED_DATA / 'wikitext-2'}",
)


def attnbench(*args, env=None, **kwargs) -> subprocess.CompletedProcess:
    """``python -m harness.cli ARGS`` in a subprocess, output captured."""
    command = [sys.executable, "-m", "harness.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=300, **kwargs)


@pytest.fixture(autouse=True)
def keep_thread_count():
    """Tests that run with ``threads=1`` must not leave the rest of the session on one thread."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)

#: (variant name, parameters): every registered variant, several settings each.
CONFIGS = [
    ("softmax", {}),
    ("softmax", {"scale": 0.3}),
    ("linear", {}),
    ("linear", {"chunk_size": 16}),
    ("linear", {"phi": "identity", "normalize": False, "chunk_size": 16}),
    ("linear", {"phi": "dpfp", "nu": 2, "sum_norm": True, "chunk_size": 32}),
    ("performer", {"m": 16, "chunk_size": 16}),
    ("performer", {"d_dot": 10, "seed": 3}),
    ("dpfp", {"nu": 1, "chunk_size": 16}),
    ("dpfp", {"nu": 3, "normalize": False}),
    ("delta", {}),
    ("delta", {"chunk_size": 16}),
    ("delta", {"phi": "identity", "sum_norm": False, "chunk_size": 16}),
    ("delta", {"attn_norm": True, "chunk_size": 16}),
    ("delta", {"phi": "dpfp", "nu": 2, "chunk_size": 16}),
    ("delta", {"phi": "favor", "m": 8, "attn_norm": True}),
    ("based", {"chunk_size": 16}),
    ("rebased", {"normalize": False}),
]


def config_id(config) -> str:
    name, params = config
    return name + "".join(f"-{key}={value}" for key, value in params.items())


@pytest.fixture
def seed(request) -> int:
    """A fresh seed per test (or ATTNBENCH_TEST_SEED), shown in the report when a test fails."""
    value = int(os.environ.get("ATTNBENCH_TEST_SEED", random.randrange(2**31)))
    request.node.user_properties.append(("seed", value))
    return value


def make_inputs(core, batch, heads, length, d_value, *, dtype, seed, requires_grad=False):
    """Random q, k, v (and β for the delta rule) for ``core``.

    Identity-φ variants get unit-norm keys: the plain delta rule is only stable while
    β‖k‖² < 2, and plain linear attention grows with ‖q‖‖k‖.
    """
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, length, core.d_key, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, heads, length, core.d_key, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, heads, length, d_value, generator=gen, dtype=torch.float64)
    if getattr(core, "phi_name", None) == "identity":
        k = k / k.norm(dim=-1, keepdim=True)
        q = q / q.norm(dim=-1, keepdim=True)
    beta = torch.rand(batch, heads, length, generator=gen, dtype=torch.float64) if core.needs_beta else None
    tensors = [t.to(dtype).requires_grad_(requires_grad) if t is not None else None for t in (q, k, v, beta)]
    return tuple(tensors)


def run_steps(core, q, k, v, beta, state=None, log_gate=None):
    """The recurrent form over a whole sequence: ``[B, H, T, Dv]`` and the final state."""
    if state is None:
        state = core.init_state(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype)
    outputs = []
    for t in range(q.shape[2]):
        at_t = {"beta_t": beta[:, :, t] if beta is not None else None}
        if log_gate is not None:
            at_t["log_gate_t"] = log_gate[:, :, t]
        out, state = core.step(q[:, :, t], k[:, :, t], v[:, :, t], state, **at_t)
        outputs.append(out)
    return torch.stack(outputs, dim=2), state


def layer_step_loop(layer, x, state=None):
    """An ``AttentionLayer``'s recurrent form over ``x [B, T, D]``, token by token."""
    state = layer.init_state(x.shape[0], dtype=x.dtype) if state is None else state
    outputs = []
    for t in range(x.shape[1]):
        y_t, state = layer.step(x[:, t], state)
        outputs.append(y_t)
    return torch.stack(outputs, dim=1)


def check_layer_forms(layer, x, gen, seed, tol=1e-10) -> dict:
    """A layer's parallel form == its step loop == a prefill chain (6 tokens, 4 more, one step),
    forward and the gradients of ``x`` and every parameter (``x``: 11 tokens or more).
    Returns the parallel form's gradients by name ("x", then the parameter names)."""
    parallel, stepped = layer(x), layer_step_loop(layer, x)
    torch.testing.assert_close(stepped, parallel, rtol=tol, atol=tol, msg=lambda m: f"step loop (seed {seed}): {m}")
    head, state = layer.prefill(x[:, :6])
    middle, state = layer.prefill(x[:, 6:10], state)
    last, _ = layer.step(x[:, 10], state)
    chained = torch.cat([head, middle, last[:, None]], 1)
    torch.testing.assert_close(chained, parallel[:, :11], rtol=tol, atol=tol, msg=lambda m: f"prefill chain (seed {seed}): {m}")
    names, leaves = ["x", *dict(layer.named_parameters())], [x, *layer.parameters()]
    cotangent = torch.randn(parallel.shape, generator=gen, dtype=parallel.dtype)
    grads_parallel = torch.autograd.grad((parallel * cotangent).sum(), leaves)
    grads_step = torch.autograd.grad((stepped * cotangent).sum(), leaves)
    for label, grad_parallel, grad_step in zip(names, grads_parallel, grads_step):
        torch.testing.assert_close(grad_step, grad_parallel, rtol=tol, atol=tol, msg=lambda m: f"d/d{label} (seed {seed}): {m}")
    return dict(zip(names, grads_parallel))


def build(config, d_key, dtype=torch.float64):
    name, params = config
    return variants.create(name, d_key, **params).to(dtype)

"""``chunk_size`` reaches the Triton kernels: ``create(name, d, backend="triton", chunk_size=C)`` launches them at
chunk C (the launches' runtime ``chunk_size`` and padded ``BLOCK_C``), agrees with the float64 reference there,
and counts its FLOPs at C; a chunk they do not take is refused at create time, naming those they take. The
passes' autotuning is keyed on the shape, so a choice made for one cell never carries over to another.
Through Triton's interpreter on a CPU (conftest.py), natively with ATTNBENCH_TEST_DEVICE=cuda."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from helpers import slow_interpreted  # noqa: E402

import variants  # noqa: E402
from variants import kernels  # noqa: E402
from variants.kernels import _common, delta_rule, delta_rule_forward, sum_rule  # noqa: E402

DEVICE = os.environ.get("ATTNBENCH_TEST_DEVICE", "cpu")
F64 = torch.float64


def _launched(monkeypatch, module) -> list[tuple[int, int]]:
    """``(chunk_size, BLOCK_C)`` of every launch of ``module``'s chunk kernels from now on (the passes included)."""
    seen, real_launch = [], module.launch

    def spy(kernel, grid, *args, options, name=None, **constexprs):
        if "BLOCK_C" in constexprs:
            arg_names = kernel.arg_names
            seen.append((args[arg_names.index("chunk_size")], constexprs["BLOCK_C"]))
        return real_launch(kernel, grid, *args, options=options, name=name, **constexprs)

    monkeypatch.setattr(module, "launch", spy)
    return seen


@pytest.mark.parametrize(
    ("name", "module", "chunk"),
    [slow_interpreted("linear", sum_rule, 16), ("linear", sum_rule, 32), slow_interpreted("gated_delta", delta_rule, 16), ("gated_delta", delta_rule, 32)],
)
def test_the_kernels_run_the_asked_chunk(monkeypatch, name, module, chunk, seed):
    """Forward and backward launch at chunk C (T = 40: two or three chunks, the last ragged), the output and every
    gradient agree with float64 (outputs poisoned first), and ``flops`` counts chunks of C."""
    monkeypatch.setattr(_common, "POISON", True)
    reference = variants.create(name, 8).double()
    core = variants.create(name, 8, backend="triton", chunk_size=chunk).to(DEVICE)
    assert core.chunk_size == chunk
    gen = torch.Generator().manual_seed(seed)
    shape = (1, 2, 40)
    inputs = {"q": torch.randn(*shape, 8, generator=gen, dtype=F64), "k": torch.randn(*shape, 8, generator=gen, dtype=F64)}
    inputs["v"] = torch.randn(*shape, 6, generator=gen, dtype=F64)
    if name == "gated_delta":
        inputs["beta"] = torch.rand(*shape, generator=gen, dtype=F64)
        inputs["log_gate"] = -3 * torch.rand(*shape, generator=gen, dtype=F64) ** 2
    leaves = {n: t.clone().requires_grad_() for n, t in inputs.items()}
    cotangent = torch.randn(*shape, 6, generator=gen, dtype=F64)
    expected = reference.reference(**leaves)
    want = torch.autograd.grad((expected * cotangent).sum(), list(leaves.values()))
    launched = _launched(monkeypatch, module)
    run = {n: t.to(DEVICE, torch.float32).requires_grad_() for n, t in inputs.items()}
    out = core(**run)
    got = torch.autograd.grad((out * cotangent.to(DEVICE, torch.float32)).sum(), list(run.values()))
    assert launched and set(launched) == {(chunk, chunk)}, launched
    for label, actual, target in zip(["out", *inputs], [out, *got], [expected, *want], strict=True):
        scale = max(1.0, target.abs().max().item())
        torch.testing.assert_close(actual.double().cpu(), target, rtol=2e-4, atol=1e-4 * scale, msg=lambda m, label=label: f"{label}: {m}")
    chunks, rest = divmod(40, chunk)
    assert core.flops(1, 2, 40, 6) == 2 * (chunks * core._chunk_flops(chunk, 6) + core._chunk_flops(rest, 6)) + (2 * 2 * 40 * 8 if core.normalize else 0)


def test_the_default_chunk_is_the_kernels():
    """Without ``chunk_size`` the Triton backend runs (and counts) the kernels' default; torch its own 64."""
    assert variants.create("linear", 8, backend="triton").chunk_size == kernels.default_chunk_size("sum_rule", 8) == 64
    assert variants.create("delta", 256, backend="triton").chunk_size == kernels.default_chunk_size("delta_rule", 256) == 32
    assert variants.create("delta", 256).chunk_size == 64


@pytest.mark.parametrize(
    ("name", "d", "chunk", "accepted"),
    [("linear", 8, 20, "16, 32, 64, 128"), ("linear", 8, 256, "16, 32, 64, 128"), ("delta", 8, 128, "16, 32, 64"), ("gated_delta", 256, 64, "16, 32")],
)
def test_chunks_the_kernels_do_not_take_are_refused_at_create(name, d, chunk, accepted):
    with pytest.raises(variants.UnsupportedBackend, match=rf"chunk_size in \({accepted}\) at d_dot={d}, got {chunk}"):
        variants.create(name, d, backend="triton", chunk_size=chunk)
    assert variants.create(name, d, chunk_size=chunk).chunk_size == chunk  # the torch form takes any chunk


def _pass_arguments(pass_kernel, seq_len: int, batch_heads: int) -> list:
    """Positional arguments of a pass at this shape (d_dot = d_value = 16, chunk 16): small tensors and sizes."""
    sizes = dict(seq_len=seq_len, d_dot=16, d_value=16, chunk_size=16, num_chunks=-(-seq_len // 16), group=1, heads=batch_heads, batch_heads=batch_heads)
    names = [name for name in pass_kernel.arg_names if name in sizes or name.endswith("_ptr")]
    return [sizes[name] if name in sizes else torch.zeros(1) for name in names]


@pytest.mark.parametrize("pass_kernel", [delta_rule._state_pass_kernel, delta_rule._backward_pass_kernel], ids=["state_pass", "backward_pass"])
def test_pass_tuning_is_keyed_on_the_shape(monkeypatch, pass_kernel):
    """Two shapes tuned in either order get the same choices: the best candidate (timed here by a stand-in
    that favours 16 columns for a short sequence and 32 for a long one) is chosen per (T, B·H), never reused."""
    candidates = [config for config in delta_rule_forward.PASS_CONFIGS if config.num_warps == 4]
    monkeypatch.setattr(pass_kernel, "early_config_prune", lambda configs, args, **constexprs: candidates)

    def timing(*args, config, **constexprs):
        seq_len = args[pass_kernel.arg_names.index("seq_len")]
        return [1.0 if (config.kwargs["BLOCK_V"] == 32) == (seq_len > 1000) else 2.0]

    monkeypatch.setattr(pass_kernel, "_bench", timing)
    ran = []
    monkeypatch.setattr(pass_kernel, "fn", type("Stub", (), {"run": lambda self, *args, **kwargs: ran.append(kwargs["BLOCK_V"])})())
    constexprs = {name: 0 for name in pass_kernel.arg_names if name.isupper() and name != "BLOCK_V"}  # BLOCK_V: the candidate's
    shapes = [(64, 8), (4096, 8), (4096, 1)]
    choices = []
    for order in (shapes, shapes[::-1]):
        monkeypatch.setattr(pass_kernel, "cache", {})
        ran.clear()
        for shape in order:
            pass_kernel.run(*_pass_arguments(pass_kernel, *shape), grid=(1,), **constexprs)
        choices.append(dict(zip(order, ran)))
        assert len(pass_kernel.cache) == len(shapes)
    assert choices[0] == choices[1] == {(64, 8): 16, (4096, 8): 32, (4096, 1): 32}
    assert {"seq_len", "batch_heads"} <= set(delta_rule_forward.PASS_TUNING_KEY)


def test_over_limits():
    """The one test of a compiled kernel against a GPU's limits, at launch and in ``attnbench kernels``."""
    limits = _common.Limits(shared=1000)
    assert _common.over_limits(1000, 255, 8, limits) == []
    assert _common.over_limits(1001, 128, 4, limits) == ["shared memory 1001 B > 1000 B per block"]
    assert _common.over_limits(0, 255, 16, limits) == ["255 registers × 512 threads > 65536 per block"]


def test_candidates_over_the_gpus_limits_are_pruned():
    """At launch on a GPU each autotuning candidate is compiled and kept only if it fits (``keep_fitting``): a
    stand-in compiler here, one candidate over the shared memory, one over the registers per block."""
    import types

    needs = {16: (2000, 64), 32: (500, 255)}  # BLOCK_V -> (shared bytes, registers)
    loaded = []

    def compile_config(config):
        shared, registers = needs[config.kwargs["BLOCK_V"]]
        kernel = types.SimpleNamespace(metadata=types.SimpleNamespace(shared=shared), n_regs=registers)
        kernel._init_handles = lambda: loaded.append(config.kwargs["BLOCK_V"])
        return kernel

    limits = _common.Limits(shared=1000)
    configs = [config for config in delta_rule_forward.PASS_CONFIGS if config.num_warps == 4]
    assert _common.keep_fitting("pass", configs, compile_config, limits) == [configs[1]]  # 32 columns, 255 × 128 threads fit
    assert loaded == [32]  # the one over the shared memory is never loaded
    half = _common.Limits(shared=1000, registers=32000)
    message = r"pass: no tile configuration fits this GPU: shared memory 2000 B > 1000 B per block; 255 registers × 128 threads > 32000"
    with pytest.raises(variants.UnsupportedBackend, match=message):
        _common.keep_fitting("pass", configs, compile_config, half)

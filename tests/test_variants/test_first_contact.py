"""What a first run on a GPU would break, reproduced on the CPU (issue 44): the paths a GPU takes that
a CPU run does not, forced here (a pinned kernel, the GPU's scan) with the GPU's dtypes."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import variants
from variants import softmax
from variants.precision import rel_error


class _LargestScores(TorchDispatchMode):
    """The largest [rows, columns] (the last two dimensions) of any tensor an operation returns."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(x, torch.Tensor) and x.dim() >= 2:
                self.largest = max(self.largest, x.shape[-2] * x.shape[-1])
        return out


def test_softmax_on_the_math_kernel_holds_no_t_by_t_scores(monkeypatch, seed):
    """float64 on a GPU runs SDPA's math kernel (no fused kernel takes it): the float64 reference of a
    softmax cell at T = 65,536 held three [T, T] score matrices, 98 GiB, beyond an H100. Pinned to the
    math kernel here: the causal form runs in blocks of queries, forward and backward, and computes
    the reference's function."""
    monkeypatch.setattr(softmax, "MATH_BLOCK_SCORES", 100 * 300)
    core = variants.create("softmax", 16, backend_options={"sdpa": "math"}).double()
    inputs = core.example_inputs(1, 2, 300, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    with _LargestScores() as scores:
        out = core(**inputs)
        grads = torch.autograd.grad(out.square().sum(), list(inputs.values()))
    assert scores.largest <= softmax.MATH_BLOCK_SCORES, f"a tensor of {scores.largest} scores > {softmax.MATH_BLOCK_SCORES}"
    expected = core.reference(**inputs)
    assert rel_error(out, expected) < 1e-12
    wanted = torch.autograd.grad(expected.square().sum(), list(inputs.values()))
    assert max(rel_error(g, w) for g, w in zip(grads, wanted, strict=True)) < 1e-12


def test_softmax_compiled_step_compiles_nothing_after_two_steps(monkeypatch, seed):
    """A compile decode cell compiles in its warm-up (a prefill and two steps) and fails if a timed step
    compiles again: softmax's step wrote the new key at an indexed position, on which TorchDynamo
    specialised, so every step compiled again (softmax[compile] decode, an error cell on any device).
    TorchDynamo's guards are the same whatever compiles the graph: here its 'eager' backend, in seconds."""
    import torch._dynamo

    from variants.compiled import compiled_frames

    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **options: real(fn, backend="eager", dynamic=options.get("dynamic")))
    torch._dynamo.reset()
    core = variants.create("softmax", 16, backend="compile")
    inputs = core.example_inputs(1, 2, 24, 8, generator=torch.Generator().manual_seed(seed))
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    with torch.no_grad():
        for round_ in range(2):  # each timed round starts from a fresh prefill
            _, state = core.prefill(**variants.time_slice(inputs, 0, 16))
            for t in range(16, 24):
                if (round_, t) == (0, 18):
                    warm = compiled_frames()
                _, state = core.step(q[:, :, t], k[:, :, t], v[:, :, t], state)
    again = compiled_frames() - warm
    torch._dynamo.reset()
    assert again == 0, f"{again} frame(s) compiled after the warm-up's two steps"

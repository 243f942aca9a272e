"""``backend='fla'``: flash-linear-attention's Triton kernels (package fla-core, ``attnbench[fla]``)
for the variants whose function they compute exactly; ``UnsupportedBackend`` naming the
difference for the others. This module holds what every mapping shares (``FlaForm``, the calls
into fla); each family maps itself beside its own definition (``sum_rule``: linear attention,
Based, ReBased; ``delta_rule``: the delta rules) and lists it in its ``backend_forms``. The
mapping of each variant is written down in docs/variants.md ("The fla backend").

Conventions mapped here, once for all: fla takes ``[B, T, H, D]`` (ours ``[B, H, T, D]``: a
transpose of dims 1 and 2 each way; the wrapped core's ``input_layout`` 'bthd' makes
``example_inputs`` lay its inputs out so, so that the transpose is a view and no copy runs
inside a timed call; Based's and ReBased's parallel kernels transpose back to ``[B, H, T, D]``
and keep 'bhtd'); its recurrent state ``[B, H, K, V]`` is our fast weight
matrix S = Wᵀ ``[B, H, d_dot, Dv]`` as it is; its ``scale`` multiplies the queries (we pass 1,
or Based's 1/√d_key); the feature map φ (with Schlag's sum normalisation where a variant has
it) is applied in PyTorch before the kernel, so the kernel sees φ(q), φ(k); β and the log
decay g = log α are fla's ``beta`` and ``g`` ``[B, T, H]`` as they are.

Which kernel runs: on CUDA tensors fla's chunk kernels (``chunk_linear_attn``,
``chunk_delta_rule``, ``chunk_gated_delta_rule``; Based and ReBased: ``parallel_based``,
``parallel_rebased``); on CPU tensors, through Triton's interpreter (TRITON_INTERPRET=1), the
``fused_recurrent_*`` kernels and the two parallel ones (fla's chunk kernels fail in the
interpreter), each autotuned kernel on its first configuration (the interpreter cannot benchmark);
the decode step is the fused recurrent kernel on one token, as fla's layers decode. fla's
``fused_recurrent_gated_delta_rule`` has no backward: the gated rule trains through fla on CUDA only.

The chunk size (fla-core 0.6.0): ``chunk_delta_rule`` and ``chunk_gated_delta_rule`` take the
core's ``chunk_size`` from 16, 32, 64; ``chunk_linear_attn`` takes none and runs 64; the
parallel Based/ReBased kernels have no chunk (tiled quadratic attention, counted as such by
``flops``). Any other ``chunk_size`` is refused when the core is built, so a swept chunk size
never measures one configuration under several labels. ``implementation_choices`` records the
kernel and chunk a cell runs (the recurrent kernels of the CPU path have no chunk), and the fla and Triton versions.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys

import torch

from .base import BackendForm, UnsupportedBackend, state_heads
from .fast_weights import DEFAULT_CHUNK

#: The options ``backend='fla'`` takes (none: the kernel follows the device, see above).
OPTIONS: dict = {}
#: The largest query/key width of fla's parallel Based/ReBased kernels (their assertion).
PARALLEL_MAX_DIM = 128
#: The chunk sizes fla's chunk kernels run, by kernel: the delta rules check for 16, 32, 64
#: (ValueError otherwise); chunk_linear_attn calls chunk_simple_gla with its default of 64.
CHUNK_SIZES = {
    "chunk_linear_attn": (64,),
    "chunk_delta_rule": (16, 32, 64),
    "chunk_gated_delta_rule": (16, 32, 64),
}


def _ops(module: str):
    """``fla.ops.<module>``, or UnsupportedBackend with the reason fla cannot be imported."""
    try:
        ops = importlib.import_module(f"fla.ops.{module}")
    except Exception as exc:  # fla's import runs device detection and Triton set-up: any failure means no backend
        raise UnsupportedBackend(f"backend 'fla': importing fla.ops.{module} failed: {type(exc).__name__}: {exc}") from exc
    if os.environ.get("TRITON_INTERPRET") == "1":
        _first_configs()
    return ops


def _first_configs() -> None:
    """Under Triton's interpreter, every ``@triton.autotune``d fla kernel keeps only its first
    configuration: the interpreter has no GPU to benchmark candidates on (Triton raises "0 active
    drivers"), and any configuration computes the same function (they differ in tiles and warps)."""
    from triton.runtime.autotuner import Autotuner, KernelInterface

    for name, module in list(sys.modules.items()):
        if not name.startswith("fla.ops"):
            continue
        for kernel in vars(module).values():
            while isinstance(kernel, KernelInterface):  # Heuristics -> Autotuner -> JITFunction, each through .fn
                if isinstance(kernel, Autotuner):
                    kernel.configs = kernel.configs[:1]
                kernel = getattr(kernel, "fn", None)


def _where(variant: str, device: torch.device) -> str:
    """'chunk' on CUDA, 'recurrent' on CPU tensors under Triton's interpreter; else UnsupportedBackend."""
    if device.type == "cuda":
        return "chunk"
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return "recurrent"
    raise UnsupportedBackend(
        f"{variant}: backend 'fla' runs Triton kernels: CUDA tensors, or CPU tensors through Triton's interpreter "
        f"(TRITON_INTERPRET=1 before Python starts; slow, for tests), got {device.type} tensors"
    )


def _fla(x):
    """Our ``[B, H, T, D]`` (or ``[B, H, T]``) as fla's ``[B, T, H, D]`` (``[B, T, H]``): a view of
    inputs laid out 'bthd' (``AttentionCore.input_layout``), a copy only of others."""
    return x.transpose(1, 2).contiguous()


def _ours(x):
    return x.transpose(1, 2)


@functools.lru_cache(maxsize=64)
def _offsets_on(bounds: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(bounds, dtype=torch.long, device=device)


def _packed(bounds, device: torch.device, host_copy: bool = False) -> dict:
    """fla's ``cu_seqlens`` (a LongTensor on ``device``) for packed sequences (``bounds``: our offsets as ints), and
    with ``host_copy`` its ``cu_seqlens_cpu`` (the chunk delta rules take it to plan their chunks without a device
    sync); made once per offsets and device, so that no timed call copies them. None: {}."""
    if bounds is None:
        return {}
    offsets = {"cu_seqlens": _offsets_on(tuple(bounds), device)}
    return offsets | ({"cu_seqlens_cpu": _offsets_on(tuple(bounds), torch.device("cpu"))} if host_copy else {})


def _causal_only(variant: str, causal: bool) -> None:
    if not causal:
        raise UnsupportedBackend(f"{variant}: fla's kernels are causal only; causal=False is backend='torch'")


class FlaForm(BackendForm):
    """What every mapping shares: its kernels by where they run (``kernels``, ``{"chunk": name,
    "recurrent": name}``), refused at once when the core's chunk size is one the chunk kernel does
    not run; the layout its inputs should have (``input_layout``) and what a call on given inputs
    runs (``implementation_choices``). A mapping defines ``_parallel``, ``_prefill`` and ``_step``; one that
    takes packed sequences (``shapes``) a ``_call(q, k, v, state, where, **token_inputs, cu_seqlens=bounds)``
    that passes them to fla (``_packed``), which the packed forms here use."""

    replaces = ("_parallel", "_prefill", "_step", "_parallel_packed", "_prefill_packed", "implementation_choices", "input_layout", "fla_kernels")
    input_layout = "bthd"

    def __init__(self, core, kernels: dict):
        super().__init__(core)
        self.fla_kernels = kernels
        accepted = CHUNK_SIZES.get(kernels["chunk"], (DEFAULT_CHUNK,))
        if core.chunk_size not in accepted:
            kernel = kernels["chunk"]
            runs = f"runs chunk_size {', '.join(map(str, accepted))}" if kernel in CHUNK_SIZES else f"has no chunk (leave chunk_size at {DEFAULT_CHUNK})"
            raise UnsupportedBackend(f"{core.variant_name}: fla's {kernel} {runs}, got chunk_size={core.chunk_size}")

    def implementation_choices(self, q, k, v, *, causal=True, **token_inputs) -> dict:
        """``{"fla_kernel": name, "chunk_size": C, "fla_version": ..., "triton_version": ...}`` for a call on ``q``'s
        device (C None for a kernel without chunks; the versions: ``variants.kernels.identity.fla_identity``)."""
        from .kernels.identity import fla_identity

        kernel = self.fla_kernels[_where(self.core.variant_name, q.device)]
        return {"fla_kernel": kernel, "chunk_size": self.core.chunk_size if kernel in CHUNK_SIZES else None, **fla_identity()}

    def _parallel_packed(self, q, k, v, causal, bounds, **token_inputs):
        """The parallel form over packed sequences (B = 1): fla's kernel with its ``cu_seqlens``."""
        _causal_only(self.core.variant_name, causal)
        return self._call(q, k, v, None, _where(self.core.variant_name, q.device), **token_inputs, cu_seqlens=bounds)[0]

    def _prefill_packed(self, q, k, v, state, bounds, **token_inputs):
        """``prefill`` over packed sequences: the outputs and the N sequences' states ``[N, H, ...]`` (default: from empty ones)."""
        if state is None:
            state = self.core.init_state(len(bounds) - 1, state_heads(k, v), v.shape[-1], device=q.device, dtype=q.dtype)
        return self._call(q, k, v, state, _where(self.core.variant_name, q.device), **token_inputs, cu_seqlens=bounds)

"""Chunk-parallel causal delta rule and gated delta rule in Triton, forward and backward (WY / UT transform).

Shapes (per batch b and head h; F = d_dot, the key side after φ, Dv = d_value):

    q, k: [B, H, T, F]   v: [B, H, T, Dv]   beta, log_gate: [B, H, T]   weights S_0: [B, H, F, Dv] or None

The recurrence (Schlag et al. 2021, eq. 20-25, with S = Wᵀ; gated: Yang, Kautz, Hatamizadeh 2024,
arXiv:2412.06464, eq. 10, α_t = exp(g_t)); keys and queries are taken as given (already feature-mapped):

    S_t = α_t S_{t-1} + β_t k_t (v_t − α_t S_{t-1}ᵀ k_t)ᵀ,    y_t = S_tᵀ q_t    (α ≡ 1 ungated)

Per chunk of C tokens (Yang et al. 2024, arXiv:2406.06484v6, eq. 8-11; the gate as in
arXiv:2412.06464 §3.3), with G_t = Σ_{s ≤ t in the chunk} g_s, γ_t = exp(G_t), γ_C = exp(G_last),
D_ti = exp(G_t − G_i) for i ≤ t (γ = D = 1 ungated) and S the state entering the chunk:

    A = tril(diag(β) (K Kᵀ ⊙ D), −1),   T = (I + A)⁻¹   (unit lower triangular)
    W = T diag(β γ) K,   U = T diag(β) V,   U' = U − W S
    O = diag(γ) Q S + (tril(Q Kᵀ) ⊙ D) U',   S' = γ_C S + K̃ᵀ U'   with K̃ = diag(γ_C / γ) K

This is ``variants.chunked.delta_rule_chunked`` (identity φ, no normaliser), the reference the
tests tie this file to. The gate is a constexpr (``GATED``) of the same kernels.

Forward, three launches:
  1. ``_ut_transform_kernel``, one program per (chunk, b·h): T (stored, fp32, for the backward),
     W and U (stored in the input dtype, ``[B·H, T, F]`` and ``[B·H, T, Dv]``); gated, G (fp32, ``[B·H, T]``),
     which every later kernel reads: the prefix sums are a [C, C] masked row sum (``tl.cumsum``'s scan failed
     natively beside the kernels' dots), computed once per chunk rather than in every kernel and pass step.
  2. ``_state_pass_kernel``, one program per (Dv block, b·h; the block and the warps autotuned,
     ``PASS_CONFIGS``): the only sequential part, light:
     per chunk U' = U − W S (overwrites U), S ← γ_C S + K̃ᵀ U'; the state entering every chunk goes
     to ``states [B·H, n_chunks, F, Dv]`` (fp32), the last one is S_T.
  3. ``_output_kernel``, one program per (chunk, b·h, Dv block): O from S_c and U', in parallel.

Backward, with dO and dS' (the gradient of the state leaving a chunk), M = tril(Q Kᵀ) ⊙ D:
  4. ``_backward_local_kernel`` (chunk, b·h, Dv block): the chunk-local Mᵀ dO into ``du``;
  5. ``_backward_pass_kernel`` (Dv block, b·h), chunks in reverse, stores dS'_c and
        dU' = Mᵀ dO + K̃ dS',   dS = γ_C dS' + (diag(γ) Q)ᵀ dO − Wᵀ dU'      (dS_0 at the end);
  6. ``_backward_chunk_kernel`` (chunk, b·h), in parallel:
        dVb = Tᵀ dU',   dA = −tril(dVb U'ᵀ, −1),   dM = (dO U'ᵀ) ⊙ D (causal),   P = diag(β) (dA ⊙ D)
        dQ = diag(γ) dO Sᵀ + dM K
        dK = dMᵀ Q + diag(γ_C/γ) U' dS'ᵀ − diag(β γ) dVb Sᵀ + P K + Pᵀ K
        dV = diag(β) dVb
        dβ = rowsum(dVb ⊙ (V − diag(γ) K S)) + rowsum(dA ⊙ K Kᵀ ⊙ D)
     (the solve [U | W] = T [diag(β) V | diag(βγ) K] gives d[βV | βγK] = Tᵀ d[U | W] with dW = −dU' Sᵀ, and
     dA = −tril(dR Xᵀ) = −tril(dVb (U − W S)ᵀ, −1)). Gated, the gradient of the in-chunk cumulative
     log gate, then dg_s = Σ_{t ≥ s in the chunk} dG_t (a masked row sum too):
        dG = rowsum(Q ⊙ diag(γ) dO Sᵀ) + rowsum(Z) − colsum(Z)  with Z = dM ⊙ tril(Q Kᵀ) ⊙ D
           + rowsum(Y) − colsum(Y)  with Y = dA ⊙ A        − rowsum(dVb Sᵀ ⊙ diag(βγ) K)
           − rowsum(K̃ ⊙ U' dS'ᵀ),   and at the last row also + Σ_i rowsum(K̃ ⊙ U' dS'ᵀ)_i + γ_C ⟨S, dS'⟩.

Precision: states, T and every accumulation are fp32. fp16/bf16 inputs go into 16-bit tensor-core
dots as they are (``_common.dot``), fp32 tiles they meet (T, the states, U', dU') rounded to the input
dtype as dot operands; W, U and U' are stored in the input dtype (so is what a 16-bit dot would round
them to). fp32 inputs use IEEE fp32 dots, or TF32 with ``precision="tf32"`` (sm_80 on). sm_70 (no bf16
tensor cores, no TF32) multiplies in fp32 FMAs whatever the input. Padding: the chunk, F and Dv are
padded to powers of two ≥ 16 with masks; a zero row of K, V, Q, β (and g = 0) is inert everywhere.

Limits: d_dot and d_value up to 256, chunk_size 16, 32 or 64, at most 32 for d_dot > 128 (``kernels.chunk_sizes``:
the passes hold [C, F] tiles and a [F, block of Dv] state); default the largest. Memory kept for the
backward: T (C² per chunk), W, U' (input dtype), the chunk states (4·F·Dv bytes per chunk and b·h) and, gated, G.
"""

from __future__ import annotations

import torch
import triton

from ..base import VariantError
from . import _common, check_chunk_size, default_chunk_size
from ._common import launch, new_output
from .delta_rule_backward import _backward_chunk_kernel, _backward_local_kernel, _backward_pass_kernel
from .delta_rule_forward import _output_kernel, _state_pass_kernel, _ut_transform_kernel

#: Columns (d_value) or rows (d_dot) of the [C, ·] tiles of the chunk kernels with 16-bit dot operands
#: (``_common.tile_plan`` narrows it for fp32 operands).
TILE = 64

# --------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------


class _Tiles(_common.Tiles):
    """Chunk kernels: [C, ``block_f``] / [C, ``block_v``] tiles and their warps (``_common.tile_plan`` of ``TILE``;
    8 warps for the backward's chunk kernel: with 4, fp32's ``ut_transform`` kept its [C, C] inverse on a 2.3 KB
    stack a thread on sm_80), chosen by compiling (docs/performance.md, "Compiled kernels"); the two passes hold
    the whole padded F and a block of Dv columns, autotuned (``PASS_CONFIGS``)."""

    def __init__(self, q, v, chunk_size, precision, packing=None):
        batch, heads, seq_len, d_value = v.shape
        super().__init__(batch, heads, seq_len, q.shape[-1], d_value, chunk_size, q.dtype, q.device, precision, packing)
        self.group = heads // q.shape[1]  # GVA: value heads per q/k head
        tile, self.num_warps = _common.tile_plan(self.precision, self.block_c, TILE)
        self.block_f, self.block_v = min(self.pad_f, tile), min(self.pad_v, tile)
        self.num_stages = 2

    def options(self, warps: int | None = None) -> dict:
        return dict(num_warps=warps or self.num_warps, num_stages=self.num_stages)

    def chunk_grid(self, per_value_block: bool = False) -> tuple[int, ...]:
        return (self.num_chunks, self.bh) + ((triton.cdiv(self.d_value, self.block_v),) if per_value_block else ())

    def pass_grid(self):
        """The grid of a pass, from the candidate's ``BLOCK_V``: a program per Dv block and state row."""
        return lambda meta: (triton.cdiv(self.d_value, meta["BLOCK_V"]), self.state_rows)

    def constexprs(self, gated: bool, sequential: bool = False) -> dict:
        blocks = dict(PAD_F=self.pad_f) if sequential else dict(BLOCK_F=self.block_f, BLOCK_V=self.block_v)
        return dict(GATED=gated, VARLEN=self.varlen, BLOCK_C=self.block_c, **blocks, PRECISION=self.precision)

    def sizes(self) -> tuple[int, ...]:
        """The sizes every kernel takes, then ``group`` (value heads per q/k head)."""
        return (*super().sizes(), self.group)

    def per_value_head(self, x: torch.Tensor) -> torch.Tensor:
        """A new buffer of q/k's width on the value heads, ``[B, H_v, T, F]`` (W, and dq, dk before ``qk_heads``)."""
        return new_output((self.batch, self.heads, self.seq_len, self.d_dot), x)

    def qk_heads(self, grad: torch.Tensor) -> torch.Tensor:
        """The gradient of GVA's shared q or k heads: the sum over each group of value heads of ``grad [B, H_v, T, F]``."""
        return grad if self.group == 1 else grad.unflatten(1, (-1, self.group)).sum(2)

    def pass_sizes(self, like: torch.Tensor) -> tuple:
        """The tables and sizes a pass takes: the chunk and sequence tables, the sizes, H and the state rows (its tuning key)."""
        return (*self.tables(like), *self.sizes(), self.heads, self.state_rows)


def _forward(q, k, v, beta, log_gate, weights, tiles: _Tiles):
    """Launches (1)-(3): y, S_T and what the backward keeps (T, W, U', the chunk states, G)."""
    gated, gate = log_gate is not None, log_gate if log_gate is not None else beta
    cumulative_gate = new_output(beta.shape, q, torch.float32) if gated else beta  # G, written by (1) (ungated: unread)
    inverse = new_output((tiles.bh, tiles.num_chunks, tiles.block_c, tiles.block_c), q, torch.float32)
    w, new_values = tiles.per_value_head(k), new_output(v.shape, v)  # W; U, then U'
    states = new_output((tiles.bh, tiles.num_chunks, tiles.d_dot, tiles.d_value), q, torch.float32)
    y = new_output(v.shape, v)
    s_final = new_output((tiles.state_batch, tiles.heads, tiles.d_dot, tiles.d_value), q, torch.float32)
    chunk_table = tiles.tables(q)[0]
    launch(
        _ut_transform_kernel, tiles.chunk_grid(), k, v, beta, gate, inverse, w, new_values, cumulative_gate, chunk_table, *tiles.sizes(),
        **tiles.constexprs(gated), options=tiles.options(), name="ut_transform",
    )  # fmt: skip
    launch(
        _state_pass_kernel, tiles.pass_grid(), k, cumulative_gate, w, new_values, s_final if weights is None else weights, states, s_final,
        *tiles.pass_sizes(q), HAS_S0=weights is not None, **tiles.constexprs(gated, sequential=True), options={}, name="state_pass",
    )  # fmt: skip
    launch(
        _output_kernel, tiles.chunk_grid(True), q, k, cumulative_gate, new_values, states, y, chunk_table, *tiles.sizes(),
        **tiles.constexprs(gated), options=tiles.options(), name="output",
    )  # fmt: skip
    return y, s_final, (inverse, w, new_values, states, cumulative_gate)


def _backward(q, k, v, beta, log_gate, saved, dy, ds_final, tiles: _Tiles):
    """Launches (4)-(6): dq, dk, dv, dβ, dg (None ungated) and dS_0 (fp32)."""
    inverse, w, new_values, states, cumulative_gate = saved
    gated = log_gate is not None
    dnew_values = new_output(v.shape, v, torch.float32)
    dstates = new_output(states.shape, states)
    ds0 = new_output((tiles.state_batch, tiles.heads, tiles.d_dot, tiles.d_value), q, torch.float32)
    chunk_table = tiles.tables(q)[0]
    launch(
        _backward_local_kernel, tiles.chunk_grid(True), q, k, cumulative_gate, dy, dnew_values, chunk_table, *tiles.sizes(),
        **tiles.constexprs(gated), options=tiles.options(), name="backward_local",
    )  # fmt: skip
    launch(
        _backward_pass_kernel, tiles.pass_grid(), q, k, cumulative_gate, w, dy, dnew_values, ds0 if ds_final is None else ds_final, dstates, ds0,
        *tiles.pass_sizes(q), HAS_DS_FINAL=ds_final is not None, **tiles.constexprs(gated, sequential=True), options={}, name="backward_pass",
    )  # fmt: skip
    dq, dk, dv, dbeta = tiles.per_value_head(q), tiles.per_value_head(k), new_output(v.shape, v), new_output(beta.shape, beta)
    dgate = new_output(log_gate.shape, log_gate) if gated else dbeta
    launch(
        _backward_chunk_kernel, tiles.chunk_grid(),
        q, k, v, beta, cumulative_gate, dy, inverse, new_values, dnew_values, states, dstates, dq, dk, dv, dbeta, dgate, chunk_table, *tiles.sizes(),
        **tiles.constexprs(gated), options=tiles.options(8), name="backward_chunk",
    )  # fmt: skip
    return tiles.qk_heads(dq), tiles.qk_heads(dk), dv, dbeta, dgate if gated else None, ds0


class _DeltaRuleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, beta, log_gate, weights, chunk_size, precision, packing):
        q, k, v, beta = (t.contiguous() for t in (q, k, v, beta))
        log_gate = log_gate.contiguous() if log_gate is not None else None
        weights = weights.contiguous() if weights is not None else None
        tiles = _Tiles(q, v, chunk_size, precision, packing)
        y, s_final, saved = _forward(q, k, v, beta, log_gate, weights, tiles)
        ctx.tiles = tiles
        ctx.weights_dtype = weights.dtype if weights is not None else None
        ctx.save_for_backward(q, k, v, beta, log_gate, *saved)
        ctx.set_materialize_grads(False)
        return y, s_final

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy, ds_final):
        q, k, v, beta, log_gate, *saved = ctx.saved_tensors
        tiles: _Tiles = ctx.tiles
        dy = torch.zeros_like(v) if dy is None else dy.contiguous()
        ds_final = ds_final.contiguous() if ds_final is not None else None
        dq, dk, dv, dbeta, dgate, ds0 = _backward(q, k, v, beta, log_gate, saved, dy, ds_final, tiles)
        dweights = ds0.to(ctx.weights_dtype) if ctx.weights_dtype is not None else None
        return dq, dk, dv, dbeta, dgate, dweights, None, None, None


def _check(q, k, v, beta, log_gate, weights, chunk_size, precision, cu_seqlens) -> tuple[int, _common.Packing | None]:
    """Validate the arguments; return the chunk size to use and the packing of ``cu_seqlens``."""
    name = "delta_rule_triton"
    _common.check_inputs(name, _ut_transform_kernel, q, k, v, beta, log_gate, weights, value_groups=True)
    _common.check_precision(name, precision)
    _, heads, seq_len, d_value = v.shape
    d_dot = q.shape[-1]
    chunk_size = default_chunk_size("delta_rule", d_dot) if chunk_size is None else chunk_size
    check_chunk_size(name, "delta_rule", d_dot, chunk_size)
    packing = _common.packing(name, q, cu_seqlens, chunk_size)
    batch = q.shape[0] if packing is None else packing.num_sequences
    for label, tensor in (("beta", beta), ("log_gate", log_gate)):
        if label == "log_gate" and tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor) or tensor.shape != v.shape[:3] or tensor.dtype not in (q.dtype, torch.float32):
            raise VariantError(
                f"{name}: {label} must be [B, H_v, T] = {tuple(v.shape[:3])} in q's dtype {q.dtype} or float32, "
                f"got {tuple(getattr(tensor, 'shape', ()))} {getattr(tensor, 'dtype', type(tensor))}"
            )
    if weights is not None and (weights.shape != (batch, heads, d_dot, d_value) or not weights.dtype.is_floating_point):
        expected = (batch, heads, d_dot, d_value)
        raise VariantError(f"{name}: weights must be floating point [B, H, d_dot, d_value] = {expected}, got {tuple(weights.shape)} {weights.dtype}")
    if seq_len == 0:
        raise VariantError(f"{name}: the sequence is empty (T = 0); give at least one token")
    return chunk_size, packing


def delta_rule_triton(
    q, k, v, beta, weights=None, *, log_gate=None, chunk_size: int | None = None, precision: str = _common.FP32_DOT_PRECISION, cu_seqlens=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal delta rule (gated with ``log_gate``), chunked, in Triton: ``(y, S_T)``.

    ``q, k: [B, H, T, F]`` (already feature-mapped; F = d_dot ≤ 256), ``v: [B, H, T, Dv]`` (Dv ≤ 256),
    one dtype for the three (float32, float16 or bfloat16); ``beta`` and ``log_gate`` g ≤ 0 (None: the
    ungated rule) ``[B, H, T]`` in that dtype or float32; ``weights``: S_0 ``[B, H, F, Dv]`` or None (zeros).
    Returns ``y [B, H, T, Dv]`` in the input dtype and ``S_T [B, H, F, Dv]`` in float32;
    S_t = α_t S_{t-1} + β_t k_t (v_t − α_t S_{t-1}ᵀ k_t)ᵀ with α_t = exp(g_t), y_t = S_tᵀ q_t.
    Differentiable w.r.t. q, k, v, beta, log_gate and weights; a gradient on S_T is accepted.
    ``chunk_size``: one of ``kernels.chunk_sizes("delta_rule", F)`` (16, 32, 64; up to 32 for F > 128), default the largest.
    ``precision``: the dots of float32 inputs, "ieee" or "tf32" (sm_80 on; 16-bit inputs use 16-bit dots).
    ``cu_seqlens``: N packed sequences in one row (B = 1), offsets ``[N + 1]`` as ints or an int tensor (read on
    the host; ``_common.packing`` caches what the kernels need per offsets): each sequence is cut into chunks of
    its own and starts from its own state, so S_0 and S_T are ``[N, H, F, Dv]``. Grouped value heads (GVA, Gated
    DeltaNet's): q and k may have fewer heads than v, a divisor of them; value head i reads q/k head i // (H_v / H),
    by index in the kernels (no copy), and β, g, S_0, y and S_T are on the value heads; dq and dk are summed over each
    group of value heads after the backward.
    """
    chunk_size, packing = _check(q, k, v, beta, log_gate, weights, chunk_size, precision, cu_seqlens)
    return _DeltaRuleFunction.apply(q, k, v, beta, log_gate, weights, chunk_size, precision, packing)


# --------------------------------------------------------------------------------------
# What `attnbench kernels` compiles.
# --------------------------------------------------------------------------------------


def compile_configs() -> list[dict]:
    """Every reachable configuration: each dtype, shape and chunk size of ``_common.shipped_shapes``, ungated and gated;
    and packed sequences (``_common.PACKED_BOUNDS``) in bf16 at chunk 64: d = 64 ungated and gated, d = 128 gated."""
    dense = [
        dict(dtype=dtype, d_dot=d_dot, d_value=d_value, chunk_size=chunk, gated=gated)
        for dtype, d_dot, d_value, chunk in _common.shipped_shapes("delta_rule")
        for gated in (False, True)
    ]
    packed = [(64, False), (64, True), (128, True)]
    return dense + [dict(dtype=torch.bfloat16, d_dot=d, d_value=d, chunk_size=64, gated=gated, packed=True) for d, gated in packed]


def config_label(config: dict) -> str:
    gate = " gated" if config.get("gated") else ""
    packed = " packed" if config.get("packed") else ""
    return f"{_common.DTYPE_NAMES[config['dtype']]} F{config['d_dot']} Dv{config['d_value']} C{config['chunk_size']}{gate}{packed}"


def record_launches(config: dict, capability: int) -> list[_common.Launch]:
    """The kernels a training step (forward, backward into q, k, v, β and g) of ``config`` launches at
    the reference shape on a GPU of compute capability ``capability`` (×10)."""
    shape = (_common.REFERENCE_BATCH, _common.REFERENCE_HEADS, _common.REFERENCE_SEQ_LEN)
    dtype = config["dtype"]
    q, k = (_common.meta_tensor(*shape, config["d_dot"], dtype=dtype) for _ in range(2))
    v = _common.meta_tensor(*shape, config["d_value"], dtype=dtype)
    beta = _common.meta_tensor(*shape, dtype=dtype)
    log_gate = _common.meta_tensor(*shape, dtype=dtype) if config.get("gated") else None

    def entry(q, k, v, beta, log_gate=None):
        packed = {"cu_seqlens": _common.PACKED_BOUNDS} if config.get("packed") else {}
        return delta_rule_triton(q, k, v, beta, log_gate=log_gate, chunk_size=config["chunk_size"], **packed)

    return _common.record_training_step(entry, capability, [q, k, v, beta] + ([log_gate] if log_gate is not None else []))

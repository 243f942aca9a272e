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
     W and U (stored in the input dtype, ``[B·H, T, F]`` and ``[B·H, T, Dv]``).
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
     log gate, then dg_s = Σ_{t ≥ s in the chunk} dG_t:
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
backward: T (C² per chunk), W, U' (input dtype) and the chunk states (4·F·Dv bytes per chunk and b·h).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..base import VariantError
from . import _common, check_chunk_size, default_chunk_size
from ._common import chunk_rows, dot, launch, load_chunk, load_or_zeros, new_output, token_tile

#: Columns (d_value) or rows (d_dot) of the [C, ·] tiles of the chunk kernels with 16-bit dot operands
#: (``_common.tile_plan`` narrows it for fp32 operands).
TILE = 64


# --------------------------------------------------------------------------------------
# @triton.jit helpers. Token tensors [B·H, T, width]; chunk states [B·H, n_chunks, F, Dv] (fp32);
# T matrices [B·H, n_chunks, BLOCK_C, BLOCK_C] (fp32).
# --------------------------------------------------------------------------------------


@triton.jit
def _unit_lower_inverse(A, BLOCK_C: tl.constexpr):
    """(I + A)⁻¹ for a strictly lower triangular [BLOCK_C, BLOCK_C] A, by forward substitution:
    row i of T = (I + A)⁻¹ is e_i − Σ_{j<i} A_ij T_j (rows j ≥ i of T are still e_j and
    meet A_ij = 0, so the sum may run over every row)."""
    rows = tl.arange(0, BLOCK_C)
    inverse = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    for i in range(1, BLOCK_C):
        a_row = tl.sum(tl.where(rows[:, None] == i, A, 0.0), axis=0)  # A[i, :]
        update = tl.sum(a_row[:, None] * inverse, axis=0)  # Σ_j A_ij T[j, :]
        inverse = tl.where(rows[:, None] == i, inverse - update[None, :], inverse)
    return inverse


@triton.jit
def _token_values(ptr, bh, chunk, seq_len, chunk_size, BLOCK_C: tl.constexpr):
    """One value per token of chunk ``chunk`` of a [B·H, T] tensor (β or g) as float32, 0 outside."""
    tokens, row_ok = chunk_rows(chunk, seq_len, chunk_size, BLOCK_C)
    return tl.load(ptr + bh * seq_len + tokens, mask=row_ok, other=0.0).to(tl.float32)


@triton.jit
def _cumulative_gate(g_ptr, bh, chunk, seq_len, chunk_size, BLOCK_C: tl.constexpr):
    """G_t = Σ_{s ≤ t in the chunk} g_s and G_last (the padding has g = 0, so G_last is the last real token's)."""
    cumulative = tl.cumsum(_token_values(g_ptr, bh, chunk, seq_len, chunk_size, BLOCK_C), axis=0)
    last = tl.sum(tl.where(tl.arange(0, BLOCK_C) == BLOCK_C - 1, cumulative, 0.0), axis=0)
    return cumulative, last


@triton.jit
def _decay(cumulative, STRICT: tl.constexpr, BLOCK_C: tl.constexpr):
    """D_ti = exp(G_t − G_i) on the lower triangle (strictly lower with STRICT), 0 above."""
    rows = tl.arange(0, BLOCK_C)
    if STRICT:
        lower = rows[:, None] > rows[None, :]
    else:
        lower = rows[:, None] >= rows[None, :]
    return tl.where(lower, tl.exp(tl.where(lower, cumulative[:, None] - cumulative[None, :], 0.0)), 0.0)


@triton.jit
def _state_offsets(bh, chunk, num_chunks, feats, cols, d_dot, d_value):
    """Offsets and mask of rows ``feats``, columns ``cols`` of chunk ``chunk``'s [F, Dv] state."""
    offs = (bh * num_chunks + chunk) * d_dot * d_value + feats[:, None] * d_value + cols[None, :]
    return offs, (feats < d_dot)[:, None] & (cols < d_value)[None, :]


@triton.jit
def _store_chunk(ptr, values, bh, chunk, seq_len, width, chunk_size, col_start, BLOCK_C: tl.constexpr, BLOCK: tl.constexpr):
    """Masked store of a [BLOCK_C, BLOCK] tile into chunk ``chunk`` of a [B·H, T, width] tensor, in its dtype."""
    tokens, token_ok = chunk_rows(chunk, seq_len, chunk_size, BLOCK_C)
    offs, mask = token_tile(bh, seq_len, tokens, token_ok, col_start + tl.arange(0, BLOCK), width)
    tl.store(ptr + offs, values.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _chunk_scores(a_ptr, b_ptr, bh, chunk, seq_len, d_dot, chunk_size, PRECISION: tl.constexpr,
                  BLOCK_C: tl.constexpr, BLOCK_F: tl.constexpr):  # fmt: skip
    """A_c B_cᵀ ``[BLOCK_C, BLOCK_C]`` in fp32 for two [B·H, T, F] tensors, summed over F in blocks of BLOCK_F."""
    scores = tl.zeros((BLOCK_C, BLOCK_C), dtype=tl.float32)
    for f_start in range(0, d_dot, BLOCK_F):
        a = load_chunk(a_ptr, bh, chunk, seq_len, d_dot, chunk_size, f_start, BLOCK_C, BLOCK_F)
        b = load_chunk(b_ptr, bh, chunk, seq_len, d_dot, chunk_size, f_start, BLOCK_C, BLOCK_F)
        scores += dot(a, tl.trans(b), PRECISION, a_ptr.dtype.element_ty)
    return scores


# --------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------


@triton.jit
def _ut_transform_kernel(
    k_ptr, v_ptr, beta_ptr, g_ptr,  # inputs [BH, T, F], [BH, T, Dv], [BH, T], [BH, T] (if GATED)
    t_ptr, w_ptr, u_ptr,  # outputs: T (fp32) [BH, NC, BLOCK_C, BLOCK_C], W [BH, T, F], U [BH, T, Dv]
    seq_len, d_dot, d_value, chunk_size, num_chunks,
    GATED: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """(1) Program (chunk, b·h): T = (I + tril(diag(β)(K Kᵀ ⊙ D), −1))⁻¹, W = T diag(βγ) K, U = T diag(β) V."""
    chunk = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rows = tl.arange(0, BLOCK_C)
    input_type = k_ptr.dtype.element_ty
    beta = _token_values(beta_ptr, bh, chunk, seq_len, chunk_size, BLOCK_C)
    gram = _chunk_scores(k_ptr, k_ptr, bh, chunk, seq_len, d_dot, chunk_size, PRECISION, BLOCK_C, BLOCK_F)
    if GATED:
        cumulative, _ = _cumulative_gate(g_ptr, bh, chunk, seq_len, chunk_size, BLOCK_C)
        gram = gram * _decay(cumulative, True, BLOCK_C)
        key_scale = beta * tl.exp(cumulative)
    else:
        gram = tl.where(rows[:, None] > rows[None, :], gram, 0.0)
        key_scale = beta
    inverse = _unit_lower_inverse(gram * beta[:, None], BLOCK_C)
    tl.store(t_ptr + ((bh * num_chunks + chunk) * BLOCK_C + rows[:, None]) * BLOCK_C + rows[None, :], inverse)
    for f_start in range(0, d_dot, BLOCK_F):
        keys = load_chunk(k_ptr, bh, chunk, seq_len, d_dot, chunk_size, f_start, BLOCK_C, BLOCK_F)
        w = dot(inverse, keys.to(tl.float32) * key_scale[:, None], PRECISION, input_type)
        _store_chunk(w_ptr, w, bh, chunk, seq_len, d_dot, chunk_size, f_start, BLOCK_C, BLOCK_F)
    for v_start in range(0, d_value, BLOCK_V):
        values = load_chunk(v_ptr, bh, chunk, seq_len, d_value, chunk_size, v_start, BLOCK_C, BLOCK_V)
        u = dot(inverse, values.to(tl.float32) * beta[:, None], PRECISION, input_type)
        _store_chunk(u_ptr, u, bh, chunk, seq_len, d_value, chunk_size, v_start, BLOCK_C, BLOCK_V)


#: The two passes' autotuning candidates (``_pass_candidates`` keeps those worth timing): the Dv columns of the
#: state one program carries (the grid is b·h × d_value / BLOCK_V) and the warps.
PASS_CONFIGS = [triton.Config({"BLOCK_V": block}, num_warps=warps, num_stages=1) for block in (16, 32) for warps in (4, 8)]


def _pass_candidates(configs, args, **constexprs):
    """The pass configurations to time: at most 32 columns with 16-bit operands and F ≤ 128, else 16 (wider
    ones spilled 0.4-7 KB a thread: docs/performance.md), none wider than d_value needs. Through the
    interpreter (CPU tensors: nothing to time) only the widest of them with 8 warps."""
    widest = 32 if constexprs["PRECISION"].startswith("input") and constexprs["PAD_F"] <= 128 else 16
    widest = min(widest, _common.pad(args["d_value"]))
    kept = [config for config in configs if config.kwargs["BLOCK_V"] <= widest]
    if args["k_ptr"].device.type == "cpu":
        kept = [config for config in kept if config.kwargs["BLOCK_V"] == widest and config.num_warps == 8]
    return kept


#: What a pass's tuning is keyed on: the sizes that decide its tiles and the shape that decides its grid and
#: its length (B·H and T), so the choice made for one cell never carries over to a cell of another shape.
PASS_TUNING_KEY = ["d_dot", "d_value", "chunk_size", "seq_len", "batch_heads"]


def _autotune_pass(restore: str):
    """``@triton.autotune`` of a pass, keyed on ``PASS_TUNING_KEY`` (and, as Triton adds, the dtypes), restoring
    ``restore`` (which the pass overwrites) after each timed candidate; the candidates worth timing
    (``_pass_candidates``) that fit the GPU (``_common.fitting``). Tuning runs at the first call of each key: in
    attnbench's warm-up call, never a timed one."""

    def tune(kernel):
        def candidates(configs, args, **constexprs):
            return _common.fitting(kernel, _pass_candidates(configs, args, **constexprs), args, constexprs)

        return triton.autotune(PASS_CONFIGS, key=PASS_TUNING_KEY, prune_configs_by={"early_config_prune": candidates}, restore_value=[restore])(kernel)

    return tune


@_autotune_pass("u_ptr")
@triton.jit
def _state_pass_kernel(
    k_ptr, g_ptr, w_ptr, u_ptr,  # inputs; u (U) is overwritten with U'
    s0_ptr,  # [BH, F, Dv] (if HAS_S0)
    states_ptr, s_final_ptr,  # outputs (fp32): [BH, NC, F, Dv] the state entering each chunk, [BH, F, Dv]
    seq_len, d_dot, d_value, chunk_size, num_chunks,
    batch_heads,  # B·H, the grid's second axis: read by the tuning key only (PASS_TUNING_KEY)
    HAS_S0: tl.constexpr, GATED: tl.constexpr,
    BLOCK_C: tl.constexpr, PAD_F: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """(2) Program (Dv block, b·h), chunks in order, S[:, block] carried in fp32 (its columns evolve
    independently: every matrix that mixes tokens depends on K, β, g only):
    U' = U − W S,  S ← γ_C S + K̃ᵀ U'."""
    v_start = tl.program_id(0) * BLOCK_V
    bh = tl.program_id(1).to(tl.int64)
    feats = tl.arange(0, PAD_F)
    cols = v_start + tl.arange(0, BLOCK_V)
    input_type = k_ptr.dtype.element_ty
    state_offs, state_mask = _state_offsets(bh, 0, 1, feats, cols, d_dot, d_value)
    state = load_or_zeros(s0_ptr, state_offs, state_mask, HAS_S0)
    for chunk in range(0, num_chunks):
        offs, mask = _state_offsets(bh, chunk, num_chunks, feats, cols, d_dot, d_value)
        tl.store(states_ptr + offs, state, mask=mask)
        w = load_chunk(w_ptr, bh, chunk, seq_len, d_dot, chunk_size, 0, BLOCK_C, PAD_F)
        u = load_chunk(u_ptr, bh, chunk, seq_len, d_value, chunk_size, v_start, BLOCK_C, BLOCK_V)
        new_values = u.to(tl.float32) - dot(w, state, PRECISION, input_type)
        _store_chunk(u_ptr, new_values, bh, chunk, seq_len, d_value, chunk_size, v_start, BLOCK_C, BLOCK_V)
        keys = load_chunk(k_ptr, bh, chunk, seq_len, d_dot, chunk_size, 0, BLOCK_C, PAD_F)
        if GATED:
            cumulative, last = _cumulative_gate(g_ptr, bh, chunk, seq_len, chunk_size, BLOCK_C)
            keys = keys.to(tl.float32) * tl.exp(last - cumulative)[:, None]
            state = state * tl.exp(last)
        state += dot(tl.trans(keys), new_values, PRECISION, input_type)
    tl.store(s_final_ptr + state_offs, state, mask=state_mask)


@triton.jit
def _output_kernel(
    q_ptr, k_ptr, g_ptr, u_ptr, states_ptr,  # inputs (u holds U')
    y_ptr,  # output [BH, T, Dv]
    seq_len, d_dot, d_value, chunk_size, num_chunks,
    GATED: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """(3) Program (chunk, b·h, Dv block): O = diag(γ) Q S_c + (tril(Q Kᵀ) ⊙ D) U', summed over F in blocks."""
    chunk = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    v_start = tl.program_id(2) * BLOCK_V
    rows = tl.arange(0, BLOCK_C)
    cols = v_start + tl.arange(0, BLOCK_V)
    input_type = q_ptr.dtype.element_ty
    scores = tl.zeros((BLOCK_C, BLOCK_C), dtype=tl.float32)
    out = tl.zeros((BLOCK_C, BLOCK_V), dtype=tl.float32)
    for f_start in range(0, d_dot, BLOCK_F):
        queries = load_chunk(q_ptr, bh, chunk, seq_len, d_dot, chunk_size, f_start, BLOCK_C, BLOCK_F)
        keys = load_chunk(k_ptr, bh, chunk, seq_len, d_dot, chunk_size, f_start, BLOCK_C, BLOCK_F)
        offs, mask = _state_offsets(bh, chunk, num_chunks, f_start + tl.arange(0, BLOCK_F), cols, d_dot, d_value)
        scores += dot(queries, tl.trans(keys), PRECISION, input_type)
        out += dot(queries, tl.load(states_ptr + offs, mask=mask, other=0.0), PRECISION, input_type)
    if GATED:
        cumulative, _ = _cumulative_gate(g_ptr, bh, chunk, seq_len, chunk_size, BLOCK_C)
        out = out * tl.exp(cumulative)[:, None]
        scores = scores * _decay(cumulative, False, BLOCK_C)
    else:
        scores = tl.where(rows[:, None] >= rows[None, :], scores, 0.0)
    new_values = load_chunk(u_ptr, bh, chunk, seq_len, d_value, chunk_size, v_start, BLOCK_C, BLOCK_V)
    out += dot(scores, new_values, PRECISION, input_type)
    _store_chunk(y_ptr, out, bh, chunk, seq_len, d_value, chunk_size, v_start, BLOCK_C, BLOCK_V)


# --------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------


@triton.jit
def _backward_local_kernel(
    q_ptr, k_ptr, g_ptr, dy_ptr,  # inputs
    du_ptr,  # output (fp32) [BH, T, Dv]: Mᵀ dO
    seq_len, d_dot, d_value, chunk_size, num_chunks,
    GATED: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """(4) Program (chunk, b·h, Dv block): the chunk-local part of dU', Mᵀ dO with M = tril(Q Kᵀ) ⊙ D."""
    chunk = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    v_start = tl.program_id(2) * BLOCK_V
    rows = tl.arange(0, BLOCK_C)
    scores = _chunk_scores(q_ptr, k_ptr, bh, chunk, seq_len, d_dot, chunk_size, PRECISION, BLOCK_C, BLOCK_F)
    if GATED:
        cumulative, _ = _cumulative_gate(g_ptr, bh, chunk, seq_len, chunk_size, BLOCK_C)
        scores = scores * _decay(cumulative, False, BLOCK_C)
    else:
        scores = tl.where(rows[:, None] >= rows[None, :], scores, 0.0)
    dout = load_chunk(dy_ptr, bh, chunk, seq_len, d_value, chunk_size, v_start, BLOCK_C, BLOCK_V)
    local = dot(tl.trans(scores), dout, PRECISION, q_ptr.dtype.element_ty)
    _store_chunk(du_ptr, local, bh, chunk, seq_len, d_value, chunk_size, v_start, BLOCK_C, BLOCK_V)


@_autotune_pass("du_ptr")
@triton.jit
def _backward_pass_kernel(
    q_ptr, k_ptr, g_ptr, w_ptr, dy_ptr,  # inputs
    du_ptr,  # in: Mᵀ dO (fp32); out: dU' = Mᵀ dO + K̃ dS'
    ds_final_ptr,  # [BH, F, Dv] (if HAS_DS_FINAL)
    dstates_ptr, ds0_ptr,  # outputs (fp32): [BH, NC, F, Dv] the gradient on the state leaving each chunk, dS_0
    seq_len, d_dot, d_value, chunk_size, num_chunks,
    batch_heads,  # B·H: read by the tuning key only
    HAS_DS_FINAL: tl.constexpr, GATED: tl.constexpr,
    BLOCK_C: tl.constexpr, PAD_F: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """(5) Program (Dv block, b·h), chunks in reverse: dU' = Mᵀ dO + K̃ dS', dS = γ_C dS' + (diag(γ) Q)ᵀ dO − Wᵀ dU'."""
    v_start = tl.program_id(0) * BLOCK_V
    bh = tl.program_id(1).to(tl.int64)
    feats = tl.arange(0, PAD_F)
    cols = v_start + tl.arange(0, BLOCK_V)
    input_type = q_ptr.dtype.element_ty
    state_offs, state_mask = _state_offsets(bh, 0, 1, feats, cols, d_dot, d_value)
    dstate = load_or_zeros(ds_final_ptr, state_offs, state_mask, HAS_DS_FINAL)
    for step in range(0, num_chunks):
        chunk = num_chunks - 1 - step
        offs, mask = _state_offsets(bh, chunk, num_chunks, feats, cols, d_dot, d_value)
        tl.store(dstates_ptr + offs, dstate, mask=mask)
        keys = load_chunk(k_ptr, bh, chunk, seq_len, d_dot, chunk_size, 0, BLOCK_C, PAD_F)
        queries = load_chunk(q_ptr, bh, chunk, seq_len, d_dot, chunk_size, 0, BLOCK_C, PAD_F)
        if GATED:
            cumulative, last = _cumulative_gate(g_ptr, bh, chunk, seq_len, chunk_size, BLOCK_C)
            keys = keys.to(tl.float32) * tl.exp(last - cumulative)[:, None]
            queries = queries.to(tl.float32) * tl.exp(cumulative)[:, None]
        local = load_chunk(du_ptr, bh, chunk, seq_len, d_value, chunk_size, v_start, BLOCK_C, BLOCK_V)
        dnew_values = local + dot(keys, dstate, PRECISION, input_type)
        _store_chunk(du_ptr, dnew_values, bh, chunk, seq_len, d_value, chunk_size, v_start, BLOCK_C, BLOCK_V)
        w = load_chunk(w_ptr, bh, chunk, seq_len, d_dot, chunk_size, 0, BLOCK_C, PAD_F)
        dout = load_chunk(dy_ptr, bh, chunk, seq_len, d_value, chunk_size, v_start, BLOCK_C, BLOCK_V)
        if GATED:
            dstate = dstate * tl.exp(last)
        dstate += dot(tl.trans(queries), dout, PRECISION, input_type) - dot(tl.trans(w), dnew_values, PRECISION, input_type)
    tl.store(ds0_ptr + state_offs, dstate, mask=state_mask)


@triton.jit
def _backward_chunk_kernel(
    q_ptr, k_ptr, v_ptr, beta_ptr, g_ptr, dy_ptr,  # inputs
    t_ptr, u_ptr, du_ptr, states_ptr, dstates_ptr,  # saved: T, U', dU' (fp32), S_c, dS'_c
    dq_ptr, dk_ptr, dv_ptr, dbeta_ptr, dg_ptr,  # outputs
    seq_len, d_dot, d_value, chunk_size, num_chunks,
    GATED: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """(6) Program (chunk, b·h): dq, dk, dv, dβ (and dg) of the chunk (module docstring). First the [C, C]
    products over Dv blocks (dO U'ᵀ, dVb U'ᵀ; dv stored), then Q Kᵀ, K Kᵀ over F blocks, then per F block
    the [C, F block] gradients over Dv blocks (dVb recomputed: Tᵀ dU' is cheap)."""
    chunk = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rows = tl.arange(0, BLOCK_C)
    tokens, row_ok = chunk_rows(chunk, seq_len, chunk_size, BLOCK_C)
    input_type = q_ptr.dtype.element_ty
    inverse = tl.load(t_ptr + ((bh * num_chunks + chunk) * BLOCK_C + rows[:, None]) * BLOCK_C + rows[None, :])
    beta = _token_values(beta_ptr, bh, chunk, seq_len, chunk_size, BLOCK_C)

    dscores = tl.zeros((BLOCK_C, BLOCK_C), dtype=tl.float32)  # dO U'ᵀ
    dsolve = tl.zeros((BLOCK_C, BLOCK_C), dtype=tl.float32)  # dVb U'ᵀ
    dbeta = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for v_start in range(0, d_value, BLOCK_V):
        dout = load_chunk(dy_ptr, bh, chunk, seq_len, d_value, chunk_size, v_start, BLOCK_C, BLOCK_V)
        new_values = load_chunk(u_ptr, bh, chunk, seq_len, d_value, chunk_size, v_start, BLOCK_C, BLOCK_V)
        dvb = dot(tl.trans(inverse), load_chunk(du_ptr, bh, chunk, seq_len, d_value, chunk_size, v_start, BLOCK_C, BLOCK_V), PRECISION, input_type)
        _store_chunk(dv_ptr, dvb * beta[:, None], bh, chunk, seq_len, d_value, chunk_size, v_start, BLOCK_C, BLOCK_V)
        values = load_chunk(v_ptr, bh, chunk, seq_len, d_value, chunk_size, v_start, BLOCK_C, BLOCK_V)
        dbeta += tl.sum(dvb * values.to(tl.float32), axis=1)
        dscores += dot(dout, tl.trans(new_values), PRECISION, input_type)
        dsolve += dot(dvb, tl.trans(new_values), PRECISION, input_type)
    scores = _chunk_scores(q_ptr, k_ptr, bh, chunk, seq_len, d_dot, chunk_size, PRECISION, BLOCK_C, BLOCK_F)
    gram = _chunk_scores(k_ptr, k_ptr, bh, chunk, seq_len, d_dot, chunk_size, PRECISION, BLOCK_C, BLOCK_F)
    grad_a = -tl.where(rows[:, None] > rows[None, :], dsolve, 0.0)  # dA
    if GATED:
        cumulative, last = _cumulative_gate(g_ptr, bh, chunk, seq_len, chunk_size, BLOCK_C)
        gamma = tl.exp(cumulative)
        dscores = dscores * _decay(cumulative, False, BLOCK_C)
        gram = gram * _decay(cumulative, True, BLOCK_C)
        z = dscores * scores  # dM ⊙ M
        y = grad_a * gram * beta[:, None]  # dA ⊙ A
        dgate = tl.sum(z, axis=1) - tl.sum(z, axis=0) + tl.sum(y, axis=1) - tl.sum(y, axis=0)
        written = tl.exp(last - cumulative)  # γ_C / γ
        dlast = tl.sum(tl.zeros((BLOCK_C,), dtype=tl.float32), axis=0)
    else:
        dscores = tl.where(rows[:, None] >= rows[None, :], dscores, 0.0)
        gram = tl.where(rows[:, None] > rows[None, :], gram, 0.0)
    dbeta += tl.sum(grad_a * gram, axis=1)
    p = grad_a * beta[:, None]
    if GATED:
        p = p * _decay(cumulative, True, BLOCK_C)

    for f_start in range(0, d_dot, BLOCK_F):
        feats = f_start + tl.arange(0, BLOCK_F)
        dq = tl.zeros((BLOCK_C, BLOCK_F), dtype=tl.float32)  # dO Sᵀ
        dk_write = tl.zeros((BLOCK_C, BLOCK_F), dtype=tl.float32)  # U' dS'ᵀ
        dk_solve = tl.zeros((BLOCK_C, BLOCK_F), dtype=tl.float32)  # dVb Sᵀ
        for v_start in range(0, d_value, BLOCK_V):
            cols = v_start + tl.arange(0, BLOCK_V)
            offs, mask = _state_offsets(bh, chunk, num_chunks, feats, cols, d_dot, d_value)
            state = tl.load(states_ptr + offs, mask=mask, other=0.0)
            dstate = tl.load(dstates_ptr + offs, mask=mask, other=0.0)
            dout = load_chunk(dy_ptr, bh, chunk, seq_len, d_value, chunk_size, v_start, BLOCK_C, BLOCK_V)
            new_values = load_chunk(u_ptr, bh, chunk, seq_len, d_value, chunk_size, v_start, BLOCK_C, BLOCK_V)
            dvb = dot(tl.trans(inverse), load_chunk(du_ptr, bh, chunk, seq_len, d_value, chunk_size, v_start, BLOCK_C, BLOCK_V), PRECISION, input_type)
            dq += dot(dout, tl.trans(state), PRECISION, input_type)
            dk_write += dot(new_values, tl.trans(dstate), PRECISION, input_type)
            dk_solve += dot(dvb, tl.trans(state), PRECISION, input_type)
            if GATED:
                dlast += tl.sum(state * dstate) * tl.exp(last)
        queries = load_chunk(q_ptr, bh, chunk, seq_len, d_dot, chunk_size, f_start, BLOCK_C, BLOCK_F)
        keys = load_chunk(k_ptr, bh, chunk, seq_len, d_dot, chunk_size, f_start, BLOCK_C, BLOCK_F)
        solve_keys = tl.sum(dk_solve * keys.to(tl.float32), axis=1)  # (dVb Sᵀ)_t · k_t
        if GATED:
            dq = dq * gamma[:, None]
            dk_write = dk_write * written[:, None]
            written_keys = tl.sum(dk_write * keys.to(tl.float32), axis=1)
            dgate += tl.sum(dq * queries.to(tl.float32), axis=1) - written_keys - beta * gamma * solve_keys
            dlast += tl.sum(written_keys, axis=0)
            dbeta -= gamma * solve_keys
            dk = dk_write - (beta * gamma)[:, None] * dk_solve
        else:
            dbeta -= solve_keys
            dk = dk_write - beta[:, None] * dk_solve
        dq += dot(dscores, keys, PRECISION, input_type)
        dk += dot(tl.trans(dscores), queries, PRECISION, input_type)
        dk += dot(p, keys, PRECISION, input_type) + dot(tl.trans(p), keys, PRECISION, input_type)
        _store_chunk(dq_ptr, dq, bh, chunk, seq_len, d_dot, chunk_size, f_start, BLOCK_C, BLOCK_F)
        _store_chunk(dk_ptr, dk, bh, chunk, seq_len, d_dot, chunk_size, f_start, BLOCK_C, BLOCK_F)
    tl.store(dbeta_ptr + bh * seq_len + tokens, dbeta.to(dbeta_ptr.dtype.element_ty), mask=row_ok)
    if GATED:
        dgate += tl.where(rows == BLOCK_C - 1, dlast, 0.0)
        tl.store(dg_ptr + bh * seq_len + tokens, tl.cumsum(dgate, axis=0, reverse=True).to(dg_ptr.dtype.element_ty), mask=row_ok)


# --------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------


class _Tiles(_common.Tiles):
    """Chunk kernels: [C, ``block_f``] / [C, ``block_v``] tiles and their warps (``_common.tile_plan`` of ``TILE``;
    8 warps for the backward's chunk kernel: with 4, fp32's ``ut_transform`` kept its [C, C] inverse on a 2.3 KB
    stack a thread on sm_80), chosen by compiling (docs/performance.md, "Compiled kernels"); the two passes hold
    the whole padded F and a block of Dv columns, autotuned (``PASS_CONFIGS``)."""

    def __init__(self, q, v, chunk_size, precision):
        batch, heads, seq_len, d_dot = q.shape
        super().__init__(batch, heads, seq_len, d_dot, v.shape[-1], chunk_size, q.dtype, q.device, precision)
        tile, self.num_warps = _common.tile_plan(self.precision, self.block_c, TILE)
        self.block_f, self.block_v = min(self.pad_f, tile), min(self.pad_v, tile)
        self.num_stages = 2

    def options(self, warps: int | None = None) -> dict:
        return dict(num_warps=warps or self.num_warps, num_stages=self.num_stages)

    def chunk_grid(self, per_value_block: bool = False) -> tuple[int, ...]:
        return (self.num_chunks, self.bh) + ((triton.cdiv(self.d_value, self.block_v),) if per_value_block else ())

    def pass_grid(self):
        """The grid of a pass, from the candidate's ``BLOCK_V``."""
        return lambda meta: (triton.cdiv(self.d_value, meta["BLOCK_V"]), self.bh)

    def constexprs(self, gated: bool, sequential: bool = False) -> dict:
        blocks = dict(PAD_F=self.pad_f) if sequential else dict(BLOCK_F=self.block_f, BLOCK_V=self.block_v)
        return dict(GATED=gated, BLOCK_C=self.block_c, **blocks, PRECISION=self.precision)


def _forward(q, k, v, beta, log_gate, weights, tiles: _Tiles):
    """Launches (1)-(3): y, S_T and what the backward keeps (T, W, U', the chunk states)."""
    gated, gate = log_gate is not None, log_gate if log_gate is not None else beta
    inverse = new_output((tiles.bh, tiles.num_chunks, tiles.block_c, tiles.block_c), q, torch.float32)
    w, new_values = new_output(k.shape, k), new_output(v.shape, v)  # W; U, then U'
    states = new_output((tiles.bh, tiles.num_chunks, tiles.d_dot, tiles.d_value), q, torch.float32)
    y = new_output(v.shape, v)
    s_final = new_output((tiles.batch, tiles.heads, tiles.d_dot, tiles.d_value), q, torch.float32)
    launch(
        _ut_transform_kernel, tiles.chunk_grid(), k, v, beta, gate, inverse, w, new_values, *tiles.sizes(),
        **tiles.constexprs(gated), options=tiles.options(), name="ut_transform",
    )  # fmt: skip
    launch(
        _state_pass_kernel, tiles.pass_grid(), k, gate, w, new_values, s_final if weights is None else weights, states, s_final,
        *tiles.sizes(), tiles.bh, HAS_S0=weights is not None, **tiles.constexprs(gated, sequential=True), options={}, name="state_pass",
    )  # fmt: skip
    launch(
        _output_kernel, tiles.chunk_grid(True), q, k, gate, new_values, states, y, *tiles.sizes(),
        **tiles.constexprs(gated), options=tiles.options(), name="output",
    )  # fmt: skip
    return y, s_final, (inverse, w, new_values, states)


def _backward(q, k, v, beta, log_gate, saved, dy, ds_final, tiles: _Tiles):
    """Launches (4)-(6): dq, dk, dv, dβ, dg (None ungated) and dS_0 (fp32)."""
    inverse, w, new_values, states = saved
    gated, gate = log_gate is not None, log_gate if log_gate is not None else beta
    dnew_values = new_output(v.shape, v, torch.float32)
    dstates = new_output(states.shape, states)
    ds0 = new_output((tiles.batch, tiles.heads, tiles.d_dot, tiles.d_value), q, torch.float32)
    launch(
        _backward_local_kernel, tiles.chunk_grid(True), q, k, gate, dy, dnew_values, *tiles.sizes(),
        **tiles.constexprs(gated), options=tiles.options(), name="backward_local",
    )  # fmt: skip
    launch(
        _backward_pass_kernel, tiles.pass_grid(), q, k, gate, w, dy, dnew_values, ds0 if ds_final is None else ds_final, dstates, ds0,
        *tiles.sizes(), tiles.bh, HAS_DS_FINAL=ds_final is not None, **tiles.constexprs(gated, sequential=True), options={}, name="backward_pass",
    )  # fmt: skip
    dq, dk, dv, dbeta = new_output(q.shape, q), new_output(k.shape, k), new_output(v.shape, v), new_output(beta.shape, beta)
    dgate = new_output(log_gate.shape, log_gate) if gated else dbeta
    launch(
        _backward_chunk_kernel, tiles.chunk_grid(),
        q, k, v, beta, gate, dy, inverse, new_values, dnew_values, states, dstates, dq, dk, dv, dbeta, dgate, *tiles.sizes(),
        **tiles.constexprs(gated), options=tiles.options(8), name="backward_chunk",
    )  # fmt: skip
    return dq, dk, dv, dbeta, dgate if gated else None, ds0


class _DeltaRuleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, beta, log_gate, weights, chunk_size, precision):
        q, k, v, beta = (t.contiguous() for t in (q, k, v, beta))
        log_gate = log_gate.contiguous() if log_gate is not None else None
        weights = weights.contiguous() if weights is not None else None
        tiles = _Tiles(q, v, chunk_size, precision)
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
        return dq, dk, dv, dbeta, dgate, dweights, None, None


def _check(q, k, v, beta, log_gate, weights, chunk_size, precision) -> int:
    """Validate the arguments; return the chunk size to use."""
    name = "delta_rule_triton"
    _common.check_inputs(name, _ut_transform_kernel, q, k, v, beta, log_gate, weights)
    batch, heads, seq_len, d_dot = q.shape
    d_value = v.shape[-1]
    for label, tensor in (("beta", beta), ("log_gate", log_gate)):
        if label == "log_gate" and tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor) or tensor.shape != q.shape[:3] or tensor.dtype not in (q.dtype, torch.float32):
            raise VariantError(
                f"{name}: {label} must be [B, H, T] = {tuple(q.shape[:3])} in q's dtype {q.dtype} or float32, "
                f"got {tuple(getattr(tensor, 'shape', ()))} {getattr(tensor, 'dtype', type(tensor))}"
            )
    if weights is not None and (weights.shape != (batch, heads, d_dot, d_value) or not weights.dtype.is_floating_point):
        expected = (batch, heads, d_dot, d_value)
        raise VariantError(f"{name}: weights must be floating point [B, H, d_dot, d_value] = {expected}, got {tuple(weights.shape)} {weights.dtype}")
    if seq_len == 0:
        raise VariantError(f"{name}: the sequence is empty (T = 0); give at least one token")
    _common.check_precision(name, precision)
    if chunk_size is None:
        return default_chunk_size("delta_rule", d_dot)
    check_chunk_size(name, "delta_rule", d_dot, chunk_size)
    return chunk_size


def delta_rule_triton(
    q, k, v, beta, weights=None, *, log_gate=None, chunk_size: int | None = None, precision: str = _common.FP32_DOT_PRECISION
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
    """
    chunk_size = _check(q, k, v, beta, log_gate, weights, chunk_size, precision)
    return _DeltaRuleFunction.apply(q, k, v, beta, log_gate, weights, chunk_size, precision)


# --------------------------------------------------------------------------------------
# What `attnbench kernels` compiles.
# --------------------------------------------------------------------------------------


def compile_configs() -> list[dict]:
    """Every reachable configuration: each dtype, shape and chunk size of ``_common.shipped_shapes``, ungated and gated."""
    return [
        dict(dtype=dtype, d_dot=d_dot, d_value=d_value, chunk_size=chunk, gated=gated)
        for dtype, d_dot, d_value, chunk in _common.shipped_shapes("delta_rule")
        for gated in (False, True)
    ]


def config_label(config: dict) -> str:
    gate = " gated" if config.get("gated") else ""
    return f"{_common.DTYPE_NAMES[config['dtype']]} F{config['d_dot']} Dv{config['d_value']} C{config['chunk_size']}{gate}"


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
        return delta_rule_triton(q, k, v, beta, log_gate=log_gate, chunk_size=config["chunk_size"])

    return _common.record_training_step(entry, capability, [q, k, v, beta] + ([log_gate] if log_gate is not None else []))

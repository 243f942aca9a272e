"""Chunked causal delta rule in Triton: forward and backward through the WY / UT transform.

Shapes (per batch b and head h; F = d_dot, the key side after φ, Dv = d_value):

    q, k: [B, H, T, F]    v: [B, H, T, Dv]    beta: [B, H, T]    weights S_0: [B, H, F, Dv] or None

The recurrence (Schlag et al. 2021, eq. 20-25, with S = Wᵀ; keys and queries are taken as
given, i.e. already feature-mapped and, if wanted, sum-normalised):

    S_t = S_{t-1} + β_t k_t (v_t − S_{t-1}ᵀ k_t)ᵀ,    y_t = S_tᵀ q_t    (y_t includes token t)

Per chunk of C tokens (Yang et al. 2024, arXiv:2406.06484v6, eq. 8-11), with K, V, Q, β of
the chunk and the incoming state S:

    A = tril(diag(β) K Kᵀ, −1),   T = (I + A)⁻¹   (unit lower triangular)
    W = T diag(β) K,   U = T diag(β) V
    U' = U − W S,   O = Q S + tril(Q Kᵀ) U',   S ← S + Kᵀ U'

``delta_rule_triton`` is the entry point; it returns ``(y, S_T)`` and is differentiable
with respect to q, k, v, beta and weights, with a gradient accepted on S_T too (so two calls
chained through the state pass gradients through it). It is the fast twin of
``variants.chunked.delta_rule_chunked`` (identity φ, no normaliser) and is tied to it by
``tests/test_kernel_delta_rule.py``.

Kernels (all fp32 inside, whatever the input dtype; B·H is the second grid axis):

forward
  1. ``_ut_transform_kernel``, one program per (chunk, b·h): A, T by forward substitution
     (row by row), W = T (β⊙K) and U = T (β⊙V). T, W, U are stored (fp32) for stage 2 and
     the backward.
  2. ``_forward_scan_kernel``, one program per (Dv block, b·h): the only sequential part.
     Loops over the chunks carrying the state block S[:, block] in registers; stores the
     incoming state of every chunk (for the backward), overwrites U with U' and writes y.
     The columns of S evolve independently (every matrix that mixes tokens depends on K
     and β only), which is why the scan can be split over Dv.

backward (gradient derivation below)
  3. ``_backward_scan_kernel``, one program per (Dv block, b·h): the reverse scan of the
     state gradient dS; stores, for every chunk, the gradient with respect to the state
     leaving it, and dS_0.
  4. ``_backward_chunk_kernel``, one program per (chunk, b·h): everything else, chunk-local
     and in parallel: dq, dk, dv, dβ.

Derivation of the backward, for one chunk. Given dO and dS' (the gradient with respect to
the state leaving the chunk), with M = tril(Q Kᵀ) (diagonal included):

  from O = Q S + M U' and S' = S + Kᵀ U':
      dU' = Mᵀ dO + K dS'
      dQ  = dO Sᵀ + tril(dO U'ᵀ) K
      dK  = tril(dO U'ᵀ)ᵀ Q + U' dS'ᵀ                       (+ the terms through T below)
      dS  = dS' + Qᵀ dO − Wᵀ dU'                            (the reverse scan, kernel 3)
  from U' = U − W S:      dU = dU',  dW = −dU' Sᵀ
  through the solve [U | W] = (I + A)⁻¹ [diag(β) V | diag(β) K]: if X = (I + A)⁻¹ R then
      dR = (I + A)⁻ᵀ dX = Tᵀ dX  and  dA = −dR Xᵀ, kept on the strict lower triangle. Hence
      d(βV) = Tᵀ dU'  =: dVb,   d(βK) = Tᵀ dW = −dVb Sᵀ,
      G := dA = −tril(dVb Uᵀ + d(βK) Wᵀ, −1) = −tril(dVb (U − W S)ᵀ, −1) = −tril(dVb U'ᵀ, −1)
  into K, V and β (A_ij = β_i k_i·k_j for i > j):
      dV  = diag(β) dVb
      dK += diag(β) G K + Gᵀ diag(β) K + diag(β) d(βK) = diag(β) G K + Gᵀ diag(β) K − diag(β) dVb Sᵀ
      dβ  = rowsum(G ⊙ K Kᵀ) + rowsum(d(βK) ⊙ K) + rowsum(dVb ⊙ V)
          = rowsum(G ⊙ K Kᵀ) + rowsum(dVb ⊙ (V − K S))

Padding: tiles are powers of two (tl.dot needs ≥ 16), so F, Dv and the chunk are padded
with masked loads (zeros). A zero row of K, V, Q, β contributes nothing anywhere (its row
of A is zero, its rows of W and U are zero), so padded tokens and features are inert. The
internal buffers (T, W, U', per-chunk states and state gradients) are stored padded, so the
kernels read and write them without masks.

Limits: d_dot and d_value up to 256 (the state block [d_dot, Dv block] and the [C, d_dot]
tiles live in registers); chunk_size from 1 to 128. Default chunk size: 64 for d_dot ≤ 64,
32 for d_dot ≤ 128, 16 above. fp32 inputs use IEEE fp32 dot products (no TF32), fp16 and
bf16 inputs TF32 dot products with fp32 accumulation; the state is always fp32.
Memory saved for the backward: T [C×C per chunk], W [T×F], U' [T×Dv] and one F×Dv state
per chunk, all fp32 (the per-chunk states are not stored when no input needs a gradient).
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

from ..base import UnsupportedBackend
from . import MAX_HEAD_DIM

#: Set by tests: every output and gradient buffer is filled with NaN before the kernels
#: write it, so an element a kernel forgets to write shows up.
POISON = False

#: Largest chunk size (C×C tiles and [C, d_dot] tiles live in registers).
MAX_CHUNK_SIZE = 128


def _new_output(shape, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A buffer a kernel writes: NaN-filled when ``POISON`` is set, else uninitialised."""
    dtype = like.dtype if dtype is None else dtype
    if POISON:
        return torch.full(shape, float("nan"), dtype=dtype, device=like.device)
    return torch.empty(shape, dtype=dtype, device=like.device)


# --------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------


@triton.jit
def _unit_lower_inverse(A, CT: tl.constexpr):
    """(I + A)⁻¹ for a strictly lower triangular [CT, CT] A, by forward substitution:
    row i of T = (I + A)⁻¹ is e_i − Σ_{j<i} A_ij T_j (rows j ≥ i of T are still e_j and
    meet A_ij = 0, so the sum may run over every row)."""
    rows = tl.arange(0, CT)
    inverse = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    for i in range(1, CT):
        a_row = tl.sum(tl.where(rows[:, None] == i, A, 0.0), axis=0)  # A[i, :]
        update = tl.sum(a_row[:, None] * inverse, axis=0)  # Σ_j A_ij T[j, :]
        inverse = tl.where(rows[:, None] == i, inverse - update[None, :], inverse)
    return inverse


@triton.jit
def _load_tokens(ptr, bh, chunk, seq_len, width, chunk_size, CT: tl.constexpr, WP: tl.constexpr, col_start):
    """Rows of chunk ``chunk`` of a contiguous [B·H, T, width] input, columns
    col_start .. col_start + WP, as fp32 [CT, WP] with zeros outside (padding)."""
    rows = tl.arange(0, CT)
    cols = col_start + tl.arange(0, WP)
    tokens = chunk * chunk_size + rows
    row_ok = (rows < chunk_size) & (tokens < seq_len)
    offsets = bh * seq_len * width + tokens[:, None] * width + cols[None, :]
    values = tl.load(ptr + offsets, mask=row_ok[:, None] & (cols < width)[None, :], other=0.0)
    return values.to(tl.float32)


@triton.jit
def _store_tokens(ptr, values, bh, chunk, seq_len, width, chunk_size, CT: tl.constexpr, WP: tl.constexpr, col_start):
    """The inverse of ``_load_tokens``: masked store, cast to the buffer's dtype."""
    rows = tl.arange(0, CT)
    cols = col_start + tl.arange(0, WP)
    tokens = chunk * chunk_size + rows
    row_ok = (rows < chunk_size) & (tokens < seq_len)
    offsets = bh * seq_len * width + tokens[:, None] * width + cols[None, :]
    tl.store(ptr + offsets, values.to(ptr.dtype.element_ty), mask=row_ok[:, None] & (cols < width)[None, :])


@triton.jit
def _load_beta(beta_ptr, bh, chunk, seq_len, chunk_size, CT: tl.constexpr):
    rows = tl.arange(0, CT)
    tokens = chunk * chunk_size + rows
    row_ok = (rows < chunk_size) & (tokens < seq_len)
    return tl.load(beta_ptr + bh * seq_len + tokens, mask=row_ok, other=0.0).to(tl.float32)


@triton.jit
def _state_tile(block, d_dot, d_value, FP: tl.constexpr, BV: tl.constexpr):
    """Value-column block ``block`` of one [F, Dv] state: ``(feats, vcols, offsets, mask)``, the
    padded row and column indices, their offsets in a contiguous [F, Dv] matrix and the mask."""
    feats = tl.arange(0, FP)
    vcols = block * BV + tl.arange(0, BV)
    offsets = feats[:, None] * d_value + vcols[None, :]
    mask = (feats < d_dot)[:, None] & (vcols < d_value)[None, :]
    return feats, vcols, offsets, mask


@triton.jit
def _load_state(ptr, bh, d_dot, d_value, offsets, mask, PRESENT: tl.constexpr, FP: tl.constexpr, BV: tl.constexpr):
    """A state block of a [B·H, F, Dv] input as fp32 [FP, BV] (zeros outside), or zeros when not ``PRESENT``."""
    if PRESENT:
        state = tl.load(ptr + bh * d_dot * d_value + offsets, mask=mask, other=0.0).to(tl.float32)
    else:
        state = tl.zeros([FP, BV], dtype=tl.float32)
    return state


@triton.jit
def _store_state(ptr, state, bh, d_dot, d_value, offsets, mask):
    """The inverse of ``_load_state``: masked store, cast to the buffer's dtype."""
    tl.store(ptr + bh * d_dot * d_value + offsets, state.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _chunk_state_offsets(bh, chunk, num_chunks, feats, vcols, FP: tl.constexpr, DVP: tl.constexpr):
    """Offsets of rows ``feats``, columns ``vcols`` of chunk ``chunk``'s entry in a padded
    [B·H, NC, FP, DVP] buffer of per-chunk states."""
    return (bh * num_chunks + chunk) * FP * DVP + feats[:, None] * DVP + vcols[None, :]


@triton.jit
def _ut_transform_kernel(
    k_ptr, v_ptr, beta_ptr,  # inputs [BH, T, F], [BH, T, Dv], [BH, T]
    t_ptr, w_ptr, u_ptr,  # outputs (fp32, padded) [BH, NC, CT, CT], [BH, NC·CT, FP], [BH, NC·CT, DVP]
    seq_len, d_dot, d_value, chunk_size,
    CT: tl.constexpr, FP: tl.constexpr, DVP: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
):
    """Stage 1, per (chunk, b·h): T = (I + tril(diag(β) K Kᵀ, −1))⁻¹, W = T (β⊙K), U = T (β⊙V)."""
    chunk = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    num_chunks = tl.num_programs(0)
    rows = tl.arange(0, CT)
    feats = tl.arange(0, FP)
    vcols = tl.arange(0, BV)
    tile = (bh * num_chunks + chunk) * CT  # first padded row of this chunk in W and U

    keys = _load_tokens(k_ptr, bh, chunk, seq_len, d_dot, chunk_size, CT, FP, 0)
    beta = _load_beta(beta_ptr, bh, chunk, seq_len, chunk_size, CT)
    keys_beta = keys * beta[:, None]
    gram = tl.dot(keys_beta, tl.trans(keys), input_precision=PRECISION)
    strictly_lower = tl.where(rows[:, None] > rows[None, :], gram, 0.0)
    inverse = _unit_lower_inverse(strictly_lower, CT)

    tl.store(t_ptr + tile * CT + rows[:, None] * CT + rows[None, :], inverse)
    w = tl.dot(inverse, keys_beta, input_precision=PRECISION)
    tl.store(w_ptr + (tile + rows)[:, None] * FP + feats[None, :], w)
    for block in range(0, DVP // BV):
        values = _load_tokens(v_ptr, bh, chunk, seq_len, d_value, chunk_size, CT, BV, block * BV)
        u = tl.dot(inverse, values * beta[:, None], input_precision=PRECISION)
        tl.store(u_ptr + (tile + rows)[:, None] * DVP + (block * BV + vcols)[None, :], u)


@triton.jit
def _forward_scan_kernel(
    q_ptr, k_ptr,  # inputs [BH, T, F]
    w_ptr, u_ptr,  # stage 1 (fp32, padded); u is overwritten with U'
    states_ptr,  # output (fp32, padded) [BH, NC, FP, DVP]: the state entering each chunk
    s0_ptr, y_ptr, s_final_ptr,  # [BH, F, Dv] (if HAS_S0), [BH, T, Dv], [BH, F, Dv] fp32
    seq_len, d_dot, d_value, chunk_size, num_chunks,
    HAS_S0: tl.constexpr, STORE_STATES: tl.constexpr,
    CT: tl.constexpr, FP: tl.constexpr, DVP: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
):
    """Stage 2, per (Dv block, b·h): the scan over chunks, S[:, block] carried in fp32:
    U' = U − W S,  O = Q S + tril(Q Kᵀ) U',  S ← S + Kᵀ U'. The incoming states are stored
    only when a backward will need them (STORE_STATES)."""
    block = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rows = tl.arange(0, CT)
    feats, vcols, state_offsets, state_mask = _state_tile(block, d_dot, d_value, FP, BV)
    state = _load_state(s0_ptr, bh, d_dot, d_value, state_offsets, state_mask, HAS_S0, FP, BV)
    causal = rows[:, None] >= rows[None, :]
    for chunk in range(0, num_chunks):
        tile = (bh * num_chunks + chunk) * CT
        if STORE_STATES:
            tl.store(states_ptr + _chunk_state_offsets(bh, chunk, num_chunks, feats, vcols, FP, DVP), state)
        queries = _load_tokens(q_ptr, bh, chunk, seq_len, d_dot, chunk_size, CT, FP, 0)
        keys = _load_tokens(k_ptr, bh, chunk, seq_len, d_dot, chunk_size, CT, FP, 0)
        w = tl.load(w_ptr + (tile + rows)[:, None] * FP + feats[None, :])
        u_offsets = (tile + rows)[:, None] * DVP + vcols[None, :]
        new_values = tl.load(u_ptr + u_offsets) - tl.dot(w, state, input_precision=PRECISION)
        scores = tl.where(causal, tl.dot(queries, tl.trans(keys), input_precision=PRECISION), 0.0)
        out = tl.dot(queries, state, input_precision=PRECISION) + tl.dot(scores, new_values, input_precision=PRECISION)
        _store_tokens(y_ptr, out, bh, chunk, seq_len, d_value, chunk_size, CT, BV, block * BV)
        tl.store(u_ptr + u_offsets, new_values)
        state += tl.dot(tl.trans(keys), new_values, input_precision=PRECISION)
    _store_state(s_final_ptr, state, bh, d_dot, d_value, state_offsets, state_mask)


@triton.jit
def _backward_scan_kernel(
    q_ptr, k_ptr, w_ptr, dy_ptr,  # inputs [BH, T, F] ×2, stage-1 W (fp32, padded), dy [BH, T, Dv]
    ds_final_ptr,  # [BH, F, Dv], the gradient on S_T (if HAS_DS_FINAL)
    dstates_ptr,  # output (fp32, padded) [BH, NC, FP, DVP]: gradient w.r.t. the state leaving each chunk
    ds0_ptr,  # output [BH, F, Dv]: gradient w.r.t. S_0 (if STORE_DS0)
    seq_len, d_dot, d_value, chunk_size, num_chunks,
    HAS_DS_FINAL: tl.constexpr, STORE_DS0: tl.constexpr,
    CT: tl.constexpr, FP: tl.constexpr, DVP: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
):
    """Per (Dv block, b·h), chunks in reverse: dU' = tril(Q Kᵀ)ᵀ dO + K dS',
    dS = dS' + Qᵀ dO − Wᵀ dU'."""
    block = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rows = tl.arange(0, CT)
    feats, vcols, state_offsets, state_mask = _state_tile(block, d_dot, d_value, FP, BV)
    dstate = _load_state(ds_final_ptr, bh, d_dot, d_value, state_offsets, state_mask, HAS_DS_FINAL, FP, BV)
    causal = rows[:, None] >= rows[None, :]
    for step in range(0, num_chunks):
        chunk = num_chunks - 1 - step
        tile = (bh * num_chunks + chunk) * CT
        tl.store(dstates_ptr + _chunk_state_offsets(bh, chunk, num_chunks, feats, vcols, FP, DVP), dstate)
        queries = _load_tokens(q_ptr, bh, chunk, seq_len, d_dot, chunk_size, CT, FP, 0)
        keys = _load_tokens(k_ptr, bh, chunk, seq_len, d_dot, chunk_size, CT, FP, 0)
        w = tl.load(w_ptr + (tile + rows)[:, None] * FP + feats[None, :])
        dout = _load_tokens(dy_ptr, bh, chunk, seq_len, d_value, chunk_size, CT, BV, block * BV)
        scores = tl.where(causal, tl.dot(queries, tl.trans(keys), input_precision=PRECISION), 0.0)
        dnew_values = tl.dot(tl.trans(scores), dout, input_precision=PRECISION) + tl.dot(keys, dstate, input_precision=PRECISION)
        dstate += tl.dot(tl.trans(queries), dout, input_precision=PRECISION) - tl.dot(tl.trans(w), dnew_values, input_precision=PRECISION)
    if STORE_DS0:
        _store_state(ds0_ptr, dstate, bh, d_dot, d_value, state_offsets, state_mask)


@triton.jit
def _backward_chunk_kernel(
    q_ptr, k_ptr, v_ptr, beta_ptr, dy_ptr,  # inputs
    t_ptr, u_ptr, states_ptr, dstates_ptr,  # saved (fp32, padded): T, U', incoming states, dS'
    dq_ptr, dk_ptr, dv_ptr, dbeta_ptr,  # outputs, input dtype
    seq_len, d_dot, d_value, chunk_size,
    CT: tl.constexpr, FP: tl.constexpr, DVP: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
):
    """Per (chunk, b·h): dq, dk, dv, dβ of the chunk (see the module docstring), summing
    the Dv-contracted products over Dv blocks:
      dQ = dO Sᵀ + tril(dO U'ᵀ) K
      dK = tril(dO U'ᵀ)ᵀ Q + U' dS'ᵀ − diag(β) dVb Sᵀ + diag(β) G K + Gᵀ diag(β) K
      dV = diag(β) dVb,  dβ = rowsum(dVb ⊙ (V − K S)) + rowsum(G ⊙ K Kᵀ)
    with dU' = tril(Q Kᵀ)ᵀ dO + K dS', dVb = Tᵀ dU', G = −tril(dVb U'ᵀ, −1)."""
    chunk = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    num_chunks = tl.num_programs(0)
    rows = tl.arange(0, CT)
    feats = tl.arange(0, FP)
    tile = (bh * num_chunks + chunk) * CT

    queries = _load_tokens(q_ptr, bh, chunk, seq_len, d_dot, chunk_size, CT, FP, 0)
    keys = _load_tokens(k_ptr, bh, chunk, seq_len, d_dot, chunk_size, CT, FP, 0)
    beta = _load_beta(beta_ptr, bh, chunk, seq_len, chunk_size, CT)
    inverse = tl.load(t_ptr + tile * CT + rows[:, None] * CT + rows[None, :])
    causal = rows[:, None] >= rows[None, :]
    scores = tl.where(causal, tl.dot(queries, tl.trans(keys), input_precision=PRECISION), 0.0)

    dq = tl.zeros([CT, FP], dtype=tl.float32)
    dk = tl.zeros([CT, FP], dtype=tl.float32)
    dscores = tl.zeros([CT, CT], dtype=tl.float32)  # dO U'ᵀ
    dvb_new_values = tl.zeros([CT, CT], dtype=tl.float32)  # dVb U'ᵀ
    dbeta = tl.zeros([CT], dtype=tl.float32)
    for block in range(0, DVP // BV):
        vcols = block * BV + tl.arange(0, BV)
        state_offsets = _chunk_state_offsets(bh, chunk, num_chunks, feats, vcols, FP, DVP)
        state = tl.load(states_ptr + state_offsets)
        dstate_next = tl.load(dstates_ptr + state_offsets)
        new_values = tl.load(u_ptr + (tile + rows)[:, None] * DVP + vcols[None, :])
        dout = _load_tokens(dy_ptr, bh, chunk, seq_len, d_value, chunk_size, CT, BV, block * BV)
        values = _load_tokens(v_ptr, bh, chunk, seq_len, d_value, chunk_size, CT, BV, block * BV)

        dnew_values = tl.dot(tl.trans(scores), dout, input_precision=PRECISION) + tl.dot(keys, dstate_next, input_precision=PRECISION)
        dvb = tl.dot(tl.trans(inverse), dnew_values, input_precision=PRECISION)
        _store_tokens(dv_ptr, dvb * beta[:, None], bh, chunk, seq_len, d_value, chunk_size, CT, BV, block * BV)

        dq += tl.dot(dout, tl.trans(state), input_precision=PRECISION)
        dk += tl.dot(new_values, tl.trans(dstate_next), input_precision=PRECISION)
        dk -= beta[:, None] * tl.dot(dvb, tl.trans(state), input_precision=PRECISION)
        dscores += tl.dot(dout, tl.trans(new_values), input_precision=PRECISION)
        dvb_new_values += tl.dot(dvb, tl.trans(new_values), input_precision=PRECISION)
        residual = values - tl.dot(keys, state, input_precision=PRECISION)  # V − K S
        dbeta += tl.sum(dvb * residual, axis=1)

    dscores = tl.where(causal, dscores, 0.0)
    grad_a = -tl.where(rows[:, None] > rows[None, :], dvb_new_values, 0.0)  # G = dA
    dq += tl.dot(dscores, keys, input_precision=PRECISION)
    dk += tl.dot(tl.trans(dscores), queries, input_precision=PRECISION)
    dk += beta[:, None] * tl.dot(grad_a, keys, input_precision=PRECISION)
    dk += tl.dot(tl.trans(grad_a), keys * beta[:, None], input_precision=PRECISION)
    gram = tl.dot(keys, tl.trans(keys), input_precision=PRECISION)
    dbeta += tl.sum(grad_a * gram, axis=1)

    _store_tokens(dq_ptr, dq, bh, chunk, seq_len, d_dot, chunk_size, CT, FP, 0)
    _store_tokens(dk_ptr, dk, bh, chunk, seq_len, d_dot, chunk_size, CT, FP, 0)
    tokens = chunk * chunk_size + rows
    row_ok = (rows < chunk_size) & (tokens < seq_len)
    tl.store(dbeta_ptr + bh * seq_len + tokens, dbeta.to(dbeta_ptr.dtype.element_ty), mask=row_ok)


# --------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def default_chunk_size(d_dot: int) -> int:
    """64 for d_dot ≤ 64, 32 for d_dot ≤ 128, 16 above (keeps the [C, d_dot] tiles small)."""
    padded = max(16, triton.next_power_of_2(d_dot))
    return 64 if padded <= 64 else 32 if padded <= 128 else 16


class _Config:
    """Tile sizes and launch parameters for one call."""

    def __init__(self, batch, heads, seq_len, d_dot, d_value, chunk_size, dtype):
        self.batch, self.heads, self.seq_len = batch, heads, seq_len
        self.d_dot, self.d_value = d_dot, d_value
        self.bh = batch * heads
        self.chunk_size = chunk_size
        self.num_chunks = triton.cdiv(seq_len, chunk_size)
        self.CT = max(16, triton.next_power_of_2(chunk_size))
        self.FP = max(16, triton.next_power_of_2(d_dot))
        self.DVP = max(16, triton.next_power_of_2(d_value))
        self.BV = min(self.DVP, 64 if self.FP <= 64 else 32)
        self.num_value_blocks = self.DVP // self.BV
        self.precision = "ieee" if dtype in (torch.float32, torch.float64) else "tf32"
        self.num_warps = 4 if self.CT * self.FP <= 2048 else 8

    def tiles(self):
        return dict(CT=self.CT, FP=self.FP, DVP=self.DVP, BV=self.BV, PRECISION=self.precision)

    def launch(self):
        return dict(num_warps=self.num_warps, num_stages=1)


def _forward(q, k, v, beta, weights, cfg: _Config, for_backward: bool):
    bh, nc, CT, FP, DVP = cfg.bh, cfg.num_chunks, cfg.CT, cfg.FP, cfg.DVP
    inverse = _new_output((bh, nc, CT, CT), q, torch.float32)
    w = _new_output((bh, nc * CT, FP), q, torch.float32)
    new_values = _new_output((bh, nc * CT, DVP), q, torch.float32)  # U, then U'
    states = _new_output((bh, nc, FP, DVP), q, torch.float32) if for_backward else None
    y = _new_output((cfg.batch, cfg.heads, cfg.seq_len, cfg.d_value), v)
    s_final = _new_output((cfg.batch, cfg.heads, cfg.d_dot, cfg.d_value), q, torch.float32)
    sizes = (cfg.seq_len, cfg.d_dot, cfg.d_value, cfg.chunk_size)
    _ut_transform_kernel[(nc, bh)](k, v, beta, inverse, w, new_values, *sizes, **cfg.tiles(), **cfg.launch())
    _forward_scan_kernel[(cfg.num_value_blocks, bh)](
        q, k, w, new_values, states if states is not None else w, weights if weights is not None else s_final, y, s_final,
        *sizes, nc, HAS_S0=weights is not None, STORE_STATES=states is not None, **cfg.tiles(), **cfg.launch(),
    )
    return y, s_final, (inverse, w, new_values, states)


def _backward(q, k, v, beta, weights, saved, dy, ds_final, cfg: _Config):
    inverse, w, new_values, states = saved
    bh, nc = cfg.bh, cfg.num_chunks
    dstates = _new_output((bh, nc, cfg.FP, cfg.DVP), q, torch.float32)
    dweights = _new_output(weights.shape, weights) if weights is not None else None
    sizes = (cfg.seq_len, cfg.d_dot, cfg.d_value, cfg.chunk_size)
    _backward_scan_kernel[(cfg.num_value_blocks, bh)](
        q, k, w, dy, ds_final if ds_final is not None else dstates, dstates, dweights if dweights is not None else dstates,
        *sizes, nc, HAS_DS_FINAL=ds_final is not None, STORE_DS0=dweights is not None, **cfg.tiles(), **cfg.launch(),
    )
    dq, dk, dv, dbeta = _new_output(q.shape, q), _new_output(k.shape, k), _new_output(v.shape, v), _new_output(beta.shape, beta)
    _backward_chunk_kernel[(nc, bh)](
        q, k, v, beta, dy, inverse, new_values, states, dstates, dq, dk, dv, dbeta, *sizes, **cfg.tiles(), **cfg.launch()
    )
    return dq, dk, dv, dbeta, dweights


def _on_device(tensor):
    """Launch on the tensor's GPU (not the current one); nothing to do on the CPU."""
    return torch.cuda.device(tensor.device) if tensor.device.type == "cuda" else contextlib.nullcontext()


class _DeltaRuleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, beta, weights, chunk_size):
        q, k, v, beta = (t.contiguous() for t in (q, k, v, beta))
        weights = weights.contiguous() if weights is not None else None
        batch, heads, seq_len, d_dot = q.shape
        cfg = _Config(batch, heads, seq_len, d_dot, v.shape[-1], chunk_size, q.dtype)
        for_backward = any(ctx.needs_input_grad[:5])
        with _on_device(q):
            y, s_final, saved = _forward(q, k, v, beta, weights, cfg, for_backward)
        if not for_backward:
            return y, s_final
        ctx.cfg = cfg
        ctx.has_weights = weights is not None
        ctx.save_for_backward(q, k, v, beta, weights, *saved)
        ctx.set_materialize_grads(False)
        return y, s_final

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy, ds_final):
        q, k, v, beta, weights, *saved = ctx.saved_tensors
        cfg: _Config = ctx.cfg
        if dy is None:
            dy = torch.zeros(cfg.batch, cfg.heads, cfg.seq_len, cfg.d_value, dtype=v.dtype, device=v.device)
        dy = dy.contiguous()
        ds_final = ds_final.contiguous() if ds_final is not None else None
        with _on_device(q):
            dq, dk, dv, dbeta, dweights = _backward(q, k, v, beta, weights if ctx.has_weights else None, saved, dy, ds_final, cfg)
        return dq, dk, dv, dbeta, dweights, None


def _check(q, k, v, beta, weights, chunk_size) -> int:
    """Validate the arguments; return the chunk size to use."""
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4:
            raise ValueError(f"delta_rule_triton: {name} must be a 4-d tensor [B, H, T, D], got {getattr(tensor, 'shape', type(tensor))}")
    batch, heads, seq_len, d_dot = q.shape
    d_value = v.shape[-1]
    if k.shape != q.shape:
        raise ValueError(f"delta_rule_triton: k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(f"delta_rule_triton: v must be [B, H, T, Dv] = [{batch}, {heads}, {seq_len}, Dv], got {tuple(v.shape)}")
    if not isinstance(beta, torch.Tensor) or beta.shape != q.shape[:3]:
        raise ValueError(f"delta_rule_triton: beta must be [B, H, T] = {tuple(q.shape[:3])}, got {tuple(getattr(beta, 'shape', ()))}")
    if weights is not None and weights.shape != (batch, heads, d_dot, d_value):
        raise ValueError(f"delta_rule_triton: weights must be [B, H, d_dot, d_value] = {(batch, heads, d_dot, d_value)}, got {tuple(weights.shape)}")
    if seq_len == 0:
        raise ValueError("delta_rule_triton: the sequence is empty (T = 0); give at least one token")
    too_big = [f"{name}={size}" for name, size in (("d_dot", d_dot), ("d_value", d_value)) if size > MAX_HEAD_DIM]
    if too_big:
        raise UnsupportedBackend(f"delta_rule_triton supports d_dot and d_value up to {MAX_HEAD_DIM}, got {', '.join(too_big)}: use backend='torch'")
    tensors = [q, k, v, beta] + ([weights] if weights is not None else [])
    if any(t.dtype != q.dtype for t in (k, v, beta)):
        raise ValueError(f"delta_rule_triton: q, k, v and beta must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}, {beta.dtype}")
    if not q.dtype.is_floating_point or (weights is not None and not weights.dtype.is_floating_point):
        raise ValueError(f"delta_rule_triton: floating point inputs expected, got {q.dtype}")
    if any(t.device != q.device for t in tensors):
        raise ValueError("delta_rule_triton: every tensor must be on one device")
    if q.device.type != "cuda" and not _interpreting():
        raise ValueError(
            f"delta_rule_triton: tensors on {q.device.type!r} need Triton's interpreter (TRITON_INTERPRET=1 set before "
            "triton is imported); on a GPU give CUDA tensors"
        )
    if chunk_size is None:
        return default_chunk_size(d_dot)
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or not 1 <= chunk_size <= MAX_CHUNK_SIZE:
        raise ValueError(f"delta_rule_triton: chunk_size must be an int in [1, {MAX_CHUNK_SIZE}], got {chunk_size!r}")
    return chunk_size


def delta_rule_triton(q, k, v, beta, weights=None, *, chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal delta rule, chunked, in Triton: ``(y, S_T)``.

    ``q, k: [B, H, T, F]`` (already feature-mapped; F = d_dot ≤ 256), ``v: [B, H, T, Dv]``
    (Dv ≤ 256), ``beta: [B, H, T]``, ``weights``: the initial state S_0 ``[B, H, F, Dv]`` or
    None (zeros). Returns ``y [B, H, T, Dv]`` in the input dtype and ``S_T [B, H, F, Dv]``
    in float32. S_t = S_{t-1} + β_t k_t (v_t − S_{t-1}ᵀ k_t)ᵀ, y_t = S_tᵀ q_t.
    Differentiable w.r.t. q, k, v, beta and weights; a gradient on S_T is accepted.
    ``chunk_size``: default 64 / 32 / 16 for d_dot ≤ 64 / ≤ 128 / above; any int in [1, 128].
    """
    chunk_size = _check(q, k, v, beta, weights, chunk_size)
    return _DeltaRuleFunction.apply(q, k, v, beta, weights, chunk_size)

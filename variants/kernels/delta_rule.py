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
``tests/test_kernels/test_kernel_delta_rule.py``.

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
bf16 inputs TF32 dot products with fp32 accumulation (IEEE fp32 on sm_70, which has no TF32:
``_common.dot_precision``); the state is always fp32.
Memory saved for the backward: T [C×C per chunk], W [T×F], U' [T×Dv] and one F×Dv state
per chunk, all fp32 (the per-chunk states are not stored when no input needs a gradient).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..base import VariantError
from . import _common
from ._common import chunk_rows, launch, load_or_zeros, load_tokens, new_output, state_tile, store_tokens

#: Largest chunk size (C×C tiles and [C, d_dot] tiles live in registers).
MAX_CHUNK_SIZE = 128


# --------------------------------------------------------------------------------------
# Kernels
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
def _load_beta(beta_ptr, bh, chunk, seq_len, chunk_size, BLOCK_C: tl.constexpr):
    """β of chunk ``chunk`` as float32 [BLOCK_C], zeros outside."""
    tokens, row_ok = chunk_rows(chunk, seq_len, chunk_size, BLOCK_C)
    return tl.load(beta_ptr + bh * seq_len + tokens, mask=row_ok, other=0.0).to(tl.float32)


@triton.jit
def _chunk_state_offsets(bh, chunk, num_chunks, feats, vcols, BLOCK_F: tl.constexpr, PAD_V: tl.constexpr):
    """Offsets of rows ``feats``, columns ``vcols`` of chunk ``chunk``'s entry in a padded
    [B·H, NC, BLOCK_F, PAD_V] buffer of per-chunk states."""
    return (bh * num_chunks + chunk) * BLOCK_F * PAD_V + feats[:, None] * PAD_V + vcols[None, :]


@triton.jit
def _ut_transform_kernel(
    k_ptr, v_ptr, beta_ptr,  # inputs [BH, T, F], [BH, T, Dv], [BH, T]
    t_ptr, w_ptr, u_ptr,  # outputs (fp32, padded) [BH, NC, BLOCK_C, BLOCK_C], [BH, NC·BLOCK_C, BLOCK_F], [BH, NC·BLOCK_C, PAD_V]
    seq_len, d_dot, d_value, chunk_size, num_chunks,
    BLOCK_C: tl.constexpr, BLOCK_F: tl.constexpr, PAD_V: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr,
):
    """Stage 1, per (chunk, b·h): T = (I + tril(diag(β) K Kᵀ, −1))⁻¹, W = T (β⊙K), U = T (β⊙V)."""
    chunk = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rows = tl.arange(0, BLOCK_C)
    feats = tl.arange(0, BLOCK_F)
    vcols = tl.arange(0, BLOCK_V)
    tile = (bh * num_chunks + chunk) * BLOCK_C  # first padded row of this chunk in W and U

    keys = load_tokens(k_ptr, bh, chunk, seq_len, d_dot, chunk_size, 0, BLOCK_C, BLOCK_F)
    beta = _load_beta(beta_ptr, bh, chunk, seq_len, chunk_size, BLOCK_C)
    keys_beta = keys * beta[:, None]
    gram = tl.dot(keys_beta, tl.trans(keys), input_precision=PRECISION)
    strictly_lower = tl.where(rows[:, None] > rows[None, :], gram, 0.0)
    inverse = _unit_lower_inverse(strictly_lower, BLOCK_C)

    tl.store(t_ptr + tile * BLOCK_C + rows[:, None] * BLOCK_C + rows[None, :], inverse)
    w = tl.dot(inverse, keys_beta, input_precision=PRECISION)
    tl.store(w_ptr + (tile + rows)[:, None] * BLOCK_F + feats[None, :], w)
    for block in range(0, PAD_V // BLOCK_V):
        values = load_tokens(v_ptr, bh, chunk, seq_len, d_value, chunk_size, block * BLOCK_V, BLOCK_C, BLOCK_V)
        u = tl.dot(inverse, values * beta[:, None], input_precision=PRECISION)
        tl.store(u_ptr + (tile + rows)[:, None] * PAD_V + (block * BLOCK_V + vcols)[None, :], u)


@triton.jit
def _forward_scan_kernel(
    q_ptr, k_ptr,  # inputs [BH, T, F]
    w_ptr, u_ptr,  # stage 1 (fp32, padded); u is overwritten with U'
    states_ptr,  # output (fp32, padded) [BH, NC, BLOCK_F, PAD_V]: the state entering each chunk
    s0_ptr, y_ptr, s_final_ptr,  # [BH, F, Dv] (if HAS_S0), [BH, T, Dv], [BH, F, Dv] fp32
    seq_len, d_dot, d_value, chunk_size, num_chunks,
    HAS_S0: tl.constexpr, STORE_STATES: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_F: tl.constexpr, PAD_V: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr,
):
    """Stage 2, per (Dv block, b·h): the scan over chunks, S[:, block] carried in fp32:
    U' = U − W S,  O = Q S + tril(Q Kᵀ) U',  S ← S + Kᵀ U'. The incoming states are stored
    only when a backward will need them (STORE_STATES)."""
    block = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rows = tl.arange(0, BLOCK_C)
    feats = tl.arange(0, BLOCK_F)
    vcols = block * BLOCK_V + tl.arange(0, BLOCK_V)
    state_offsets, state_mask = state_tile(bh, feats, vcols, d_dot, d_value)
    state = load_or_zeros(s0_ptr, state_offsets, state_mask, HAS_S0)
    causal = rows[:, None] >= rows[None, :]
    for chunk in range(0, num_chunks):
        tile = (bh * num_chunks + chunk) * BLOCK_C
        if STORE_STATES:
            tl.store(states_ptr + _chunk_state_offsets(bh, chunk, num_chunks, feats, vcols, BLOCK_F, PAD_V), state)
        queries = load_tokens(q_ptr, bh, chunk, seq_len, d_dot, chunk_size, 0, BLOCK_C, BLOCK_F)
        keys = load_tokens(k_ptr, bh, chunk, seq_len, d_dot, chunk_size, 0, BLOCK_C, BLOCK_F)
        w = tl.load(w_ptr + (tile + rows)[:, None] * BLOCK_F + feats[None, :])
        u_offsets = (tile + rows)[:, None] * PAD_V + vcols[None, :]
        new_values = tl.load(u_ptr + u_offsets) - tl.dot(w, state, input_precision=PRECISION)
        scores = tl.where(causal, tl.dot(queries, tl.trans(keys), input_precision=PRECISION), 0.0)
        out = tl.dot(queries, state, input_precision=PRECISION) + tl.dot(scores, new_values, input_precision=PRECISION)
        store_tokens(y_ptr, out, bh, chunk, seq_len, d_value, chunk_size, block * BLOCK_V, BLOCK_C, BLOCK_V)
        tl.store(u_ptr + u_offsets, new_values)
        state += tl.dot(tl.trans(keys), new_values, input_precision=PRECISION)
    tl.store(s_final_ptr + state_offsets, state, mask=state_mask)


@triton.jit
def _backward_scan_kernel(
    q_ptr, k_ptr, w_ptr, dy_ptr,  # inputs [BH, T, F] ×2, stage-1 W (fp32, padded), dy [BH, T, Dv]
    ds_final_ptr,  # [BH, F, Dv], the gradient on S_T (if HAS_DS_FINAL)
    dstates_ptr,  # output (fp32, padded) [BH, NC, BLOCK_F, PAD_V]: gradient w.r.t. the state leaving each chunk
    ds0_ptr,  # output [BH, F, Dv]: gradient w.r.t. S_0 (if STORE_DS0)
    seq_len, d_dot, d_value, chunk_size, num_chunks,
    HAS_DS_FINAL: tl.constexpr, STORE_DS0: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_F: tl.constexpr, PAD_V: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr,
):
    """Per (Dv block, b·h), chunks in reverse: dU' = tril(Q Kᵀ)ᵀ dO + K dS',
    dS = dS' + Qᵀ dO − Wᵀ dU'."""
    block = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rows = tl.arange(0, BLOCK_C)
    feats = tl.arange(0, BLOCK_F)
    vcols = block * BLOCK_V + tl.arange(0, BLOCK_V)
    state_offsets, state_mask = state_tile(bh, feats, vcols, d_dot, d_value)
    dstate = load_or_zeros(ds_final_ptr, state_offsets, state_mask, HAS_DS_FINAL)
    causal = rows[:, None] >= rows[None, :]
    for step in range(0, num_chunks):
        chunk = num_chunks - 1 - step
        tile = (bh * num_chunks + chunk) * BLOCK_C
        tl.store(dstates_ptr + _chunk_state_offsets(bh, chunk, num_chunks, feats, vcols, BLOCK_F, PAD_V), dstate)
        queries = load_tokens(q_ptr, bh, chunk, seq_len, d_dot, chunk_size, 0, BLOCK_C, BLOCK_F)
        keys = load_tokens(k_ptr, bh, chunk, seq_len, d_dot, chunk_size, 0, BLOCK_C, BLOCK_F)
        w = tl.load(w_ptr + (tile + rows)[:, None] * BLOCK_F + feats[None, :])
        dout = load_tokens(dy_ptr, bh, chunk, seq_len, d_value, chunk_size, block * BLOCK_V, BLOCK_C, BLOCK_V)
        scores = tl.where(causal, tl.dot(queries, tl.trans(keys), input_precision=PRECISION), 0.0)
        dnew_values = tl.dot(tl.trans(scores), dout, input_precision=PRECISION) + tl.dot(keys, dstate, input_precision=PRECISION)
        dstate += tl.dot(tl.trans(queries), dout, input_precision=PRECISION) - tl.dot(tl.trans(w), dnew_values, input_precision=PRECISION)
    if STORE_DS0:
        tl.store(ds0_ptr + state_offsets, dstate.to(ds0_ptr.dtype.element_ty), mask=state_mask)


@triton.jit
def _backward_chunk_kernel(
    q_ptr, k_ptr, v_ptr, beta_ptr, dy_ptr,  # inputs
    t_ptr, u_ptr, states_ptr, dstates_ptr,  # saved (fp32, padded): T, U', incoming states, dS'
    dq_ptr, dk_ptr, dv_ptr, dbeta_ptr,  # outputs, input dtype
    seq_len, d_dot, d_value, chunk_size, num_chunks,
    BLOCK_C: tl.constexpr, BLOCK_F: tl.constexpr, PAD_V: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr,
):
    """Per (chunk, b·h): dq, dk, dv, dβ of the chunk (see the module docstring), summing
    the Dv-contracted products over Dv blocks:
      dQ = dO Sᵀ + tril(dO U'ᵀ) K
      dK = tril(dO U'ᵀ)ᵀ Q + U' dS'ᵀ − diag(β) dVb Sᵀ + diag(β) G K + Gᵀ diag(β) K
      dV = diag(β) dVb,  dβ = rowsum(dVb ⊙ (V − K S)) + rowsum(G ⊙ K Kᵀ)
    with dU' = tril(Q Kᵀ)ᵀ dO + K dS', dVb = Tᵀ dU', G = −tril(dVb U'ᵀ, −1)."""
    chunk = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rows = tl.arange(0, BLOCK_C)
    feats = tl.arange(0, BLOCK_F)
    tile = (bh * num_chunks + chunk) * BLOCK_C

    queries = load_tokens(q_ptr, bh, chunk, seq_len, d_dot, chunk_size, 0, BLOCK_C, BLOCK_F)
    keys = load_tokens(k_ptr, bh, chunk, seq_len, d_dot, chunk_size, 0, BLOCK_C, BLOCK_F)
    beta = _load_beta(beta_ptr, bh, chunk, seq_len, chunk_size, BLOCK_C)
    inverse = tl.load(t_ptr + tile * BLOCK_C + rows[:, None] * BLOCK_C + rows[None, :])
    causal = rows[:, None] >= rows[None, :]
    scores = tl.where(causal, tl.dot(queries, tl.trans(keys), input_precision=PRECISION), 0.0)

    dq = tl.zeros([BLOCK_C, BLOCK_F], dtype=tl.float32)
    dk = tl.zeros([BLOCK_C, BLOCK_F], dtype=tl.float32)
    dscores = tl.zeros([BLOCK_C, BLOCK_C], dtype=tl.float32)  # dO U'ᵀ
    dvb_new_values = tl.zeros([BLOCK_C, BLOCK_C], dtype=tl.float32)  # dVb U'ᵀ
    dbeta = tl.zeros([BLOCK_C], dtype=tl.float32)
    for block in range(0, PAD_V // BLOCK_V):
        vcols = block * BLOCK_V + tl.arange(0, BLOCK_V)
        state_offsets = _chunk_state_offsets(bh, chunk, num_chunks, feats, vcols, BLOCK_F, PAD_V)
        state = tl.load(states_ptr + state_offsets)
        dstate_next = tl.load(dstates_ptr + state_offsets)
        new_values = tl.load(u_ptr + (tile + rows)[:, None] * PAD_V + vcols[None, :])
        dout = load_tokens(dy_ptr, bh, chunk, seq_len, d_value, chunk_size, block * BLOCK_V, BLOCK_C, BLOCK_V)
        values = load_tokens(v_ptr, bh, chunk, seq_len, d_value, chunk_size, block * BLOCK_V, BLOCK_C, BLOCK_V)

        dnew_values = tl.dot(tl.trans(scores), dout, input_precision=PRECISION) + tl.dot(keys, dstate_next, input_precision=PRECISION)
        dvb = tl.dot(tl.trans(inverse), dnew_values, input_precision=PRECISION)
        store_tokens(dv_ptr, dvb * beta[:, None], bh, chunk, seq_len, d_value, chunk_size, block * BLOCK_V, BLOCK_C, BLOCK_V)

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

    store_tokens(dq_ptr, dq, bh, chunk, seq_len, d_dot, chunk_size, 0, BLOCK_C, BLOCK_F)
    store_tokens(dk_ptr, dk, bh, chunk, seq_len, d_dot, chunk_size, 0, BLOCK_C, BLOCK_F)
    tokens, row_ok = chunk_rows(chunk, seq_len, chunk_size, BLOCK_C)
    tl.store(dbeta_ptr + bh * seq_len + tokens, dbeta.to(dbeta_ptr.dtype.element_ty), mask=row_ok)


# --------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------


def default_chunk_size(d_dot: int) -> int:
    """64 for d_dot ≤ 64, 32 for d_dot ≤ 128, 16 above (keeps the [C, d_dot] tiles small)."""
    padded = _common.pad(d_dot)
    return 64 if padded <= 64 else 32 if padded <= 128 else 16


class _Tiles(_common.Tiles):
    """Every kernel holds all d_dot rows (``block_f`` = d_dot padded); the scans split d_value into
    blocks of ``block_v`` columns, one program each."""

    def __init__(self, batch, heads, seq_len, d_dot, d_value, chunk_size, dtype, device):
        super().__init__(batch, heads, seq_len, d_dot, d_value, chunk_size, dtype, device)
        self.block_f = self.pad_f
        self.block_v = min(self.pad_v, 64 if self.pad_f <= 64 else 32)
        self.num_value_blocks = self.pad_v // self.block_v
        self.num_warps = 4 if self.block_c * self.pad_f <= 2048 else 8
        self.num_stages = 1

    def constexprs(self):
        return dict(BLOCK_C=self.block_c, BLOCK_F=self.block_f, PAD_V=self.pad_v, BLOCK_V=self.block_v, PRECISION=self.precision)


def _forward(q, k, v, beta, weights, tiles: _Tiles, for_backward: bool):
    bh, nc = tiles.bh, tiles.num_chunks
    inverse = new_output((bh, nc, tiles.block_c, tiles.block_c), q, torch.float32)
    w = new_output((bh, nc * tiles.block_c, tiles.block_f), q, torch.float32)
    new_values = new_output((bh, nc * tiles.block_c, tiles.pad_v), q, torch.float32)  # U, then U'
    states = new_output((bh, nc, tiles.block_f, tiles.pad_v), q, torch.float32) if for_backward else None
    y = new_output((tiles.batch, tiles.heads, tiles.seq_len, tiles.d_value), v)
    s_final = new_output((tiles.batch, tiles.heads, tiles.d_dot, tiles.d_value), q, torch.float32)
    launch(_ut_transform_kernel, (nc, bh), k, v, beta, inverse, w, new_values, *tiles.sizes(), **tiles.constexprs(), options=tiles.options())
    launch(
        _forward_scan_kernel, (tiles.num_value_blocks, bh),
        q, k, w, new_values, states if states is not None else w, weights if weights is not None else s_final, y, s_final, *tiles.sizes(),
        HAS_S0=weights is not None, STORE_STATES=states is not None, **tiles.constexprs(), options=tiles.options(),
    )  # fmt: skip
    return y, s_final, (inverse, w, new_values, states)


def _backward(q, k, v, beta, weights, saved, dy, ds_final, tiles: _Tiles):
    inverse, w, new_values, states = saved
    bh, nc = tiles.bh, tiles.num_chunks
    dstates = new_output((bh, nc, tiles.block_f, tiles.pad_v), q, torch.float32)
    dweights = new_output(weights.shape, weights) if weights is not None else None
    launch(
        _backward_scan_kernel, (tiles.num_value_blocks, bh),
        q, k, w, dy, ds_final if ds_final is not None else dstates, dstates, dweights if dweights is not None else dstates, *tiles.sizes(),
        HAS_DS_FINAL=ds_final is not None, STORE_DS0=dweights is not None, **tiles.constexprs(), options=tiles.options(),
    )  # fmt: skip
    dq, dk, dv, dbeta = new_output(q.shape, q), new_output(k.shape, k), new_output(v.shape, v), new_output(beta.shape, beta)
    launch(
        _backward_chunk_kernel, (nc, bh),
        q, k, v, beta, dy, inverse, new_values, states, dstates, dq, dk, dv, dbeta, *tiles.sizes(), **tiles.constexprs(), options=tiles.options(),
    )  # fmt: skip
    return dq, dk, dv, dbeta, dweights


class _DeltaRuleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, beta, weights, chunk_size):
        q, k, v, beta = (t.contiguous() for t in (q, k, v, beta))
        weights = weights.contiguous() if weights is not None else None
        batch, heads, seq_len, d_dot = q.shape
        tiles = _Tiles(batch, heads, seq_len, d_dot, v.shape[-1], chunk_size, q.dtype, q.device)
        for_backward = any(ctx.needs_input_grad[:5])
        y, s_final, saved = _forward(q, k, v, beta, weights, tiles, for_backward)
        if not for_backward:
            return y, s_final
        ctx.tiles = tiles
        ctx.has_weights = weights is not None
        ctx.save_for_backward(q, k, v, beta, weights, *saved)
        ctx.set_materialize_grads(False)
        return y, s_final

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy, ds_final):
        q, k, v, beta, weights, *saved = ctx.saved_tensors
        tiles: _Tiles = ctx.tiles
        if dy is None:
            dy = torch.zeros(tiles.batch, tiles.heads, tiles.seq_len, tiles.d_value, dtype=v.dtype, device=v.device)
        dy = dy.contiguous()
        ds_final = ds_final.contiguous() if ds_final is not None else None
        dq, dk, dv, dbeta, dweights = _backward(q, k, v, beta, weights if ctx.has_weights else None, saved, dy, ds_final, tiles)
        return dq, dk, dv, dbeta, dweights, None


def _check(q, k, v, beta, weights, chunk_size) -> int:
    """Validate the arguments; return the chunk size to use."""
    name = "delta_rule_triton"
    _common.check_inputs(name, _ut_transform_kernel, q, k, v, beta, weights)
    batch, heads, seq_len, d_dot = q.shape
    d_value = v.shape[-1]
    if not isinstance(beta, torch.Tensor) or beta.shape != q.shape[:3] or beta.dtype != q.dtype:
        raise VariantError(
            f"{name}: beta must be [B, H, T] = {tuple(q.shape[:3])} in q's dtype {q.dtype}, "
            f"got {tuple(getattr(beta, 'shape', ()))} {getattr(beta, 'dtype', type(beta))}"
        )
    if weights is not None and (weights.shape != (batch, heads, d_dot, d_value) or not weights.dtype.is_floating_point):
        expected = (batch, heads, d_dot, d_value)
        raise VariantError(f"{name}: weights must be floating point [B, H, d_dot, d_value] = {expected}, got {tuple(weights.shape)} {weights.dtype}")
    if seq_len == 0:
        raise VariantError(f"{name}: the sequence is empty (T = 0); give at least one token")
    if chunk_size is None:
        return default_chunk_size(d_dot)
    _common.check_chunk_size(name, chunk_size, MAX_CHUNK_SIZE)
    return chunk_size


def delta_rule_triton(q, k, v, beta, weights=None, *, chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal delta rule, chunked, in Triton: ``(y, S_T)``.

    ``q, k: [B, H, T, F]`` (already feature-mapped; F = d_dot ≤ 256), ``v: [B, H, T, Dv]``
    (Dv ≤ 256), ``beta: [B, H, T]`` (one dtype for the four: float32, float16 or bfloat16),
    ``weights``: the initial state S_0 ``[B, H, F, Dv]`` or None (zeros). Returns
    ``y [B, H, T, Dv]`` in the input dtype and ``S_T [B, H, F, Dv]`` in float32.
    S_t = S_{t-1} + β_t k_t (v_t − S_{t-1}ᵀ k_t)ᵀ, y_t = S_tᵀ q_t.
    Differentiable w.r.t. q, k, v, beta and weights; a gradient on S_T is accepted.
    ``chunk_size``: default 64 / 32 / 16 for d_dot ≤ 64 / ≤ 128 / above; any int in [1, 128].
    """
    chunk_size = _check(q, k, v, beta, weights, chunk_size)
    return _DeltaRuleFunction.apply(q, k, v, beta, weights, chunk_size)


# --------------------------------------------------------------------------------------
# What `attnbench kernels` compiles.
# --------------------------------------------------------------------------------------


def compile_configs() -> list[dict]:
    """Every shipped configuration: each dtype and shape of ``_common.shipped_shapes``."""
    return [dict(dtype=dtype, d_dot=d_dot, d_value=d_value, chunk_size=chunk) for dtype, d_dot, d_value, chunk in _common.shipped_shapes()]


def config_label(config: dict) -> str:
    chunk = config["chunk_size"] or default_chunk_size(config["d_dot"])
    return f"{_common.DTYPE_NAMES[config['dtype']]} F{config['d_dot']} Dv{config['d_value']} C{chunk}"


def record_launches(config: dict, capability: int) -> list[_common.Launch]:
    """The kernels a training step (forward, backward into q, k, v, β) of ``config`` launches at
    the reference shape on a GPU of compute capability ``capability`` (×10)."""
    shape = (_common.REFERENCE_BATCH, _common.REFERENCE_HEADS, _common.REFERENCE_SEQ_LEN)
    dtype = config["dtype"]
    q, k = (_common.meta_tensor(*shape, config["d_dot"], dtype=dtype) for _ in range(2))
    v = _common.meta_tensor(*shape, config["d_value"], dtype=dtype)
    beta = _common.meta_tensor(*shape, dtype=dtype)
    return _common.record_training_step(delta_rule_triton, capability, [q, k, v, beta], chunk_size=config["chunk_size"])

"""The sum rule's backward Triton kernels: dq, dk and dv of each chunk. The maths and the launches: ``kernels.sum_rule``."""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import chunk_rows, chunk_span, dot, token_tile
from .sum_rule_forward import _load_tokens, _norm_tile, _state_tile, _token_values


@triton.jit
def _backward_dqk_kernel(
    q_ptr, k_ptr, v_ptr, dy_ptr, rinv_ptr, delta_ptr, states_ptr, norms_ptr, dstates_ptr, dnorms_ptr,  # inputs
    dq_ptr, dk_ptr,  # outputs
    chunk_table_ptr,  # [num_chunks, 2] with VARLEN
    seq_len, d_dot, d_value, chunk_size, num_chunks,
    NORMALIZE: tl.constexpr, VARLEN: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Program (chunk c, bh, i): dq, dk [:, block i of F] = P K + G S_cᵀ + dden z_cᵀ and Pᵀ Q + V dS_cᵀ + 1 dz_cᵀ,
    summed over Dv in blocks of BLOCK_V. G = diag(r) dY enters as r (dY Vᵀ − δ 1ᵀ) = P (before tril) and
    r (dY S_cᵀ − δ z_cᵀ), so dY reaches the dots as it is (16-bit: not rounded again) and the near-cancelling
    differences are taken in float32."""
    chunk = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    offs_f = tl.program_id(2) * BLOCK_F + tl.arange(0, BLOCK_F)
    start, stop = chunk_span(chunk, seq_len, chunk_size, chunk_table_ptr, VARLEN)
    rows, row_ok = chunk_rows(start, stop, chunk_size, BLOCK_C)
    input_type = q_ptr.dtype.element_ty

    p = tl.zeros((BLOCK_C, BLOCK_C), dtype=tl.float32)
    dq = tl.zeros((BLOCK_C, BLOCK_F), dtype=tl.float32)
    dk = tl.zeros((BLOCK_C, BLOCK_F), dtype=tl.float32)
    for v_start in range(0, d_value, BLOCK_V):
        offs_v = v_start + tl.arange(0, BLOCK_V)
        dy = _load_tokens(dy_ptr, bh, seq_len, rows, row_ok, offs_v, d_value)
        v = _load_tokens(v_ptr, bh, seq_len, rows, row_ok, offs_v, d_value)
        p += dot(dy, tl.trans(v), PRECISION, input_type)
        state = _state_tile(states_ptr, bh, chunk, num_chunks, offs_f, offs_v, d_dot, d_value)
        dstate = _state_tile(dstates_ptr, bh, chunk, num_chunks, offs_f, offs_v, d_dot, d_value)
        dq += dot(dy, tl.trans(state), PRECISION, input_type)
        dk += dot(v, tl.trans(dstate), PRECISION, input_type)
    if NORMALIZE:
        rinv = _token_values(rinv_ptr, bh, seq_len, rows, row_ok)
        delta = _token_values(delta_ptr, bh, seq_len, rows, row_ok)
        p = (p - delta[:, None]) * rinv[:, None]
        norm = _norm_tile(norms_ptr, bh, chunk, num_chunks, offs_f, d_dot)
        dq = (dq - delta[:, None] * norm[None, :]) * rinv[:, None]
        dk += _norm_tile(dnorms_ptr, bh, chunk, num_chunks, offs_f, d_dot)[None, :]
    p = tl.where(rows[:, None] >= rows[None, :], p, 0.0)
    q = _load_tokens(q_ptr, bh, seq_len, rows, row_ok, offs_f, d_dot)
    k = _load_tokens(k_ptr, bh, seq_len, rows, row_ok, offs_f, d_dot)
    dq += dot(p, k, PRECISION, input_type)
    dk += dot(tl.trans(p), q, PRECISION, input_type)
    offs, mask = token_tile(bh, seq_len, rows, row_ok, offs_f, d_dot)
    tl.store(dq_ptr + offs, dq.to(dq_ptr.dtype.element_ty), mask=mask)
    tl.store(dk_ptr + offs, dk.to(dk_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _backward_dv_kernel(
    q_ptr, k_ptr, dy_ptr, rinv_ptr, dstates_ptr,  # inputs
    dv_ptr,  # output
    chunk_table_ptr,  # [num_chunks, 2] with VARLEN
    seq_len, d_dot, d_value, chunk_size, num_chunks,
    NORMALIZE: tl.constexpr, VARLEN: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Program (chunk c, bh, j): dv[:, block j of Dv] = Aᵀ G + K dS_c = (diag(r) A)ᵀ dY + K dS_c, A = tril(Q Kᵀ)
    summed over F in blocks of BLOCK_F (dY reaches the dot as it is)."""
    chunk = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    start, stop = chunk_span(chunk, seq_len, chunk_size, chunk_table_ptr, VARLEN)
    rows, row_ok = chunk_rows(start, stop, chunk_size, BLOCK_C)
    input_type = q_ptr.dtype.element_ty

    scores = tl.zeros((BLOCK_C, BLOCK_C), dtype=tl.float32)
    dv = tl.zeros((BLOCK_C, BLOCK_V), dtype=tl.float32)
    for f_start in range(0, d_dot, BLOCK_F):
        offs_f = f_start + tl.arange(0, BLOCK_F)
        q = _load_tokens(q_ptr, bh, seq_len, rows, row_ok, offs_f, d_dot)
        k = _load_tokens(k_ptr, bh, seq_len, rows, row_ok, offs_f, d_dot)
        scores += dot(q, tl.trans(k), PRECISION, input_type)
        dv += dot(k, _state_tile(dstates_ptr, bh, chunk, num_chunks, offs_f, offs_v, d_dot, d_value), PRECISION, input_type)
    scores = tl.where(rows[:, None] >= rows[None, :], scores, 0.0)
    if NORMALIZE:
        scores = scores * _token_values(rinv_ptr, bh, seq_len, rows, row_ok)[:, None]
    dy = _load_tokens(dy_ptr, bh, seq_len, rows, row_ok, offs_v, d_value)
    dv += dot(tl.trans(scores), dy, PRECISION, input_type)
    offs, mask = token_tile(bh, seq_len, rows, row_ok, offs_v, d_value)
    tl.store(dv_ptr + offs, dv.to(dv_ptr.dtype.element_ty), mask=mask)

"""The delta rule's backward Triton kernels: (4) the chunk-local part, (5) the reverse pass, (6) the gradients
of each chunk. The maths and the launches: ``kernels.delta_rule``."""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import chunk_rows, chunk_span, dot, load_chunk, load_or_zeros, sequence_chunks
from .delta_rule_forward import _autotune_pass, _chunk_gate, _chunk_scores, _decay, _prefix_sum, _state_offsets, _store_chunk, _token_values

# --------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------


@triton.jit
def _backward_local_kernel(
    q_ptr, k_ptr, gc_ptr, dy_ptr,  # inputs (gc: G, if GATED)
    du_ptr,  # output (fp32) [BH, T, Dv]: Mᵀ dO
    chunk_table_ptr,  # [num_chunks, 2] with VARLEN
    seq_len, d_dot, d_value, chunk_size, num_chunks, group,
    GATED: tl.constexpr, VARLEN: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """(4) Program (chunk, b·h, Dv block): the chunk-local part of dU', Mᵀ dO with M = tril(Q Kᵀ) ⊙ D."""
    chunk = tl.program_id(0)
    start, stop = chunk_span(chunk, seq_len, chunk_size, chunk_table_ptr, VARLEN)
    bh = tl.program_id(1).to(tl.int64)
    bh_qk = bh // group  # GVA: q, k hold one head per group of value heads
    v_start = tl.program_id(2) * BLOCK_V
    rows = tl.arange(0, BLOCK_C)
    scores = _chunk_scores(q_ptr, k_ptr, bh_qk, start, stop, chunk_size, seq_len, d_dot, PRECISION, BLOCK_C, BLOCK_F)
    if GATED:
        cumulative, _ = _chunk_gate(gc_ptr, bh, start, stop, chunk_size, seq_len, BLOCK_C)
        scores = scores * _decay(cumulative, False, BLOCK_C)
    else:
        scores = tl.where(rows[:, None] >= rows[None, :], scores, 0.0)
    dout = load_chunk(dy_ptr, bh, start, stop, chunk_size, seq_len, d_value, v_start, BLOCK_C, BLOCK_V)
    local = dot(tl.trans(scores), dout, PRECISION, q_ptr.dtype.element_ty)
    _store_chunk(du_ptr, local, bh, start, stop, chunk_size, seq_len, d_value, v_start, BLOCK_C, BLOCK_V)


@_autotune_pass("du_ptr")
@triton.jit
def _backward_pass_kernel(
    q_ptr, k_ptr, gc_ptr, w_ptr, dy_ptr,  # inputs (gc: G, if GATED)
    du_ptr,  # in: Mᵀ dO (fp32); out: dU' = Mᵀ dO + K̃ dS'
    ds_final_ptr,  # [BH, F, Dv] (if HAS_DS_FINAL)
    dstates_ptr, ds0_ptr,  # outputs (fp32): [BH, NC, F, Dv] the gradient on the state leaving each chunk, dS_0
    chunk_table_ptr, sequence_table_ptr,  # [num_chunks, 2] and [N + 1] with VARLEN
    seq_len, d_dot, d_value, chunk_size, num_chunks, group, heads,
    batch_heads,  # B·H: read by the tuning key only
    HAS_DS_FINAL: tl.constexpr, GATED: tl.constexpr, VARLEN: tl.constexpr,
    BLOCK_C: tl.constexpr, PAD_F: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """(5) Program (Dv block, b·h), chunks in reverse: dU' = Mᵀ dO + K̃ dS', dS = γ_C dS' + (diag(γ) Q)ᵀ dO − Wᵀ dU'."""
    v_start = tl.program_id(0) * BLOCK_V
    program = tl.program_id(1).to(tl.int64)
    bh, first, end = sequence_chunks(program, heads, num_chunks, sequence_table_ptr, VARLEN)
    bh_qk = bh // group  # GVA: q, k hold one head per group of value heads
    feats = tl.arange(0, PAD_F)
    cols = v_start + tl.arange(0, BLOCK_V)
    input_type = q_ptr.dtype.element_ty
    state_offs, state_mask = _state_offsets(program, 0, 1, feats, cols, d_dot, d_value)
    dstate = load_or_zeros(ds_final_ptr, state_offs, state_mask, HAS_DS_FINAL)
    for step in range(0, end - first):
        chunk = end - 1 - step
        start, stop = chunk_span(chunk, seq_len, chunk_size, chunk_table_ptr, VARLEN)
        offs, mask = _state_offsets(bh, chunk, num_chunks, feats, cols, d_dot, d_value)
        tl.store(dstates_ptr + offs, dstate, mask=mask)
        keys = load_chunk(k_ptr, bh_qk, start, stop, chunk_size, seq_len, d_dot, 0, BLOCK_C, PAD_F)
        queries = load_chunk(q_ptr, bh_qk, start, stop, chunk_size, seq_len, d_dot, 0, BLOCK_C, PAD_F)
        if GATED:
            cumulative, last = _chunk_gate(gc_ptr, bh, start, stop, chunk_size, seq_len, BLOCK_C)
            keys = keys.to(tl.float32) * tl.exp(last - cumulative)[:, None]
            queries = queries.to(tl.float32) * tl.exp(cumulative)[:, None]
        local = load_chunk(du_ptr, bh, start, stop, chunk_size, seq_len, d_value, v_start, BLOCK_C, BLOCK_V)
        dnew_values = local + dot(keys, dstate, PRECISION, input_type)
        _store_chunk(du_ptr, dnew_values, bh, start, stop, chunk_size, seq_len, d_value, v_start, BLOCK_C, BLOCK_V)
        w = load_chunk(w_ptr, bh, start, stop, chunk_size, seq_len, d_dot, 0, BLOCK_C, PAD_F)
        dout = load_chunk(dy_ptr, bh, start, stop, chunk_size, seq_len, d_value, v_start, BLOCK_C, BLOCK_V)
        if GATED:
            dstate = dstate * tl.exp(last)
        dstate += dot(tl.trans(queries), dout, PRECISION, input_type) - dot(tl.trans(w), dnew_values, PRECISION, input_type)
    tl.store(ds0_ptr + state_offs, dstate, mask=state_mask)


@triton.jit
def _backward_chunk_kernel(
    q_ptr, k_ptr, v_ptr, beta_ptr, gc_ptr, dy_ptr,  # inputs (gc: G, if GATED)
    t_ptr, u_ptr, du_ptr, states_ptr, dstates_ptr,  # saved: T, U', dU' (fp32), S_c, dS'_c
    dq_ptr, dk_ptr, dv_ptr, dbeta_ptr, dg_ptr,  # outputs
    chunk_table_ptr,  # [num_chunks, 2] with VARLEN
    seq_len, d_dot, d_value, chunk_size, num_chunks, group,
    GATED: tl.constexpr, VARLEN: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """(6) Program (chunk, b·h): dq, dk, dv, dβ (and dg) of the chunk (module docstring). First the [C, C]
    products over Dv blocks (dO U'ᵀ, dVb U'ᵀ; dv stored), then Q Kᵀ, K Kᵀ over F blocks, then per F block
    the [C, F block] gradients over Dv blocks (dVb recomputed: Tᵀ dU' is cheap)."""
    chunk = tl.program_id(0)
    start, stop = chunk_span(chunk, seq_len, chunk_size, chunk_table_ptr, VARLEN)
    bh = tl.program_id(1).to(tl.int64)
    bh_qk = bh // group  # GVA: q, k hold one head per group of value heads
    rows = tl.arange(0, BLOCK_C)
    tokens, row_ok = chunk_rows(start, stop, chunk_size, BLOCK_C)
    input_type = q_ptr.dtype.element_ty
    inverse = tl.load(t_ptr + ((bh * num_chunks + chunk) * BLOCK_C + rows[:, None]) * BLOCK_C + rows[None, :])
    beta = _token_values(beta_ptr, bh, start, stop, chunk_size, seq_len, BLOCK_C)

    dscores = tl.zeros((BLOCK_C, BLOCK_C), dtype=tl.float32)  # dO U'ᵀ
    dsolve = tl.zeros((BLOCK_C, BLOCK_C), dtype=tl.float32)  # dVb U'ᵀ
    dbeta = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for v_start in range(0, d_value, BLOCK_V):
        dout = load_chunk(dy_ptr, bh, start, stop, chunk_size, seq_len, d_value, v_start, BLOCK_C, BLOCK_V)
        new_values = load_chunk(u_ptr, bh, start, stop, chunk_size, seq_len, d_value, v_start, BLOCK_C, BLOCK_V)
        dvb = dot(tl.trans(inverse), load_chunk(du_ptr, bh, start, stop, chunk_size, seq_len, d_value, v_start, BLOCK_C, BLOCK_V), PRECISION, input_type)
        _store_chunk(dv_ptr, dvb * beta[:, None], bh, start, stop, chunk_size, seq_len, d_value, v_start, BLOCK_C, BLOCK_V)
        values = load_chunk(v_ptr, bh, start, stop, chunk_size, seq_len, d_value, v_start, BLOCK_C, BLOCK_V)
        dbeta += tl.sum(dvb * values.to(tl.float32), axis=1)
        dscores += dot(dout, tl.trans(new_values), PRECISION, input_type)
        dsolve += dot(dvb, tl.trans(new_values), PRECISION, input_type)
    scores = _chunk_scores(q_ptr, k_ptr, bh_qk, start, stop, chunk_size, seq_len, d_dot, PRECISION, BLOCK_C, BLOCK_F)
    gram = _chunk_scores(k_ptr, k_ptr, bh_qk, start, stop, chunk_size, seq_len, d_dot, PRECISION, BLOCK_C, BLOCK_F)
    grad_a = -tl.where(rows[:, None] > rows[None, :], dsolve, 0.0)  # dA
    if GATED:
        cumulative, last = _chunk_gate(gc_ptr, bh, start, stop, chunk_size, seq_len, BLOCK_C)
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
            dout = load_chunk(dy_ptr, bh, start, stop, chunk_size, seq_len, d_value, v_start, BLOCK_C, BLOCK_V)
            new_values = load_chunk(u_ptr, bh, start, stop, chunk_size, seq_len, d_value, v_start, BLOCK_C, BLOCK_V)
            dvb = dot(tl.trans(inverse), load_chunk(du_ptr, bh, start, stop, chunk_size, seq_len, d_value, v_start, BLOCK_C, BLOCK_V), PRECISION, input_type)
            dq += dot(dout, tl.trans(state), PRECISION, input_type)
            dk_write += dot(new_values, tl.trans(dstate), PRECISION, input_type)
            dk_solve += dot(dvb, tl.trans(state), PRECISION, input_type)
            if GATED:
                dlast += tl.sum(state * dstate) * tl.exp(last)
        queries = load_chunk(q_ptr, bh_qk, start, stop, chunk_size, seq_len, d_dot, f_start, BLOCK_C, BLOCK_F)
        keys = load_chunk(k_ptr, bh_qk, start, stop, chunk_size, seq_len, d_dot, f_start, BLOCK_C, BLOCK_F)
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
        _store_chunk(dq_ptr, dq, bh, start, stop, chunk_size, seq_len, d_dot, f_start, BLOCK_C, BLOCK_F)
        _store_chunk(dk_ptr, dk, bh, start, stop, chunk_size, seq_len, d_dot, f_start, BLOCK_C, BLOCK_F)
    tl.store(dbeta_ptr + bh * seq_len + tokens, dbeta.to(dbeta_ptr.dtype.element_ty), mask=row_ok)
    if GATED:
        dgate += tl.where(rows == BLOCK_C - 1, dlast, 0.0)
        tl.store(dg_ptr + bh * seq_len + tokens, _prefix_sum(dgate, True, BLOCK_C).to(dg_ptr.dtype.element_ty), mask=row_ok)

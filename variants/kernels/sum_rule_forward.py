"""The sum rule's forward Triton kernels: (a) the scan over chunks (the state each chunk starts from), (b) the
outputs, and the tile helpers the backward shares. The maths and the launches: ``kernels.sum_rule``."""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import chunk_rows, chunk_span, dot, load_or_zeros, sequence_chunks, token_tile

# --------------------------------------------------------------------------------------
# Kernels. Tensors are contiguous; [B, H] is flattened into one grid axis ``bh``. Chunk states are S_c
# [B·H, num_chunks, d_dot·d_value] in the dots' operand dtype and, with NORMALIZE, z_c [B·H, num_chunks, d_dot] in
# float32; the initial and final states are rows of width = d_dot·d_value (+ d_dot): S, then z, in float32.
# --------------------------------------------------------------------------------------


@triton.jit
def _state_tile(states_ptr, bh, chunk, num_chunks, offs_f, offs_v, d_dot, d_value):
    """Rows ``offs_f``, columns ``offs_v`` of S_c (in the states' dtype, 0 outside F × Dv)."""
    offs = (bh * num_chunks + chunk) * d_dot * d_value + offs_f[:, None] * d_value + offs_v[None, :]
    mask = (offs_f < d_dot)[:, None] & (offs_v < d_value)[None, :]
    return tl.load(states_ptr + offs, mask=mask, other=0.0)


@triton.jit
def _norm_tile(norms_ptr, bh, chunk, num_chunks, offs_f, d_dot):
    """Entries ``offs_f`` of z_c (float32, 0 outside F)."""
    return tl.load(norms_ptr + (bh * num_chunks + chunk) * d_dot + offs_f, mask=offs_f < d_dot, other=0.0)


@triton.jit
def _load_tokens(ptr, bh, seq_len, rows, row_ok, cols, width):
    """Rows ``rows`` (where ``row_ok``), columns ``cols`` of a [B·H, T, width] tensor, in its dtype, 0 outside."""
    offs, mask = token_tile(bh, seq_len, rows, row_ok, cols, width)
    return tl.load(ptr + offs, mask=mask, other=0.0)


@triton.jit
def _token_values(ptr, bh, seq_len, rows, row_ok):
    """One float32 per token of a [B·H, T] tensor (r or δ) for one chunk, 0 outside."""
    return tl.load(ptr + bh * seq_len + rows, mask=row_ok, other=0.0)


@triton.jit
def _chunk_scan_kernel(
    x_ptr, y_ptr, rinv_ptr, delta_ptr,  # inputs: (K, V) or (Q, dY with r, δ)
    initial_ptr,  # [state rows, width] with HAS_INITIAL
    states_ptr, norms_ptr, final_ptr,  # outputs: S_c, z_c (with NORMALIZE), [state rows, width]
    chunk_table_ptr, sequence_table_ptr,  # [num_chunks, 2], [N + 1] with VARLEN
    seq_len, d_dot, d_value, chunk_size, num_chunks, width, heads,
    HAS_INITIAL: tl.constexpr, NORMALIZE: tl.constexpr, COTANGENT: tl.constexpr, REVERSE: tl.constexpr, VARLEN: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """(a) Program (state row, tile (i, j)): rows block i, columns block j of the state, walking the row's chunks in
    order (with REVERSE backwards) with the tile in fp32 registers: it stores the state chunk c starts from (in the
    dtype ``states`` has: the input dtype for 16-bit dots, which round it to that anyway),
    S_c = S_0 + Σ_{c'<c} K_c'ᵀ V_c', then adds K_cᵀ V_c; the sum over all its chunks (S_T) goes to ``final``. With
    NORMALIZE the programs of column block 0 carry block i of z_c = z_0 + Σ_{c'<c} K_c'ᵀ 1 alike. With COTANGENT
    (x = Q, y = dY) the backward's dS_c = dS_T + Σ_{c'>c} Q_c'ᵀ G_c' and dz_c from Q_c'ᵀ dden_c', ending at dS_0, dz_0.
    A state row is a b·h, or with VARLEN a sequence's head (``sequence_chunks``), whose chunks are its sequence's."""
    program = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    bh, first, end = sequence_chunks(program, heads, num_chunks, sequence_table_ptr, VARLEN)
    n_v = tl.cdiv(d_value, BLOCK_V)
    offs_f = (tile // n_v) * BLOCK_F + tl.arange(0, BLOCK_F)
    offs_v = (tile % n_v) * BLOCK_V + tl.arange(0, BLOCK_V)
    f_ok = offs_f < d_dot
    mask = f_ok[:, None] & (offs_v < d_value)[None, :]
    tile_offs = offs_f[:, None] * d_value + offs_v[None, :]
    norm_ok = offs_f < tl.where(tile % n_v == 0, d_dot, 0)  # z: the programs of column block 0
    # z's offsets are computed where used: held across the chunk loop they cost a 16-byte stack frame (bf16, d 32, C 64, sm_90)
    running = load_or_zeros(initial_ptr, program * width + tile_offs, mask, HAS_INITIAL)
    if NORMALIZE:
        running_norm = load_or_zeros(initial_ptr, program * width + d_dot * d_value + offs_f, norm_ok, HAS_INITIAL)
    states_row = states_ptr + bh * num_chunks * d_dot * d_value
    norms_row = norms_ptr + bh * num_chunks * d_dot
    for step in range(end - first):
        chunk = end - 1 - step if REVERSE else first + step
        start, stop = chunk_span(chunk, seq_len, chunk_size, chunk_table_ptr, VARLEN)
        rows, row_ok = chunk_rows(start, stop, chunk_size, BLOCK_C)
        x = _load_tokens(x_ptr, bh, seq_len, rows, row_ok, offs_f, d_dot)
        y = _load_tokens(y_ptr, bh, seq_len, rows, row_ok, offs_v, d_value)
        if COTANGENT and NORMALIZE:
            rinv = _token_values(rinv_ptr, bh, seq_len, rows, row_ok)
            y = y.to(tl.float32) * rinv[:, None]  # G = diag(r) dY
        tl.store(states_row + chunk * d_dot * d_value + tile_offs, running.to(states_ptr.dtype.element_ty), mask=mask)
        running += dot(tl.trans(x), y, PRECISION, x_ptr.dtype.element_ty)
        if NORMALIZE:
            tl.store(norms_row + chunk * d_dot + offs_f, running_norm, mask=norm_ok)
            if COTANGENT:
                dden = -rinv * _token_values(delta_ptr, bh, seq_len, rows, row_ok)
                running_norm += tl.sum(x.to(tl.float32) * dden[:, None], axis=0)
            else:
                running_norm += tl.sum(x.to(tl.float32), axis=0)
    tl.store(final_ptr + program * width + tile_offs, running, mask=mask)
    if NORMALIZE:
        tl.store(final_ptr + program * width + d_dot * d_value + offs_f, running_norm, mask=norm_ok)


@triton.jit
def _chunk_output_kernel(
    q_ptr, k_ptr, v_ptr, states_ptr, norms_ptr,  # inputs
    y_ptr, rinv_ptr,  # outputs
    dy_ptr, delta_ptr,  # only with DELTA_ONLY
    chunk_table_ptr,  # [num_chunks, 2] with VARLEN
    seq_len, d_dot, d_value, chunk_size, num_chunks,
    NORMALIZE: tl.constexpr, DELTA_ONLY: tl.constexpr, VARLEN: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_V: tl.constexpr,
    PRECISION: tl.constexpr, EPSILON: tl.constexpr,
):  # fmt: skip
    """(b) Program (chunk c, bh, j): y_c[:, block j] = (A V + Q S_c) r with A = tril(Q Kᵀ) and, with
    NORMALIZE, r = 1 / (A 1 + Q z_c + ε) (block 0 stores r). A and the reads of S_c, z_c sum over F
    in blocks of BLOCK_F.

    With ``DELTA_ONLY`` (backward of 16-bit inputs) it writes only Σ_{d in block j} dy_td y_td,
    y in float32, to ``delta[j, bh, t]`` (the wrapper sums over j)."""
    chunk = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    pid_v = tl.program_id(2)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    start, stop = chunk_span(chunk, seq_len, chunk_size, chunk_table_ptr, VARLEN)
    rows, row_ok = chunk_rows(start, stop, chunk_size, BLOCK_C)
    input_type = q_ptr.dtype.element_ty

    scores = tl.zeros((BLOCK_C, BLOCK_C), dtype=tl.float32)
    out = tl.zeros((BLOCK_C, BLOCK_V), dtype=tl.float32)
    den = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for f_start in range(0, d_dot, BLOCK_F):
        offs_f = f_start + tl.arange(0, BLOCK_F)
        q = _load_tokens(q_ptr, bh, seq_len, rows, row_ok, offs_f, d_dot)
        k = _load_tokens(k_ptr, bh, seq_len, rows, row_ok, offs_f, d_dot)
        scores += dot(q, tl.trans(k), PRECISION, input_type)
        out += dot(q, _state_tile(states_ptr, bh, chunk, num_chunks, offs_f, offs_v, d_dot, d_value), PRECISION, input_type)
        if NORMALIZE:
            norm = _norm_tile(norms_ptr, bh, chunk, num_chunks, offs_f, d_dot)
            den += tl.sum(q.to(tl.float32) * norm[None, :], axis=1)
    scores = tl.where(rows[:, None] >= rows[None, :], scores, 0.0)
    v = _load_tokens(v_ptr, bh, seq_len, rows, row_ok, offs_v, d_value)
    out += dot(scores, v, PRECISION, input_type)
    if NORMALIZE:
        if PRECISION.startswith("input"):
            # 16-bit operands: A 1 summed from A's tile rounded as the A V product above rounds it, so that y stays a
            # weighted mean of the v_i and dy·v_i − δ cancels where one weight dominates (the first tokens, q·z small);
            # summed in fp32 (the product with a ones column, natively on the H200 with bf16 operands, gave NaN or Inf
            # in 22-38 % of the rows: docs/performance.md, "First GPU contact")
            row_sums = tl.sum(scores.to(input_type).to(tl.float32), axis=1)
        else:
            # fp32 operands: A 1 as a product with [1, 0, ..., 0] columns, which keeps A in the layout of the dot
            # above (a row sum of A beside it held A twice: fp32 spilled 1.2 KB a thread)
            first_column = tl.zeros((BLOCK_C, 16), dtype=tl.float32) + (tl.arange(0, 16) == 0).to(tl.float32)[None, :]
            row_sums = tl.sum(dot(scores, first_column, PRECISION, input_type), axis=1)
        rinv = 1.0 / (den + row_sums + EPSILON)
        out = out * rinv[:, None]
        if not DELTA_ONLY:
            if pid_v == 0:
                tl.store(rinv_ptr + bh * seq_len + rows, rinv, mask=row_ok)
    y_offs, y_mask = token_tile(bh, seq_len, rows, row_ok, offs_v, d_value)
    if DELTA_ONLY:
        dy = tl.load(dy_ptr + y_offs, mask=y_mask, other=0.0).to(tl.float32)
        n_bh = tl.num_programs(1).to(tl.int64)
        tl.store(delta_ptr + (pid_v * n_bh + bh) * seq_len + rows, tl.sum(dy * out, axis=1), mask=row_ok)
    else:
        tl.store(y_ptr + y_offs, out.to(y_ptr.dtype.element_ty), mask=y_mask)

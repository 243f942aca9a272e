"""The delta rule's forward Triton kernels: (1) the UT transform, (2) the state pass, (3) the outputs, with
the tile helpers and the passes' autotuning the backward shares. The maths and the launches: ``kernels.delta_rule``."""

from __future__ import annotations

import triton
import triton.language as tl

from . import _common
from ._common import chunk_rows, chunk_span, dot, load_chunk, load_or_zeros, sequence_chunks, token_tile

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
def _token_values(ptr, bh, start, stop, chunk_size, seq_len, BLOCK_C: tl.constexpr):
    """One value per token of chunk ``chunk`` of a [B·H, T] tensor (β or g) as float32, 0 outside."""
    tokens, row_ok = chunk_rows(start, stop, chunk_size, BLOCK_C)
    return tl.load(ptr + bh * seq_len + tokens, mask=row_ok, other=0.0).to(tl.float32)


@triton.jit
def _prefix_sum(x, REVERSE: tl.constexpr, BLOCK_C: tl.constexpr):
    """Σ_{s ≤ t} x_s (Σ_{s ≥ t} with REVERSE) of a [BLOCK_C] vector, as the row sums of the masked [BLOCK_C, BLOCK_C]
    broadcast: a reduction, not ``tl.cumsum``'s scan (the gated kernels failed natively with scans beside their
    dots and reductions, a combination Triton has miscompiled: triton-lang/triton#3017, #7817)."""
    rows = tl.arange(0, BLOCK_C)
    if REVERSE:
        kept = rows[None, :] >= rows[:, None]
    else:
        kept = rows[None, :] <= rows[:, None]
    return tl.sum(tl.where(kept, x[None, :], 0.0), axis=1)


@triton.jit
def _chunk_gate(gc_ptr, bh, start, stop, chunk_size, seq_len, BLOCK_C: tl.constexpr):
    """G_t = Σ_{s ≤ t in the chunk} g_s of the chunk's tokens, as ``_ut_transform_kernel`` stored them in a [B·H, T]
    fp32 tensor, and G_last, the last token's (the padding rows get G_last, as g = 0 there)."""
    _, row_ok = chunk_rows(start, stop, chunk_size, BLOCK_C)
    last = tl.load(gc_ptr + bh * seq_len + tl.minimum(start + chunk_size, stop) - 1)
    return tl.where(row_ok, _token_values(gc_ptr, bh, start, stop, chunk_size, seq_len, BLOCK_C), last), last


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
def _store_chunk(ptr, values, bh, start, stop, chunk_size, seq_len, width, col_start, BLOCK_C: tl.constexpr, BLOCK: tl.constexpr):
    """Masked store of a [BLOCK_C, BLOCK] tile into chunk ``chunk`` of a [B·H, T, width] tensor, in its dtype."""
    tokens, token_ok = chunk_rows(start, stop, chunk_size, BLOCK_C)
    offs, mask = token_tile(bh, seq_len, tokens, token_ok, col_start + tl.arange(0, BLOCK), width)
    tl.store(ptr + offs, values.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _chunk_scores(a_ptr, b_ptr, bh, start, stop, chunk_size, seq_len, d_dot, PRECISION: tl.constexpr,
                  BLOCK_C: tl.constexpr, BLOCK_F: tl.constexpr):  # fmt: skip
    """A_c B_cᵀ ``[BLOCK_C, BLOCK_C]`` in fp32 for two [B·H, T, F] tensors, summed over F in blocks of BLOCK_F."""
    scores = tl.zeros((BLOCK_C, BLOCK_C), dtype=tl.float32)
    for f_start in range(0, d_dot, BLOCK_F):
        a = load_chunk(a_ptr, bh, start, stop, chunk_size, seq_len, d_dot, f_start, BLOCK_C, BLOCK_F)
        b = load_chunk(b_ptr, bh, start, stop, chunk_size, seq_len, d_dot, f_start, BLOCK_C, BLOCK_F)
        scores += dot(a, tl.trans(b), PRECISION, a_ptr.dtype.element_ty)
    return scores


# --------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------


@triton.jit
def _ut_transform_kernel(
    k_ptr, v_ptr, beta_ptr, g_ptr,  # inputs [BH, T, F], [BH, T, Dv], [BH, T], [BH, T] (if GATED)
    t_ptr, w_ptr, u_ptr,  # outputs: T (fp32) [BH, NC, BLOCK_C, BLOCK_C], W [BH, T, F], U [BH, T, Dv]
    gc_ptr,  # output (if GATED): G (fp32) [BH, T], the gate summed within each chunk (``_chunk_gate`` reads it)
    chunk_table_ptr,  # [num_chunks, 2] with VARLEN
    seq_len, d_dot, d_value, chunk_size, num_chunks, group,
    GATED: tl.constexpr, VARLEN: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """(1) Program (chunk, b·h): G, T = (I + tril(diag(β)(K Kᵀ ⊙ D), −1))⁻¹, W = T diag(βγ) K, U = T diag(β) V."""
    chunk = tl.program_id(0)
    start, stop = chunk_span(chunk, seq_len, chunk_size, chunk_table_ptr, VARLEN)
    bh = tl.program_id(1).to(tl.int64)
    bh_qk = bh // group  # GVA: q, k hold one head per group of value heads
    rows = tl.arange(0, BLOCK_C)
    input_type = k_ptr.dtype.element_ty
    beta = _token_values(beta_ptr, bh, start, stop, chunk_size, seq_len, BLOCK_C)
    gram = _chunk_scores(k_ptr, k_ptr, bh_qk, start, stop, chunk_size, seq_len, d_dot, PRECISION, BLOCK_C, BLOCK_F)
    if GATED:
        cumulative = _prefix_sum(_token_values(g_ptr, bh, start, stop, chunk_size, seq_len, BLOCK_C), False, BLOCK_C)
        tokens, row_ok = chunk_rows(start, stop, chunk_size, BLOCK_C)
        tl.store(gc_ptr + bh * seq_len + tokens, cumulative, mask=row_ok)
        gram = gram * _decay(cumulative, True, BLOCK_C)
        key_scale = beta * tl.exp(cumulative)
    else:
        gram = tl.where(rows[:, None] > rows[None, :], gram, 0.0)
        key_scale = beta
    inverse = _unit_lower_inverse(gram * beta[:, None], BLOCK_C)
    tl.store(t_ptr + ((bh * num_chunks + chunk) * BLOCK_C + rows[:, None]) * BLOCK_C + rows[None, :], inverse)
    for f_start in range(0, d_dot, BLOCK_F):
        keys = load_chunk(k_ptr, bh_qk, start, stop, chunk_size, seq_len, d_dot, f_start, BLOCK_C, BLOCK_F)
        w = dot(inverse, keys.to(tl.float32) * key_scale[:, None], PRECISION, input_type)
        _store_chunk(w_ptr, w, bh, start, stop, chunk_size, seq_len, d_dot, f_start, BLOCK_C, BLOCK_F)
    for v_start in range(0, d_value, BLOCK_V):
        values = load_chunk(v_ptr, bh, start, stop, chunk_size, seq_len, d_value, v_start, BLOCK_C, BLOCK_V)
        u = dot(inverse, values.to(tl.float32) * beta[:, None], PRECISION, input_type)
        _store_chunk(u_ptr, u, bh, start, stop, chunk_size, seq_len, d_value, v_start, BLOCK_C, BLOCK_V)


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
    k_ptr, gc_ptr, w_ptr, u_ptr,  # inputs (gc: G, if GATED); u (U) is overwritten with U'
    s0_ptr,  # [BH, F, Dv] (if HAS_S0)
    states_ptr, s_final_ptr,  # outputs (fp32): [BH, NC, F, Dv] the state entering each chunk, [BH, F, Dv]
    chunk_table_ptr, sequence_table_ptr,  # [num_chunks, 2] and [N + 1] with VARLEN
    seq_len, d_dot, d_value, chunk_size, num_chunks, group, heads,
    batch_heads,  # B·H, the grid's second axis: read by the tuning key only (PASS_TUNING_KEY)
    HAS_S0: tl.constexpr, GATED: tl.constexpr, VARLEN: tl.constexpr,
    BLOCK_C: tl.constexpr, PAD_F: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """(2) Program (Dv block, b·h), chunks in order, S[:, block] carried in fp32 (its columns evolve
    independently: every matrix that mixes tokens depends on K, β, g only):
    U' = U − W S,  S ← γ_C S + K̃ᵀ U'."""
    v_start = tl.program_id(0) * BLOCK_V
    program = tl.program_id(1).to(tl.int64)
    bh, first, end = sequence_chunks(program, heads, num_chunks, sequence_table_ptr, VARLEN)
    bh_qk = bh // group  # GVA: q, k hold one head per group of value heads
    feats = tl.arange(0, PAD_F)
    cols = v_start + tl.arange(0, BLOCK_V)
    input_type = k_ptr.dtype.element_ty
    state_offs, state_mask = _state_offsets(program, 0, 1, feats, cols, d_dot, d_value)
    state = load_or_zeros(s0_ptr, state_offs, state_mask, HAS_S0)
    for chunk in range(first, end):
        start, stop = chunk_span(chunk, seq_len, chunk_size, chunk_table_ptr, VARLEN)
        offs, mask = _state_offsets(bh, chunk, num_chunks, feats, cols, d_dot, d_value)
        tl.store(states_ptr + offs, state, mask=mask)
        w = load_chunk(w_ptr, bh, start, stop, chunk_size, seq_len, d_dot, 0, BLOCK_C, PAD_F)
        u = load_chunk(u_ptr, bh, start, stop, chunk_size, seq_len, d_value, v_start, BLOCK_C, BLOCK_V)
        new_values = u.to(tl.float32) - dot(w, state, PRECISION, input_type)
        _store_chunk(u_ptr, new_values, bh, start, stop, chunk_size, seq_len, d_value, v_start, BLOCK_C, BLOCK_V)
        keys = load_chunk(k_ptr, bh_qk, start, stop, chunk_size, seq_len, d_dot, 0, BLOCK_C, PAD_F)
        if GATED:
            cumulative, last = _chunk_gate(gc_ptr, bh, start, stop, chunk_size, seq_len, BLOCK_C)
            keys = keys.to(tl.float32) * tl.exp(last - cumulative)[:, None]
            state = state * tl.exp(last)
        state += dot(tl.trans(keys), new_values, PRECISION, input_type)
    tl.store(s_final_ptr + state_offs, state, mask=state_mask)


@triton.jit
def _output_kernel(
    q_ptr, k_ptr, gc_ptr, u_ptr, states_ptr,  # inputs (gc: G, if GATED; u holds U')
    y_ptr,  # output [BH, T, Dv]
    chunk_table_ptr,  # [num_chunks, 2] with VARLEN
    seq_len, d_dot, d_value, chunk_size, num_chunks, group,
    GATED: tl.constexpr, VARLEN: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """(3) Program (chunk, b·h, Dv block): O = diag(γ) Q S_c + (tril(Q Kᵀ) ⊙ D) U', summed over F in blocks."""
    chunk = tl.program_id(0)
    start, stop = chunk_span(chunk, seq_len, chunk_size, chunk_table_ptr, VARLEN)
    bh = tl.program_id(1).to(tl.int64)
    bh_qk = bh // group  # GVA: q, k hold one head per group of value heads
    v_start = tl.program_id(2) * BLOCK_V
    rows = tl.arange(0, BLOCK_C)
    cols = v_start + tl.arange(0, BLOCK_V)
    input_type = q_ptr.dtype.element_ty
    scores = tl.zeros((BLOCK_C, BLOCK_C), dtype=tl.float32)
    out = tl.zeros((BLOCK_C, BLOCK_V), dtype=tl.float32)
    for f_start in range(0, d_dot, BLOCK_F):
        queries = load_chunk(q_ptr, bh_qk, start, stop, chunk_size, seq_len, d_dot, f_start, BLOCK_C, BLOCK_F)
        keys = load_chunk(k_ptr, bh_qk, start, stop, chunk_size, seq_len, d_dot, f_start, BLOCK_C, BLOCK_F)
        offs, mask = _state_offsets(bh, chunk, num_chunks, f_start + tl.arange(0, BLOCK_F), cols, d_dot, d_value)
        scores += dot(queries, tl.trans(keys), PRECISION, input_type)
        out += dot(queries, tl.load(states_ptr + offs, mask=mask, other=0.0), PRECISION, input_type)
    if GATED:
        cumulative, _ = _chunk_gate(gc_ptr, bh, start, stop, chunk_size, seq_len, BLOCK_C)
        out = out * tl.exp(cumulative)[:, None]
        scores = scores * _decay(cumulative, False, BLOCK_C)
    else:
        scores = tl.where(rows[:, None] >= rows[None, :], scores, 0.0)
    new_values = load_chunk(u_ptr, bh, start, stop, chunk_size, seq_len, d_value, v_start, BLOCK_C, BLOCK_V)
    out += dot(scores, new_values, PRECISION, input_type)
    _store_chunk(y_ptr, out, bh, start, stop, chunk_size, seq_len, d_value, v_start, BLOCK_C, BLOCK_V)

"""Chunked causal sum rule (linear attention) in Triton, forward and backward.

Inputs are already feature-mapped: ``q, k: [B, H, T, F]`` (F = d_dot), ``v: [B, H, T, Dv]``.
With S_0 ``[F, Dv]`` and z_0 ``[F]`` the initial state (zero when not given), per (b, h):

    S_t = S_0 + Σ_{i≤t} k_i v_iᵀ,   z_t = z_0 + Σ_{i≤t} k_i,
    num_t = S_tᵀ q_t,   den_t = q_t·z_t,
    y_t = num_t                       (normalize=False)
    y_t = num_t / (den_t + ε)         (normalize=True, ε = variants.feature_maps.EPS)

Three faces, as everywhere in the library: :func:`sum_rule_triton` (this kernel, the
chunked parallel form), ``variants.chunked.sum_rule_chunked`` (the PyTorch chunked form, the
reference the tests tie this file to) and the recurrent ``step`` of ``variants.sum_rule``.

Forward (one program per (b, h) and block of Dv columns), per chunk of C tokens with
Q, K ``[C, F]``, V ``[C, Dv]`` and the state S, z carried from earlier chunks:

    A = tril(Q Kᵀ)                        (causal, inclusive)
    num = A V + Q S,   den = A 1 + Q z
    S ← S + Kᵀ V,      z ← z + Kᵀ 1

Every product accumulates in float32, whatever the input dtype; fp32 inputs use IEEE fp32
dots (``_common.FP32_DOT_PRECISION``), fp16/bf16 inputs use TF32 dots on fp32 operands, which is
exact on the 16-bit inputs themselves (IEEE fp32 on sm_70, which has no TF32: ``_common.dot_precision``).
y is written in the input dtype, the final state in
float32. For the normalised form the forward also keeps r_t = 1 / (den_t + ε) for backward.

Backward. Let dy_t, dS_T, dz_T be the incoming gradients (zero when absent), and

    g_t = dy_t r_t,   dden_t = −r_t (dy_t·y_t)     (normalised; else g_t = dy_t, dden_t = 0)

(the gradient of y = num·r through r = 1/(den + ε): ∂y/∂den = −y r). Then num_t, den_t depend
on q_t through S_t, z_t and on k_i, v_i, S_0, z_0 through every S_t, z_t with t ≥ i, so with
the reverse-time sums  dS̃_i = dS_T + Σ_{t≥i} q_t g_tᵀ  and  dz̃_i = dz_T + Σ_{t≥i} dden_t q_t:

    dq_t = S_t g_t + dden_t z_t,   dk_i = dS̃_i v_i + dz̃_i,   dv_i = dS̃_iᵀ k_i,
    dS_0 = dS̃_1,   dz_0 = dz̃_1.

Chunked, with P = tril(G Vᵀ + dden 1ᵀ) ``[C, C]`` (P_{ti} = g_t·v_i + dden_t for t ≥ i):

    dq = P K + G Sᵀ + dden zᵀ                  (S, z: the state before the chunk; forward scan)
    dk = Pᵀ Q + V dSᵀ + 1 dzᵀ,  dv = Aᵀ G + K dS (dS, dz: the gradient after the chunk; reverse scan)
    dS ← dS + Qᵀ G,   dz ← dz + Qᵀ dden

δ_t = dy_t·y_t uses the returned y for float32 inputs; for 16-bit inputs the forward kernel
reruns to recompute y in float32 (the rounded y would put its rounding error into dq and dk,
badly so at tokens where q·z is small). Three backward kernels, each splitting the state where its outputs allow: dq and dk (with dS_0, dz_0) per
block of F rows, dv per block of Dv columns; each recomputes the state it needs, so nothing
per chunk is stored. Feature and value dims are padded to powers of two (≥ 16, for tl.dot)
with masks; at most 256 each.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from ..base import VariantError
from ..feature_maps import EPS
from . import _common
from ._common import chunk_rows, launch, load_or_zeros, new_output, state_tile, token_tile

#: Rows (d_dot) or columns (d_value) of the state one program holds; a power of two ≥ 16.
STATE_BLOCK = 64


# --------------------------------------------------------------------------------------
# Kernels. Tensors are contiguous; [B, H] is flattened into one program axis ``bh``.
# --------------------------------------------------------------------------------------


@triton.jit
def _forward_kernel(
    q_ptr, k_ptr, v_ptr, s0_ptr, z0_ptr,  # inputs
    y_ptr, st_ptr, zt_ptr, rinv_ptr,  # outputs
    dy_ptr, delta_ptr,  # only with DELTA_ONLY
    seq_len, d_dot, d_value, chunk_size, num_chunks,
    HAS_S0: tl.constexpr, HAS_Z0: tl.constexpr, NORMALIZE: tl.constexpr, DELTA_ONLY: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_V: tl.constexpr,
    PRECISION: tl.constexpr, EPSILON: tl.constexpr,
):
    """Program (bh, j): y[:, block j of Dv], S_T[:, block j]; block 0 also writes z_T and r.

    With ``DELTA_ONLY`` (backward of 16-bit inputs) it writes only Σ_{d in block j} dy_td y_td,
    y recomputed in float32, to ``delta[j, bh, t]`` (the wrapper sums over j)."""
    bh = tl.program_id(0).to(tl.int64)
    pid_v = tl.program_id(1)
    offs_c = tl.arange(0, BLOCK_C)
    offs_f = tl.arange(0, BLOCK_F)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    f_ok = offs_f < d_dot
    causal = offs_c[:, None] >= offs_c[None, :]

    state_offs, state_mask = state_tile(bh, offs_f, offs_v, d_dot, d_value)
    state = load_or_zeros(s0_ptr, state_offs, state_mask, HAS_S0)
    norm = load_or_zeros(z0_ptr, bh * d_dot + offs_f, f_ok, HAS_Z0)

    for chunk in range(num_chunks):
        rows, row_ok = chunk_rows(chunk, seq_len, chunk_size, BLOCK_C)
        qk_offs, qk_mask = token_tile(bh, seq_len, rows, row_ok, offs_f, d_dot)
        v_offs, v_mask = token_tile(bh, seq_len, rows, row_ok, offs_v, d_value)
        q = tl.load(q_ptr + qk_offs, mask=qk_mask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + qk_offs, mask=qk_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + v_offs, mask=v_mask, other=0.0).to(tl.float32)

        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        scores = tl.where(causal, scores, 0.0)
        out = tl.dot(scores, v, input_precision=PRECISION)
        out += tl.dot(q, state, input_precision=PRECISION)
        if NORMALIZE:
            den = tl.sum(scores, axis=1) + tl.sum(q * norm[None, :], axis=1)
            rinv = 1.0 / (den + EPSILON)
            out = out * rinv[:, None]
            if not DELTA_ONLY:
                if pid_v == 0:
                    tl.store(rinv_ptr + bh * seq_len + rows, rinv, mask=row_ok)
            norm += tl.sum(k, axis=0)
        if DELTA_ONLY:
            dy = tl.load(dy_ptr + v_offs, mask=v_mask, other=0.0).to(tl.float32)
            n_bh = tl.num_programs(0).to(tl.int64)
            tl.store(delta_ptr + (pid_v * n_bh + bh) * seq_len + rows, tl.sum(dy * out, axis=1), mask=row_ok)
        else:
            tl.store(y_ptr + v_offs, out.to(y_ptr.dtype.element_ty), mask=v_mask)
        state += tl.dot(tl.trans(k), v, input_precision=PRECISION)

    if not DELTA_ONLY:
        tl.store(st_ptr + state_offs, state, mask=state_mask)
        if NORMALIZE:
            if pid_v == 0:
                tl.store(zt_ptr + bh * d_dot + offs_f, norm, mask=f_ok)


@triton.jit
def _load_cotangent(dy_ptr, rinv_ptr, delta_ptr, bh, seq_len, d_value, rows, row_ok, offs_v, NORMALIZE: tl.constexpr):
    """g = dy·r and dden = −r (dy·y) for one chunk (g = dy, dden = 0 without normalisation)."""
    dy_offs, dy_mask = token_tile(bh, seq_len, rows, row_ok, offs_v, d_value)
    g = tl.load(dy_ptr + dy_offs, mask=dy_mask, other=0.0).to(tl.float32)
    if NORMALIZE:
        rinv = tl.load(rinv_ptr + bh * seq_len + rows, mask=row_ok, other=0.0)
        delta = tl.load(delta_ptr + bh * seq_len + rows, mask=row_ok, other=0.0)
        g = g * rinv[:, None]
        dden = -rinv * delta
    else:
        dden = tl.zeros_like(rows).to(tl.float32)
    return g, dden


@triton.jit
def _cotangent_scores(g, v, dden, causal, NORMALIZE: tl.constexpr, PRECISION: tl.constexpr):
    """P = tril(G Vᵀ + dden 1ᵀ) for one chunk (P = tril(G Vᵀ) without normalisation)."""
    p = tl.dot(g, tl.trans(v), input_precision=PRECISION)
    if NORMALIZE:
        p += dden[:, None]
    return tl.where(causal, p, 0.0)


@triton.jit
def _backward_dq_kernel(
    k_ptr, v_ptr, s0_ptr, z0_ptr, dy_ptr, rinv_ptr, delta_ptr,
    dq_ptr,
    seq_len, d_dot, d_value, chunk_size, num_chunks,
    HAS_S0: tl.constexpr, HAS_Z0: tl.constexpr, NORMALIZE: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_V: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (bh, i): dq[:, block i of d_dot] = P K + G Sᵀ + dden zᵀ, forward over chunks
    carrying rows block i of S (all Dv columns) and of z."""
    bh = tl.program_id(0).to(tl.int64)
    pid_f = tl.program_id(1)
    offs_c = tl.arange(0, BLOCK_C)
    offs_f = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    offs_v = tl.arange(0, BLOCK_V)
    causal = offs_c[:, None] >= offs_c[None, :]

    state_offs, state_mask = state_tile(bh, offs_f, offs_v, d_dot, d_value)
    state = load_or_zeros(s0_ptr, state_offs, state_mask, HAS_S0)
    norm = load_or_zeros(z0_ptr, bh * d_dot + offs_f, offs_f < d_dot, HAS_Z0)

    for chunk in range(num_chunks):
        rows, row_ok = chunk_rows(chunk, seq_len, chunk_size, BLOCK_C)
        k_offs, k_mask = token_tile(bh, seq_len, rows, row_ok, offs_f, d_dot)
        v_offs, v_mask = token_tile(bh, seq_len, rows, row_ok, offs_v, d_value)
        k = tl.load(k_ptr + k_offs, mask=k_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + v_offs, mask=v_mask, other=0.0).to(tl.float32)
        g, dden = _load_cotangent(dy_ptr, rinv_ptr, delta_ptr, bh, seq_len, d_value, rows, row_ok, offs_v, NORMALIZE)

        p = _cotangent_scores(g, v, dden, causal, NORMALIZE, PRECISION)
        dq = tl.dot(p, k, input_precision=PRECISION)
        dq += tl.dot(g, tl.trans(state), input_precision=PRECISION)
        if NORMALIZE:
            dq += dden[:, None] * norm[None, :]
            norm += tl.sum(k, axis=0)
        tl.store(dq_ptr + k_offs, dq.to(dq_ptr.dtype.element_ty), mask=k_mask)
        state += tl.dot(tl.trans(k), v, input_precision=PRECISION)


@triton.jit
def _backward_dk_kernel(
    q_ptr, v_ptr, dst_ptr, dzt_ptr, dy_ptr, rinv_ptr, delta_ptr,
    dk_ptr, ds0_ptr, dz0_ptr,
    seq_len, d_dot, d_value, chunk_size, num_chunks,
    HAS_DST: tl.constexpr, HAS_DZT: tl.constexpr, NORMALIZE: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_V: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (bh, i): dk[:, block i of d_dot] = Pᵀ Q + V dSᵀ + 1 dzᵀ, backward over chunks
    carrying rows block i of dS and of dz; ends with dS_0, dz_0 of those rows."""
    bh = tl.program_id(0).to(tl.int64)
    pid_f = tl.program_id(1)
    offs_c = tl.arange(0, BLOCK_C)
    offs_f = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    offs_v = tl.arange(0, BLOCK_V)
    f_ok = offs_f < d_dot
    causal = offs_c[:, None] >= offs_c[None, :]

    state_offs, state_mask = state_tile(bh, offs_f, offs_v, d_dot, d_value)
    dstate = load_or_zeros(dst_ptr, state_offs, state_mask, HAS_DST)
    dnorm = load_or_zeros(dzt_ptr, bh * d_dot + offs_f, f_ok, HAS_DZT)

    for step in range(num_chunks):
        rows, row_ok = chunk_rows(num_chunks - 1 - step, seq_len, chunk_size, BLOCK_C)
        q_offs, q_mask = token_tile(bh, seq_len, rows, row_ok, offs_f, d_dot)
        v_offs, v_mask = token_tile(bh, seq_len, rows, row_ok, offs_v, d_value)
        q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + v_offs, mask=v_mask, other=0.0).to(tl.float32)
        g, dden = _load_cotangent(dy_ptr, rinv_ptr, delta_ptr, bh, seq_len, d_value, rows, row_ok, offs_v, NORMALIZE)

        p = _cotangent_scores(g, v, dden, causal, NORMALIZE, PRECISION)
        dk = tl.dot(tl.trans(p), q, input_precision=PRECISION)
        dk += tl.dot(v, tl.trans(dstate), input_precision=PRECISION)
        if NORMALIZE:
            dk += dnorm[None, :]
            dnorm += tl.sum(q * dden[:, None], axis=0)
        tl.store(dk_ptr + q_offs, dk.to(dk_ptr.dtype.element_ty), mask=q_mask)
        dstate += tl.dot(tl.trans(q), g, input_precision=PRECISION)

    tl.store(ds0_ptr + state_offs, dstate, mask=state_mask)
    if NORMALIZE:
        tl.store(dz0_ptr + bh * d_dot + offs_f, dnorm, mask=f_ok)


@triton.jit
def _backward_dv_kernel(
    q_ptr, k_ptr, dst_ptr, dy_ptr, rinv_ptr, delta_ptr,
    dv_ptr,
    seq_len, d_dot, d_value, chunk_size, num_chunks,
    HAS_DST: tl.constexpr, NORMALIZE: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_V: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (bh, j): dv[:, block j of Dv] = Aᵀ G + K dS, backward over chunks carrying
    columns block j of dS."""
    bh = tl.program_id(0).to(tl.int64)
    pid_v = tl.program_id(1)
    offs_c = tl.arange(0, BLOCK_C)
    offs_f = tl.arange(0, BLOCK_F)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    causal = offs_c[:, None] >= offs_c[None, :]

    state_offs, state_mask = state_tile(bh, offs_f, offs_v, d_dot, d_value)
    dstate = load_or_zeros(dst_ptr, state_offs, state_mask, HAS_DST)

    for step in range(num_chunks):
        rows, row_ok = chunk_rows(num_chunks - 1 - step, seq_len, chunk_size, BLOCK_C)
        qk_offs, qk_mask = token_tile(bh, seq_len, rows, row_ok, offs_f, d_dot)
        v_offs, v_mask = token_tile(bh, seq_len, rows, row_ok, offs_v, d_value)
        q = tl.load(q_ptr + qk_offs, mask=qk_mask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + qk_offs, mask=qk_mask, other=0.0).to(tl.float32)
        g, dden = _load_cotangent(dy_ptr, rinv_ptr, delta_ptr, bh, seq_len, d_value, rows, row_ok, offs_v, NORMALIZE)

        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        scores = tl.where(causal, scores, 0.0)
        dv = tl.dot(tl.trans(scores), g, input_precision=PRECISION)
        dv += tl.dot(k, dstate, input_precision=PRECISION)
        tl.store(dv_ptr + v_offs, dv.to(dv_ptr.dtype.element_ty), mask=v_mask)
        dstate += tl.dot(tl.trans(q), g, input_precision=PRECISION)


# --------------------------------------------------------------------------------------
# Launch configuration and the autograd wrapper.
# --------------------------------------------------------------------------------------


def default_chunk_size(d_dot: int, d_value: int) -> int:
    """64 while d_dot and d_value are at most 128, else 32."""
    return 64 if max(d_dot, d_value) <= 128 else 32


class _Tiles(_common.Tiles):
    """The forward and dv kernels hold all d_dot rows and a block of ``block_v`` columns of the
    state, the dq and dk kernels a block of ``block_f`` rows and all d_value columns."""

    def __init__(self, q: torch.Tensor, v: torch.Tensor, chunk_size: int | None):
        batch, heads, seq_len, d_dot = q.shape
        d_value = v.shape[-1]
        chunk_size = default_chunk_size(d_dot, d_value) if chunk_size is None else chunk_size
        super().__init__(batch, heads, seq_len, d_dot, d_value, chunk_size, q.dtype, q.device)
        self.block_f = min(self.pad_f, STATE_BLOCK)
        self.block_v = min(self.pad_v, STATE_BLOCK)
        self.num_warps = 4 if max(self.pad_f, self.pad_v) <= 64 and self.block_c <= 32 else 8
        self.num_stages = 3  # Triton's default

    def grid_f(self):
        return (self.bh, triton.cdiv(self.d_dot, self.block_f))

    def grid_v(self):
        return (self.bh, triton.cdiv(self.d_value, self.block_v))


def _dy_dot_y(q, k, v, s0, z0, dy, y, tiles) -> torch.Tensor:
    """δ_t = dy_t·y_t ``[B, H, T]`` in float32: from the saved y for float32 inputs, else from y
    recomputed in float32 by the forward kernel (the returned 16-bit y would cost its rounding:
    at an early token with a small q·z, dq and dk are differences of nearly equal terms)."""
    if y is not None:
        return (dy.to(torch.float32) * y).sum(-1).contiguous()
    n_blocks = tiles.grid_v()[1]
    partial = new_output((n_blocks, *dy.shape[:3]), dy, torch.float32)
    dummy = partial
    launch(
        _forward_kernel, tiles.grid_v(),
        q, k, v, s0 if s0 is not None else dummy, z0 if z0 is not None else dummy,
        dummy, dummy, dummy, dummy, dy, partial, *tiles.sizes(),
        HAS_S0=s0 is not None, HAS_Z0=z0 is not None, NORMALIZE=True, DELTA_ONLY=True,
        BLOCK_C=tiles.block_c, BLOCK_F=tiles.pad_f, BLOCK_V=tiles.block_v,
        PRECISION=tiles.precision, EPSILON=EPS, options=tiles.options(), name="forward_dy_dot_y",
    )  # fmt: skip
    return partial.sum(0)


def _as_float32(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.detach().to(torch.float32).contiguous()


class _SumRuleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, weights, normaliser, normalize, chunk_size):
        tiles = _Tiles(q, v, chunk_size)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        s0, z0 = _as_float32(weights), _as_float32(normaliser)
        batch, heads, seq_len, d_dot = q.shape
        d_value = v.shape[-1]

        y = new_output((batch, heads, seq_len, d_value), v)
        s_final = new_output((batch, heads, d_dot, d_value), v, torch.float32)
        z_final = new_output((batch, heads, d_dot), v, torch.float32) if normalize else None
        rinv = new_output((batch, heads, seq_len), v, torch.float32) if normalize else None
        dummy = s_final  # stands in for absent optional pointers; never read or written
        launch(
            _forward_kernel, tiles.grid_v(),
            q, k, v, s0 if s0 is not None else dummy, z0 if z0 is not None else dummy,
            y, s_final, z_final if normalize else dummy, rinv if normalize else dummy, dummy, dummy, *tiles.sizes(),
            HAS_S0=s0 is not None, HAS_Z0=z0 is not None, NORMALIZE=normalize, DELTA_ONLY=False,
            BLOCK_C=tiles.block_c, BLOCK_F=tiles.pad_f, BLOCK_V=tiles.block_v,
            PRECISION=tiles.precision, EPSILON=EPS, options=tiles.options(),
        )  # fmt: skip
        ctx.tiles, ctx.normalize = tiles, normalize
        ctx.has_s0, ctx.has_z0 = weights is not None, normaliser is not None
        ctx.state_dtypes = (None if weights is None else weights.dtype, None if normaliser is None else normaliser.dtype)
        # dy·y in backward: from y itself when it is float32, else from y recomputed in float32
        ctx.save_for_backward(q, k, v, s0, z0, y if normalize and y.dtype == torch.float32 else None, rinv)
        ctx.set_materialize_grads(False)
        return y, s_final, z_final

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, ds_final, dz_final):
        q, k, v, s0, z0, y, rinv = ctx.saved_tensors
        tiles, normalize = ctx.tiles, ctx.normalize
        need_q, need_k, need_v, need_s0, need_z0 = ctx.needs_input_grad[:5]
        if dy is None:
            dy = torch.zeros_like(v)
        dy = dy.contiguous()
        delta = _dy_dot_y(q, k, v, s0, z0, dy, y, tiles) if normalize else None
        ds_final = _as_float32(ds_final)
        dz_final = _as_float32(dz_final) if normalize else None
        has_dst, has_dzt = ds_final is not None, dz_final is not None
        dummy = dy
        common = dict(NORMALIZE=normalize, BLOCK_C=tiles.block_c, PRECISION=tiles.precision, options=tiles.options())
        rinv_arg = rinv if normalize else dummy
        delta_arg = delta if normalize else dummy

        dq = dk = dv = ds0 = dz0 = None
        if need_q:
            dq = new_output(q.shape, q)
            launch(
                _backward_dq_kernel, tiles.grid_f(),
                k, v, s0 if s0 is not None else dummy, z0 if z0 is not None else dummy, dy, rinv_arg, delta_arg,
                dq, *tiles.sizes(),
                HAS_S0=s0 is not None, HAS_Z0=z0 is not None,
                BLOCK_F=tiles.block_f, BLOCK_V=tiles.pad_v, **common,
            )  # fmt: skip
        if need_k or need_s0 or need_z0:
            dk = new_output(k.shape, k)
            ds0 = new_output((tiles.bh, tiles.d_dot, tiles.d_value), q, torch.float32)
            dz0 = new_output((tiles.bh, tiles.d_dot), q, torch.float32) if normalize else None
            launch(
                _backward_dk_kernel, tiles.grid_f(),
                q, v, ds_final if has_dst else dummy, dz_final if has_dzt else dummy, dy, rinv_arg, delta_arg,
                dk, ds0, dz0 if normalize else dummy, *tiles.sizes(),
                HAS_DST=has_dst, HAS_DZT=has_dzt,
                BLOCK_F=tiles.block_f, BLOCK_V=tiles.pad_v, **common,
            )  # fmt: skip
        if need_v:
            dv = new_output(v.shape, v)
            launch(
                _backward_dv_kernel, tiles.grid_v(),
                q, k, ds_final if has_dst else dummy, dy, rinv_arg, delta_arg,
                dv, *tiles.sizes(),
                HAS_DST=has_dst,
                BLOCK_F=tiles.pad_f, BLOCK_V=tiles.block_v, **common,
            )  # fmt: skip

        weights_dtype, normaliser_dtype = ctx.state_dtypes
        grad_s0 = ds0.view(*q.shape[:2], tiles.d_dot, tiles.d_value).to(weights_dtype) if need_s0 and ctx.has_s0 else None
        grad_z0 = dz0.view(*q.shape[:2], tiles.d_dot).to(normaliser_dtype) if need_z0 and ctx.has_z0 else None
        return dq, dk if need_k else None, dv, grad_s0, grad_z0, None, None


def _check(q, k, v, weights, normaliser, normalize, chunk_size):
    name = "sum_rule_triton"
    _common.check_inputs(name, _forward_kernel, q, k, v, weights, normaliser)
    batch, heads, _, d_dot = q.shape
    d_value = v.shape[-1]
    if weights is not None and tuple(weights.shape) != (batch, heads, d_dot, d_value):
        raise VariantError(f"{name}: weights must be [B, H, F, Dv] = {[batch, heads, d_dot, d_value]}, got {list(weights.shape)}")
    if normaliser is not None:
        if not normalize:
            raise VariantError(f"{name}: a normaliser was given with normalize=False")
        if tuple(normaliser.shape) != (batch, heads, d_dot):
            raise VariantError(f"{name}: normaliser must be [B, H, F] = {[batch, heads, d_dot]}, got {list(normaliser.shape)}")
    if chunk_size is not None:
        _common.check_chunk_size(name, chunk_size)


def sum_rule_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    weights: torch.Tensor | None = None,
    normaliser: torch.Tensor | None = None,
    *,
    normalize: bool,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Chunked causal sum rule on feature-mapped inputs (see the module docstring for the math).

    ``q, k: [B, H, T, F]``, ``v: [B, H, T, Dv]`` (one dtype: float32, float16 or bfloat16),
    ``weights`` S_0 ``[B, H, F, Dv]`` and ``normaliser`` z_0 ``[B, H, F]`` (only with
    ``normalize=True``), each zero when None. F and Dv at most 256. ``chunk_size`` defaults
    to 64 (32 when F or Dv exceeds 128); any positive int works, powers of two ≥ 16 waste nothing.

    Returns ``(y [B, H, T, Dv] in the input dtype, S_T [B, H, F, Dv] float32,
    z_T [B, H, F] float32 or None)``. Differentiable in q, k, v, weights and normaliser, with
    gradients flowing into S_T and z_T too (so calls can be chained through the state).
    """
    _check(q, k, v, weights, normaliser, normalize, chunk_size)
    y, s_final, z_final = _SumRuleFunction.apply(q, k, v, weights, normaliser, bool(normalize), chunk_size)
    return y, s_final, z_final


# --------------------------------------------------------------------------------------
# What `attnbench kernels` compiles.
# --------------------------------------------------------------------------------------


def compile_configs() -> list[dict]:
    """Every shipped configuration: each dtype and shape of ``_common.shipped_shapes``, with and without the normaliser."""
    return [
        dict(dtype=dtype, d_dot=d_dot, d_value=d_value, chunk_size=chunk, normalize=normalize)
        for dtype, d_dot, d_value, chunk in _common.shipped_shapes()
        for normalize in (True, False)
    ]


def config_label(config: dict) -> str:
    chunk = config["chunk_size"] or default_chunk_size(config["d_dot"], config["d_value"])
    norm = "norm" if config["normalize"] else "plain"
    return f"{_common.DTYPE_NAMES[config['dtype']]} F{config['d_dot']} Dv{config['d_value']} C{chunk} {norm}"


def record_launches(config: dict, capability: int) -> list[_common.Launch]:
    """The kernels a training step (forward, backward into q, k, v) of ``config`` launches at the
    reference shape on a GPU of compute capability ``capability`` (×10)."""
    shape = (_common.REFERENCE_BATCH, _common.REFERENCE_HEADS, _common.REFERENCE_SEQ_LEN)
    dtype = config["dtype"]
    q, k = (_common.meta_tensor(*shape, config["d_dot"], dtype=dtype) for _ in range(2))
    v = _common.meta_tensor(*shape, config["d_value"], dtype=dtype)
    return _common.record_training_step(
        sum_rule_triton, capability, [q, k, v], normalize=config["normalize"], chunk_size=config["chunk_size"]
    )

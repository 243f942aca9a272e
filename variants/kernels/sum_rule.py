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
dots (``FP32_DOT_PRECISION``), fp16/bf16 inputs use TF32 dots on fp32 operands, which is
exact on the 16-bit inputs themselves. y is written in the input dtype, the final state in
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

from ..base import UnsupportedBackend, VariantError
from ..feature_maps import EPS
from . import MAX_HEAD_DIM

#: Rows (F) or columns (Dv) of the state one program holds; a power of two ≥ 16.
STATE_BLOCK = 64
#: tl.dot precision for float32 inputs ("ieee": true fp32; "tf32" is faster and ~1e-3 relative).
FP32_DOT_PRECISION = "ieee"
#: Tests set this: new outputs and gradients start as NaN, so an element no kernel writes shows.
POISON = False

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _new_output(shape, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialised tensor on ``like``'s device (NaN-filled when ``POISON`` is set)."""
    dtype = like.dtype if dtype is None else dtype
    if POISON:
        return torch.full(shape, float("nan"), dtype=dtype, device=like.device)
    return torch.empty(shape, dtype=dtype, device=like.device)


def _pow2_block(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


# --------------------------------------------------------------------------------------
# Kernels. Tensors are contiguous; [B, H] is flattened into one program axis ``bh``.
# --------------------------------------------------------------------------------------


@triton.jit
def _state_tile(bh, offs_f, offs_v, F, DV):
    """Offsets and mask of rows ``offs_f``, columns ``offs_v`` of a contiguous [B·H, F, Dv] state."""
    offs = bh * F * DV + offs_f[:, None] * DV + offs_v[None, :]
    mask = (offs_f < F)[:, None] & (offs_v < DV)[None, :]
    return offs, mask


@triton.jit
def _load_or_zeros(ptr, offs, mask, PRESENT: tl.constexpr):
    """``ptr[offs]`` as float32 (masked, 0 outside) when ``PRESENT``, else float32 zeros of ``offs``'s shape."""
    if PRESENT:
        values = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        values = tl.zeros(offs.shape, dtype=tl.float32)
    return values


@triton.jit
def _chunk_rows(chunk, T, CHUNK, offs_c):
    """Token indices of chunk ``chunk`` and which of them are real (inside the chunk and the sequence)."""
    rows = chunk * CHUNK + offs_c
    return rows, (offs_c < CHUNK) & (rows < T)


@triton.jit
def _token_tile(bh, T, rows, row_ok, cols, width):
    """Offsets and mask of tokens ``rows``, columns ``cols`` of a contiguous [B·H, T, width] tensor."""
    offs = bh * T * width + rows[:, None] * width + cols[None, :]
    mask = row_ok[:, None] & (cols < width)[None, :]
    return offs, mask


@triton.jit
def _forward_kernel(
    q_ptr, k_ptr, v_ptr, s0_ptr, z0_ptr,  # inputs
    y_ptr, st_ptr, zt_ptr, rinv_ptr,  # outputs
    dy_ptr, delta_ptr,  # only with DELTA_ONLY
    T, F, DV, CHUNK, n_chunks,
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
    f_ok = offs_f < F
    causal = offs_c[:, None] >= offs_c[None, :]

    state_offs, state_mask = _state_tile(bh, offs_f, offs_v, F, DV)
    state = _load_or_zeros(s0_ptr, state_offs, state_mask, HAS_S0)
    norm = _load_or_zeros(z0_ptr, bh * F + offs_f, f_ok, HAS_Z0)

    for chunk in range(n_chunks):
        rows, row_ok = _chunk_rows(chunk, T, CHUNK, offs_c)
        qk_offs, qk_mask = _token_tile(bh, T, rows, row_ok, offs_f, F)
        v_offs, v_mask = _token_tile(bh, T, rows, row_ok, offs_v, DV)
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
                    tl.store(rinv_ptr + bh * T + rows, rinv, mask=row_ok)
            norm += tl.sum(k, axis=0)
        if DELTA_ONLY:
            dy = tl.load(dy_ptr + v_offs, mask=v_mask, other=0.0).to(tl.float32)
            n_bh = tl.num_programs(0).to(tl.int64)
            tl.store(delta_ptr + (pid_v * n_bh + bh) * T + rows, tl.sum(dy * out, axis=1), mask=row_ok)
        else:
            tl.store(y_ptr + v_offs, out.to(y_ptr.dtype.element_ty), mask=v_mask)
        state += tl.dot(tl.trans(k), v, input_precision=PRECISION)

    if not DELTA_ONLY:
        tl.store(st_ptr + state_offs, state, mask=state_mask)
        if NORMALIZE:
            if pid_v == 0:
                tl.store(zt_ptr + bh * F + offs_f, norm, mask=f_ok)


@triton.jit
def _load_cotangent(dy_ptr, rinv_ptr, delta_ptr, bh, T, DV, rows, row_ok, offs_v, NORMALIZE: tl.constexpr):
    """g = dy·r and dden = −r (dy·y) for one chunk (g = dy, dden = 0 without normalisation)."""
    dy_offs, dy_mask = _token_tile(bh, T, rows, row_ok, offs_v, DV)
    g = tl.load(dy_ptr + dy_offs, mask=dy_mask, other=0.0).to(tl.float32)
    if NORMALIZE:
        rinv = tl.load(rinv_ptr + bh * T + rows, mask=row_ok, other=0.0)
        delta = tl.load(delta_ptr + bh * T + rows, mask=row_ok, other=0.0)
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
    T, F, DV, CHUNK, n_chunks,
    HAS_S0: tl.constexpr, HAS_Z0: tl.constexpr, NORMALIZE: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_V: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (bh, i): dq[:, block i of F] = P K + G Sᵀ + dden zᵀ, forward over chunks
    carrying rows block i of S (all Dv columns) and of z."""
    bh = tl.program_id(0).to(tl.int64)
    pid_f = tl.program_id(1)
    offs_c = tl.arange(0, BLOCK_C)
    offs_f = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    offs_v = tl.arange(0, BLOCK_V)
    causal = offs_c[:, None] >= offs_c[None, :]

    state_offs, state_mask = _state_tile(bh, offs_f, offs_v, F, DV)
    state = _load_or_zeros(s0_ptr, state_offs, state_mask, HAS_S0)
    norm = _load_or_zeros(z0_ptr, bh * F + offs_f, offs_f < F, HAS_Z0)

    for chunk in range(n_chunks):
        rows, row_ok = _chunk_rows(chunk, T, CHUNK, offs_c)
        k_offs, k_mask = _token_tile(bh, T, rows, row_ok, offs_f, F)
        v_offs, v_mask = _token_tile(bh, T, rows, row_ok, offs_v, DV)
        k = tl.load(k_ptr + k_offs, mask=k_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + v_offs, mask=v_mask, other=0.0).to(tl.float32)
        g, dden = _load_cotangent(dy_ptr, rinv_ptr, delta_ptr, bh, T, DV, rows, row_ok, offs_v, NORMALIZE)

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
    T, F, DV, CHUNK, n_chunks,
    HAS_DST: tl.constexpr, HAS_DZT: tl.constexpr, NORMALIZE: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_V: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (bh, i): dk[:, block i of F] = Pᵀ Q + V dSᵀ + 1 dzᵀ, backward over chunks
    carrying rows block i of dS and of dz; ends with dS_0, dz_0 of those rows."""
    bh = tl.program_id(0).to(tl.int64)
    pid_f = tl.program_id(1)
    offs_c = tl.arange(0, BLOCK_C)
    offs_f = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    offs_v = tl.arange(0, BLOCK_V)
    f_ok = offs_f < F
    causal = offs_c[:, None] >= offs_c[None, :]

    state_offs, state_mask = _state_tile(bh, offs_f, offs_v, F, DV)
    dstate = _load_or_zeros(dst_ptr, state_offs, state_mask, HAS_DST)
    dnorm = _load_or_zeros(dzt_ptr, bh * F + offs_f, f_ok, HAS_DZT)

    for step in range(n_chunks):
        rows, row_ok = _chunk_rows(n_chunks - 1 - step, T, CHUNK, offs_c)
        q_offs, q_mask = _token_tile(bh, T, rows, row_ok, offs_f, F)
        v_offs, v_mask = _token_tile(bh, T, rows, row_ok, offs_v, DV)
        q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + v_offs, mask=v_mask, other=0.0).to(tl.float32)
        g, dden = _load_cotangent(dy_ptr, rinv_ptr, delta_ptr, bh, T, DV, rows, row_ok, offs_v, NORMALIZE)

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
        tl.store(dz0_ptr + bh * F + offs_f, dnorm, mask=f_ok)


@triton.jit
def _backward_dv_kernel(
    q_ptr, k_ptr, dst_ptr, dy_ptr, rinv_ptr, delta_ptr,
    dv_ptr,
    T, F, DV, CHUNK, n_chunks,
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

    state_offs, state_mask = _state_tile(bh, offs_f, offs_v, F, DV)
    dstate = _load_or_zeros(dst_ptr, state_offs, state_mask, HAS_DST)

    for step in range(n_chunks):
        rows, row_ok = _chunk_rows(n_chunks - 1 - step, T, CHUNK, offs_c)
        qk_offs, qk_mask = _token_tile(bh, T, rows, row_ok, offs_f, F)
        v_offs, v_mask = _token_tile(bh, T, rows, row_ok, offs_v, DV)
        q = tl.load(q_ptr + qk_offs, mask=qk_mask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + qk_offs, mask=qk_mask, other=0.0).to(tl.float32)
        g, dden = _load_cotangent(dy_ptr, rinv_ptr, delta_ptr, bh, T, DV, rows, row_ok, offs_v, NORMALIZE)

        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        scores = tl.where(causal, scores, 0.0)
        dv = tl.dot(tl.trans(scores), g, input_precision=PRECISION)
        dv += tl.dot(k, dstate, input_precision=PRECISION)
        tl.store(dv_ptr + v_offs, dv.to(dv_ptr.dtype.element_ty), mask=v_mask)
        dstate += tl.dot(tl.trans(q), g, input_precision=PRECISION)


# --------------------------------------------------------------------------------------
# Launch configuration and the autograd wrapper.
# --------------------------------------------------------------------------------------


class _Config:
    """Block sizes, chunking and launch options for one call (no autotuning)."""

    def __init__(self, q: torch.Tensor, v: torch.Tensor, chunk_size: int | None):
        batch, heads, self.length, self.d_dot = q.shape
        self.d_value = v.shape[-1]
        self.bh = batch * heads
        if chunk_size is None:
            chunk_size = 64 if max(self.d_dot, self.d_value) <= 128 else 32
        self.chunk = chunk_size
        self.n_chunks = triton.cdiv(self.length, chunk_size)
        self.block_c = _pow2_block(chunk_size)
        self.block_f = _pow2_block(self.d_dot)
        self.block_v = _pow2_block(self.d_value)
        self.split_f = min(self.block_f, STATE_BLOCK)
        self.split_v = min(self.block_v, STATE_BLOCK)
        self.precision = FP32_DOT_PRECISION if q.dtype == torch.float32 else "tf32"
        self.num_warps = 4 if max(self.block_f, self.block_v) <= 64 and self.block_c <= 32 else 8

    def grid_f(self):
        return (self.bh, triton.cdiv(self.d_dot, self.split_f))

    def grid_v(self):
        return (self.bh, triton.cdiv(self.d_value, self.split_v))

    def sizes(self):
        return (self.length, self.d_dot, self.d_value, self.chunk, self.n_chunks)


def _dy_dot_y(q, k, v, s0, z0, dy, y, cfg) -> torch.Tensor:
    """δ_t = dy_t·y_t ``[B, H, T]`` in float32: from the saved y for float32 inputs, else from y
    recomputed in float32 by the forward kernel (the returned 16-bit y would cost its rounding:
    at an early token with a small q·z, dq and dk are differences of nearly equal terms)."""
    if y is not None:
        return (dy.to(torch.float32) * y).sum(-1).contiguous()
    n_blocks = cfg.grid_v()[1]
    partial = _new_output((n_blocks, *dy.shape[:3]), dy, torch.float32)
    dummy = partial
    _forward_kernel[cfg.grid_v()](
        q, k, v, s0 if s0 is not None else dummy, z0 if z0 is not None else dummy,
        dummy, dummy, dummy, dummy, dy, partial,
        *cfg.sizes(),
        HAS_S0=s0 is not None, HAS_Z0=z0 is not None, NORMALIZE=True, DELTA_ONLY=True,
        BLOCK_C=cfg.block_c, BLOCK_F=cfg.block_f, BLOCK_V=cfg.split_v,
        PRECISION=cfg.precision, EPSILON=EPS, num_warps=cfg.num_warps,
    )  # fmt: skip
    return partial.sum(0)


def _as_float32(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.detach().to(torch.float32).contiguous()


class _SumRuleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, weights, normaliser, normalize, chunk_size):
        cfg = _Config(q, v, chunk_size)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        s0, z0 = _as_float32(weights), _as_float32(normaliser)
        batch, heads, length, d_dot = q.shape
        d_value = v.shape[-1]

        y = _new_output((batch, heads, length, d_value), v)
        s_final = _new_output((batch, heads, d_dot, d_value), v, torch.float32)
        z_final = _new_output((batch, heads, d_dot), v, torch.float32) if normalize else None
        rinv = _new_output((batch, heads, length), v, torch.float32) if normalize else None
        dummy = s_final  # stands in for absent optional pointers; never read or written
        _forward_kernel[cfg.grid_v()](
            q, k, v, s0 if s0 is not None else dummy, z0 if z0 is not None else dummy,
            y, s_final, z_final if normalize else dummy, rinv if normalize else dummy, dummy, dummy,
            *cfg.sizes(),
            HAS_S0=s0 is not None, HAS_Z0=z0 is not None, NORMALIZE=normalize, DELTA_ONLY=False,
            BLOCK_C=cfg.block_c, BLOCK_F=cfg.block_f, BLOCK_V=cfg.split_v,
            PRECISION=cfg.precision, EPSILON=EPS, num_warps=cfg.num_warps,
        )  # fmt: skip
        ctx.cfg, ctx.normalize = cfg, normalize
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
        cfg, normalize = ctx.cfg, ctx.normalize
        need_q, need_k, need_v, need_s0, need_z0 = ctx.needs_input_grad[:5]
        if dy is None:
            dy = torch.zeros_like(v)
        dy = dy.contiguous()
        delta = _dy_dot_y(q, k, v, s0, z0, dy, y, cfg) if normalize else None
        ds_final = _as_float32(ds_final)
        dz_final = _as_float32(dz_final) if normalize else None
        has_dst, has_dzt = ds_final is not None, dz_final is not None
        dummy = dy
        common = dict(
            NORMALIZE=normalize, BLOCK_C=cfg.block_c, PRECISION=cfg.precision, num_warps=cfg.num_warps
        )  # fmt: skip
        rinv_arg = rinv if normalize else dummy
        delta_arg = delta if normalize else dummy

        dq = dk = dv = ds0 = dz0 = None
        if need_q:
            dq = _new_output(q.shape, q)
            _backward_dq_kernel[cfg.grid_f()](
                k, v, s0 if s0 is not None else dummy, z0 if z0 is not None else dummy, dy, rinv_arg, delta_arg,
                dq, *cfg.sizes(),
                HAS_S0=s0 is not None, HAS_Z0=z0 is not None,
                BLOCK_F=cfg.split_f, BLOCK_V=cfg.block_v, **common,
            )  # fmt: skip
        if need_k or need_s0 or need_z0:
            dk = _new_output(k.shape, k)
            ds0 = _new_output((cfg.bh, cfg.d_dot, cfg.d_value), q, torch.float32)
            dz0 = _new_output((cfg.bh, cfg.d_dot), q, torch.float32) if normalize else None
            _backward_dk_kernel[cfg.grid_f()](
                q, v, ds_final if has_dst else dummy, dz_final if has_dzt else dummy, dy, rinv_arg, delta_arg,
                dk, ds0, dz0 if normalize else dummy, *cfg.sizes(),
                HAS_DST=has_dst, HAS_DZT=has_dzt,
                BLOCK_F=cfg.split_f, BLOCK_V=cfg.block_v, **common,
            )  # fmt: skip
        if need_v:
            dv = _new_output(v.shape, v)
            _backward_dv_kernel[cfg.grid_v()](
                q, k, ds_final if has_dst else dummy, dy, rinv_arg, delta_arg,
                dv, *cfg.sizes(),
                HAS_DST=has_dst,
                BLOCK_F=cfg.block_f, BLOCK_V=cfg.split_v, **common,
            )  # fmt: skip

        weights_dtype, normaliser_dtype = ctx.state_dtypes
        grad_s0 = ds0.view(*q.shape[:2], cfg.d_dot, cfg.d_value).to(weights_dtype) if need_s0 and ctx.has_s0 else None
        grad_z0 = dz0.view(*q.shape[:2], cfg.d_dot).to(normaliser_dtype) if need_z0 and ctx.has_z0 else None
        return dq, dk if need_k else None, dv, grad_s0, grad_z0, None, None


def _check(q, k, v, weights, normaliser, normalize, chunk_size):
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise VariantError(
            f"sum_rule_triton expects q, k: [B, H, T, F] and v: [B, H, T, Dv], "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    batch, heads, _, d_dot = q.shape
    d_value = v.shape[-1]
    if d_dot > MAX_HEAD_DIM or d_value > MAX_HEAD_DIM:
        raise UnsupportedBackend(
            f"sum_rule_triton supports d_dot and d_value up to {MAX_HEAD_DIM}, got d_dot={d_dot}, d_value={d_value}: use backend='torch'"
        )
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _SUPPORTED_DTYPES:
        raise UnsupportedBackend(
            f"sum_rule_triton takes q, k, v of one dtype among float32, float16, bfloat16, "
            f"got {q.dtype}, {k.dtype}, {v.dtype}: use backend='torch'"
        )
    if weights is not None and tuple(weights.shape) != (batch, heads, d_dot, d_value):
        raise VariantError(f"weights must be [B, H, F, Dv] = {[batch, heads, d_dot, d_value]}, got {list(weights.shape)}")
    if normaliser is not None:
        if not normalize:
            raise VariantError("sum_rule_triton: a normaliser was given with normalize=False")
        if tuple(normaliser.shape) != (batch, heads, d_dot):
            raise VariantError(f"normaliser must be [B, H, F] = {[batch, heads, d_dot]}, got {list(normaliser.shape)}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1):
        raise VariantError(f"chunk_size must be a positive int, got {chunk_size!r}")
    devices = {t.device for t in (q, k, v, weights, normaliser) if t is not None}
    if len(devices) != 1:
        raise VariantError(f"sum_rule_triton: all tensors must be on one device, got {sorted(map(str, devices))}")
    if q.device.type == "cpu" and not _interpreted():
        raise UnsupportedBackend(
            "sum_rule_triton on CPU tensors needs Triton's interpreter: set TRITON_INTERPRET=1 before triton is imported"
        )


def _interpreted() -> bool:
    return type(_forward_kernel).__name__ == "InterpretedFunction"


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

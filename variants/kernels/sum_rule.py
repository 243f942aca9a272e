"""Chunk-parallel causal sum rule (linear attention) in Triton, forward and backward.

Inputs are already feature-mapped: ``q, k: [B, H, T, F]`` (F = d_dot), ``v: [B, H, T, Dv]``.
With S_0 ``[F, Dv]`` and z_0 ``[F]`` the initial state (zero when not given), per (b, h)
(Katharopoulos et al. 2020, eq. 9-12; Schlag et al. 2021, eq. 17-19):

    S_t = S_0 + Σ_{i≤t} k_i v_iᵀ,   z_t = z_0 + Σ_{i≤t} k_i,
    num_t = S_tᵀ q_t,   den_t = q_t·z_t,
    y_t = num_t                       (normalize=False)
    y_t = num_t / (den_t + ε)         (normalize=True, ε = variants.feature_maps.EPS)

Three faces, as everywhere in the library: :func:`sum_rule_triton` (these kernels, the chunked
parallel form), ``variants.chunked.sum_rule_chunked`` (the PyTorch chunked form, the reference the
tests tie this file to) and the recurrent ``step`` of ``variants.sum_rule``.

Forward, in two launches, with chunk c holding Q_c, K_c ``[C, F]``, V_c ``[C, Dv]``:

  (a) ``_chunk_scan_kernel``, one program per (state row: b·h, F×Dv tile), the only sequential part: it walks
      the chunks with its state tile in fp32 registers, stores the state each chunk starts from,
      S_c = S_0 + Σ_{c'<c} K_c'ᵀ V_c' (z_c likewise, from K_c'ᵀ 1), then adds the chunk's own K_cᵀ V_c;
      the last sum is S_T, z_T (fla's ``chunk_fwd_h`` has the same shape);
  (b) ``_chunk_output_kernel``, one program per (chunk, b·h, Dv block), in parallel:
      A = tril(Q_c K_cᵀ) (causal, inclusive), num = A V_c + Q_c S_c, den = A 1 + Q_c z_c.

For the normalised form (b) also keeps r_t = 1 / (den_t + ε) for the backward. The states of
(a) live in one fp32 buffer ``[B·H, n_chunks, W]``, row c = [S_c flattened (F·Dv), z_c (F, only
when normalising)]; the backward recomputes them (one launch of (a)) rather than keeping them from the forward.

Backward. Let dy_t, dS_T, dz_T be the incoming gradients (zero when absent), and

    g_t = dy_t r_t,   dden_t = −r_t (dy_t·y_t)     (normalised; else g_t = dy_t, dden_t = 0)

(the gradient of y = num·r through r = 1/(den + ε): ∂y/∂den = −y r). Then num_t, den_t depend
on q_t through S_t, z_t and on k_i, v_i, S_0, z_0 through every S_t, z_t with t ≥ i, so with
the reverse-time sums  dS̃_i = dS_T + Σ_{t≥i} q_t g_tᵀ  and  dz̃_i = dz_T + Σ_{t≥i} dden_t q_t:

    dq_t = S_t g_t + dden_t z_t,   dk_i = dS̃_i v_i + dz̃_i,   dv_i = dS̃_iᵀ k_i,
    dS_0 = dS̃_1,   dz_0 = dz̃_1.

Chunked, with P = tril(G Vᵀ + dden 1ᵀ) ``[C, C]`` (P_{ti} = g_t·v_i + dden_t for t ≥ i) and
dS_c, dz_c the gradient reaching chunk c from after it:

    dq = P K + G S_cᵀ + dden z_cᵀ,   dk = Pᵀ Q + V dS_cᵀ + 1 dz_cᵀ,   dv = Aᵀ G + K dS_c,
    dS_c = dS_T + Σ_{c'>c} Q_c'ᵀ G_c',   dz_c = dz_T + Σ_{c'>c} Q_c'ᵀ dden_c'.

The same (a) gives dS_c, dz_c: on (Q, G, dden) instead of (K, V, 1), walking the chunks in reverse,
starting from dS_T, dz_T and ending with dS_0, dz_0. Then ``_backward_dqk_kernel`` (one program per
(chunk, b·h, F block)) and ``_backward_dv_kernel`` (per (chunk, b·h, Dv block)), in parallel, with
G = diag(r) dY applied after the products with dY: P = diag(r)(dY Vᵀ − δ 1ᵀ) (before tril),
G S_cᵀ + dden z_cᵀ = diag(r)(dY S_cᵀ − δ z_cᵀ), Aᵀ G = (diag(r) A)ᵀ dY. So dY enters the dots as it
is and the nearly cancelling differences (g_t·v_i vs r_t δ_t) are taken in float32.
δ_t = dy_t·y_t uses the returned y for float32 inputs; for 16-bit inputs (b) reruns to recompute y
in float32 (the rounded y would put its rounding error into dq and dk, badly so at tokens where
q·z is small). For the same reason, with 16-bit operands den's A 1 sums A as rounded for the A V product, so that
y_t stays a weighted mean of the v_i whatever the rounding (at a sequence's first token, where one weight is all, dq_t
is then ~0 as it should be, not the rounding of y_t times 1/q·z: 4 of 150 bf16 seeds failed there before).

Precision: the running states and every accumulation are float32. fp16/bf16 inputs go into 16-bit tensor-core
dots as they are; the fp32 tiles they meet (A, P, diag(r) A, G in (a), the states) are rounded to the
input dtype as dot operands (``_common.dot``; sm_70, without bf16 tensor cores, multiplies in fp32), so (a)
stores the chunk states S_c, dS_c already rounded so (half the bytes; the same products; from sm_90 on and in the
interpreter, ``HALF_STATES_FROM``), z_c, dz_c in fp32.
fp32 inputs use IEEE fp32 dots (``_common.FP32_DOT_PRECISION``), TF32 ones with ``precision="tf32"``. y is written in the input dtype,
S_T and z_T in float32. F and Dv are padded to powers of two (≥ 16, for tl.dot) with masks, at most
256 each; the chunk kernels loop over F (or Dv) in blocks of ``STATE_BLOCK``, so their tiles stay
[C, 64] ([C, 32] with fp32 operands) whatever d. Memory: one state per chunk and b·h, 2·F·Dv + 4·F bytes
with 16-bit inputs, 4·(F·Dv + F) with fp32 ones (16 and 32 MiB at B·H = 8, T = 16384, d = 64; 4× at d = 128);
the backward holds two.
"""

from __future__ import annotations

import torch
import triton
from torch.autograd.function import once_differentiable

from ..base import VariantError
from ..feature_maps import EPS
from . import _common, check_chunk_size, default_chunk_size
from ._common import launch, new_output
from .sum_rule_backward import _backward_dqk_kernel, _backward_dv_kernel
from .sum_rule_forward import _chunk_output_kernel, _chunk_scan_kernel

#: The first compute capability (×10) whose chunk states are stored in 16-bit inputs' own dtype (``_Tiles.state_dtype``;
#: the interpreter too). On sm_80 loading them so took ``forward_output`` and ``backward_dv`` from 140-146 to 196-198
#: registers a thread, 8 warps per SM instead of 12 (compile table, docs/performance.md, "Kernel redesign"): fp32 there.
HALF_STATES_FROM = 90
#: Rows (d_dot) or columns (d_value) of a state tile with 16-bit dot operands up to C = 64, a power of two ≥ 16
#: (``_common.tile_plan`` narrows it for fp32 operands and C = 128).
STATE_BLOCK = 64


# --------------------------------------------------------------------------------------
# Launch configuration and the autograd wrapper.
# --------------------------------------------------------------------------------------


class _Tiles(_common.Tiles):
    """Chunk kernels: [C, ``block_f``] tiles of q, k and [C, ``block_v``] of v and their warps
        (``_common.tile_plan`` of STATE_BLOCK), 8 warps for dq, dk (``options(wide=True)``: three [C, ·] fp32
        accumulators); the scan (a) carries one [``block_f``, ``block_v``] state tile a program. ``width`` is an initial or final
    state row (S, then z, fp32); ``state_dtype`` the chunk states' (16-bit inputs' own, the dots' operand dtype, from
        ``HALF_STATES_FROM`` on; else fp32).
        Chosen by compiling (docs/performance.md, "Compiled kernels"): at every chunk size these spill nothing at
        d ≤ 128 in 16-bit on sm_80, sm_90."""

    def __init__(self, q: torch.Tensor, v: torch.Tensor, chunk_size: int, normalize: bool, precision: str, packing=None):
        batch, heads, seq_len, d_dot = q.shape
        d_value = v.shape[-1]
        super().__init__(batch, heads, seq_len, d_dot, d_value, chunk_size, q.dtype, q.device, precision, packing)
        self.device, self.normalize = q.device, normalize
        self.width = d_dot * d_value + (d_dot if normalize else 0)
        capability = _common.capability(q.device)
        half_states = self.precision.startswith("input") and (capability is None or capability >= HALF_STATES_FROM)
        self.state_dtype = q.dtype if half_states else torch.float32
        block, self.num_warps = _common.tile_plan(self.precision, self.block_c, STATE_BLOCK)
        self.block_f, self.block_v = min(self.pad_f, block), min(self.pad_v, block)
        self.num_f, self.num_v = triton.cdiv(d_dot, self.block_f), triton.cdiv(d_value, self.block_v)
        self.num_stages = 2

    def options(self, wide: bool = False) -> dict:
        return dict(num_warps=8 if wide else self.num_warps, num_stages=self.num_stages)

    def constexprs(self) -> dict:
        return dict(VARLEN=self.varlen, BLOCK_C=self.block_c, BLOCK_F=self.block_f, BLOCK_V=self.block_v, PRECISION=self.precision)


def _chunk_states(x, y, initial, tiles: _Tiles, *, rinv=None, delta=None, reverse=False, name=""):
    """(a): the states every chunk starts from, ``(S_c [B·H, n_chunks, F·Dv] in tiles.state_dtype, z_c [B·H, n_chunks, F]
    float32)`` (without the normaliser S_c twice: the kernels read no z_c), and the last one of each state row
    ``[B·H (packed: N·H), width]`` (S_T, z_T); with ``reverse`` (x = q, y = dy) the gradient reaching each chunk
    from after it and dS_0, dz_0."""
    states = new_output((tiles.bh, tiles.num_chunks, tiles.d_dot * tiles.d_value), x, tiles.state_dtype)
    norms = new_output((tiles.bh, tiles.num_chunks, tiles.d_dot), x, torch.float32) if tiles.normalize else states
    final = new_output((tiles.state_rows, tiles.width), x, torch.float32)
    chunk_table, sequence_table = tiles.tables(x)
    launch(
        _chunk_scan_kernel, (tiles.state_rows, tiles.num_f * tiles.num_v),
        x, y, states if rinv is None else rinv, states if delta is None else delta, states if initial is None else initial, states, norms, final,
        chunk_table, sequence_table, *tiles.sizes(), tiles.width, tiles.heads,
        HAS_INITIAL=initial is not None, NORMALIZE=tiles.normalize, COTANGENT=reverse, REVERSE=reverse, **tiles.constexprs(),
        options=tiles.options(), name=f"{name}_scan",
    )  # fmt: skip
    return (states, norms), final


def _state_row(weights, normaliser, tiles: _Tiles) -> torch.Tensor | None:
    """S (and z) as one fp32 state row per b·h (packed: per sequence and head), ``[B·H, width]``; None when both are absent."""
    if weights is None and normaliser is None:
        return None
    rows = tiles.state_rows
    parts = [torch.zeros(rows, tiles.d_dot * tiles.d_value, device=tiles.device) if weights is None else weights.reshape(rows, -1)]
    if tiles.normalize:
        parts.append(torch.zeros(rows, tiles.d_dot, device=tiles.device) if normaliser is None else normaliser.reshape(rows, -1))
    return torch.cat([part.to(torch.float32) for part in parts], dim=1)


def _split_state_row(row: torch.Tensor, tiles: _Tiles):
    """The inverse of ``_state_row``: S ``[B, H, F, Dv]`` and z ``[B, H, F]`` (None without the normaliser); packed, N for B."""
    size, batch = tiles.d_dot * tiles.d_value, tiles.state_batch
    weights = row[:, :size].reshape(batch, tiles.heads, tiles.d_dot, tiles.d_value).contiguous()
    normaliser = row[:, size:].reshape(batch, tiles.heads, tiles.d_dot).contiguous() if tiles.normalize else None
    return weights, normaliser


def _output(q, k, v, chunk_states, tiles: _Tiles, *, dy=None, name="forward_output"):
    """(b): y and r (None without the normaliser); with ``dy``, δ = dy·y in float32 ``[B, H, T]`` instead."""
    shape = (tiles.batch, tiles.heads, tiles.seq_len)
    if dy is None:
        y = new_output((*shape, tiles.d_value), v)
        rinv = new_output(shape, v, torch.float32) if tiles.normalize else y
        partial = y
    else:
        partial = new_output((tiles.num_v, *shape), dy, torch.float32)
        y = rinv = partial
    launch(
        _chunk_output_kernel, (tiles.num_chunks, tiles.bh, tiles.num_v),
        q, k, v, *chunk_states, y, rinv, partial if dy is None else dy, partial, tiles.tables(q)[0], *tiles.sizes(),
        NORMALIZE=tiles.normalize, DELTA_ONLY=dy is not None, **tiles.constexprs(), EPSILON=EPS,
        options=tiles.options(), name=name,
    )  # fmt: skip
    if dy is not None:
        return partial.sum(0)
    return y, rinv if tiles.normalize else None


class _SumRuleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, weights, normaliser, normalize, chunk_size, precision, packing):
        tiles = _Tiles(q, v, chunk_size, normalize, precision, packing)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        initial = _state_row(weights, normaliser, tiles)
        chunk_states, final = _chunk_states(k, v, initial, tiles, name="forward")
        y, rinv = _output(q, k, v, chunk_states, tiles)
        s_final, z_final = _split_state_row(final, tiles)
        ctx.tiles = tiles
        ctx.state_dtypes = (None if weights is None else weights.dtype, None if normaliser is None else normaliser.dtype)
        # dy·y in backward: from y itself when it is float32, else from y recomputed in float32
        ctx.save_for_backward(q, k, v, initial, y if normalize and y.dtype == torch.float32 else None, rinv)
        ctx.set_materialize_grads(False)
        return y, s_final, z_final

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, ds_final, dz_final):
        q, k, v, initial, y, rinv = ctx.saved_tensors
        tiles = ctx.tiles
        need_q, need_k, need_v, need_s0, need_z0 = ctx.needs_input_grad[:5]
        dy = torch.zeros_like(v) if dy is None else dy.contiguous()
        chunk_states = delta = None
        if need_q or need_k or (tiles.normalize and y is None):
            chunk_states, _ = _chunk_states(k, v, initial, tiles, name="recompute")
        if tiles.normalize:
            delta = (dy.to(torch.float32) * y).sum(-1) if y is not None else _output(q, k, v, chunk_states, tiles, dy=dy, name="recompute_dy_dot_y")
        dinitial = None if ds_final is None and dz_final is None else _state_row(ds_final, dz_final, tiles)
        dchunk_states, dfinal = _chunk_states(q, dy, dinitial, tiles, rinv=rinv, delta=delta, reverse=True, name="backward")
        common = dict(**tiles.constexprs(), NORMALIZE=tiles.normalize)
        rinv_arg = dy if rinv is None else rinv

        dq = dk = dv = None
        if need_q or need_k:
            dq, dk = new_output(q.shape, q), new_output(k.shape, k)
            launch(
                _backward_dqk_kernel, (tiles.num_chunks, tiles.bh, tiles.num_f),
                q, k, v, dy, rinv_arg, dy if delta is None else delta, *chunk_states, *dchunk_states, dq, dk, tiles.tables(q)[0], *tiles.sizes(), **common,
                options=tiles.options(wide=True),
            )  # fmt: skip
        if need_v:
            dv = new_output(v.shape, v)
            launch(
                _backward_dv_kernel, (tiles.num_chunks, tiles.bh, tiles.num_v),
                q, k, dy, rinv_arg, dchunk_states[0], dv, tiles.tables(q)[0], *tiles.sizes(), **common, options=tiles.options(),
            )  # fmt: skip

        ds0, dz0 = _split_state_row(dfinal, tiles)
        weights_dtype, normaliser_dtype = ctx.state_dtypes
        grad_s0 = ds0.to(weights_dtype) if need_s0 and weights_dtype is not None else None
        grad_z0 = dz0.to(normaliser_dtype) if need_z0 and normaliser_dtype is not None else None
        return dq if need_q else None, dk if need_k else None, dv, grad_s0, grad_z0, None, None, None, None


def _check(q, k, v, weights, normaliser, normalize, chunk_size, precision, cu_seqlens) -> tuple[int, _common.Packing | None]:
    """Validate the arguments; return the chunk size to use and the packing of ``cu_seqlens``."""
    name = "sum_rule_triton"
    _common.check_precision(name, precision)
    _common.check_inputs(name, _chunk_output_kernel, q, k, v, weights, normaliser)
    _, heads, _, d_dot = q.shape
    chunk_size = default_chunk_size("sum_rule", d_dot) if chunk_size is None else chunk_size
    check_chunk_size(name, "sum_rule", d_dot, chunk_size)
    packing = _common.packing(name, q, cu_seqlens, chunk_size)
    batch = q.shape[0] if packing is None else packing.num_sequences
    d_value = v.shape[-1]
    if weights is not None and tuple(weights.shape) != (batch, heads, d_dot, d_value):
        raise VariantError(f"{name}: weights must be [B, H, F, Dv] = {[batch, heads, d_dot, d_value]}, got {list(weights.shape)}")
    if normaliser is not None:
        if not normalize:
            raise VariantError(f"{name}: a normaliser was given with normalize=False")
        if tuple(normaliser.shape) != (batch, heads, d_dot):
            raise VariantError(f"{name}: normaliser must be [B, H, F] = {[batch, heads, d_dot]}, got {list(normaliser.shape)}")
    return chunk_size, packing


def sum_rule_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    weights: torch.Tensor | None = None,
    normaliser: torch.Tensor | None = None,
    *,
    normalize: bool,
    chunk_size: int | None = None,
    precision: str = _common.FP32_DOT_PRECISION,
    cu_seqlens=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Chunked causal sum rule on feature-mapped inputs (see the module docstring for the math).

    ``q, k: [B, H, T, F]``, ``v: [B, H, T, Dv]`` (one dtype: float32, float16 or bfloat16),
    ``weights`` S_0 ``[B, H, F, Dv]`` and ``normaliser`` z_0 ``[B, H, F]`` (only with
    ``normalize=True``), each zero when None. F and Dv at most 256. ``chunk_size``: one of
    ``kernels.chunk_sizes("sum_rule", F)`` (16, 32, 64, 128), default 64. ``precision``: the dots of
    float32 inputs, "ieee" (default) or "tf32" (sm_80 on; 16-bit inputs always use 16-bit dots).

    Returns ``(y [B, H, T, Dv] in the input dtype, S_T [B, H, F, Dv] float32,
    z_T [B, H, F] float32 or None)``. Differentiable in q, k, v, weights and normaliser, with
    gradients flowing into S_T and z_T too (so calls can be chained through the state).

    ``cu_seqlens``: N packed sequences in one row (B = 1), offsets ``[N + 1]`` as ints or an int tensor (read on
    the host; ``_common.packing`` caches what the kernels need per offsets): each sequence is cut into chunks of
    its own and starts from its own state, so S_0, z_0, S_T and z_T are ``[N, H, ...]``.
    """
    chunk_size, packing = _check(q, k, v, weights, normaliser, normalize, chunk_size, precision, cu_seqlens)
    y, s_final, z_final = _SumRuleFunction.apply(q, k, v, weights, normaliser, bool(normalize), chunk_size, precision, packing)
    return y, s_final, z_final


# --------------------------------------------------------------------------------------
# What `attnbench kernels` compiles.
# --------------------------------------------------------------------------------------


def compile_configs() -> list[dict]:
    """Every reachable configuration: each dtype, shape and chunk size of ``_common.shipped_shapes``, with and without
    the normaliser; and packed sequences (``_common.PACKED_BOUNDS``) in bf16 at d = 64, chunk 64, with and without it."""
    dense = [
        dict(dtype=dtype, d_dot=d_dot, d_value=d_value, chunk_size=chunk, normalize=normalize)
        for dtype, d_dot, d_value, chunk in _common.shipped_shapes("sum_rule")
        for normalize in (True, False)
    ]
    return dense + [dict(dtype=torch.bfloat16, d_dot=64, d_value=64, chunk_size=64, normalize=normalize, packed=True) for normalize in (True, False)]


def config_label(config: dict) -> str:
    norm = "norm" if config["normalize"] else "plain"
    packed = " packed" if config.get("packed") else ""
    return f"{_common.DTYPE_NAMES[config['dtype']]} F{config['d_dot']} Dv{config['d_value']} C{config['chunk_size']} {norm}{packed}"


def record_launches(config: dict, capability: int) -> list[_common.Launch]:
    """The kernels a training step (forward, backward into q, k, v) of ``config`` launches at the
    reference shape on a GPU of compute capability ``capability`` (×10)."""
    shape = (_common.REFERENCE_BATCH, _common.REFERENCE_HEADS, _common.REFERENCE_SEQ_LEN)
    dtype = config["dtype"]
    q, k = (_common.meta_tensor(*shape, config["d_dot"], dtype=dtype) for _ in range(2))
    v = _common.meta_tensor(*shape, config["d_value"], dtype=dtype)
    packed = {"cu_seqlens": _common.PACKED_BOUNDS} if config.get("packed") else {}
    return _common.record_training_step(sum_rule_triton, capability, [q, k, v], normalize=config["normalize"], chunk_size=config["chunk_size"], **packed)

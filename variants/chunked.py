"""The chunked scan machinery shared by every linear-time variant.

Both scans take raw queries and keys and apply the feature map φ chunk by chunk, so the
feature-mapped sequence never exists in full. They carry a fast weight matrix ``S`` of
shape ``[B, H, d_dot, Dv]`` (the transpose of Schlag et al.'s ``W``, so that a read is
``φ(q)ᵀ S``) and, for the attention normaliser, ``z = Σ φ(k)`` of shape ``[B, H, d_dot]``.
Within a chunk of C tokens the work is a few dense C×C and C×d products; across chunks
only the state is carried, so memory stays linear in T, no T×T matrix is formed and no
T-long prefix sum is materialised. T need not be a multiple of C: the last chunk is
simply shorter. The inputs are cut by one ``split`` (a slice per chunk makes the backward
scatter each chunk's gradient into a zero tensor of the full length: quadratic in T) and
the outputs gathered by ``_Output``. Over packed sequences (``bounds``, ``cu_seqlens`` as ints) no
chunk straddles a boundary and each sequence starts from its own row of the initial state
(``_packed_chunks``): the scan is still one loop over the chunks, and returns the N final states.

Precision: the state is kept in ``state_dtype`` (float32 for bfloat16 and float16 inputs, as the
Triton kernels keep theirs), and every product with the state, and the delta rule's triangular
solve, is taken in that dtype; the products within a chunk (φ(Q)φ(K)ᵀ, KKᵀ, scores times values)
stay in the input dtype (``chunk_dtype``: float32 for 16-bit inputs with the attention normaliser).
The output is in the input dtype.
"""

from __future__ import annotations

import functools
import itertools
import math

import torch

from .base import checks_due
from .feature_maps import EPS
from .precision import state_dtype


def _check_chunk_size(chunk_size) -> None:
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def _chunks(length: int, chunk_size: int):
    _check_chunk_size(chunk_size)
    return [(start, min(start + chunk_size, length)) for start in range(0, length, chunk_size)]


def _split_time(chunk_size, *sequences):
    """Per chunk (of ``chunk_size``, or of each of a list of sizes), a tuple of views of each
    ``[B, H, T, ...]`` sequence (None stays None).

    One ``split`` per sequence: its backward joins the chunk gradients once, whereas a slice
    per chunk would scatter each into a zero tensor of the full length (quadratic in T)."""
    if not isinstance(chunk_size, list):
        _check_chunk_size(chunk_size)
    return zip(*(x.split(chunk_size, 2) if x is not None else itertools.repeat(None) for x in sequences))


def _packed_chunks(chunk_size: int, bounds, initial: tuple, *sequences):
    """Per chunk of the ``[B, H, T, ...]`` sequences (None stays None), ``(start, ends, views)``: the
    state its sequence starts from where it is that sequence's first chunk (row n of each of ``initial``
    for sequence n of ``bounds``; ``initial`` itself for ``bounds=None``, one sequence), else None;
    whether it ends its sequence; its views. Chunks of ``chunk_size``, none straddling a boundary."""
    length = next(x.shape[2] for x in sequences if x is not None)
    edges = (0, length) if bounds is None else bounds
    plan = []  # (size, sequence starting here or None, ends its sequence)
    for n, (a, b) in enumerate(zip(edges[:-1], edges[1:])):
        plan += [(min(chunk_size, b - t), n if t == a else None, t + chunk_size >= b) for t in range(a, b, chunk_size)]
    sizes = chunk_size if bounds is None else [size for size, _, _ in plan]
    for (_, n, ends), views in zip(plan, _split_time(sizes, *sequences)):
        start = None if n is None else initial if bounds is None else tuple(None if x is None else x[n : n + 1] for x in initial)
        yield start, ends, views


def _finals(finals: list[tuple]) -> tuple:
    """The states after each sequence as one batch (row n: sequence n)."""
    return tuple(parts[0] if len(parts) == 1 or parts[0] is None else torch.cat(parts) for parts in zip(*finals))


class _Output:
    """The scan's output ``[B, H, T, Dv]``, written chunk by chunk along time.

    Without a graph the chunks go into one preallocated tensor (``torch.cat`` at the end
    costs the plain sum rule 10-20% forward); under autograd they are joined by one
    ``torch.cat``, since a slice write per chunk makes the backward copy the whole gradient
    once per chunk (measured: 2.5x slower training of the sum rule at T = 2048)."""

    def __init__(self, like: torch.Tensor):
        self._like, self._chunks, self._tensor, self._start = like, [], None, 0

    def write(self, chunk: torch.Tensor) -> None:
        if self._start == 0 and not chunk.requires_grad:
            self._tensor = self._like.new_empty(self._like.shape, dtype=chunk.dtype)
        if self._tensor is None:
            self._chunks.append(chunk)
        else:
            self._tensor[:, :, self._start : self._start + chunk.shape[2]] = chunk
        self._start += chunk.shape[2]

    def joined(self) -> torch.Tensor:
        return self._tensor if self._tensor is not None else torch.cat(self._chunks, 2)


def safe_reciprocal(x):
    """1 / x where x > 0, else 0 (so that nothing is retrieved before anything was written)."""
    positive = x > 0
    return torch.where(positive, 1 / torch.where(positive, x, torch.ones_like(x)), torch.zeros_like(x))


def causal_read(read, values: torch.Tensor, dim: int = 2, *, every_channel: bool = False) -> torch.Tensor:
    """``read(values)`` for a causal read, in which output t is a weighted sum of the values at
    positions i ≤ t along ``dim``, such that a non-finite value at position p reaches no output
    before p. A causal matrix times the values multiplies each later value by an exact zero, and
    0·NaN = NaN would carry a NaN at p into every earlier row; so ``read`` gets the values with
    non-finite entries zeroed, and the cumulative sum of ``values − values`` (0, or NaN from the
    first non-finite value on; a forward-only scan) puts NaN back into the output at or after one:
    into its channel, or with ``every_channel`` (keys, whose channels are not the output's) into all.
    Outputs that are fewer than the values are the last positions (a prefill after a cache).
    The guard costs about ten elementwise kernels: on an accelerator it runs only under
    ``variants.debug_checks`` (a timed call holds none; a non-finite input still gives non-finite
    outputs, from p on and maybe before). On the CPU, where reading a sum costs no device sync,
    finite values (a finite sum) skip it, except under ``torch.compile`` (backend='compile'), whose
    graph would break at that data-dependent test."""
    if values.device.type != "cpu" and not checks_due(values.device):
        return read(values)
    if values.device.type == "cpu" and not torch.compiler.is_compiling() and math.isfinite(values.detach().sum()):
        return read(values)
    poison = values - values
    poison = (poison.sum(-1, keepdim=True) if every_channel else poison).detach().cumsum(dim)
    out = read(torch.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0))
    poison = poison if poison.shape[1] == out.shape[1] else poison.repeat_interleave(out.shape[1] // poison.shape[1], 1)  # grouped heads
    return out + poison.narrow(dim, poison.shape[dim] - out.shape[dim], out.shape[dim])


def chunk_dtype(dtype: torch.dtype, normalised: bool) -> torch.dtype:
    """The dtype of a scan's products within a chunk: the input's, except 16 bits with an attention
    normaliser (then float32, as the step computes it). float16: its backward holds g / (φ(q)·z + ε) in a
    16-bit tensor, ~1/ε where φ(q)·z = 0 (ReLU-type features), beyond float16's 65,504, and inf·0 = NaN
    reaches every gradient. bfloat16: the delta rule's erase β / ((z − φ(k))·φ(k)) (and its gradient)
    divides by a sum of products of features rounded to 8 bits; with sum-normalised FAVOR+ features
    d/dk was off by 7-16 % on 2 of 20 seeds."""
    return state_dtype(dtype) if normalised else dtype


def _identity(x):
    return x


def outside_compiled_graphs(loop):
    """``torch.compiler.disable(loop)`` where it matters: a loop over chunks traced by TorchDynamo (backend 'compile',
    variants/compiled.py) is left out of the graph, so the graph is one chunk's whatever T. Eagerly the loop is called as it
    is: applying the decorator at import would import TorchDynamo in every process (about 1 s of a worker's start, and
    150 MB) that never compiles."""

    @functools.wraps(loop)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            return torch.compiler.disable(loop)(*args, **kwargs)
        return loop(*args, **kwargs)

    return call


@outside_compiled_graphs
def sum_rule_chunked(q, k, v, weights, normaliser, chunk_size: int, phi=_identity, phi_k=None, bounds=None, chunk=None):
    """Causal sum rule: y_t = φ(q_t)ᵀ S_t / (φ(q_t)·z_t + ε), S_t = S_0 + Σ_{i≤t} φ(k_i) v_iᵀ,
    z_t = z_0 + Σ_{i≤t} φ(k_i).

    Katharopoulos et al. 2020, eq. 9-12; Schlag et al. 2021, eq. 17-19. With
    ``normaliser=None`` there is no denominator: y_t = φ(q_t)ᵀ S_t. ``phi`` maps the queries
    and, unless a separate ``phi_k`` is given (ReBased's learnable maps), the keys.
    ``q, k: [B, H, T, Dk]``, ``v: [B, H, T, Dv]``, ``weights`` S_0: ``[B, H, F, Dv]``,
    ``normaliser`` z_0: ``[B, H, F]`` or None. Returns ``(y [B, H, T, Dv], S_T, z_T)``. Packed sequences
    (``bounds``, B = 1): S_0, z_0 and S_T, z_T are ``[N, H, ...]``, row n sequence n's.
    Each chunk is one call of ``chunk`` (default ``sum_rule_chunk``; backend 'compile' passes it
    compiled): the loop stays Python's, out of any torch.compile'd graph, which would unroll it.
    """
    _check_chunk_size(chunk_size)
    phi_k = phi if phi_k is None else phi_k
    output, finals = _Output(v), []
    for start, ends, (q_c, k_c, v_c) in _packed_chunks(chunk_size, bounds, (weights, normaliser), q, k, v):
        weights, normaliser = start or (weights, normaliser)
        read, weights, normaliser = (chunk or sum_rule_chunk)(q_c, k_c, v_c, weights, normaliser, phi, phi_k)
        output.write(read)
        finals += [(weights, normaliser)] if ends else []
    return output.joined(), *_finals(finals)


def sum_rule_chunk(q_c, k_c, v_c, weights, normaliser, phi, phi_k):
    """One chunk of ``sum_rule_chunked``: ``(y_c, S, z)`` after it, from S, z before it."""
    wide, narrow = weights.dtype, chunk_dtype(q_c.dtype, normaliser is not None)
    features_q, features_k, values = phi(q_c.to(narrow)), phi_k(k_c.to(narrow)), v_c.to(narrow)
    scores = (features_q @ features_k.transpose(-1, -2)).tril_()
    read = (features_q.to(wide) @ weights).add_(causal_read(scores.matmul, values))
    if normaliser is not None:
        denominator = scores.sum(-1, keepdim=True, dtype=wide) + features_q.to(wide) @ normaliser.unsqueeze(-1)
        read = read * (denominator + EPS).reciprocal()
        normaliser = normaliser + features_k.sum(2, dtype=wide)
    return read.to(v_c.dtype), weights + features_k.transpose(-1, -2) @ values, normaliser


def _solve_unit_lower(strictly_lower: torch.Tensor, rhs: torch.Tensor, wide: torch.dtype) -> torch.Tensor:
    """X with (I + L) X = rhs for a strictly lower triangular L, in the state's dtype ``wide`` (PyTorch
    has no 16-bit triangular solve, on the CPU or CUDA). On one CPU thread it is solved as its transpose,
    Xᵀ (I + L)ᵀ = rhsᵀ (``left=False``), which LAPACK takes without copying L and rhs to column-major: at
    C = 64 (32 systems of 128 right-hand sides) half the time of the left solve forward and backward on
    one thread, but 1.3x its time on two, where the left solve runs the systems in parallel."""
    lower, rhs = strictly_lower.to(wide), rhs.to(wide)
    if rhs.device.type == "cpu" and torch.get_num_threads() == 1:
        return torch.linalg.solve_triangular(lower.mT, rhs.mT, upper=True, unitriangular=True, left=False).mT
    return torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)


@outside_compiled_graphs
def delta_rule_chunked(q, k, v, beta, weights, normaliser, chunk_size: int, phi=_identity, phi_k=None, log_gate=None, bounds=None, chunk=None):
    """Causal delta rule through the WY / UT-transform representation, optionally gated.

    S_t = α_t S_{t-1} + φ(k_t) u_tᵀ with u_t = b_t v_t − a_t (α_t S_{t-1})ᵀ φ(k_t), y_t = S_tᵀ φ(q_t).
    Ungated (α ≡ 1), with write strength b = β and erase strength a = β, this is Schlag et al.
    2021, eq. 20-25. With a ``normaliser`` z it is their attention-normalised form, eq. 26-28:
    a_t = β_t / (z_{t-1}·φ(k_t)) (0 while that is 0) and y_t = S_tᵀ φ(q_t) / (z_t·φ(q_t) + ε).
    With ``log_gate`` g_t = log α_t ≤ 0 it is the gated delta rule (Yang, Kautz, Hatamizadeh
    2024, arXiv:2412.06464, eq. 10: S_t = S_{t-1}(α_t(I − β_t k_t k_tᵀ)) + β_t v_t k_tᵀ, transposed).
    Per chunk (Yang et al. 2024, arXiv:2406.06484v6, eq. 8-11, extended to a ≠ b and, as in
    arXiv:2412.06464 §3.3, to the gate), with G_t = Σ_{s≤t in the chunk} g_s, γ_t = exp(G_t),
    D_ti = exp(G_t − G_i) for i ≤ t (γ = D = 1 ungated) and A = tril(diag(a) (K Kᵀ ⊙ D), −1):
        U = (I + A)⁻¹ diag(b) V,   W = (I + A)⁻¹ diag(a γ) K,
        U' = U − W S,   O = diag(γ) Q S + (tril(Q Kᵀ) ⊙ D) U',   S ← γ_C S + (diag(γ_C / γ) K)ᵀ U'.
    ``q, k: [B, H, T, Dk]``, ``v: [B, H, T, Dv]``, ``beta, log_gate: [B, H, T]``, ``weights`` S_0:
    ``[B, H, F, Dv]``, ``normaliser`` z_0: ``[B, H, F]`` or None (always None with ``log_gate``);
    ``phi``/``phi_k``, packed sequences (``bounds``) and ``chunk`` (default ``delta_rule_chunk``) as in
    ``sum_rule_chunked``. Returns ``(y, S_T, z_T)``.
    """
    if log_gate is not None and normaliser is not None:
        raise ValueError("the gated delta rule has no attention normaliser; pass normaliser=None")
    _check_chunk_size(chunk_size)
    phi_k = phi if phi_k is None else phi_k
    output, finals = _Output(v), []
    for start, ends, (q_c, k_c, v_c, beta_c, gate_c) in _packed_chunks(chunk_size, bounds, (weights, normaliser), q, k, v, beta, log_gate):
        weights, normaliser = start or (weights, normaliser)
        read, weights, normaliser = (chunk or delta_rule_chunk)(q_c, k_c, v_c, beta_c, gate_c, weights, normaliser, phi, phi_k)
        output.write(read)
        finals += [(weights, normaliser)] if ends else []
    return output.joined(), *_finals(finals)


def delta_rule_chunk(q_c, k_c, v_c, beta_c, gate_c, weights, normaliser, phi, phi_k):
    """One chunk of ``delta_rule_chunked``: ``(y_c, S, z)`` after it, from S, z before it."""
    wide, narrow, d_value = weights.dtype, chunk_dtype(q_c.dtype, normaliser is not None), v_c.shape[-1]
    q_c, k_c, values = phi(q_c.to(narrow)), phi_k(k_c.to(narrow)), v_c.to(narrow)
    write = erase = beta_c.unsqueeze(-1)
    if normaliser is not None:
        z = normaliser.unsqueeze(2) + k_c.cumsum(2, dtype=wide)
        erase = write * safe_reciprocal(((z - k_c) * k_c).sum(-1, keepdim=True))
        normaliser = z[:, :, -1]
    keys_keys, queries_keys = k_c @ k_c.transpose(-1, -2), q_c @ k_c.transpose(-1, -2)
    erased_keys, state_queries, written_keys = k_c, q_c, k_c
    if gate_c is not None:
        # G_t in the state's dtype: a 16-bit cumulative sum of log gates is off by a fraction of
        # a unit within a chunk, and exp turns that into a relative error of the same size
        cumulative = gate_c.to(wide).cumsum(-1)
        future = torch.ones(q_c.shape[2], q_c.shape[2], dtype=torch.bool, device=q_c.device).triu(1)
        decay = torch.exp((cumulative[..., :, None] - cumulative[..., None, :]).masked_fill(future, float("-inf"))).to(q_c.dtype)
        keys_keys, queries_keys = keys_keys * decay, queries_keys * decay
        state_decay = torch.exp(cumulative).unsqueeze(-1)
        erased_keys, state_queries = state_decay * k_c, state_decay * q_c
        written_keys = decay[..., -1, :, None] * k_c
        weights_after = state_decay[:, :, -1:] * weights
    strictly_lower = (erase * keys_keys).tril_(-1)
    solved = _solve_unit_lower(strictly_lower, torch.cat([write * values, erase * erased_keys], dim=-1), wide)
    new_values = solved[..., :d_value] - solved[..., d_value:] @ weights
    read = (state_queries.to(wide) @ weights).add_(causal_read(queries_keys.tril_().matmul, new_values.to(q_c.dtype)))
    if normaliser is not None:
        read = read * ((q_c * z).sum(-1, keepdim=True) + EPS).reciprocal()
    kept = weights if gate_c is None else weights_after
    return read.to(v_c.dtype), kept + written_keys.to(wide).transpose(-1, -2) @ new_values, normaliser


@outside_compiled_graphs
def wkv_chunked(k, v, decay, bonus, numerator, denominator, max_exponent, chunk_size: int, chunk=None):
    """Causal RWKV-4 WKV operator (Peng et al. 2023, eq. 14), stabilised per chunk:

        wkv_t = (Σ_{i<t} e^{−(t−1−i)w + k_i} v_i + e^{u + k_t} v_t) / (Σ_{i<t} e^{−(t−1−i)w + k_i} + e^{u + k_t})

    per channel, continuing from a state that holds the earlier tokens as e^p·a = Σ e^{−(s−1−i)w + k_i} v_i
    and e^p·b = Σ e^{−(s−1−i)w + k_i} (``numerator`` a, ``denominator`` b, ``max_exponent`` p, each
    ``[B, H, D]``; p = −∞ for the empty state). Within a chunk every exponent
    E_ti = k_i − (t−1−i)w (i < t), u + k_t (i = t), and the state's p − t·w (t = chunk-local index)
    is taken relative to its row maximum before ``exp``, so nothing overflows whatever the size of k,
    w or T; the maxima cancel exactly and are detached. Memory per chunk: [B, H, C, C, D].
    ``k, v: [B, H, T, D]``, ``decay`` w > 0 and ``bonus`` u: ``[D]``. Returns ``(wkv, a, b, p)``.
    Each chunk is one call of ``chunk`` (default ``wkv_chunk``), as in ``sum_rule_chunked``.
    """
    output = _Output(v)
    for k_c, v_c in _split_time(chunk_size, k, v):
        read, numerator, denominator, max_exponent = (chunk or wkv_chunk)(k_c, v_c, decay, bonus, numerator, denominator, max_exponent)
        output.write(read)
    return output.joined(), numerator, denominator, max_exponent


def wkv_chunk(k_c, v_c, decay, bonus, numerator, denominator, max_exponent):
    """One chunk of ``wkv_chunked``: ``(wkv_c, a, b, p)`` after it, from a, b, p before it."""
    n = k_c.shape[2]
    steps = torch.arange(n, device=k_c.device)
    lag = (steps[:, None] - 1 - steps[None, :]).to(k_c.dtype)  # t − 1 − i
    exponents = k_c.unsqueeze(2) - lag[..., None] * decay  # [B, H, t, i, D]
    exponents = torch.where(lag[..., None] == -1, (bonus + k_c).unsqueeze(3), exponents)
    exponents = exponents.masked_fill(lag[..., None] < -1, float("-inf"))
    state_exponent = max_exponent.unsqueeze(2) - steps[:, None].to(k_c.dtype) * decay  # [B, H, t, D]
    row_max = torch.maximum(exponents.amax(3), state_exponent).detach()
    weights, state_weight = torch.exp(exponents - row_max.unsqueeze(3)), torch.exp(state_exponent - row_max)
    read = causal_read(lambda values: torch.einsum("bhtic,bhic->bhtc", weights, values), v_c) + state_weight * numerator.unsqueeze(2)
    read = read / (weights.sum(3) + state_weight * denominator.unsqueeze(2))
    # the state after the chunk: earlier tokens decay by n·w, token i by (n − 1 − i)·w
    end_exponents = k_c - (n - 1 - steps)[:, None].to(k_c.dtype) * decay
    carried = max_exponent - n * decay
    new_max = torch.maximum(carried, end_exponents.amax(2)).detach()
    end_weights, carried_weight = torch.exp(end_exponents - new_max.unsqueeze(2)), torch.exp(carried - new_max)
    numerator = carried_weight * numerator + torch.einsum("bhic,bhic->bhc", end_weights, v_c)
    return read, numerator, carried_weight * denominator + end_weights.sum(2), new_max

"""Chunk-parallel forms of the sum and delta rules: every chunk at once, no Python loop over time.

The same equations as ``chunked.sum_rule_chunked`` and ``chunked.delta_rule_chunked`` (see them
for the notation), computed as in the chunk kernels of Yang et al. 2024 (arXiv:2406.06484v6, §3.2)
but with the inter-chunk recurrence made parallel too, so that the number of operations of a call
does not grow with T (on a GPU, the launches; under ``torch.compile``, the graph):

* the sequence is cut into N = ⌈T/C⌉ chunks ``[B, H, N, C, ...]`` (the last padded with tokens
  that write nothing: zero features, β = 0, log α = 0), and every product within a chunk
  (φ(Q)φ(K)ᵀ, the triangular solve, the reads) is one batched call over all chunks;
* the state before each chunk, ``[B, H, N, d_dot, Dv]``: for the sum rule an exclusive cumulative
  sum of the chunks' writes φ(K)ᵀV; for the delta rules each chunk is an affine map of the state,
  S ↦ A S + B with A = γ_C I − K̃ᵀ W and B = K̃ᵀ U (K̃ = diag(γ_C / γ) K; from S_C = γ_C S + K̃ᵀ(U − W S)),
  whose prefixes ``affine_scan`` composes in ⌈log₂ N⌉ levels (Blelloch 1990's scan of an
  associative operator: (A₂, B₂) ∘ (A₁, B₁) = (A₂A₁, A₂B₁ + B₂)).

The price is work and memory: the delta rules build and compose d_dot × d_dot transitions (about
N (C d_dot² + d_dot³ + 2 d_dot² Dv) multiply-adds more than the loop: 1.6× its FLOPs at
d_dot = Dv = C = 64), and every chunk's intermediates, φ(q) and φ(k) exist at once.
Over packed sequences (``bounds``, ``cu_seqlens`` as ints) each sequence is padded to whole chunks
(``_Chunks``), so that no chunk straddles a boundary, and the scans restart there: the cumulative sums
from the sequence's own initial state, the affine scan through a transition A = 0 at each sequence's
first chunk (whose offset takes A S₀ of that sequence's S₀). Still one pass, whatever N.

Precision as in ``chunked``: the states, the transitions A, B and every product with them in
``state_dtype``; the products within a chunk in ``chunk_dtype``; the output in the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import sequences
from .chunked import _identity, _solve_unit_lower, causal_read, chunk_dtype, safe_reciprocal
from .feature_maps import EPS


def _in_chunks(x: torch.Tensor | None, chunk_size: int) -> torch.Tensor | None:
    """``[B, H, T, ...]`` -> ``[B, H, N, C, ...]``, T padded with zeros to N·C (None stays None)."""
    if x is None:
        return None
    padding = -x.shape[2] % chunk_size
    if padding:
        x = F.pad(x, (0, 0) * (x.dim() - 3) + (0, padding))
    return x.unflatten(2, (x.shape[2] // chunk_size, chunk_size))


class _Chunks:
    """The chunks of a scan over ``length`` tokens: T cut into N chunks of ``chunk_size`` (the last padded),
    or over packed sequences (``bounds``; B = 1) each sequence padded to whole chunks, sequence n starting
    from row n of a state ``[N_seq, H, ...]``. Padding is zeros: tokens that write nothing."""

    def __init__(self, length: int, chunk_size: int, bounds, device):
        self.length, self.size, self.bounds = length, chunk_size, bounds
        self.count = -(-length // chunk_size)
        if bounds is None:
            return
        counts = [-(-(b - a) // chunk_size) for a, b in sequences(bounds)]
        firsts = [sum(counts[:n]) for n in range(len(counts))]
        self.count = sum(counts)
        self.first = torch.tensor(firsts, device=device)
        self.last = self.first + torch.tensor(counts, device=device) - 1
        self.sequence = torch.repeat_interleave(torch.arange(len(counts), device=device), torch.tensor(counts, device=device))
        spans = [torch.arange(b - a, device=device) + first * chunk_size for (a, b), first in zip(sequences(bounds), firsts)]
        self.positions = torch.cat(spans)  # each token's place in the padded layout

    def cut(self, x: torch.Tensor | None) -> torch.Tensor | None:
        """``[B, H, T, ...]`` -> ``[B, H, N, C, ...]`` (None stays None)."""
        if x is None or self.bounds is None:
            return _in_chunks(x, self.size)
        spread = x.new_zeros(*x.shape[:2], self.count * self.size, *x.shape[3:]).index_copy(2, self.positions, x)
        return spread.unflatten(2, (self.count, self.size))

    def join(self, chunks: torch.Tensor) -> torch.Tensor:
        """``[B, H, N, C, D]`` -> ``[B, H, T, D]``: the chunks' outputs without the padding."""
        joined = chunks.flatten(2, 3)
        if self.bounds is not None:
            return joined.index_select(2, self.positions)
        return joined if joined.shape[2] == self.length else joined[:, :, : self.length]

    def _starts(self, initial: torch.Tensor) -> torch.Tensor:
        """A state ``[N_seq, H, ...]`` as ``[1, H, N_seq, ...]``."""
        return initial.transpose(0, 1).unsqueeze(0)

    def before_each(self, initial: torch.Tensor, increments: torch.Tensor) -> torch.Tensor:
        """``initial + Σ_{m<n} increments_m`` for every chunk n (dim 2), over the chunks of n's sequence
        from its own initial row: an exclusive cumulative sum."""
        if self.bounds is None:
            return torch.cat([initial.unsqueeze(2), increments[:, :, :-1]], 2).cumsum(2)
        exclusive = increments.cumsum(2) - increments
        restart = self._starts(initial) - exclusive[:, :, self.first]
        return exclusive + restart[:, :, self.sequence]

    def finals(self, per_chunk: torch.Tensor) -> torch.Tensor:
        """``[B, H, N, ...]`` -> the entries of each sequence's last chunk (``[N_seq, H, ...]`` where packed)."""
        if self.bounds is None:
            return per_chunk[:, :, -1]
        return per_chunk[:, :, self.last].squeeze(0).transpose(0, 1)

    def affine(self, transitions: torch.Tensor, offsets: torch.Tensor, initial: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The states before and after each chunk of X_n = A_n X_{n-1} + B_n (``affine_scan``), each
        sequence from its row of ``initial``: at its first chunk A = 0 and B + A S₀."""
        if self.bounds is None:
            ends = affine_scan(transitions, offsets, initial)
            return torch.cat([initial.unsqueeze(2), ends[:, :, :-1]], 2), ends
        starts = self._starts(initial)
        offsets = offsets.index_add(2, self.first, transitions[:, :, self.first] @ starts)
        ends = affine_scan(transitions.index_fill(2, self.first, 0), offsets, torch.zeros_like(starts[:, :, 0]))
        return torch.cat([torch.zeros_like(ends[:, :, :1]), ends[:, :, :-1]], 2).index_copy(2, self.first, starts), ends


def affine_scan(transitions: torch.Tensor, offsets: torch.Tensor, initial: torch.Tensor) -> torch.Tensor:
    """The states X_n = A_n X_{n-1} + B_n after each step n, from X_{-1} = ``initial``.

    ``transitions`` A: ``[..., N, F, F]``, ``offsets`` B: ``[..., N, F, D]``, ``initial``: ``[..., F, D]``
    -> ``[..., N, F, D]``. A work-efficient parallel scan (Blelloch 1990): adjacent steps are composed
    pairwise, the prefixes of the N/2 pairs found by recursion, and the even steps filled in from them,
    so a call is O(log N) batched operations and O(N) matrix products."""
    first = transitions[..., 0, :, :] @ initial + offsets[..., 0, :, :]
    return _prefix(transitions, torch.cat([first.unsqueeze(-3), offsets[..., 1:, :, :]], -3))


def _prefix(transitions: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``affine_scan`` from X_{-1} = 0 (so A_0 is not used)."""
    steps = offsets.shape[-3]
    if steps == 1:
        return offsets
    pairs = steps // 2
    early, late = slice(0, 2 * pairs, 2), slice(1, 2 * pairs, 2)
    late_transitions = transitions[..., late, :, :]
    paired_offsets = late_transitions @ offsets[..., early, :, :] + offsets[..., late, :, :]
    paired_transitions = late_transitions @ transitions[..., early, :, :] if pairs > 1 else None
    odd = _prefix(paired_transitions, paired_offsets)  # the states after steps 1, 3, 5, ...
    rest = transitions[..., 2::2, :, :] @ odd[..., : (steps - 1) // 2, :, :] + offsets[..., 2::2, :, :]
    even = torch.cat([offsets[..., :1, :, :], rest], -3)  # the states after steps 0, 2, 4, ...
    woven = torch.stack([even[..., :pairs, :, :], odd], -3).flatten(-4, -3)
    return woven if steps % 2 == 0 else torch.cat([woven, even[..., -1:, :, :]], -3)


def sum_rule_parallel(q, k, v, weights, normaliser, chunk_size: int, phi=_identity, phi_k=None, bounds=None):
    """``chunked.sum_rule_chunked`` (same arguments and result) with every chunk at once and the
    states before them by a cumulative sum over the chunks."""
    phi_k = phi if phi_k is None else phi_k
    wide, narrow = weights.dtype, chunk_dtype(q.dtype, normaliser is not None)
    chunks = _Chunks(q.shape[2], chunk_size, bounds, q.device)
    q_c, k_c, v_c = (chunks.cut(x) for x in (phi(q.to(narrow)), phi_k(k.to(narrow)), v.to(narrow)))
    scores = torch.tril(q_c @ k_c.transpose(-1, -2))
    writes = (k_c.transpose(-1, -2) @ v_c).to(wide)
    states = chunks.before_each(weights, writes)
    read = causal_read(scores.matmul, v_c, dim=3) + q_c.to(wide) @ states
    if normaliser is not None:
        key_sums = k_c.sum(3, dtype=wide)
        normalisers = chunks.before_each(normaliser, key_sums)
        read = read / (scores.sum(-1, keepdim=True, dtype=wide) + q_c.to(wide) @ normalisers.unsqueeze(-1) + EPS)
        normaliser = chunks.finals(normalisers) + chunks.finals(key_sums)
    return chunks.join(read.to(v.dtype)), chunks.finals(states) + chunks.finals(writes), normaliser


def delta_rule_parallel(q, k, v, beta, weights, normaliser, chunk_size: int, phi=_identity, phi_k=None, log_gate=None, bounds=None):
    """``chunked.delta_rule_chunked`` (same arguments, equations and result) with every chunk's
    U, W (the UT transform) at once and the states before the chunks by ``affine_scan``."""
    if log_gate is not None and normaliser is not None:
        raise ValueError("the gated delta rule has no attention normaliser; pass normaliser=None")
    phi_k = phi if phi_k is None else phi_k
    wide, narrow, d_value = weights.dtype, chunk_dtype(q.dtype, normaliser is not None), v.shape[-1]
    chunks = _Chunks(q.shape[2], chunk_size, bounds, q.device)
    q_c, k_c, v_c = (chunks.cut(x) for x in (phi(q.to(narrow)), phi_k(k.to(narrow)), v.to(narrow)))
    write = erase = chunks.cut(beta).unsqueeze(-1)
    if normaliser is not None:  # z_t at every t: the sums before each chunk, then within it
        z = chunks.before_each(normaliser, k_c.sum(3, dtype=wide)).unsqueeze(3) + k_c.cumsum(3, dtype=wide)
        normaliser = chunks.finals(z[:, :, :, -1])
        erase = write * safe_reciprocal(((z - k_c) * k_c).sum(-1, keepdim=True))
    keys_keys, queries_keys = k_c @ k_c.transpose(-1, -2), q_c @ k_c.transpose(-1, -2)
    erased_keys, state_queries, written_keys, end_decay = k_c, q_c, k_c, None
    if log_gate is not None:
        # G_t within each chunk in the state's dtype (as chunked.delta_rule_chunked)
        cumulative = chunks.cut(log_gate).to(wide).cumsum(-1)
        future = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
        decay = torch.exp((cumulative[..., :, None] - cumulative[..., None, :]).masked_fill(future, float("-inf"))).to(q_c.dtype)
        keys_keys, queries_keys = keys_keys * decay, queries_keys * decay
        state_decay = torch.exp(cumulative).unsqueeze(-1)
        erased_keys, state_queries = state_decay * k_c, state_decay * q_c
        written_keys, end_decay = decay[..., -1, :, None] * k_c, state_decay[..., -1, :]
    strictly_lower = torch.tril(erase * keys_keys, diagonal=-1)
    solved = _solve_unit_lower(strictly_lower, torch.cat([write * v_c, erase * erased_keys], dim=-1), wide)
    new_values, erasures = solved[..., :d_value], solved[..., d_value:]  # U, W
    written_keys = written_keys.to(wide).transpose(-1, -2)
    identity = torch.eye(weights.shape[-2], dtype=wide, device=q.device)
    kept = identity if end_decay is None else end_decay[..., None] * identity
    states, ends = chunks.affine(kept - written_keys @ erasures, written_keys @ new_values, weights)
    new_values = new_values - erasures @ states
    read = state_queries.to(wide) @ states + causal_read(torch.tril(queries_keys).matmul, new_values.to(q_c.dtype), dim=3)
    if normaliser is not None:
        read = read / ((q_c * z).sum(-1, keepdim=True) + EPS)
    return chunks.join(read.to(v.dtype)), chunks.finals(ends), normaliser

"""The chunked scan machinery shared by every linear-time variant.

All functions act on already feature-mapped queries and keys (φ(q), φ(k)) and carry a
fast weight matrix ``S`` of shape ``[B, H, d_dot, Dv]`` (the transpose of Schlag et al.'s
``W``, so that a read is ``qᵀ S``). Within a chunk of C tokens the work is a few dense
C×C and C×d products; across chunks only the state is carried, so memory stays linear
in T and no T×T matrix is ever formed. T need not be a multiple of C: the last chunk is
simply shorter.
"""

from __future__ import annotations

import torch


def _chunks(length: int, chunk_size: int):
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    return [(start, min(start + chunk_size, length)) for start in range(0, length, chunk_size)]


def sum_rule_chunked(q, k, v, weights, chunk_size: int):
    """Causal sum rule: o_t = q_tᵀ S_t with S_t = S_0 + Σ_{i≤t} k_i v_iᵀ.

    Katharopoulos et al. 2020, eq. 9-10 (the numerator), i.e. Schlag et al. 2021, eq. 17
    with y = W φ(q). ``q, k: [B, H, T, F]``, ``v: [B, H, T, Dv]``, ``weights`` S_0:
    ``[B, H, F, Dv]``. Returns ``(o [B, H, T, Dv], S_T)``.
    """
    outputs = []
    for start, end in _chunks(q.shape[2], chunk_size):
        q_c, k_c, v_c = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end]
        intra = torch.tril(q_c @ k_c.transpose(-1, -2))
        outputs.append(intra @ v_c + q_c @ weights)
        weights = weights + k_c.transpose(-1, -2) @ v_c
    return torch.cat(outputs, dim=2), weights


def delta_rule_chunked(q, k, v, write, erase, weights, chunk_size: int):
    """Causal (generalised) delta rule through the WY / UT-transform representation.

    S_t = S_{t-1} + k_t (b_t v_t − a_t S_{t-1}ᵀ k_t)ᵀ and o_t = S_tᵀ q_t, with write strength
    b = ``write`` and erase strength a = ``erase`` (both ``[B, H, T]``). With a = b = β this
    is Schlag et al. 2021, eq. 24-25; with a = β / (z_{t-1}·k_t) their attention-normalised
    retrieval, eq. 27. Per chunk (Yang et al. 2024, arXiv:2406.06484v6, eq. 8-11, extended
    to a ≠ b): with A = tril(diag(a) K Kᵀ, −1),
        U = (I + A)⁻¹ diag(b) V,   W = (I + A)⁻¹ diag(a) K,
        U' = U − W S,   O = Q S + tril(Q Kᵀ) U',   S ← S + Kᵀ U'.
    ``q, k: [B, H, T, F]``, ``v: [B, H, T, Dv]``, ``weights`` S_0: ``[B, H, F, Dv]``.
    Returns ``(o [B, H, T, Dv], S_T)``.
    """
    d_value = v.shape[-1]
    outputs = []
    for start, end in _chunks(q.shape[2], chunk_size):
        q_c, k_c, v_c = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end]
        a_c, b_c = erase[:, :, start:end, None], write[:, :, start:end, None]
        strictly_lower = torch.tril(a_c * (k_c @ k_c.transpose(-1, -2)), diagonal=-1)
        solved = torch.linalg.solve_triangular(
            strictly_lower, torch.cat([b_c * v_c, a_c * k_c], dim=-1), upper=False, unitriangular=True
        )
        new_values = solved[..., :d_value] - solved[..., d_value:] @ weights
        intra = torch.tril(q_c @ k_c.transpose(-1, -2))
        outputs.append(q_c @ weights + intra @ new_values)
        weights = weights + k_c.transpose(-1, -2) @ new_values
    return torch.cat(outputs, dim=2), weights


def running_normaliser(q, k, normaliser, causal: bool):
    """The attention normaliser d_t = q_t · z_t with z_t = z_0 + Σ_{i≤t} k_i.

    Katharopoulos et al. 2020, eq. 11-12 (denominator); Schlag et al. 2021, eq. 18-19 and
    26. Non-causal: z = z_0 + Σ_i k_i for every t. ``q, k: [B, H, T, F]``, ``normaliser``
    z_0: ``[B, H, F]``. Returns ``(d [B, H, T, 1], z [B, H, T, F])``; ``z[:, :, -1]`` is z_T.
    """
    accumulated = k.cumsum(dim=2) if causal else k.sum(dim=2, keepdim=True).expand_as(k)
    z = normaliser[:, :, None] + accumulated
    return (q * z).sum(-1, keepdim=True), z

"""The delta rule: Schlag et al. 2021's fast weight programmer (§4.2, eq. 20-25).

    v̄_t = W_{t-1} φ(k_t),   W_t = W_{t-1} + β_t (v_t − v̄_t) ⊗ φ(k_t),   y_t = W_t φ(q_t)

with β_t = σ(W_β x_t) ∈ (0, 1) given per token and head, and, by default, the sum
normalisation φ'(x) = φ(x) / Σ_j φ(x)_j of keys and queries (eq. 29). ``attn_norm=True``
adds the attention normalisation the paper ablates (eq. 26-28): z_t = z_{t-1} + φ(k_t),
v̄_t = W_{t-1} φ(k_t) / (z_{t-1}·φ(k_t)) (v̄ = 0 while that is 0), y_t = W_t φ(q_t) / (z_t·φ(q_t) + ε).
With ``phi='identity', sum_norm=False`` this is the plain delta rule
W_t = W_{t-1} + β_t (v_t − W_{t-1} k_t) k_tᵀ, y_t = W_t q_t. Causal only.
"""

from __future__ import annotations

import torch

from . import kernels
from .base import register
from .chunked import delta_rule_chunked, safe_reciprocal
from .fast_weights import FastWeightCore, FastWeightState
from .feature_maps import EPS


@register("delta")
class DeltaRule(FastWeightCore):
    """The delta rule with any φ (default elu+1), sum normalisation on by default."""

    needs_beta = True
    supports_noncausal = False

    def __init__(self, d_key, *, phi="elu1", sum_norm=True, attn_norm=False, **options):
        super().__init__(d_key, phi=phi, sum_norm=sum_norm, attn_norm=attn_norm, **options)
        if self.backend == "triton" and attn_norm:
            raise kernels.UnsupportedBackend(
                "delta: backend='triton' implements the delta rule without attention normalisation; use attn_norm=False or backend='torch'"
            )

    def _run(self, q, k, v, beta, state, causal):
        if self.backend == "triton":
            kernel = self._kernel("delta_rule", q).delta_rule_triton
            read, weights = kernel(self.phi(q), self.phi(k), v, beta, state.weights)
            return read, FastWeightState(weights.to(v.dtype), None)
        read, weights, normaliser = delta_rule_chunked(q, k, v, beta, *state, self.chunk_size, phi=self.phi)
        return read, FastWeightState(weights, normaliser)

    def _write(self, features_k, v_t, beta_t, state):
        retrieved = (features_k.unsqueeze(-2) @ state.weights).squeeze(-2)
        if self.attn_norm:
            retrieved = retrieved * safe_reciprocal((state.normaliser * features_k).sum(-1, keepdim=True))
        return state.weights + features_k.unsqueeze(-1) * (beta_t.unsqueeze(-1) * (v_t - retrieved)).unsqueeze(-2)

    def _chunk_flops(self, n, d_value):
        """K Kᵀ and Q Kᵀ (n × n), the triangular solve for [U, W], W S, the read Q S, the
        intra product with U' and the write Kᵀ U'."""
        d_dot = self.d_dot
        return 4 * n * n * d_dot + n * n * (d_value + d_dot) + 2 * n * n * d_value + 6 * n * d_dot * d_value

    def _step_flops_per_head(self, d_value):
        return 6 * self.d_dot * d_value

    def _reference(self, q, k, v, beta, causal):
        """Token by token, in the paper's notation: W is [Dv, d_dot], eq. 20-28."""
        features_q, features_k = self.phi(q), self.phi(k)
        batch, heads, length, _ = q.shape
        W = q.new_zeros(batch, heads, v.shape[-1], self.d_dot)
        z = q.new_zeros(batch, heads, self.d_dot)
        outputs = []
        for t in range(length):
            phi_k, phi_q = features_k[:, :, t], features_q[:, :, t]
            v_bar = torch.einsum("bhvd,bhd->bhv", W, phi_k)
            if self.attn_norm:
                v_bar = v_bar * safe_reciprocal(torch.einsum("bhd,bhd->bh", z, phi_k)).unsqueeze(-1)
                z = z + phi_k
            W = W + torch.einsum("bhv,bhd->bhvd", beta[:, :, t, None] * (v[:, :, t] - v_bar), phi_k)
            y = torch.einsum("bhvd,bhd->bhv", W, phi_q)
            if self.attn_norm:
                y = y / (torch.einsum("bhd,bhd->bh", z, phi_q).unsqueeze(-1) + EPS)
            outputs.append(y)
        return torch.stack(outputs, dim=2)

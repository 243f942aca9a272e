"""The sum rule (linear attention) and its named presets: linear, performer, dpfp, based, rebased.

    S_t = S_{t-1} + φ(k_t) v_tᵀ,   z_t = z_{t-1} + φ(k_t),   y_t = S_tᵀ φ(q_t) / (z_t·φ(q_t) + ε)

Katharopoulos et al. 2020, eq. 9-12; Schlag et al. 2021, eq. 17-19. ``normalize=False``
drops the denominator (y_t = S_tᵀ φ(q_t)); with ``phi='identity'`` that is plain causal
(Q Kᵀ ⊙ M) V with no scale.
"""

from __future__ import annotations

import torch

from . import kernels
from .base import register
from .chunk_scan import sum_rule_parallel
from .chunked import causal_read, sum_rule_chunked
from .fast_weights import FastWeightCore, FastWeightState
from .feature_maps import EPS


@register("linear")
class SumRule(FastWeightCore):
    """Linear attention: the sum rule with any φ (default elu+1) and, by default,
    Katharopoulos' normalisation. ``sum_norm`` (off by default) is Schlag's φ / Σφ. ``precision``
    ('ieee' or 'tf32', backend='triton' only): the dots of float32 inputs in the Triton kernels."""

    kernel_rule = "sum_rule"

    def __init__(self, d_key, *, phi="elu1", normalize=True, sum_norm=False, precision="ieee", **options):
        super().__init__(d_key, phi=phi, sum_norm=sum_norm, normalize=normalize, **options)
        kernels.check_precision(self.variant_name, self.backend, precision)
        self.precision = precision

    def _run(self, q, k, v, state, causal):
        if causal and self.backend == "triton":
            kernel = self._kernel(q).sum_rule_triton
            features_q, features_k = self.phi.for_queries(q), self.phi.for_keys(k)
            read, weights, normaliser = kernel(
                features_q, features_k, v, *state, normalize=self.normalize, chunk_size=self.chunk_size, precision=self.precision
            )
            return read, FastWeightState(weights, normaliser)  # float32, the state dtype of every input dtype it takes
        if causal:
            scan = sum_rule_parallel if self.scan_choice(q.device) == "parallel" else sum_rule_chunked
            read, weights, normaliser = scan(q, k, v, *state, self.chunk_size, phi=self.phi.for_queries, phi_k=self.phi.for_keys)
            return read, FastWeightState(weights, normaliser)
        # non-causal: every read meets the whole state, so all of it is in the state's dtype
        wide = state.weights.dtype
        features_q, features_k = self.phi.for_queries(q.to(wide)), self.phi.for_keys(k.to(wide))
        weights = state.weights + features_k.transpose(-1, -2) @ v.to(wide)
        read = features_q @ weights
        if not self.normalize:
            return read.to(v.dtype), FastWeightState(weights, None)
        normaliser = state.normaliser + features_k.sum(2)
        return (read / (features_q @ normaliser.unsqueeze(-1) + EPS)).to(v.dtype), FastWeightState(weights, normaliser)

    def _write(self, features_k, v_t, state):
        return state.weights + features_k.unsqueeze(-1) * v_t.unsqueeze(-2)

    def _chunk_flops(self, n, d_value):
        """φ(Q)φ(K)ᵀ and its product with V (n × n), the read φ(Q)S and the write φ(K)ᵀV."""
        return 2 * n * n * (self.d_dot + d_value) + 4 * n * self.d_dot * d_value

    def _step_flops_per_head(self, d_value):
        return 4 * self.d_dot * d_value

    def _reference(self, q, k, v, causal):
        """The O(T²) masked form: y_t = Σ_{i≤t} (φ(q_t)·φ(k_i)) v_i / Σ_{i≤t} φ(q_t)·φ(k_i)."""
        scores = self.phi.for_queries(q) @ self.phi.for_keys(k).transpose(-1, -2)
        if causal:
            scores = torch.tril(scores)
        read = causal_read(scores.matmul, v) if causal else scores @ v
        return read / (scores.sum(-1, keepdim=True) + EPS) if self.normalize else read


@register("performer")
def performer(d_key, *, m=None, d_dot=None, **options):
    """Performer: the sum rule with FAVOR+ (m random features, d_dot = 2m; default m = d_key).
    ``core.phi.redraw(seed)`` draws new features."""
    if m is None and d_dot is None:
        m = d_key
    return SumRule(d_key, phi="favor", m=m, d_dot=d_dot, **options)


@register("dpfp")
def dpfp(d_key, *, nu=None, d_dot=None, **options):
    """The sum rule with DPFP-ν (Schlag et al. 2021, eq. 37; d_dot = 2·d_key·ν; default ν = 1)."""
    if nu is None and d_dot is None:
        nu = 1
    return SumRule(d_key, phi="dpfp", nu=nu, d_dot=d_dot, **options)


@register("based")
def based(d_key, **options):
    """Based (Arora et al. 2024, §4.1): the normalised sum rule with the 2nd-order Taylor map of
    exp(q·k/√d_key), d_dot = 1 + d_key + d_key², on a low d_key (the paper projects to 16)."""
    return SumRule(d_key, phi="taylor", **options)


@register("rebased")
def rebased(d_key, **options):
    """ReBased (Aksenov et al. 2024, §4): the normalised sum rule with the learnable kernel
    (γ ⊙ LayerNorm(x) + β)², separate γ, β for queries and keys; d_dot = d_key²."""
    return SumRule(d_key, phi="rebased", **options)

"""A plugin for ``attnbench check`` (tests/test_harness/test_check_command.py): one correct variant written
outside attnbench on its shared chunked scan, and the mistakes a researcher makes, each planted in a copy.

- ``check_mirrored``: normalised linear attention with mirrored elu+1 features, φ(x) = [elu(x)+1, elu(-x)+1]
  (d_dot = 2·d_key): y_t = Σ_{s≤t} φ(q_t)·φ(k_s) v_s / (Σ_{s≤t} φ(q_t)·φ(k_s) + ε).
- ``check_no_normaliser_step``: its recurrent step forgets the normaliser.
- ``check_half_k_grad``: its parallel form passes k through an autograd function that halves k's gradient.
- ``check_k_detached``: its parallel form uses k detached from the graph.
- ``check_no_state_numel``: it does not implement ``state_numel``.
- ``check_d_dot_unset``: its constructor never sets ``d_dot`` (left at d_key, the features are 2·d_key wide).
- ``check_wrong_reference``: its reference is 1 % off, its forms right.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import variants
from variants.base import AttentionCore
from variants.chunked import sum_rule_chunked
from variants.fast_weights import FastWeightState
from variants.feature_maps import EPS
from variants.params import integer
from variants.precision import state_dtype


def mirrored(x: torch.Tensor) -> torch.Tensor:
    """φ(x) = [elu(x) + 1, elu(-x) + 1]: positive features, twice as wide as x."""
    return torch.cat([F.elu(x) + 1, F.elu(-x) + 1], -1)


@variants.register("check_mirrored")
class Mirrored(AttentionCore):
    PARAMS = {"chunk_size": integer()}
    supports_noncausal = False

    def __init__(self, d_key: int, *, chunk_size: int = 16):
        super().__init__(d_key)
        self.d_dot = 2 * d_key
        self.chunk_size = chunk_size

    def init_state(self, batch, heads, d_value, *, device=None, dtype=None):
        dtype = state_dtype(dtype or torch.get_default_dtype())
        return FastWeightState(
            torch.zeros(batch, heads, self.d_dot, d_value, device=device, dtype=dtype), torch.zeros(batch, heads, self.d_dot, device=device, dtype=dtype)
        )

    def _prefill(self, q, k, v, state):
        state = state if state is not None else self.init_state(q.shape[0], q.shape[1], v.shape[-1], device=q.device, dtype=q.dtype)
        out, weights, normaliser = sum_rule_chunked(q, k, v, *state, self.chunk_size, phi=mirrored)
        return out, FastWeightState(weights, normaliser)

    def _parallel(self, q, k, v, causal):
        return self._prefill(q, k, v, None)[0]

    def _reference(self, q, k, v, causal):
        scores = (mirrored(q) @ mirrored(k).transpose(-1, -2)).tril()
        return scores @ v / (scores.sum(-1, keepdim=True) + EPS)

    def _step(self, q_t, k_t, v_t, state):
        wide = state.weights.dtype
        features_q, features_k = mirrored(q_t.to(wide)), mirrored(k_t.to(wide))
        weights = state.weights + features_k[..., :, None] * v_t.to(wide)[..., None, :]
        normaliser = state.normaliser + features_k
        read = (features_q[..., None, :] @ weights)[..., 0, :]
        return (read / ((features_q * normaliser).sum(-1, keepdim=True) + EPS)).to(q_t.dtype), FastWeightState(weights, normaliser)

    def flops(self, batch, heads, length, d_value, *, causal=True):
        return 2 * batch * heads * length * (self.chunk_size * (self.d_dot + d_value) + 2 * self.d_dot * d_value)

    def step_flops(self, batch, heads, d_value, position):
        return 4 * batch * heads * self.d_dot * d_value

    def state_numel(self, batch, heads, d_value, length):
        return batch * heads * self.d_dot * (d_value + 1)


@variants.register("check_no_normaliser_step")
class NoNormaliserStep(Mirrored):
    def _step(self, q_t, k_t, v_t, state):
        wide = state.weights.dtype
        features_q, features_k = mirrored(q_t.to(wide)), mirrored(k_t.to(wide))
        weights = state.weights + features_k[..., :, None] * v_t.to(wide)[..., None, :]
        return (features_q[..., None, :] @ weights)[..., 0, :].to(q_t.dtype), FastWeightState(weights, state.normaliser + features_k)


class _HalveGradient(torch.autograd.Function):
    """The identity forward; half the gradient backward."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad / 2


@variants.register("check_half_k_grad")
class HalfKGrad(Mirrored):
    def _parallel(self, q, k, v, causal):
        return super()._parallel(q, _HalveGradient.apply(k), v, causal)


@variants.register("check_k_detached")
class KDetached(Mirrored):
    def _parallel(self, q, k, v, causal):
        return super()._parallel(q, k.detach(), v, causal)


@variants.register("check_no_state_numel")
class NoStateNumel(Mirrored):
    state_numel = AttentionCore.state_numel


@variants.register("check_d_dot_unset")
class DDotUnset(Mirrored):
    def __init__(self, d_key: int, *, chunk_size: int = 16):
        AttentionCore.__init__(self, d_key)
        self.chunk_size = chunk_size


@variants.register("check_wrong_reference")
class WrongReference(Mirrored):
    def _reference(self, q, k, v, causal):
        return 1.01 * super()._reference(q, k, v, causal)

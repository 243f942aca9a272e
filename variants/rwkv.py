"""RWKV-4 time mixing: the WKV operator (Peng et al. 2023, "RWKV: Reinventing RNNs for the
Transformer Era", arXiv:2305.13048, §3.1.2-3.1.3, eq. 14-19).

    wkv_t = (Σ_{i<t} e^{−(t−1−i)w + k_i} ⊙ v_i + e^{u + k_t} ⊙ v_t) / (Σ_{i<t} e^{−(t−1−i)w + k_i} + e^{u + k_t}),
    o_t = σ(r_t) ⊙ wkv_t

per channel, with a learned decay w = exp(w_raw) > 0 and bonus u for the current token, both of
size d_key; the receptance r is the core's q. The token shift of r, k, v is done by
``AttentionLayer`` (``token_shift = True``). Causal only; d_value must equal d_key.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from .base import AttentionCore, register
from .chunked import _chunks, causal_read, wkv_chunk, wkv_chunked
from .compiled import chunk_form
from .params import RWKV as RWKV_PARAMS

#: The chunked form's work per token grows with C (its [B, H, C, C, D] exponents): on a CPU,
#: C = 8 was 3.1x faster forward and 1.3x in training than C = 32, with 0.4x the training
#: memory (docs/performance.md, `attnbench run chunk-size`).
DEFAULT_CHUNK = 8


class WKVState(NamedTuple):
    """RWKV's decoding state, each ``[B, H, D]``: the decayed sums e^p·a = Σ e^{−(t−1−i)w + k_i} v_i,
    e^p·b = Σ e^{−(t−1−i)w + k_i}, kept as (a, b) relative to the running maximum exponent p."""

    numerator: torch.Tensor
    denominator: torch.Tensor
    max_exponent: torch.Tensor


@register("rwkv")
class RWKV(AttentionCore):
    """The WKV operator with learnable ``log_decay`` (w_raw, w = e^{w_raw}) and ``bonus`` (u).

    Initialisation: w_raw evenly spaced in [−6, 1] over the channels (decays from about e^{−0.0025}
    to e^{−2.7} per token, RWKV's spread of fast and slow channels), u = log 0.3.
    ``chunk_size`` is the parallel form's chunk (memory C²·D per batch row and head)."""

    token_shift = True
    supports_noncausal = False
    d_value_is_d_key = True
    PARAMS = RWKV_PARAMS
    backend_forms = {"fla": "fla's fused_recurrent_rwkv4 (RWKV-4's WKV over [B, T, channels]) is not mapped yet"}

    def __init__(self, d_key, *, chunk_size=DEFAULT_CHUNK):
        super().__init__(d_key)
        self.chunk_size = chunk_size
        self.d_dot = 1  # one decayed average per channel
        self.log_decay = nn.Parameter(torch.linspace(-6.0, 1.0, d_key))
        self.bonus = nn.Parameter(torch.full((d_key,), math.log(0.3)))

    def _parameters_as(self, x):
        return torch.exp(self.log_decay.to(x.dtype)), self.bonus.to(x.dtype)

    def init_state(self, batch, heads, d_value, *, device=None, dtype=None) -> WKVState:
        zeros = torch.zeros(batch, heads, self.d_key, device=device, dtype=dtype)
        return WKVState(zeros, zeros.clone(), torch.full_like(zeros, float("-inf")))

    def _prefill(self, q, k, v, state: WKVState | None):
        if state is None:
            state = self.init_state(q.shape[0], q.shape[1], v.shape[-1], device=q.device, dtype=q.dtype)
        wkv, *state = wkv_chunked(k, v, *self._parameters_as(k), *state, self.chunk_size, chunk=chunk_form(self, wkv_chunk))
        return torch.sigmoid(q) * wkv, WKVState(*state)

    def _parallel(self, q, k, v, causal):
        return self._prefill(q, k, v, None)[0]

    def _step(self, q_t, k_t, v_t, state):
        """The running-maximum recurrence (RWKV-4's CUDA kernel form): read with the bonus, then
        decay the state by e^{−w} and add token t, all relative to the largest exponent. Without
        autograd the new a, b are written into ``state``'s (which the step consumes)."""
        decay, bonus = self._parameters_as(k_t)
        numerator, denominator, max_exponent = state
        boosted, lowered = bonus + k_t, max_exponent - decay
        top = torch.maximum(max_exponent, boosted).detach()
        old, new = torch.exp(max_exponent - top), torch.exp(boosted - top)
        wkv = torch.addcmul(old * numerator, new, v_t) / torch.addcmul(new, old, denominator)
        top = torch.maximum(lowered, k_t).detach()
        old, new = torch.exp(lowered - top), torch.exp(k_t - top)
        if torch.is_grad_enabled():
            numerator, denominator = torch.addcmul(old * numerator, new, v_t), torch.addcmul(new, old, denominator)
        else:
            numerator, denominator = numerator.mul_(old).addcmul_(new, v_t), denominator.mul_(old).add_(new)
        return torch.sigmoid(q_t) * wkv, WKVState(numerator, denominator, top)

    def _reference(self, q, k, v, causal):
        """The formula above as written: all T × T weights e^{k_i − (t−1−i)w}, no stabiliser."""
        decay, bonus = self._parameters_as(k)
        steps = torch.arange(q.shape[2], device=q.device)
        lag = (steps[:, None] - 1 - steps[None, :]).to(k.dtype)[..., None]
        weights = torch.exp((k.unsqueeze(2) - lag * decay).masked_fill(lag < 0, float("-inf")))
        weights = weights + torch.diag_embed(torch.exp(bonus + k).transpose(-1, -2)).permute(0, 1, 3, 4, 2)
        wkv = causal_read(lambda values: (weights * values.unsqueeze(2)).sum(3), v) / weights.sum(3)
        return torch.sigmoid(q) * wkv

    def flops(self, batch, heads, length, d_value, *, causal=True):
        """The weighted sums of values, 2·n²·D per chunk of n tokens plus 2·n·D for the carried
        state (matmul-shaped einsums); the exps, maxima and the denominator's sums are not counted."""
        per_head = sum(2 * (end - start) * ((end - start) + 1) * d_value for start, end in _chunks(length, self.chunk_size))
        return batch * heads * per_head

    def step_flops(self, batch, heads, d_value, position):
        """Reading and updating a and b: 6 multiply-adds (12 FLOPs) per channel; exps not counted."""
        return batch * heads * 12 * d_value

    def state_numel(self, batch, heads, d_value, length):
        """numerator, denominator and running maximum exponent, one a channel (``init_state``)."""
        return 3 * batch * heads * self.d_key

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, chunk_size={self.chunk_size}"

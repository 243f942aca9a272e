"""Softmax attention: the quadratic baseline (Schlag et al. 2021, eq. 7; Katharopoulos eq. 2).

    y_t = Σ_{i≤t} softmax_i(q_t·k_i · s) v_i,   s = 1/sqrt(d_key) unless ``scale`` is given.

The parallel form is PyTorch's ``scaled_dot_product_attention`` (FlashAttention or the
memory-efficient kernel where the device has one); decoding keeps a KV cache.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .base import AttentionCore, VariantError, register
from .chunked import causal_read


class KVCache(NamedTuple):
    """Keys ``[B, H, capacity, Dk]`` and values ``[B, H, capacity, Dv]``, of which the first
    ``length`` positions are filled. Capacity doubles when full, so appending is amortised O(1)."""

    keys: torch.Tensor
    values: torch.Tensor
    length: int

    def filled(self):
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]

    def append(self, k_t, v_t) -> KVCache:
        """Add one token (``k_t: [B, H, Dk]``, ``v_t: [B, H, Dv]``). Under autograd the cache
        is rebuilt out of place, so that earlier steps keep the tensors they saved."""
        if torch.is_grad_enabled() and (k_t.requires_grad or v_t.requires_grad or self.keys.requires_grad):
            keys, values = self.filled()
            return KVCache(torch.cat([keys, k_t[:, :, None]], 2), torch.cat([values, v_t[:, :, None]], 2), self.length + 1)
        keys, values = self.keys, self.values
        if self.length == keys.shape[2]:
            grow = max(self.length, 16)
            keys = torch.cat([keys, keys.new_empty(*keys.shape[:2], grow, keys.shape[3])], 2)
            values = torch.cat([values, values.new_empty(*values.shape[:2], grow, values.shape[3])], 2)
        keys[:, :, self.length] = k_t
        values[:, :, self.length] = v_t
        return KVCache(keys, values, self.length + 1)


@register("softmax")
class Softmax(AttentionCore):
    """Scaled dot-product softmax attention; ``scale`` defaults to 1/sqrt(d_key)."""

    def __init__(self, d_key, *, scale: float | None = None):
        super().__init__(d_key)
        self.d_dot = None  # no fixed-size memory: the KV cache grows with the sequence
        if scale is not None and (not isinstance(scale, (int, float)) or scale <= 0):
            raise VariantError(f"softmax: scale must be a positive number, got {scale!r}")
        self.scale = 1 / math.sqrt(d_key) if scale is None else float(scale)

    def _parallel(self, q, k, v, causal):
        if not causal:
            return F.scaled_dot_product_attention(q, k, v, scale=self.scale)
        return self._causal(q, k, v, is_causal=True)

    def _causal(self, q, k, v, **mask):
        """Causal SDPA in which a non-finite key or value at position p reaches no output before p,
        whatever the SDPA backend does with a masked-out NaN (0·NaN and NaN − ∞ are NaN): both go
        through ``causal_read``, a key poisoning every channel of the outputs from p on."""
        attend = lambda keys, values: F.scaled_dot_product_attention(q, keys, values, scale=self.scale, **mask)  # noqa: E731
        return causal_read(lambda keys: causal_read(lambda values: attend(keys, values), v), k, every_channel=True)

    def _prefill(self, q, k, v, state: KVCache | None):
        """Causal parallel form that also returns the KV cache after the last token."""
        if state is None or state.length == 0:
            return self._parallel(q, k, v, True), KVCache(k, v, k.shape[2])
        past_keys, past_values = state.filled()
        keys, values = torch.cat([past_keys, k], 2), torch.cat([past_values, v], 2)
        # A query at prefill position t sees every cached token and the new tokens up to t.
        visible = torch.ones(q.shape[2], keys.shape[2], dtype=torch.bool, device=q.device).tril(state.length)
        return self._causal(q, keys, values, attn_mask=visible), KVCache(keys, values, keys.shape[2])

    def init_state(self, batch, heads, d_value, *, device=None, dtype=None) -> KVCache:
        keys = torch.empty(batch, heads, 0, self.d_key, device=device, dtype=dtype)
        values = torch.empty(batch, heads, 0, d_value, device=device, dtype=dtype)
        return KVCache(keys, values, 0)

    def _step(self, q_t, k_t, v_t, state):
        state = state.append(k_t, v_t)
        keys, values = state.filled()
        weights = torch.softmax((keys @ q_t.unsqueeze(-1)).squeeze(-1) * self.scale, dim=-1)
        return (weights.unsqueeze(-2) @ values).squeeze(-2), state

    def _reference(self, q, k, v, causal):
        scores = (q @ k.transpose(-1, -2)) * self.scale
        if causal:
            future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
            return causal_read(torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1).matmul, v)
        return torch.softmax(scores, dim=-1) @ v

    def flops(self, batch, heads, length, d_value, *, causal=True):
        """Q Kᵀ and P V over the visible pairs: T(T+1)/2 of them when causal, T² otherwise."""
        pairs = length * (length + 1) // 2 if causal else length * length
        return 2 * batch * heads * pairs * (self.d_key + d_value)

    def step_flops(self, batch, heads, d_value, position):
        return 2 * batch * heads * (position + 1) * (self.d_key + d_value)

    def state_numel(self, batch, heads, d_value, length):
        return batch * heads * length * (self.d_key + d_value)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scale={self.scale:.4g}"

"""A multi-head attention layer around any registered core (Schlag et al. 2021, eq. 4-6, 21)."""

from __future__ import annotations

import torch
from torch import nn

from .base import VariantError, create


class AttentionLayer(nn.Module):
    """Projections x -> q, k, v (and β = σ(W_β x) for cores that need it), the core, and the
    output projection. ``x: [B, T, d_model] -> [B, T, d_model]``; ``step`` takes ``x_t: [B, d_model]``.

    ``d_key`` and ``d_value`` default to d_model / n_heads; ``params`` go to the core.
    """

    def __init__(self, d_model: int, n_heads: int, core_name: str, *, d_key=None, d_value=None, bias=False, **params):
        super().__init__()
        for label, value in (("d_model", d_model), ("n_heads", n_heads), ("d_key", d_key), ("d_value", d_value)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise VariantError(f"AttentionLayer: {label} must be a positive int, got {value!r}")
        if (d_key is None or d_value is None) and d_model % n_heads:
            raise VariantError(f"d_model={d_model} is not divisible by n_heads={n_heads}; give d_key and d_value")
        self.n_heads = n_heads
        self.d_key = d_model // n_heads if d_key is None else d_key
        self.d_value = d_model // n_heads if d_value is None else d_value
        self.core = create(core_name, self.d_key, **params)
        self.query = nn.Linear(d_model, n_heads * self.d_key, bias=bias)
        self.key = nn.Linear(d_model, n_heads * self.d_key, bias=bias)
        self.value = nn.Linear(d_model, n_heads * self.d_value, bias=bias)
        self.write_strength = nn.Linear(d_model, n_heads) if self.core.needs_beta else None
        self.out = nn.Linear(n_heads * self.d_value, d_model, bias=bias)

    def _project(self, x):
        """``x: [..., d_model]`` -> q, k ``[..., H, Dk]``, v ``[..., H, Dv]``, β ``[..., H]`` or None."""
        heads = x.shape[:-1] + (self.n_heads, -1)
        q, k, v = self.query(x).view(heads), self.key(x).view(heads), self.value(x).view(heads)
        beta = torch.sigmoid(self.write_strength(x)) if self.write_strength is not None else None
        return q, k, v, beta

    def _project_sequence(self, x):
        """``x: [B, T, d_model]`` -> q, k, v ``[B, H, T, D]`` and β ``[B, H, T]`` or None."""
        q, k, v, beta = self._project(x)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return q, k, v, beta.transpose(1, 2) if beta is not None else None

    def forward(self, x, *, causal: bool = True):
        q, k, v, beta = self._project_sequence(x)
        y = self.core(q, k, v, beta=beta, causal=causal)
        return self.out(y.transpose(1, 2).flatten(2))

    def prefill(self, x, state=None):
        """Causal parallel form over ``x: [B, T, d_model]`` that also returns the decoding state."""
        q, k, v, beta = self._project_sequence(x)
        y, state = self.core.prefill(q, k, v, beta=beta, state=state)
        return self.out(y.transpose(1, 2).flatten(2)), state

    def init_state(self, batch: int, *, device=None, dtype=None):
        return self.core.init_state(batch, self.n_heads, self.d_value, device=device, dtype=dtype)

    def step(self, x_t, state):
        """One decoding step: ``x_t: [B, d_model]`` -> ``(y_t [B, d_model], state)``."""
        q, k, v, beta = self._project(x_t)
        y, state = self.core.step(q, k, v, state, beta_t=beta)
        return self.out(y.flatten(1)), state

"""A multi-head attention layer around any registered core (Schlag et al. 2021, eq. 4-6, 21)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .backends import create
from .base import VariantError, sequences
from .conv import ShortConv, TokenShift


class LayerState(NamedTuple):
    """Decoding state of a layer that keeps past inputs: the core's state, the short
    convolution's last K − 1 inputs ``[B, K − 1, d_model]`` and the previous (convolved) input
    ``[B, d_model]`` of the token shift (None where the layer has no such part)."""

    core: object
    conv_window: torch.Tensor | None
    previous: torch.Tensor | None


class AttentionLayer(nn.Module):
    """Projections x -> q, k, v and, for each token input the core declares, one value per head
    (β = σ(W_β x + b_β) in ``write_strength``, the gated rule's log decay in ``decay_gate``: the
    module ``TokenInput.layer`` builds, kept as the attribute ``TokenInput.layer_attribute``), the core, and the output projection.
    ``x: [B, T, d_model] -> [B, T, d_model]``; ``step`` takes ``x_t: [B, d_model]``.

    ``d_key`` and ``d_value`` default to d_model / n_heads; ``params`` go to the core.
    ``short_conv=K`` applies a causal depthwise convolution of width K to the layer input
    before every projection (Based's short convolution), and a core with ``token_shift``
    (RWKV) gets its r, k, v projections from token-shifted inputs; decoding then keeps those
    past inputs in a ``LayerState``.

    Grouped heads: ``heads_k`` key heads (default ``n_heads``, the query heads) and ``heads_v`` value
    heads (default ``heads_k``), as the core's ``head_grouping`` allows (GQA: ``heads_k = heads_v``
    dividing ``n_heads``; GVA: ``heads_v`` a multiple of ``n_heads``). The output, the token inputs
    and the output projection have the larger of ``n_heads`` and ``heads_v``. Packed sequences:
    ``forward`` and ``prefill`` take ``cu_seqlens`` (``x: [1, total_T, d_model]``), and the short
    convolution and the token shift, like the core, restart at each sequence's first token.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        core_name: str,
        *,
        d_key=None,
        d_value=None,
        heads_k=None,
        heads_v=None,
        bias=False,
        short_conv=None,
        **params,
    ):
        super().__init__()
        sizes = (
            ("d_model", d_model),
            ("n_heads", n_heads),
            ("d_key", d_key),
            ("d_value", d_value),
            ("heads_k", heads_k),
            ("heads_v", heads_v),
            ("short_conv", short_conv),
        )
        for label, value in sizes:
            if value is not None and (not isinstance(value, int) or value < 1):
                raise VariantError(f"AttentionLayer: {label} must be a positive int, got {value!r}")
        if (d_key is None or d_value is None) and d_model % n_heads:
            raise VariantError(f"d_model={d_model} is not divisible by n_heads={n_heads}; give d_key and d_value")
        self.n_heads = n_heads
        self.heads_k = n_heads if heads_k is None else heads_k
        self.heads_v = self.heads_k if heads_v is None else heads_v
        self.heads_out = max(n_heads, self.heads_v)
        self.d_key = d_model // n_heads if d_key is None else d_key
        self.d_value = d_model // n_heads if d_value is None else d_value
        self.core = create(core_name, self.d_key, **params)
        self.core._check_heads(n_heads, self.heads_k, self.heads_v)  # the core's own rule, refused now rather than at the first call
        self.short_conv = ShortConv(d_model, short_conv) if short_conv is not None else None
        self.token_shift = TokenShift(d_model) if self.core.token_shift else None
        self.query = nn.Linear(d_model, n_heads * self.d_key, bias=bias)
        self.key = None if self.core.shared_qk else nn.Linear(d_model, self.heads_k * self.d_key, bias=bias)
        self.value = nn.Linear(d_model, self.heads_v * self.d_value, bias=bias)
        for spec in self.core.token_inputs:
            if hasattr(self, spec.layer_attribute) or spec.layer_attribute == "out":  # registered before out: the parameter order stays
                raise VariantError(f"AttentionLayer: {core_name}'s token input {spec.name!r} names its projection {spec.layer_attribute!r}, taken")
            self.add_module(spec.layer_attribute, spec.layer(d_model, self.heads_out))
        self.out = nn.Linear(self.heads_out * self.d_value, d_model, bias=bias)

    @property
    def _buffered(self) -> bool:
        """Whether decoding keeps past layer inputs (short convolution, token shift) beside the core's state."""
        return self.short_conv is not None or self.token_shift is not None

    def _project(self, x, x_q=None, x_k=None, x_v=None):
        """``x: [..., d_model]`` -> q, k ``[..., H, Dk]``, v ``[..., H, Dv]`` and the core's token inputs
        by name, ``[..., H]`` (e.g. ``{'beta': σ(W_β x)}``). ``x_q, x_k, x_v`` (token shift) replace ``x``
        as the input of each projection."""
        lead = x.shape[:-1]
        q = self.query(x if x_q is None else x_q).view(*lead, self.n_heads, -1)
        k = F.normalize(q, dim=-1) if self.key is None else self.key(x if x_k is None else x_k).view(*lead, self.heads_k, -1)
        v = self.value(x if x_v is None else x_v).view(*lead, self.heads_v, -1)
        per_token = {spec.name: getattr(self, spec.layer_attribute)(x) for spec in self.core.token_inputs}
        return q, k, v, per_token

    def _project_sequence(self, x, state=None, bounds=None):
        """``x: [B, T, d_model]``, continuing from a ``LayerState`` (or from nothing) -> q, k, v
        ``[B, H, T, D]``, the per-token inputs ``[B, H, T]`` and the input buffers after x (packed,
        ``bounds``: ``x [1, total_T, d_model]`` from nothing, and the buffers of each sequence)."""
        conv_window = previous = streams = None
        if bounds is not None:
            if self.short_conv is not None:
                x, conv_window = self.short_conv.packed(x, bounds), self.short_conv.packed_windows(x, bounds)
            if self.token_shift is not None:
                streams, previous = self.token_shift.packed(x, bounds), x[0, [stop - 1 for _, stop in sequences(bounds)]]
        elif self.short_conv is not None:
            conv_window = state.conv_window if state is not None else self.short_conv.init_window(x.shape[0], device=x.device, dtype=x.dtype)
            x, conv_window = self.short_conv(x, conv_window), self.short_conv.next_window(x, conv_window)
        if self.token_shift is not None and bounds is None:
            streams, previous = self.token_shift(x, None if state is None else state.previous), x[:, -1]
        q, k, v, per_token = self._project(x, *(streams if streams is not None else ()))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return q, k, v, {name: t.transpose(1, 2) for name, t in per_token.items()}, conv_window, previous

    def forward(self, x, *, causal: bool = True, cu_seqlens=None):
        q, k, v, per_token, _, _ = self._project_sequence(x, bounds=self._bounds(x, cu_seqlens))
        y = self.core(q, k, v, causal=causal, cu_seqlens=cu_seqlens, **per_token)
        return self.out(y.transpose(1, 2).flatten(2))

    def prefill(self, x, state=None, *, cu_seqlens=None):
        """Causal parallel form over ``x: [B, T, d_model]`` that also returns the decoding state
        (packed, ``cu_seqlens``: from nothing, the state of each sequence as a batch row)."""
        bounds = self._bounds(x, cu_seqlens)
        if bounds is not None and state is not None:
            raise VariantError("AttentionLayer.prefill: packed sequences (cu_seqlens) start from nothing; give no state")
        buffers = state if self._buffered else None
        q, k, v, per_token, conv_window, previous = self._project_sequence(x, buffers, bounds)
        packed = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
        y, core_state = self.core.prefill(q, k, v, state=state.core if buffers is not None else state, **packed, **per_token)
        state = LayerState(core_state, conv_window, previous) if self._buffered else core_state
        return self.out(y.transpose(1, 2).flatten(2)), state

    def _bounds(self, x, cu_seqlens) -> list[int] | None:
        """``cu_seqlens`` as ints, checked against ``x: [1, total_T, d_model]`` (None: not packed)."""
        if cu_seqlens is None:
            return None
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or len(cu_seqlens) < 2:
            raise VariantError("AttentionLayer: cu_seqlens must be a 1-d int32 tensor of N + 1 offsets")
        bounds = cu_seqlens.tolist()
        if x.shape[0] != 1 or bounds[0] != 0 or bounds[-1] != x.shape[1] or any(b <= a for a, b in sequences(bounds)):
            raise VariantError(
                f"AttentionLayer: packed sequences are x [1, total_T, d_model] with cu_seqlens rising from 0 to total_T; "
                f"got x {tuple(x.shape)}, cu_seqlens {bounds}"
            )
        return bounds

    def init_state(self, batch: int, *, device=None, dtype=None):
        """The core's empty state (on the state's heads: GQA's key/value heads, GVA's value heads),
        with zero input buffers when the layer keeps them (``LayerState``)."""
        heads = max(self.heads_k, self.heads_v)
        core_state = self.core.init_state(batch, heads, self.d_value, device=device, dtype=dtype)
        if not self._buffered:
            return core_state
        conv_window = self.short_conv.init_window(batch, device=device, dtype=dtype) if self.short_conv is not None else None
        previous = torch.zeros(batch, self.query.in_features, device=device, dtype=dtype) if self.token_shift is not None else None
        return LayerState(core_state, conv_window, previous)

    def step(self, x_t, state):
        """One decoding step: ``x_t: [B, d_model]`` -> ``(y_t [B, d_model], state)``."""
        core_state, streams = state, ()
        if self._buffered:
            core_state, conv_window, previous = state
            if self.short_conv is not None:
                x_t, conv_window = self.short_conv.step(x_t, conv_window)
            if self.token_shift is not None:
                streams, previous = self.token_shift(x_t.unsqueeze(1), previous).squeeze(2), x_t
        q, k, v, per_token = self._project(x_t, *streams)
        y, core_state = self.core.step(q, k, v, core_state, **{f"{name}_t": t for name, t in per_token.items()})
        state = LayerState(core_state, conv_window, previous) if self._buffered else core_state
        return self.out(y.flatten(1)), state

    def cross(self, x, memory):
        """Cross-attention (Vaswani et al. 2017, §3.2.3) through the core's non-causal form:
        queries from ``x: [B, T, d_model]``, keys and values from ``memory``, either the encoder
        output ``[B, S, d_model]`` (every position real: cores take no padding mask) or the
        projected pair ``(k [B, H, S, Dk], v [B, H, S, Dv])`` an earlier call returned, so that
        decoding projects the fixed memory once. Returns ``(y [B, T, d_model], (k, v))``.

        Cores take queries and keys of one length. A non-causal output at query i depends only
        on q_i and the whole key/value set, so the T queries are cut into blocks of S (the last
        zero-padded), each block a batch row that attends to the same S keys and values."""
        if self._buffered:
            raise VariantError("AttentionLayer.cross: a layer with short_conv or token shift mixes neighbouring inputs; memory keys have no order")
        if self.key is None:
            raise VariantError("AttentionLayer.cross: this core computes its keys from its queries (shared_qk); memory needs keys of its own")
        if isinstance(memory, torch.Tensor):
            lead = memory.shape[:-1]
            memory = self.key(memory).view(*lead, self.heads_k, -1).transpose(1, 2), self.value(memory).view(*lead, self.heads_v, -1).transpose(1, 2)
        k, v = memory
        (batch, length, _), memory_length = x.shape, k.shape[2]
        blocks = -(-length // memory_length)
        q = self.query(x).view(batch, length, self.n_heads, self.d_key).transpose(1, 2)
        q = F.pad(q, (0, 0, 0, blocks * memory_length - length))
        q = q.view(batch, self.n_heads, blocks, memory_length, self.d_key).transpose(1, 2).flatten(0, 1)
        y = self.core(q, k.repeat_interleave(blocks, 0), v.repeat_interleave(blocks, 0), causal=False)
        y = y.reshape(batch, blocks, self.heads_out, memory_length, self.d_value).transpose(1, 2).flatten(2, 3)
        return self.out(y[:, :, :length].transpose(1, 2).flatten(2)), memory

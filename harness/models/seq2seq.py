"""An encoder-decoder Transformer (Vaswani et al. 2017) whose three attentions are any variants.

Pre-LayerNorm blocks (Xiong et al. 2020), dropout on every residual branch, sinusoidal
positions (§3.5; no length limit, no parameters), a final LayerNorm on each side. Source,
target and output share one embedding matrix (Press & Wolf 2017): the subword vocabulary is
joint, and on small data (Multi30k) three-way tying saves a third of the parameters and
trains faster; embeddings are scaled by √d_model as in §3.4 (``tie_embeddings=False`` unties
the output). The attention at each position is ``variants.AttentionLayer`` built by name:

* ``encoder``: encoder self-attention, non-causal;
* ``decoder``: decoder self-attention, causal, decoded with the core's recurrent ``step``
  (a KV cache for softmax, the fast weights for the linear-time variants);
* ``cross``: decoder-to-encoder attention (``AttentionLayer.cross``), non-causal.

A causal-only core (the delta rule) is refused at the two non-causal positions. Cores take
no padding mask, so no padded source position ever reaches a non-causal attention: ``forward``
runs the rows of each source length together (the batcher makes batches of one source
length, so that is one group). Target padding sits after the last real token, where causal
attention keeps it out of every real position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

import variants

from ..tasks.parallel_text import PAD

POSITIONS = ("encoder", "decoder", "cross")


@dataclass
class Seq2SeqConfig:
    """Sizes of a Seq2Seq model; ``encoder``, ``decoder``, ``cross`` name the variant at each
    attention position and ``*_params`` go to it (and to ``AttentionLayer``)."""

    vocab_size: int
    encoder_layers: int
    decoder_layers: int
    d_model: int
    n_heads: int
    d_ff: int
    dropout: float = 0.1
    encoder: str = "softmax"
    decoder: str = "softmax"
    cross: str = "softmax"
    encoder_params: dict = field(default_factory=dict)
    decoder_params: dict = field(default_factory=dict)
    cross_params: dict = field(default_factory=dict)
    tie_embeddings: bool = True


def sinusoids(positions: torch.Tensor, d_model: int) -> torch.Tensor:
    """Vaswani et al. 2017, §3.5: PE(p, 2i) = sin(p / 10000^(2i/d)), PE(p, 2i+1) = cos(...);
    ``positions: [T]`` -> ``[T, d_model]``."""
    frequencies = torch.exp(torch.arange(0, d_model, 2, device=positions.device) * (-math.log(10000.0) / d_model))
    angles = positions.float()[:, None] * frequencies
    return torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(1)[:, :d_model]


def _attention(config: Seq2SeqConfig, position: str) -> variants.AttentionLayer:
    """The AttentionLayer at ``position``; a causal-only core at a non-causal position is an error."""
    name, params = getattr(config, position), getattr(config, f"{position}_params")
    layer = variants.AttentionLayer(config.d_model, config.n_heads, name, **params)
    if position != "decoder" and not layer.core.supports_noncausal:
        raise variants.VariantError(
            f"Seq2SeqConfig.{position}: variant {name!r} is causal only, but {position} attention is non-causal; "
            f"use it for decoder self-attention (Seq2SeqConfig.decoder) and a non-causal variant here"
        )
    return layer


def _feed_forward(config: Seq2SeqConfig) -> nn.Sequential:
    return nn.Sequential(nn.Linear(config.d_model, config.d_ff), nn.ReLU(), nn.Dropout(config.dropout), nn.Linear(config.d_ff, config.d_model))


class EncoderBlock(nn.Module):
    """``x + attn(ln(x))`` (non-causal), then ``x + ff(ln(x))``."""

    def __init__(self, config: Seq2SeqConfig):
        super().__init__()
        self.ln_attn, self.attn = nn.LayerNorm(config.d_model), _attention(config, "encoder")
        self.ln_ff, self.ff = nn.LayerNorm(config.d_model), _feed_forward(config)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln_attn(x), causal=False))
        return x + self.drop(self.ff(self.ln_ff(x)))


class DecoderBlock(nn.Module):
    """``x + self_attn(ln(x))`` (causal), ``x + cross(ln(x), memory)``, ``x + ff(ln(x))``."""

    def __init__(self, config: Seq2SeqConfig):
        super().__init__()
        self.ln_self, self.self_attn = nn.LayerNorm(config.d_model), _attention(config, "decoder")
        self.ln_cross, self.cross_attn = nn.LayerNorm(config.d_model), _attention(config, "cross")
        self.ln_ff, self.ff = nn.LayerNorm(config.d_model), _feed_forward(config)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x, memory):
        """``x: [B, T, d_model]``, ``memory: [B, S, d_model]`` -> ``[B, T, d_model]``."""
        x = x + self.drop(self.self_attn(self.ln_self(x), causal=True))
        x = x + self.drop(self.cross_attn.cross(self.ln_cross(x), memory)[0])
        return x + self.drop(self.ff(self.ln_ff(x)))

    def step(self, x_t, self_state, memory):
        """One target token ``x_t: [B, d_model]`` -> ``(y_t, self_state, memory)``; ``memory`` is
        the encoder output or its projected keys and values (``AttentionLayer.cross``)."""
        attended, self_state = self.self_attn.step(self.ln_self(x_t), self_state)
        x_t = x_t + attended
        crossed, memory = self.cross_attn.cross(self.ln_cross(x_t)[:, None], memory)
        x_t = x_t + crossed[:, 0]
        return x_t + self.ff(self.ln_ff(x_t)), self_state, memory


@dataclass
class DecoderState:
    """What ``Seq2Seq.step`` carries: the next position, each block's self-attention state and
    each block's projected memory (keys and values of the encoder output)."""

    position: int
    self_states: list
    memories: list

    def select(self, rows: torch.Tensor) -> DecoderState:
        """The state of batch rows ``rows`` (beam search reorders hypotheses with this)."""
        return DecoderState(self.position, [_select(s, rows) for s in self.self_states], [_select(m, rows) for m in self.memories])


def _select(state, rows):
    """Rows of every tensor in a (nested) tuple state (a KV cache, fast weights, a key/value pair)."""
    if isinstance(state, torch.Tensor):
        return state.index_select(0, rows)
    if isinstance(state, tuple):
        selected = [_select(item, rows) for item in state]
        return type(state)(*selected) if hasattr(state, "_fields") else tuple(selected)
    return state


class Seq2Seq(nn.Module):
    """``forward(src [B, S], tgt_in [B, T]) -> logits [B, T, vocab]`` (teacher forcing);
    ``encode``, ``start`` and ``step`` for autoregressive decoding."""

    def __init__(self, config: Seq2SeqConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model, padding_idx=PAD)
        self.drop = nn.Dropout(config.dropout)
        self.encoder = nn.ModuleList(EncoderBlock(config) for _ in range(config.encoder_layers))
        self.decoder = nn.ModuleList(DecoderBlock(config) for _ in range(config.decoder_layers))
        self.ln_encoder, self.ln_decoder = nn.LayerNorm(config.d_model), nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        nn.init.normal_(self.embed.weight, std=config.d_model**-0.5)
        with torch.no_grad():
            self.embed.weight[PAD].zero_()
        if config.tie_embeddings:
            self.head.weight = self.embed.weight

    def _embed(self, tokens, start: int = 0):
        """Scaled token embedding plus sinusoids of positions ``start ..``: ``[B, T] -> [B, T, d]``."""
        positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        return self.drop(self.embed(tokens) * math.sqrt(self.config.d_model) + sinusoids(positions, self.config.d_model))

    def encode(self, src):
        """``src: [B, S]`` with no padding (every row of length S) -> memory ``[B, S, d_model]``."""
        x = self._embed(src)
        for block in self.encoder:
            x = block(x)
        return self.ln_encoder(x)

    def decode(self, memory, tgt_in):
        """Teacher-forced logits ``[B, T, vocab]`` of ``tgt_in: [B, T]`` given ``memory``."""
        x = self._embed(tgt_in)
        for block in self.decoder:
            x = block(x, memory)
        return self.head(self.ln_decoder(x))

    def forward(self, src, tgt_in):
        """Logits ``[B, T, vocab]``. ``src: [B, S]`` may be right-padded with PAD: rows of each
        source length run together, unpadded (one group when the batch has one source length)."""
        lengths = source_lengths(src)
        if bool((lengths == src.shape[1]).all()):
            return self.decode(self.encode(src), tgt_in)
        logits = None
        for length in lengths.unique().tolist():
            rows = (lengths == length).nonzero().squeeze(1)
            group = self.decode(self.encode(src[rows, :length]), tgt_in[rows])
            logits = group.new_empty(src.shape[0], *group.shape[1:]) if logits is None else logits
            logits = logits.index_put((rows,), group)
        return logits

    def start(self, memory) -> DecoderState:
        """The decoding state before the first target token, for ``memory: [B, S, d_model]``."""
        weight = self.head.weight
        batch = memory.shape[0]
        self_states = [block.self_attn.init_state(batch, device=weight.device, dtype=weight.dtype) for block in self.decoder]
        return DecoderState(0, self_states, [memory] * len(self.decoder))

    def step(self, token_t, state: DecoderState):
        """One decoding step: ``token_t: [B]`` at ``state.position`` -> ``(logits_t [B, vocab], state)``."""
        x_t = self._embed(token_t[:, None], state.position)[:, 0]
        self_states, memories = [], []
        for block, self_state, memory in zip(self.decoder, state.self_states, state.memories, strict=True):
            x_t, self_state, memory = block.step(x_t, self_state, memory)
            self_states.append(self_state)
            memories.append(memory)
        return self.head(self.ln_decoder(x_t)), DecoderState(state.position + 1, self_states, memories)


def source_lengths(src) -> torch.Tensor:
    """The number of real tokens of each row of a right-padded ``src: [B, S]``; padding inside
    a row (a PAD followed by a real token) is an error."""
    real = src != PAD
    lengths = real.sum(1)
    if not bool((real == (torch.arange(src.shape[1], device=src.device) < lengths[:, None])).all()):
        raise ValueError("src must be right-padded: every PAD after the row's last real token")
    if not bool((lengths > 0).all()):
        raise ValueError("src has an empty row (every source needs at least its EOS token)")
    return lengths

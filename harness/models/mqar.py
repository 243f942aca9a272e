"""The model of the MQAR task (Arora et al. 2023, "Zoology"; ``harness.tasks.mqar``): a small
Zoology-style stack. Token + learned position embedding, ``n_layers`` blocks of (short causal
depthwise convolution, ``variants.AttentionLayer``, GELU MLP of 2× width), each a
pre-LayerNorm residual, then a final LayerNorm and a projection to the vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn

import variants
from variants.conv import ShortConv

from . import check_positive_int


class MQARBlock(nn.Module):
    """``x + conv(ln(x))``, ``x + attn(ln(x))``, ``x + mlp(ln(x))`` (pre-LayerNorm residuals)."""

    def __init__(self, d_model: int, n_heads: int, variant: str, conv_size: int, **variant_params):
        super().__init__()
        self.ln_conv = nn.LayerNorm(d_model)
        self.conv = ShortConv(d_model, conv_size)
        self.ln_attn = nn.LayerNorm(d_model)
        self.attn = variants.AttentionLayer(d_model, n_heads, variant, **variant_params)
        self.ln_mlp = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 2 * d_model), nn.GELU(), nn.Linear(2 * d_model, d_model))

    def forward(self, x):
        x = x + self.conv(self.ln_conv(x))
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class MQARModel(nn.Module):
    """Token + learned position embedding, ``n_layers`` MQARBlocks, final LayerNorm and an
    output projection: ``inputs [B, T] -> logits [B, T, vocab_size]`` (T ≤ ``max_len``)."""

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        variant: str,
        *,
        n_layers: int = 2,
        n_heads: int = 1,
        conv_size: int = 3,
        max_len: int = 1024,
        **variant_params,
    ):
        super().__init__()
        for name, value in (
            ("vocab_size", vocab_size),
            ("d_model", d_model),
            ("n_layers", n_layers),
            ("n_heads", n_heads),
            ("conv_size", conv_size),
            ("max_len", max_len),
        ):
            check_positive_int(name, value)
        self.vocab_size = vocab_size
        self.max_len = max_len
        self.embed = nn.Embedding(vocab_size, d_model)
        self.positions = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(MQARBlock(d_model, n_heads, variant, conv_size, **variant_params) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, inputs):
        length = inputs.shape[1]
        if length > self.max_len:
            raise ValueError(f"sequence length T={length} exceeds the model's max_len={self.max_len}")
        x = self.embed(inputs) + self.positions(torch.arange(length, device=inputs.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

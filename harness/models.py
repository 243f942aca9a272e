"""A decoder-only Transformer language model around any attention variant.

Pre-LayerNorm blocks (x + attn(ln(x)), then x + ff(ln(x))), learned absolute positions and an
output projection tied to the token embedding. The attention is ``variants.AttentionLayer``,
so every registered variant (softmax, linear, performer, dpfp, delta, ...) drops in by name.
The same model serves the speed scenarios (random tokens, words/s and memory) and the
WikiText quality runs; its presets are Schlag et al. 2021, §6.3.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch
import torch.nn.functional as F
from torch import nn

import variants


@dataclass
class LMConfig:
    """Sizes of a DecoderLM. ``variant`` names the attention core, ``variant_params`` go to it
    (and to ``AttentionLayer``: e.g. ``d_key``, ``chunk_size``, ``phi``)."""

    vocab_size: int
    n_layers: int
    d_model: int
    n_heads: int
    d_ff: int
    context: int
    dropout: float = 0.0
    variant: str = "softmax"
    variant_params: dict = field(default_factory=dict)
    tie_embeddings: bool = True


#: Model sizes without the vocabulary. "small" and "medium" are the WikiText-103 language
#: models of Schlag et al. 2021, §6.3; "cpu" is small enough to train on two CPU cores.
LM_PRESETS: dict[str, dict] = {
    "small": dict(n_layers=16, d_model=128, n_heads=8, d_ff=2048, context=256),
    "medium": dict(n_layers=16, d_model=256, n_heads=8, d_ff=4096, context=384),
    "cpu": dict(n_layers=4, d_model=128, n_heads=4, d_ff=512, context=128),
}


def lm_config(preset: str, vocab_size: int, **overrides) -> LMConfig:
    """The LMConfig of a preset (see ``LM_PRESETS``) for ``vocab_size``, with ``overrides``
    (any LMConfig field, e.g. ``variant="delta"``, ``dropout=0.1``)."""
    if preset not in LM_PRESETS:
        raise ValueError(f"unknown LM preset {preset!r}; known presets: {', '.join(LM_PRESETS)}")
    known = {f.name for f in fields(LMConfig)} - {"vocab_size"}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown LMConfig override(s) {', '.join(unknown)}; known fields: {', '.join(sorted(known))}")
    return replace(LMConfig(vocab_size=vocab_size, **LM_PRESETS[preset]), **overrides)


class Block(nn.Module):
    """Pre-LayerNorm residual block: ``x + attn(ln1(x))``, then ``x + ff(ln2(x))``."""

    def __init__(self, config: LMConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = variants.AttentionLayer(config.d_model, config.n_heads, config.variant, **config.variant_params)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.ff = nn.Sequential(
            nn.Linear(config.d_model, config.d_ff),
            nn.GELU(),
            nn.Linear(config.d_ff, config.d_model),
            nn.Dropout(config.dropout),
        )

    def forward(self, x):
        """Parallel, causal: ``x: [B, T, d_model] -> [B, T, d_model]``."""
        x = x + self.attn(self.ln1(x))
        return x + self.ff(self.ln2(x))

    def step(self, x_t, state):
        """One token: ``x_t: [B, d_model] -> (y_t [B, d_model], state)`` (the attention's recurrent step)."""
        attended, state = self.attn.step(self.ln1(x_t), state)
        x_t = x_t + attended
        return x_t + self.ff(self.ln2(x_t)), state


class DecoderLM(nn.Module):
    """Token + position embedding, ``n_layers`` Blocks, final LayerNorm, output projection."""

    def __init__(self, config: LMConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.positions = nn.Embedding(config.context, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        if config.tie_embeddings:
            self.head.weight = self.embed.weight

    @staticmethod
    def _init_weights(module):
        """N(0, 0.02) weights and zero biases, as in GPT-2 and Transformer-XL (init_std 0.02)."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens):
        """``tokens: [B, T]`` (int, T ≤ context) -> logits ``[B, T, vocab_size]``."""
        length = tokens.shape[1]
        if length > self.config.context:
            raise ValueError(f"sequence length T={length} exceeds the model's context={self.config.context}")
        position = torch.arange(length, device=tokens.device)
        x = self.drop(self.embed(tokens) + self.positions(position))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, tokens, targets):
        """Mean cross-entropy of the next-token predictions: ``tokens, targets: [B, T]`` -> scalar."""
        logits = self(tokens)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def init_state(self, batch: int, device=None, dtype=None) -> list:
        """The empty decoding state, one per block (the model's device and dtype by default)."""
        weight = self.head.weight
        device = weight.device if device is None else device
        dtype = weight.dtype if dtype is None else dtype
        return [block.attn.init_state(batch, device=device, dtype=dtype) for block in self.blocks]

    def step(self, token_t, position: int, states):
        """One decoding step: ``token_t: [B]`` at ``position`` (< context) -> ``(logits_t [B, vocab_size], states)``."""
        if not 0 <= position < self.config.context:
            raise ValueError(f"position={position} is outside the model's context [0, {self.config.context})")
        x_t = self.drop(self.embed(token_t) + self.positions.weight[position])
        new_states = []
        for block, state in zip(self.blocks, states, strict=True):
            x_t, state = block.step(x_t, state)
            new_states.append(state)
        return self.head(self.ln_f(x_t)), new_states

    def num_parameters(self) -> int:
        """The number of parameters, a tied embedding counted once."""
        return sum(p.numel() for p in self.parameters())

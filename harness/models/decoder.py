"""A decoder-only Transformer language model around any attention variant.

Pre-LayerNorm blocks (x + drop(attn(ln(x))), then x + drop(ff(ln(x)))), learned absolute
positions, and by default an output projection tied to the token embedding (Press & Wolf
2017: the tie halves the parameters of a model whose embedding dominates, e.g. 33k × 128 for
WikiText-2, and improves perplexity at these sizes). With ``adaptive_cutoffs`` the output is
instead an adaptive softmax (Grave et al. 2017, ``torch.nn.AdaptiveLogSoftmaxWithLoss``,
untied): frequent words in a full head, rarer ones in clusters of lower dimension. It makes
the output layer about 10× cheaper for a 33k vocabulary, which is what lets the CPU preset
train in minutes; its "logits" are then log-probabilities. Dropout acts on the embeddings and
on each residual branch. The attention is ``variants.AttentionLayer``,
so every registered variant (softmax, linear, performer, dpfp, delta, ...) drops in by name.
The same model serves the speed scenarios (random tokens, words/s and memory) and the
WikiText quality runs; its presets are Schlag et al. 2021, §6.3.

With a ``SegmentConfig`` the model is a segment-level recurrent one (``DecoderLM.segment``,
``DecoderLM.segments``): Transformer-XL's cached hidden states (Dai et al. 2019), the Recurrent
Memory Transformer's memory tokens (Bulatov et al. 2022), or a linear-time variant's fast-weight
state carried from one segment to the next.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

import variants
from variants import KVCache

from .configs import DecoderConfig, SegmentConfig


class Block(nn.Module):
    """Pre-LayerNorm residual block: ``x + attn(ln1(x))``, then ``x + ff(ln2(x))``."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = variants.AttentionLayer(config.d_model, config.n_heads, config.variant, **config.variant_params)
        self.drop_attn = nn.Dropout(config.dropout)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.ff = nn.Sequential(
            nn.Linear(config.d_model, config.d_ff),
            nn.GELU(),
            nn.Linear(config.d_ff, config.d_model),
            nn.Dropout(config.dropout),
        )

    def forward(self, x):
        """Parallel, causal: ``x: [B, T, d_model] -> [B, T, d_model]``."""
        x = x + self.drop_attn(self.attn(self.ln1(x)))
        return x + self.ff(self.ln2(x))

    def prefill(self, x, state=None):
        """Parallel and causal, continuing from the attention's ``state`` (None: empty):
        ``x: [B, T, d_model] -> (y [B, T, d_model], state after the last token)``."""
        attended, state = self.attn.prefill(self.ln1(x), state)
        x = x + self.drop_attn(attended)
        return x + self.ff(self.ln2(x)), state

    def step(self, x_t, state):
        """One token: ``x_t: [B, d_model] -> (y_t [B, d_model], state)`` (the attention's recurrent step)."""
        attended, state = self.attn.step(self.ln1(x_t), state)
        x_t = x_t + self.drop_attn(attended)
        return x_t + self.ff(self.ln2(x_t)), state


class DecoderLM(nn.Module):
    """Token + position embedding, ``n_layers`` Blocks, final LayerNorm, output projection."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.positions = nn.Embedding(config.context, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        if config.adaptive_cutoffs:
            self.head = None
            self.adaptive = nn.AdaptiveLogSoftmaxWithLoss(config.d_model, config.vocab_size, list(config.adaptive_cutoffs), div_value=config.adaptive_div_value)
        else:
            self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        segment = config.segment
        self.memory = nn.Parameter(torch.empty(segment.memory, config.d_model)) if segment and segment.kind == "rmt" else None
        self.apply(self._init_weights)
        if self.memory is not None:
            nn.init.normal_(self.memory, std=0.02)
        if config.tie_embeddings and self.head is not None:
            self.head.weight = self.embed.weight
        if segment is not None and segment.active:
            self._check_segment(segment)

    def _check_segment(self, segment: SegmentConfig) -> None:
        """The segment model fits this model: a set length within the positions, and attention
        that supports the kind (``xl``: plain softmax layers; ``carry_state``: linear-time)."""
        if segment.length is None:
            raise ValueError("segment.length must be set to build a model (run_lm sets it to the context by default)")
        if segment.positions() > self.config.context:
            raise ValueError(
                f"segment: a segment occupies length + 2·memory = {segment.positions()} positions, more than the model's context={self.config.context}"
            )
        layers = [block.attn for block in self.blocks]
        if segment.kind == "xl" and not all(isinstance(layer.core, variants.softmax.Softmax) and layer.short_conv is None for layer in layers):
            raise ValueError(
                f"segment.kind 'xl' caches keys and values of past hidden states: it needs softmax attention "
                f"without short_conv, got variant {self.config.variant!r}"
            )
        if segment.kind == "carry_state" and not self.linear_time:
            raise ValueError(
                f"segment.kind 'carry_state' needs a linear-time variant (a fixed-size fast-weight state); "
                f"variant {self.config.variant!r} keeps a KV cache that would grow with the whole stream"
            )

    @property
    def linear_time(self) -> bool:
        """Whether every attention keeps a fixed-size state (fast weights), not a growing KV cache."""
        return all(block.attn.core.d_dot is not None for block in self.blocks)

    @staticmethod
    def _init_weights(module):
        """N(0, 0.02) weights and zero biases, as in GPT-2 and Transformer-XL (init_std 0.02)."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def _embed(self, tokens, positions):
        """Token + position embeddings; ``positions`` default to 0 .. T−1 (then T ≤ context)."""
        if positions is None:
            length = tokens.shape[1]
            if length > self.config.context:
                raise ValueError(f"sequence length T={length} exceeds the model's context={self.config.context}")
            positions = torch.arange(length, device=tokens.device)
        elif positions.shape[-1] != tokens.shape[1] or int(positions.max()) >= self.config.context or int(positions.min()) < 0:
            raise ValueError(f"positions must have length T={tokens.shape[1]} and lie in [0, context={self.config.context})")
        return self.drop(self.embed(tokens) + self.positions(positions))

    def _output(self, h):
        """Logits ``[..., vocab_size]`` of final features ``h`` (log-probabilities for the adaptive softmax)."""
        if self.head is not None:
            return self.head(h)
        with self._adaptive_precision(h) as h:
            return self.adaptive.log_prob(h.flatten(0, -2)).view(*h.shape[:-1], -1)

    @contextlib.contextmanager
    def _adaptive_precision(self, h):
        """``h`` in the adaptive softmax's own dtype, with autocast off: under mixed precision
        (``harness.tasks.precision``) its clusters would otherwise return 16-bit log-probabilities
        that it then scatters into a float32 output (an error), so it runs in float32 there."""
        with torch.autocast(h.device.type, enabled=False):
            yield h.to(self.adaptive.head.weight.dtype)

    def _score(self, h, targets):
        """Logits of ``h: [B, T, d_model]``, or with ``targets: [B, T']`` (T' ≤ T) the negative
        log-likelihood ``[B, T']`` of each target at the last T' positions (the adaptive softmax
        then computes only the clusters the targets need; nothing of size vocab_size is kept)."""
        if targets is None:
            return self._output(h)
        h = h[:, h.shape[1] - targets.shape[1] :]
        if self.head is None:
            with self._adaptive_precision(h) as h:
                return -self.adaptive(h.flatten(0, 1), targets.flatten()).output.view(targets.shape)
        logits = self.head(h).flatten(0, 1)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # half precision: the loss in float32
        return F.cross_entropy(logits, targets.flatten(), reduction="none").view(targets.shape)

    def forward(self, tokens, positions=None, *, targets=None):
        """``tokens: [B, T]`` (int) -> logits ``[B, T, vocab_size]``, causal over all T tokens;
        with ``targets`` (``[B, T']``, T' ≤ T), the negative log-likelihood ``[B, T']`` of each
        target at the last T' positions instead. ``positions`` (``[T]`` ints in [0, context))
        default to 0 .. T−1, and then T ≤ context. A segment model (active ``config.segment``)
        runs its recurrence over consecutive segments of the T tokens instead (``segments``)."""
        if self.config.segment is not None and self.config.segment.active:
            if positions is not None:
                raise ValueError("a segment model restarts positions in every segment; it takes no positions")
            return self.segments(tokens, targets)[0]
        x = self._embed(tokens, positions)
        for block in self.blocks:
            x = block(x)
        return self._score(self.ln_f(x), targets)

    def prefill(self, tokens, states=None, positions=None, *, targets=None):
        """The parallel form continuing from ``states`` (one per block; None: empty), which also
        returns the states after the last token: ``-> (logits [B, T, vocab_size] or, with
        targets, NLLs as in forward, states)``. Calling it on consecutive segments equals one
        ``forward`` over their concatenation (with the same positions)."""
        x = self._embed(tokens, positions)
        states = [None] * len(self.blocks) if states is None else states
        new_states = []
        for block, state in zip(self.blocks, states, strict=True):
            x, state = block.prefill(x, state)
            new_states.append(state)
        return self._score(self.ln_f(x), targets), new_states

    def segment(self, tokens, carried=None, *, targets=None):
        """One segment ``tokens: [B, T]`` (T ≤ segment.length, positions 0 .. T − 1) continuing
        from what the previous segment left (``carried``; None: the first segment) -> (logits
        or, with targets, NLLs as in ``forward``; what this segment leaves for the next):

        - ``xl``: the layer inputs of this segment, detached, one ``[B, T, d_model]`` per block;
          block n attends to [SG(h_prev^{n−1}); h^{n−1}] (``_xl_segment``).
        - ``rmt``: the write-memory outputs of the last block ``[B, memory, d_model]``.
        - ``carry_state``: each block's fast-weight state after the segment (``prefill``)."""
        segment = self.config.segment
        if segment is None or not segment.active:
            raise ValueError("DecoderLM.segment needs a model built with an active DecoderConfig.segment")
        if tokens.shape[1] > segment.length:
            raise ValueError(f"a segment has at most segment.length={segment.length} tokens, got {tokens.shape[1]}")
        if segment.kind == "carry_state":
            return self.prefill(tokens, carried, targets=targets)
        if segment.kind == "xl":
            return self._xl_segment(tokens, carried, targets)
        return self._rmt_segment(tokens, carried, targets)

    def _xl_segment(self, tokens, cached, targets):
        """Transformer-XL (Dai et al. 2019, §3.2): h̃^{n−1} = [SG(m^{n−1}); h^{n−1}], q from
        h^{n−1}, k and v from h̃^{n−1}, causal within the segment, every cached position
        visible. Here through the softmax core's prefill with a KV cache of the projected,
        LayerNormed memory. Positions are the model's learned absolute ones, 0 .. T − 1 in
        every segment (XL proper uses relative positions; see the docs)."""
        x = self._embed(tokens, None)
        layer_inputs = []
        for index, block in enumerate(self.blocks):
            layer_inputs.append(x.detach())
            memory = None if cached is None else self._xl_cache(block, cached[index])
            x, _ = block.prefill(x, memory)
        return self._score(self.ln_f(x), targets), layer_inputs

    @staticmethod
    def _xl_cache(block: Block, hidden):
        """The KV cache of a block's attention over cached layer inputs ``hidden: [B, M, d_model]``."""
        layer, normed = block.attn, block.ln1(hidden)
        heads = hidden.shape[:-1] + (layer.n_heads, -1)
        keys, values = (projection(normed).view(heads).transpose(1, 2) for projection in (layer.key, layer.value))
        return KVCache(keys, values, hidden.shape[1])

    def _rmt_segment(self, tokens, read, targets):
        """Recurrent Memory Transformer, decoder-only form (Bulatov et al. 2022, §3): the input
        is [read memory; segment tokens; write memory] with positions 0 .. T + 2M − 1, run
        causally; the last block's outputs at the write positions are the next read memory.
        The first segment reads, and every segment writes into, the learned memory tokens."""
        batch, length = tokens.shape
        initial = self.memory.expand(batch, -1, -1)
        x = torch.cat([initial if read is None else read, self.embed(tokens), initial], 1)
        x = self.drop(x + self.positions.weight[: x.shape[1]])
        for block in self.blocks:
            x = block(x)
        size = self.memory.shape[0]
        return self._score(self.ln_f(x[:, size : size + length]), targets), x[:, size + length :]

    def segments(self, tokens, targets=None, carried=None):
        """Logits ``[B, T, vocab_size]`` (with ``targets [B, T]``: NLLs ``[B, T]``) over
        consecutive segments of ``segment.length`` of ``tokens: [B, T]`` (the last may be
        shorter), each continuing from what the previous left; returns ``(scores, carried
        after the last)``. Truncated backpropagation: what is
        carried is detached at the start of every group of ``segment.bptt`` segments (None:
        only at the start of the call), so gradients flow through at most ``bptt`` segments."""
        segment = self.config.segment
        if targets is not None and targets.shape != tokens.shape:
            raise ValueError(f"a segment model scores every position: targets must have the tokens' shape {tuple(tokens.shape)}, got {tuple(targets.shape)}")
        starts = range(0, tokens.shape[1], segment.length)
        group = segment.bptt or len(starts)
        outputs = []
        for index, start in enumerate(starts):
            if index % group == 0:
                carried = _detach(carried)
            window = slice(start, start + segment.length)
            scores, carried = self.segment(tokens[:, window], carried, targets=None if targets is None else targets[:, window])
            outputs.append(scores)
        return torch.cat(outputs, 1), carried

    def loss(self, tokens, targets):
        """Mean cross-entropy of the next-token predictions: ``tokens, targets: [B, T]`` -> scalar."""
        return self(tokens, targets=targets).mean()

    def init_state(self, batch: int, device=None, dtype=None) -> list:
        """The empty decoding state, one per block (the model's device and dtype by default)."""
        weight = self.embed.weight
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
        return self._output(self.ln_f(x_t)), new_states

    def num_parameters(self) -> int:
        """The number of parameters, a tied embedding counted once."""
        return sum(p.numel() for p in self.parameters())


def _detach(carried):
    """``carried`` (a tensor, None, or lists, tuples and NamedTuples of them) cut from the graph."""
    if isinstance(carried, torch.Tensor):
        return carried.detach()
    if isinstance(carried, list):
        return [_detach(item) for item in carried]
    if isinstance(carried, tuple):
        items = [_detach(item) for item in carried]
        return type(carried)(*items) if hasattr(carried, "_fields") else tuple(items)
    return carried

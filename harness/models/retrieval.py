"""The model of the associative retrieval task (Schlag et al. 2021, §6.1; ``harness.tasks.retrieval``):
a learned key embedding e and the projections W_K, W_Q (and W_β for the delta rule) around one
head of an attention core, whose memory's values are the one-hot v."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

import variants

from . import check_positive_int


class RetrievalMemory(NamedTuple):
    """Sequences written but for their last pair: the core's decoding ``state`` ``[N, ...]``
    and the last pair's ``last_k [N, 1, d_key]``, ``last_v [N, 1, S]``, ``last_beta [N, 1]``
    (None unless the core needs it)."""

    state: tuple
    last_k: torch.Tensor
    last_v: torch.Tensor
    last_beta: torch.Tensor | None


class RetrievalModel(nn.Module):
    """e, W_K, W_Q (and W_β for the delta rule) around one head of an attention core
    (Schlag et al. 2021, §6.1); the memory's values are the one-hot v, so d_value = S.

    The read after all L writes comes from the core's causal parallel form: the real query
    q = W_Q e(q) is placed at the last position L − 1 and the queries before it are zeros.
    Every form's output at position t includes token t (softmax attends to keys ≤ t, the
    fast weight rules write token t before reading with q_t), so the output at L − 1 is the
    read with q after the L writes; outputs at earlier positions are computed and discarded.
    Evaluation asks many queries of each sequence: ``memory`` then writes a sequence once (the
    first L − 1 pairs through ``prefill``) and ``read`` answers each query with one recurrent
    ``step`` that writes the last pair, the same read by the forms' equivalence.
    """

    def __init__(self, S: int, variant: str, *, d_key: int = 64, d_emb: int | None = None, **variant_params):
        super().__init__()
        check_positive_int("S", S)
        check_positive_int("d_key", d_key)
        d_emb = d_key if d_emb is None else d_emb
        check_positive_int("d_emb", d_emb)
        self.S = S
        self.embed = nn.Embedding(S, d_emb)
        self.W_K = nn.Linear(d_emb + S, d_key, bias=False)
        self.W_Q = nn.Linear(d_emb, d_key, bias=False)
        self.core = variants.create(variant, d_key, **variant_params)
        self.W_beta = nn.Linear(d_emb + S, 1) if variants.BETA in self.core.token_inputs else None

    def writes(self, keys: torch.Tensor, values: torch.Tensor):
        """What the pairs ``keys, values [B, L]`` write: ``k [B, 1, L, d_key]`` = W_K [e(k); v],
        the one-hot ``v [B, 1, L, S]`` and ``beta [B, 1, L]`` = σ(W_β [e(k); v]) (None unless
        the core needs it)."""
        v = F.one_hot(values, self.S).to(self.embed.weight.dtype)  # [B, L, S]
        written = torch.cat([self.embed(keys), v], dim=-1)  # [e(k); v]
        beta = torch.sigmoid(self.W_beta(written)).squeeze(-1)[:, None] if self.W_beta is not None else None
        k = self.W_K(written)[:, None]
        return k, v[:, None].to(k.dtype), beta  # under autocast (harness.tasks.precision) k is 16-bit: v follows

    def sequences(self, batch):
        """The core's inputs ``q, k: [B, 1, L, d_key]``, ``v: [B, 1, L, S]`` and ``beta:
        [B, 1, L]`` (None unless the core needs it); q is zero but at the last position."""
        k, v, beta = self.writes(batch.keys, batch.values)
        q_last = self.W_Q(self.embed(batch.query))[:, None, None]
        q = torch.cat([q_last.new_zeros(*k.shape[:2], k.shape[2] - 1, k.shape[3]), q_last], dim=2)
        return q, k, v, beta

    def forward(self, batch) -> torch.Tensor:
        """v̂ ``[batch, S]``: the read with the query key after writing the L pairs."""
        q, k, v, beta = self.sequences(batch)
        return self.core(q, k, v, beta=beta)[:, 0, -1]

    def memory(self, keys: torch.Tensor, values: torch.Tensor) -> RetrievalMemory:
        """The core's state after the first L − 1 of the pairs ``keys, values [N, L]`` (its
        ``prefill``), and the last pair's write, which ``read`` makes with each query."""
        k, v, beta = self.writes(keys, values)
        betas = {} if beta is None else {"beta": beta[..., :-1]}
        if k.shape[2] == 1:
            state = self.core.init_state(k.shape[0], 1, self.S, device=k.device, dtype=k.dtype)
        else:
            _, state = self.core.prefill(torch.zeros_like(k[:, :, :-1]), k[:, :, :-1], v[:, :, :-1], **betas)
        return RetrievalMemory(state, k[:, :, -1], v[:, :, -1], None if beta is None else beta[..., -1])

    def read(self, memory: RetrievalMemory, query: torch.Tensor, sequence: torch.Tensor) -> torch.Tensor:
        """v̂ ``[R, S]`` for the query keys ``query [R]``, the r-th asked of sequence
        ``sequence[r]`` of ``memory``: one ``step`` of the core that writes the sequence's last
        pair and reads with q = W_Q e(query) (the output at t includes token t)."""
        rows = lambda x: x.index_select(0, sequence) if torch.is_tensor(x) else x  # noqa: E731
        state = type(memory.state)(*map(rows, memory.state))
        betas = {} if memory.last_beta is None else {"beta_t": rows(memory.last_beta)}
        q = self.W_Q(self.embed(query))[:, None]
        read, _ = self.core.step(q, rows(memory.last_k), rows(memory.last_v), state, **betas)
        return read[:, 0]

"""LSH attention: the Reformer's (Kitaev, Kaiser, Levskaya 2020, §2-3).

Angular locality-sensitive hashing puts each token in one of ``n_buckets`` buckets per round:
with a random rotation R ∈ R^{d × n_buckets/2} (one per round, drawn from ``seed``),
h(x) = argmax([xR; −xR]) (§2, eq. 4). The bucket is the token's, hashed from its query: the
Reformer shares the query and key projection (k_j = q_j / ‖q_j‖, which ``AttentionLayer`` does
for a core with ``shared_qk``), so a token's query and key always fall in the same bucket.
Query i attends, with scale 1/√d, to the earlier tokens j < i of its bucket, and to itself only
when there is no such token (§3, "shared-QK"); the rounds r are combined by the log-sum-exp of
each round's scores (§2.1, "multi-round LSH"):

    o_i = Σ_r exp(z_{r,i} − logsumexp_r z_{r,i}) o_{r,i},   z_{r,i} = logsumexp_{j ∈ P_r(i)} q_i·k_j / √d.

Three faces:

- ``reference``: that definition, exact attention under the same-bucket causal mask, O(T²);
- the parallel form, the Reformer's algorithm: per round the tokens sorted by (bucket,
  position) and cut into chunks of ``chunk_size``, each attending to its own and the previous
  chunk. It equals the reference whenever every query's bucket-mates fit in that window
  (no bucket holds more than ``chunk_size`` tokens), and approximates it otherwise;
- ``step``: the exact definition for one new token over the cached keys of its buckets.

A non-finite key or value at position p makes outputs from p on NaN and no earlier one
(``causal_read``, as in softmax; a NaN never travels back through a masked zero weight).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .base import AttentionCore, VariantError, register
from .chunked import causal_read
from .params import LSH


class LSHCache(NamedTuple):
    """The decoding state: every past token's key ``[B, H, T, Dk]`` and value ``[B, H, T, Dv]``,
    bucket per round ``[B, H, R, T]``, and ``poison`` ``[B, H]``: 0,
    or NaN once a past token's key or value was not finite."""

    keys: torch.Tensor
    values: torch.Tensor
    buckets: torch.Tensor
    poison: torch.Tensor


def _combine(outputs: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Σ_r softmax_r(z_r) o_r over the rounds axis 2: ``outputs [B, H, R, T, Dv]``, ``lse [B, H, R, T]``."""
    return (torch.softmax(lse, dim=2).unsqueeze(-1) * outputs).sum(2)


def _poison(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Per token ``[..., T]``: 0, or NaN from the first token whose key or value is not finite on
    (the decoding state carries it, so a step after such a token is NaN as the parallel form is)."""
    return ((k - k).sum(-1) + (v - v).sum(-1)).detach().cumsum(-1)


def _causal(read, k, v):
    """``read(keys, values)`` through ``causal_read``, as softmax does: a non-finite key (every
    channel) or value (its channel) at p makes the outputs from p on NaN and no earlier one."""
    return causal_read(lambda keys: causal_read(lambda values: read(keys, values), v), k, every_channel=True)


def _attend(scores, allowed, values):
    """Softmax attention under the mask ``allowed`` (its last axis the keys): the output and the
    log-sum-exp of the allowed scores."""
    scores = scores.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ values, lse


def _with_self_fallback(allowed: torch.Tensor, is_self: torch.Tensor) -> torch.Tensor:
    """A query with no earlier bucket-mate attends to itself."""
    return allowed | (is_self & ~allowed.any(-1, keepdim=True))


@register("lsh")
class LSHAttention(AttentionCore):
    """Reformer LSH attention: ``n_rounds`` hashing rounds into ``n_buckets`` (even) buckets,
    chunks of ``chunk_size`` in the sorted order, rotations drawn from ``seed``."""

    supports_noncausal = False
    shared_qk = True
    approximates_reference = True
    PARAMS = LSH

    def __init__(self, d_key, *, n_rounds: int = 1, n_buckets: int = 32, chunk_size: int = 64, seed: int = 0):
        super().__init__(d_key)
        if n_buckets % 2:
            raise VariantError(f"lsh: n_buckets must be even (h(x) = argmax([xR; −xR])), got {n_buckets}")
        self.d_dot = None  # attends to a cache of every past token, like softmax
        self.n_rounds, self.n_buckets, self.chunk_size, self.seed = n_rounds, n_buckets, chunk_size, seed
        rotations = torch.randn(n_rounds, d_key, n_buckets // 2, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        self.register_buffer("rotations", rotations, persistent=False)
        self.scale = 1 / math.sqrt(d_key)

    def _apply(self, fn, recurse=True):
        """Move the rotations with the module but keep them float64: ``.to(bfloat16)`` would round them
        and hash a 16-bit cell differently from its float64 reference (a different function, not a
        rounding of the same one)."""
        rotations = self.rotations
        super()._apply(fn, recurse)
        self.rotations = rotations.to(self.rotations.device)
        return self

    def buckets(self, q: torch.Tensor) -> torch.Tensor:
        """h(q_t) of every token in every round: ``q [B, H, T, Dk]`` -> ``[B, H, R, T]`` (§2, eq. 4)."""
        projected = torch.einsum("bhtd,rdn->bhrtn", q.detach().to(self.rotations.dtype), self.rotations)
        return torch.cat([projected, -projected], -1).argmax(-1)

    def _reference(self, q, k, v, causal):
        """Exact attention under the mask of each round: same bucket, earlier position (self as the fallback)."""
        buckets = self.buckets(q)
        T = q.shape[2]
        positions = torch.arange(T, device=q.device)
        earlier = positions[None, :] < positions[:, None]
        is_self = positions[None, :] == positions[:, None]
        allowed = _with_self_fallback((buckets[..., :, None] == buckets[..., None, :]) & earlier, is_self)

        def read(keys, values):
            return _combine(*_attend((q @ keys.transpose(-1, -2) * self.scale).unsqueeze(2), allowed, values.unsqueeze(2)))

        return _causal(read, k, v)

    def _parallel(self, q, k, v, causal):
        buckets = self.buckets(q)
        return _causal(lambda keys, values: self._sorted_chunks(q, keys, values, buckets), k, v)

    def _sorted_chunks(self, q, k, v, buckets):
        """The sorted-chunk algorithm (Reformer §2, Figure 2), every round at once: each round's
        tokens sorted by (bucket, position), cut into chunks of C, each chunk's queries against
        the keys of its own and the previous chunk under the reference's mask."""
        B, H, T, _ = q.shape
        R, C = self.n_rounds, self.chunk_size
        n_chunks = -(-T // C)
        pad = n_chunks * C - T
        positions = torch.arange(T, device=q.device).expand(B, H, T)
        order = torch.argsort(buckets * T + positions.unsqueeze(2), dim=-1)  # [B, H, R, T]

        def sort(x, fill):
            """``x [B, H, T, ...]`` in each round's order, padded to whole chunks with ``fill``
            (a bucket and position that match nothing): ``[B, H, R, n, C, ...]``."""
            trailing = x.shape[3:]
            index = order.view(*order.shape, *([1] * len(trailing))).expand(B, H, R, T, *trailing)
            taken = x.unsqueeze(2).expand(B, H, R, *x.shape[2:]).gather(3, index)
            if pad:
                taken = torch.cat([taken, taken.new_full((B, H, R, pad, *trailing), fill)], dim=3)
            return taken.view(B, H, R, n_chunks, C, *trailing)

        def window(x, fill):
            """Each chunk after the one before it (before the first: ``fill``): ``[B, H, R, n, 2C, ...]``."""
            before = torch.cat([torch.full_like(x[:, :, :, :1], fill), x[:, :, :, :-1]], dim=3)
            return torch.cat([before, x], dim=4)

        q_s, k_s, v_s, pos_s = sort(q, 0.0), sort(k, 0.0), sort(v, 0.0), sort(positions, T)
        bucket_s = torch.cat([buckets.gather(3, order), buckets.new_full((B, H, R, pad), -1)], dim=3).view(B, H, R, n_chunks, C)
        k_w, v_w, pos_w, bucket_w = window(k_s, 0.0), window(v_s, 0.0), window(pos_s, T), window(bucket_s, -1)
        same = bucket_s.unsqueeze(-1) == bucket_w.unsqueeze(-2)
        allowed = _with_self_fallback(same & (pos_w.unsqueeze(-2) < pos_s.unsqueeze(-1)), pos_w.unsqueeze(-2) == pos_s.unsqueeze(-1))
        out, lse = _attend(q_s @ k_w.transpose(-1, -2) * self.scale, allowed, v_w)
        out, lse = out.reshape(B, H, R, n_chunks * C, -1)[:, :, :, :T], lse.reshape(B, H, R, n_chunks * C)[:, :, :, :T]
        unsort = torch.argsort(order, dim=-1)
        out = out.gather(3, unsort.unsqueeze(-1).expand(*unsort.shape, out.shape[-1]))
        return _combine(out, lse.gather(3, unsort))

    def init_state(self, batch, heads, d_value, *, device=None, dtype=None) -> LSHCache:
        return LSHCache(
            torch.zeros(batch, heads, 0, self.d_key, device=device, dtype=dtype),
            torch.zeros(batch, heads, 0, d_value, device=device, dtype=dtype),
            torch.zeros(batch, heads, self.n_rounds, 0, device=device, dtype=torch.long),
            torch.zeros(batch, heads, device=device, dtype=dtype),
        )

    def _prefill(self, q, k, v, state: LSHCache | None):
        """The parallel form over the prompt (from an empty cache) or, after a cache, the step
        form token by token; the cache then holds the prompt."""
        if state is None or state.keys.shape[2] == 0:
            return self._parallel(q, k, v, True), LSHCache(k, v, self.buckets(q), _poison(k, v)[:, :, -1])
        outputs = []
        for t in range(q.shape[2]):
            out, state = self._step(q[:, :, t], k[:, :, t], v[:, :, t], state)
            outputs.append(out)
        return torch.stack(outputs, dim=2), state

    def _step(self, q_t, k_t, v_t, state: LSHCache):
        """Query t over the cached tokens of its bucket in each round, itself as the fallback."""
        bucket_t = self.buckets(q_t.unsqueeze(2))  # [B, H, R, 1]
        keys = torch.cat([state.keys, k_t.unsqueeze(2)], 2)
        values = torch.cat([state.values, v_t.unsqueeze(2)], 2)
        buckets = torch.cat([state.buckets, bucket_t], 3)
        poison = state.poison + _poison(k_t.unsqueeze(2), v_t.unsqueeze(2))[:, :, 0]
        T = keys.shape[2]
        is_self = (torch.arange(T, device=q_t.device) == T - 1).view(1, 1, 1, 1, T)
        allowed = _with_self_fallback((buckets == bucket_t).unsqueeze(-2) & ~is_self, is_self)
        scores = (q_t.unsqueeze(2) @ keys.transpose(-1, -2) * self.scale).unsqueeze(2)
        out, lse = _attend(scores, allowed, values.unsqueeze(2))
        return _combine(out, lse)[:, :, 0] + poison.unsqueeze(-1), LSHCache(keys, values, buckets, poison)

    def flops(self, batch, heads, length, d_value, *, causal=True):
        """Hashing (T·d·n_buckets/2 multiply-adds per round) and each query against the 2·chunk
        keys of its window, per round."""
        per_round = 2 * length * self.d_key * (self.n_buckets // 2) + 2 * length * 2 * self.chunk_size * (self.d_key + d_value)
        return batch * heads * self.n_rounds * per_round

    def step_flops(self, batch, heads, d_value, position):
        per_round = 2 * self.d_key * (self.n_buckets // 2) + 2 * (position + 1) * (self.d_key + d_value)
        return batch * heads * self.n_rounds * per_round

    def state_numel(self, batch, heads, d_value, length):
        """Every past token's key, value and bucket per round, and one poison flag a head (``LSHCache``)."""
        return batch * heads * (length * (self.d_key + d_value + self.n_rounds) + 1)

    def extra_repr(self) -> str:
        return f"d_key={self.d_key}, n_rounds={self.n_rounds}, n_buckets={self.n_buckets}, chunk_size={self.chunk_size}, seed={self.seed}"

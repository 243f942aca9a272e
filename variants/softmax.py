"""Softmax attention: the quadratic baseline (Schlag et al. 2021, eq. 7; Katharopoulos eq. 2).

    y_t = Σ_{i≤t} softmax_i(q_t·k_i · s) v_i,   s = 1/sqrt(d_key) unless ``scale`` is given.

The parallel form is PyTorch's ``scaled_dot_product_attention`` (SDPA); decoding keeps a KV
cache. SDPA runs one of several kernels (FlashAttention, the memory-efficient kernel, cuDNN's,
the plain math form), chosen per call from the device, dtype, shapes and strides. The backend
option ``sdpa`` (``create(..., backend_options={"sdpa": "flash"})``, backends 'torch' and
'compile') pins one of them, and ``implementation_choices`` says which one a call runs, so that
two machines' softmax rows say whether they compared the same kernel.

Grouped-query attention (GQA): k and v may have fewer heads than q (SDPA's ``enable_gqa``; the KV
cache holds the key/value heads). Packed sequences (``cu_seqlens``): ``packed_choice``. A batch of mixed
context lengths (a packed or right-padded prefill's) decodes from one cache padded to the longest, each
row's step masked to its own positions (``KVCache.lengths``).
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import torch
import torch.backends.cuda as cuda_backends
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .base import AttentionCore, UnsupportedBackend, VariantError, register, sequences
from .chunked import causal_read
from .params import SOFTMAX

#: The SDPA kernels the backend option ``sdpa`` pins, by the name a scenario gives ('auto': PyTorch picks per call).
SDPA_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}
#: Each SDPA kernel's switch in torch.backends.cuda (the flags SDPA's dispatcher reads on every device).
_SWITCHES = {
    "flash": (cuda_backends.flash_sdp_enabled, cuda_backends.enable_flash_sdp),
    "efficient": (cuda_backends.mem_efficient_sdp_enabled, cuda_backends.enable_mem_efficient_sdp),
    "cudnn": (cuda_backends.cudnn_sdp_enabled, cuda_backends.enable_cudnn_sdp),
    "math": (cuda_backends.math_sdp_enabled, cuda_backends.enable_math_sdp),
}
SDPA_CHOICES = ("auto", *SDPA_BACKENDS)
#: The most scores [queries, keys] one call of SDPA's math kernel holds in a causal parallel form: it
#: materialises them three times (the mask, the scores, their softmax), which for float64 on a GPU (no fused
#: kernel takes it, so the float64 reference of a cell runs there) was 98 GiB at T = 65,536, beyond an
#: H100's 80 GB; beyond this the form runs in blocks of queries (``_parallel``).
MATH_BLOCK_SCORES = 2**27


class _Pinned:
    """Within the block, SDPA may run only the kernel ``name``: the four switches set, and restored
    on exit. The same as ``sdpa_kernel`` at a sixth of its cost (about 4 µs per call against 22 µs
    on the 2-core development VM), which matters inside a timed call; under torch.compile, where
    the switches are not traceable, ``sdpa_kernel`` (which TorchDynamo traces) does it."""

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        self.saved = [(enable, enabled()) for enabled, enable in _SWITCHES.values()]
        for kernel, (_, enable) in _SWITCHES.items():
            enable(kernel == self.name)

    def __exit__(self, *exc_info):
        for enable, was in self.saved:
            enable(was)


def _check_sdpa(value) -> bool:
    return isinstance(value, str) and value in SDPA_CHOICES


class KVCache(NamedTuple):
    """Keys ``[B, H, capacity, Dk]`` and values ``[B, H, capacity, Dv]``, of which the first
    ``length`` positions are filled. Capacity doubles when full, so appending is amortised O(1).
    ``lengths`` (``[B]`` int64; None: every row ``length``): a batch of mixed context lengths (a packed
    or right-padded prefill's), row n's first lengths[n] positions its own and ``length`` their
    longest; each row appends at its own position and a step reads only its own (``visible``)."""

    keys: torch.Tensor
    values: torch.Tensor
    length: int
    lengths: torch.Tensor | None = None

    def filled(self):
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]

    def visible(self) -> torch.Tensor | None:
        """``[B, 1, 1, length]``: the filled positions each row's step reads (None: all of them)."""
        if self.lengths is None:
            return None
        return (torch.arange(self.length, device=self.keys.device) < self.lengths[:, None])[:, None, None]

    def append(self, k_t, v_t) -> KVCache:
        """Add one token (``k_t: [B, H, Dk]``, ``v_t: [B, H, Dv]``), at each row's own position. Under
        autograd the cache is rebuilt out of place, so that earlier steps keep the tensors they saved."""
        rebuild = torch.is_grad_enabled() and (k_t.requires_grad or v_t.requires_grad or self.keys.requires_grad)
        if rebuild and self.lengths is None:
            keys, values = self.filled()
            return KVCache(torch.cat([keys, k_t[:, :, None]], 2), torch.cat([values, v_t[:, :, None]], 2), self.length + 1)
        keys, values = self.keys, self.values
        if self.length == keys.shape[2]:  # zeros: a shorter row's unwritten positions are read, masked (0 · NaN is NaN)
            grow = max(self.length, 16)
            keys = torch.cat([keys, keys.new_zeros(*keys.shape[:2], grow, keys.shape[3])], 2)
            values = torch.cat([values, values.new_zeros(*values.shape[:2], grow, values.shape[3])], 2)
        elif rebuild:
            keys, values = keys.clone(), values.clone()
        if self.lengths is None:
            # a slice, not an index: TorchDynamo keeps a sliced position symbolic but specialises an indexed one,
            # and the compiled step compiled again at every step (softmax[compile] decode: an error cell)
            keys[:, :, self.length : self.length + 1], values[:, :, self.length : self.length + 1] = k_t[:, :, None], v_t[:, :, None]
            return KVCache(keys, values, self.length + 1)
        rows = torch.arange(keys.shape[0], device=keys.device)
        keys[rows, :, self.lengths], values[rows, :, self.lengths] = k_t, v_t
        return KVCache(keys, values, self.length + 1, self.lengths + 1)


def packed_cache(keys, values, bounds) -> KVCache:
    """The KV cache of the N sequences of a packed row (``keys [1, H, total, Dk]``, ``bounds``: its
    ``cu_seqlens`` as ints): each written into its row of zeros ``[N, H, longest, Dk]``, with its length."""
    device, lengths = keys.device, [b - a for a, b in sequences(bounds)]
    counts = torch.tensor(lengths, device=device)
    row = torch.repeat_interleave(torch.arange(len(lengths), device=device), counts)
    position = torch.arange(keys.shape[2], device=device) - torch.tensor(bounds[:-1], device=device)[row]
    cache = []
    for x in (keys, values):
        padded = x.new_zeros(len(lengths), x.shape[1], max(lengths), x.shape[3])
        padded[row, :, position] = x[0].transpose(0, 1)
        cache.append(padded)
    return KVCache(*cache, max(lengths), counts)


@register("softmax")
class Softmax(AttentionCore):
    """Scaled dot-product softmax attention; ``scale`` defaults to 1/sqrt(d_key). ``sdpa``: the
    SDPA kernel its parallel form and prefill run ('auto', or one of ``SDPA_BACKENDS``), set by
    ``create`` from the backend option of that name."""

    #: The backend options of the PyTorch forms (backends 'torch' and 'compile'): name -> (accepts(value), what it accepts).
    OPTIONS = {"sdpa": (_check_sdpa, " | ".join(SDPA_CHOICES))}
    PARAMS = SOFTMAX
    sdpa = "auto"
    head_grouping = "gqa"

    def __init__(self, d_key, *, scale: float | None = None):
        super().__init__(d_key)
        self.d_dot = None  # no fixed-size memory: the KV cache grows with the sequence
        self.scale = 1 / math.sqrt(d_key) if scale is None else float(scale)

    def _parallel(self, q, k, v, causal):
        if not causal:
            return self._attend(q, k, v)
        rows = max(1, MATH_BLOCK_SCORES // k.shape[2])
        if rows < q.shape[2] and not torch.compiler.is_compiling() and self._sdp_choice(q, k, v, causal) == int(SDPBackend.MATH):
            return torch.cat([self._causal_block(q, k, v, start, min(start + rows, q.shape[2])) for start in range(0, q.shape[2], rows)], 2)
        return self._causal(q, k, v, is_causal=True)

    def _causal_block(self, q, k, v, start, end):
        """The causal outputs of queries start..end-1, against the keys up to end-1 (those they see)."""
        visible = torch.ones(end - start, end, dtype=torch.bool, device=q.device).tril(start)
        return self._causal(q[:, :, start:end], k[:, :, :end], v[:, :, :end], attn_mask=visible)

    def packed_choice(self, device: torch.device) -> str:
        """How the parallel form runs packed sequences on ``device``: 'per_sequence', one SDPA call each, on
        the CPU (7x faster than the mask there: 8 sequences, 2048 tokens, docs/variants.md); elsewhere
        'block_mask', one call over the packed row with a block-causal mask (one launch; not yet
        measured against per-sequence calls on a GPU)."""
        return "per_sequence" if device.type == "cpu" else "block_mask"

    def _parallel_packed(self, q, k, v, causal, bounds):
        """``packed_choice``: one SDPA call per sequence, or over the row, a query seeing only keys of its
        own sequence (up to itself when causal)."""
        if self.packed_choice(q.device) == "per_sequence":
            return super()._parallel_packed(q, k, v, causal, bounds)
        sequence = torch.cat([torch.full((b - a,), n, device=q.device) for n, (a, b) in enumerate(sequences(bounds))])
        visible = sequence[:, None] == sequence[None, :]
        if not causal:
            return self._attend(q, k, v, attn_mask=visible)
        return self._causal(q, k, v, attn_mask=visible.tril())

    def _attend(self, q, k, v, **mask):
        """SDPA on the kernel ``sdpa`` pins (any for 'auto'); grouped heads through its ``enable_gqa``."""
        grouped = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
        if self.sdpa == "auto":
            return F.scaled_dot_product_attention(q, k, v, scale=self.scale, **mask, **grouped)
        pinned = sdpa_kernel(SDPA_BACKENDS[self.sdpa]) if torch.compiler.is_compiling() else _Pinned(self.sdpa)
        with pinned:
            return F.scaled_dot_product_attention(q, k, v, scale=self.scale, **mask, **grouped)

    def _causal(self, q, k, v, **mask):
        """Causal SDPA in which a non-finite key or value at position p reaches no output before p,
        whatever the SDPA backend does with a masked-out NaN (0·NaN and NaN − ∞ are NaN): both go
        through ``causal_read``, a key poisoning every channel of the outputs from p on."""
        attend = lambda keys, values: self._attend(q, keys, values, **mask)  # noqa: E731
        return causal_read(lambda keys: causal_read(lambda values: attend(keys, values), v), k, every_channel=True)

    def implementation_choices(self, q, k, v, *, causal: bool = True, cu_seqlens=None, **token_inputs) -> dict:
        """``{"sdpa_backend": name}`` (and ``"packed"``, ``packed_choice``, with ``cu_seqlens``): the SDPA kernel the parallel form runs on these inputs, as
        SDPA's own dispatcher picks it (``torch._fused_sdp_choice``; under a pin, among the pinned
        one only). On the CPU PyTorch has two: its flash kernel ('flash') and 'math'.
        UnsupportedBackend names the pinned kernel and the inputs when it cannot run them."""
        names = {int(kernel): name for name, kernel in SDPA_BACKENDS.items()}
        choice = self._sdp_choice(q, k, v, causal)
        if choice not in names:
            shape = "x".join(map(str, q.shape))
            raise UnsupportedBackend(
                f"softmax: the SDPA kernel sdpa={self.sdpa} cannot run {q.device.type} {str(q.dtype).removeprefix('torch.')} inputs "
                f"[B, H, T, D] = {shape} (PyTorch has no such kernel for them); pin another ({', '.join(SDPA_CHOICES)})"
            )
        return {"sdpa_backend": names[choice]} | ({} if cu_seqlens is None else {"packed": self.packed_choice(q.device)})

    def _sdp_choice(self, q, k, v, causal) -> int:
        """The SDPA kernel (``int(SDPBackend)``) a call on these inputs runs, as SDPA's own dispatcher picks
        it (``torch._fused_sdp_choice``; under a pin, among the pinned one only; ERROR where none can)."""
        pinned = contextlib.nullcontext() if self.sdpa == "auto" else _Pinned(self.sdpa)
        with pinned:
            try:
                return torch._fused_sdp_choice(q, k, v, is_causal=causal, scale=self.scale, enable_gqa=q.shape[1] != k.shape[1])
            except RuntimeError:  # "No viable backend for scaled_dot_product_attention was found"
                return int(SDPBackend.ERROR)

    def _prefill(self, q, k, v, state: KVCache | None):
        """Causal parallel form that also returns the KV cache after the last token."""
        if state is None or state.length == 0:
            return self._parallel(q, k, v, True), KVCache(k, v, k.shape[2])
        if state.lengths is not None:
            raise VariantError("softmax: prefill continues a KV cache of one length; this one holds mixed context lengths (step it)")
        past_keys, past_values = state.filled()
        keys, values = torch.cat([past_keys, k], 2), torch.cat([past_values, v], 2)
        # A query at prefill position t sees every cached token and the new tokens up to t.
        visible = torch.ones(q.shape[2], keys.shape[2], dtype=torch.bool, device=q.device).tril(state.length)
        return self._causal(q, keys, values, attn_mask=visible), KVCache(keys, values, keys.shape[2])

    def _prefill_packed(self, q, k, v, state, bounds):
        """The packed parallel form, and the N sequences' KV cache (``packed_cache``), from an empty state."""
        if state is not None and state.length:
            raise VariantError("softmax: a packed prefill (cu_seqlens) starts from an empty KV cache; continue each sequence with step")
        return self._parallel_packed(q, k, v, True, bounds), packed_cache(k, v, bounds)

    def _prefill_padded(self, q, k, v, lengths):
        """A right-padded batch as a server runs it: the dense causal form over every row (its padding
        after the real tokens reaches none of their outputs) and the cache of the whole batch, copied
        (the steps write into it), row n's length lengths[n]: each step overwrites and masks its padding."""
        out, cache = self._prefill(q, k, v, None)
        return out, KVCache(cache.keys.clone(), cache.values.clone(), cache.length, torch.tensor(lengths, device=k.device))

    def init_state(self, batch, heads, d_value, *, device=None, dtype=None) -> KVCache:
        keys = torch.empty(batch, heads, 0, self.d_key, device=device, dtype=dtype)
        values = torch.empty(batch, heads, 0, d_value, device=device, dtype=dtype)
        return KVCache(keys, values, 0)

    def _step(self, q_t, k_t, v_t, state):
        """The queries of a group ``[B, H_kv, g, Dk]`` against their key/value head's cache (of mixed
        context lengths: each row's own positions, ``KVCache.visible``)."""
        state = state.append(k_t, v_t)
        keys, values = state.filled()
        grouped = q_t.unflatten(1, (keys.shape[1], -1))
        return F.scaled_dot_product_attention(grouped, keys, values, attn_mask=state.visible(), scale=self.scale).flatten(1, 2), state

    def _reference(self, q, k, v, causal):
        scores = (q @ k.transpose(-1, -2)) * self.scale
        if causal:
            future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
            return causal_read(torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1).matmul, v)
        return torch.softmax(scores, dim=-1) @ v

    def flops(self, batch, heads, length, d_value, *, causal=True, heads_k=None, heads_v=None):
        """Q Kᵀ and P V over the visible pairs: T(T+1)/2 of them when causal, T² otherwise, on the query
        heads (GQA's ``heads_k`` = ``heads_v`` change nothing: each query head meets every visible key)."""
        pairs = length * (length + 1) // 2 if causal else length * length
        return 2 * batch * heads * pairs * (self.d_key + d_value)

    def step_flops(self, batch, heads, d_value, position, *, heads_k=None, heads_v=None):
        return 2 * batch * heads * (position + 1) * (self.d_key + d_value)

    def state_numel(self, batch, heads, d_value, length, *, heads_k=None, heads_v=None):
        """The KV cache, on the ``heads_k`` = ``heads_v`` key/value heads (GQA; default ``heads``). FLOPs
        do not depend on them: every query head still meets every visible key."""
        return batch * (heads_k or heads) * length * (self.d_key + d_value)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scale={self.scale:.4g}, sdpa={self.sdpa}"

"""What the linear-time variants share: φ, the fast weight state and the normaliser.

Schlag et al. 2021 frame every linear attention as a fast weight programmer: an update
rule (sum, delta) writes key/value outer products into a matrix, and a query reads it.
This module holds the parts that do not depend on the rule, and the shapes every rule takes:
grouped heads (the sum rule's GQA, the delta rules' GVA: the fewer heads repeated to the output's,
``base.repeat_heads``; the decoding state is on the state heads, ``base.state_heads``) and packed
sequences (``cu_seqlens``: either scan restarting the state at each boundary).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import kernels, precision
from .base import AttentionCore, BackendForm, UnsupportedBackend, repeat_heads, state_heads
from .feature_maps import EPS, FeatureMap, SumNormalized, make_feature_map
from .params import FAST_WEIGHTS

DEFAULT_CHUNK = 64


class FastWeightState(NamedTuple):
    """The decoding state of a linear-time variant.

    ``weights``: the fast weight matrix S = Wᵀ, ``[B, H, d_dot, Dv]``.
    ``normaliser``: z = Σ φ(k), ``[B, H, d_dot]``, or None when the variant does not normalise.
    """

    weights: torch.Tensor
    normaliser: torch.Tensor | None


def times_state(rows: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """``rows [B, H, n, F] @ state [B, H, F, D]`` as one ``bmm`` over the B·H heads (``@`` on 4-d tensors
    dispatches seven operations, ``bmm`` one and three views)."""
    return torch.bmm(rows.flatten(0, 1), state.flatten(0, 1)).unflatten(0, rows.shape[:2])


class FastWeightCore(AttentionCore):
    """Base of the sum and delta rules: builds φ, owns the state and the attention normaliser.

    ``phi`` names the feature map ('identity', 'elu1', 'favor' with ``m``, 'dpfp' with
    ``nu``; ``d_dot`` may stand in for m or ν; ``seed`` draws FAVOR+'s features). ``sum_norm``
    divides φ(q), φ(k) by the sum of their components; ``normalize`` divides each read by
    z·φ(q) (the attention normalisation of the sum rule, Katharopoulos et al. eq. 12; Schlag
    et al. 2021 eq. 17 for the delta rule). ``precision`` ('ieee' or 'tf32', backend 'triton' only): the
    dots of float32 inputs in the Triton kernels. ``chunk_size`` is the scan's chunk (None: ``DEFAULT_CHUNK``, or on
    backend 'triton' the kernels' default, ``kernels.default_chunk_size``; ``chunk_size_given`` says which).
    ``scan`` (one of ``params.SCANS``; PyTorch forms only) picks how the causal form runs the chunks.
    """

    PARAMS = FAST_WEIGHTS
    #: The Triton kernel module of the rule ('sum_rule' or 'delta_rule'), set by each rule.
    kernel_rule: str

    def __init__(self, d_key, *, phi, sum_norm, normalize, chunk_size=None, m=None, nu=None, d_dot=None, seed=0, precision="ieee", scan="auto"):
        super().__init__(d_key)
        self.scan = scan
        feature_map: FeatureMap = make_feature_map(phi, d_key, m=m, nu=nu, d_dot=d_dot, seed=seed)
        self.phi = SumNormalized(feature_map) if sum_norm else feature_map
        self.phi_name = phi
        self.sum_norm = sum_norm
        self.normalize = normalize
        self.d_dot = feature_map.d_dot
        self.chunk_size = chunk_size or DEFAULT_CHUNK
        self.chunk_size_given = chunk_size is not None
        self.precision = precision
        # without φ the plain rules stay bounded only for bounded keys (delta: while β‖k‖² < 2)
        self.example_unit_keys = phi == "identity"

    def scan_choice(self, device: torch.device) -> str:
        """The scan the causal PyTorch form runs on ``device``: ``scan``, or for 'auto' 'loop' on the CPU (faster
        there, eagerly and compiled, where backend 'compile' compiles one chunk's step: docs/performance.md) and
        'parallel' elsewhere (a few launches a call, not a few per chunk)."""
        if self.scan != "auto":
            return self.scan
        return "loop" if device.type == "cpu" else "parallel"

    def implementation_choices(self, q, k, v, *, causal=True, cu_seqlens=None, **token_inputs) -> dict:
        """``{"scan": 'loop' or 'parallel'}``: the scan a causal call on ``q``'s device runs (PyTorch forms)."""
        return {"scan": self.scan_choice(q.device)} if causal else {}

    def state_dtype(self, dtype):
        """At least float32 (``precision.state_dtype``), as the chunked scans and the Triton kernels keep it."""
        return precision.state_dtype(dtype)

    def init_state(self, batch, heads, d_value, *, device=None, dtype=None) -> FastWeightState:
        dtype = self.state_dtype(dtype or torch.get_default_dtype())
        weights = torch.zeros(batch, heads, self.d_dot, d_value, device=device, dtype=dtype)
        normaliser = torch.zeros(batch, heads, self.d_dot, device=device, dtype=dtype) if self.normalize else None
        return FastWeightState(weights, normaliser)

    def _prefill(self, q, k, v, state: FastWeightState | None, **token_inputs):
        return self._grouped_run(q, k, v, state, q.shape[0], None, **token_inputs)

    def _parallel(self, q, k, v, causal, **token_inputs):
        return self._grouped_run(q, k, v, None, q.shape[0], None, causal, **token_inputs)[0]

    def _prefill_packed(self, q, k, v, state, bounds, **token_inputs):
        """The outputs and the N sequences' states ``[N, H, ...]``, from ``state`` (``[N, H, ...]``; default empty)."""
        return self._grouped_run(q, k, v, state, len(bounds) - 1, bounds, **token_inputs)

    def _prefill_padded(self, q, k, v, lengths, **token_inputs):
        """A right-padded batch ``[N, H, T, ...]``: its N × T tokens run as one packed row in which each
        row's padding is a sequence of its own (the scans restart the state at every boundary, so the padding,
        computed as a padded batch computes it, never enters a real sequence's state): the outputs, and
        row n's state after its first lengths[n] tokens (a backend that takes no cu_seqlens refuses it)."""
        self._check_shape("packed", " (the padded prefill of the sum and delta rules runs its rows packed)")
        batch, steps = q.shape[0], q.shape[2]
        bounds = sorted({n * steps + end for n, length in enumerate(lengths) for end in (0, length)} | {batch * steps})
        row = lambda x: x.transpose(0, 1).flatten(1, 2).unsqueeze(0)  # noqa: E731  [N, H, T, ...] -> [1, H, N·T, ...]
        out, states = self._prefill_packed(row(q), row(k), row(v), None, bounds, **{name: row(x) for name, x in token_inputs.items()})
        real = [bounds.index(n * steps) for n in range(batch)]
        return out[0].unflatten(1, (batch, steps)).transpose(0, 1), FastWeightState(*(None if x is None else x[real] for x in states))

    def _parallel_packed(self, q, k, v, causal, bounds, **token_inputs):
        if not causal:  # every read meets its whole sequence
            return super()._parallel_packed(q, k, v, causal, bounds, **token_inputs)
        return self._grouped_run(q, k, v, None, len(bounds) - 1, bounds, **token_inputs)[0]

    def _grouped_run(self, q, k, v, state, batch, bounds, causal=True, **token_inputs):
        """``_run`` (with ``bounds`` where packed) on the output's heads, from ``state`` (on the state
        heads; default empty, ``batch`` rows): grouped q, k, v repeated, and the state of GQA's
        key/value heads repeated to the query heads and back (its copies within a group are equal)."""
        heads, kept = max(q.shape[1], v.shape[1]), state_heads(k, v)
        if state is None:
            state = self.init_state(batch, kept, v.shape[-1], device=q.device, dtype=q.dtype)
        state = FastWeightState(*(None if x is None else repeat_heads(x, heads) for x in state))
        packed = {} if bounds is None else {"bounds": bounds}
        out, state = self._run(*(repeat_heads(x, heads) for x in (q, k, v)), state, causal, **packed, **token_inputs)
        return out, FastWeightState(*(None if x is None else x[:, :: heads // kept] for x in state))

    def _step(self, q_t, k_t, v_t, state, **token_inputs):
        """One token, in the state's dtype (every product of a step meets the state); the output in q's.
        GVA: q_t, k_t repeated to the value heads; GQA: the queries of a group read their head's state.
        Without autograd (``torch.is_grad_enabled()`` false) the new state is written into ``state``'s
        tensors, which the step consumes (as softmax's KV cache): nothing of the state's size is allocated."""
        wide, heads = state.weights.dtype, state.weights.shape[1]
        q_t, k_t = repeat_heads(q_t, max(q_t.shape[1], heads)), repeat_heads(k_t, heads)
        features_q, features_k = self.phi.for_queries(q_t.to(wide)), self.phi.for_keys(k_t.to(wide))
        in_place = not torch.is_grad_enabled()
        weights = self._write(features_k, v_t.to(wide), state, in_place, **token_inputs)  # reads z before this token
        normaliser = None
        if self.normalize:
            normaliser = state.normaliser.add_(features_k) if in_place else state.normaliser + features_k
        features_q = features_q.unflatten(1, (heads, -1))  # [B, heads, g, d_dot]
        read = times_state(features_q, weights)
        if self.normalize:
            read = read / ((features_q * normaliser.unsqueeze(2)).sum(-1, keepdim=True) + EPS)
        return read.flatten(1, 2).to(q_t.dtype), FastWeightState(weights, normaliser)

    def flops(self, batch, heads, length, d_value, *, causal=True, heads_k=None, heads_v=None):
        """Matmul FLOPs of the chunked scan (φ itself not counted): per chunk of n tokens the
        rule's intra-chunk products plus reading and writing the d_dot × Dv state, and the
        normaliser's read φ(q)·z; the chunk algorithm's work, whichever ``scan`` runs it (the
        parallel delta scan's d_dot × d_dot transitions are extra work, not counted). Grouped heads
        (``heads_k``, ``heads_v``; default ``heads``): on the output's heads, where the form repeats the fewer."""
        heads = max(heads, heads_v or heads)
        normaliser = 2 * length * self.d_dot if self.normalize else 0
        if not causal:
            return batch * heads * (4 * length * self.d_dot * d_value + normaliser)
        chunks, rest = divmod(length, self.chunk_size)
        per_head = chunks * self._chunk_flops(self.chunk_size, d_value) + (self._chunk_flops(rest, d_value) if rest else 0)
        return batch * heads * (per_head + normaliser)

    def step_flops(self, batch, heads, d_value, position, *, heads_k=None, heads_v=None):
        """Per step: the write on the state heads, the read on the output's heads."""
        kept, reads = max(heads_k or heads, heads_v or heads), max(heads, heads_v or heads)
        read = 2 * self.d_dot * d_value * (reads - kept)  # GQA: the extra query heads' reads
        return batch * (kept * self._step_flops_per_head(d_value) + read)

    def state_numel(self, batch, heads, d_value, length, *, heads_k=None, heads_v=None):
        """The fast weights (and normaliser) on the state heads: GQA's key/value heads, GVA's value heads."""
        kept = max(heads_k or heads, heads_v or heads)
        return batch * kept * self.d_dot * (d_value + (1 if self.normalize else 0))

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, phi={self.phi_name}, sum_norm={self.sum_norm}, "
            f"normalize={self.normalize}, chunk_size={self.chunk_size}, scan={self.scan}, backend={self.backend}"
        )

    # --- implemented by each rule -------------------------------------------------
    def _run(self, q, k, v, state, causal, **token_inputs):
        """Parallel form from ``state``: ``(out, final_state)``; ``token_inputs`` as the rule declares them."""
        raise NotImplementedError

    def _write(self, features_k, v_t, state, in_place: bool, **token_inputs):
        """One write into the fast weights (token inputs ``[B, H]``): the new ``weights``, written into
        ``state.weights`` where ``in_place``."""
        raise NotImplementedError

    def _chunk_flops(self, n: int, d_value: int) -> int:
        """Matmul FLOPs of one chunk of ``n`` tokens, per head."""
        raise NotImplementedError

    def _step_flops_per_head(self, d_value: int) -> int:
        raise NotImplementedError


class TritonForm(BackendForm):
    """A rule on backend 'triton' (``backend_forms``): its ``_run`` through the rule's kernels
    (``variants.kernels``), at the chunk they run: the core's ``chunk_size`` where given (refused
    unless the kernels take it at this d_dot), else their default for it. Packed sequences go to the kernels
    as they are (``bounds``: their ``cu_seqlens``); grouped heads where a rule's form says so (``shapes``)."""

    replaces = ("_run", "chunk_size", "implementation_choices")
    shapes = ("packed",)

    def __init__(self, core: FastWeightCore):
        super().__init__(core)
        name, rule, d_dot = core.variant_name, core.kernel_rule, core.d_dot
        if d_dot > kernels.MAX_HEAD_DIM:
            raise UnsupportedBackend(f"{name}: d_dot={d_dot} exceeds the Triton kernels' limit of {kernels.MAX_HEAD_DIM}; use backend='torch'")
        if core.chunk_size_given:
            kernels.check_chunk_size(name, rule, d_dot, core.chunk_size)
            self.chunk_size = core.chunk_size
        else:
            self.chunk_size = kernels.default_chunk_size(rule, d_dot)

    def kernel(self, q):
        """The rule's Triton kernel module, after checking it can run on ``q``'s device."""
        kernels.require_device(self.core.variant_name, q.device)
        return kernels.load(self.core.kernel_rule)

    def implementation_choices(self, q, k, v, *, causal=True, **token_inputs) -> dict:
        """None to record: the kernels run one way (no ``scan``)."""
        return {}

    def _run(self, q, k, v, state, causal, **token_inputs):
        raise NotImplementedError

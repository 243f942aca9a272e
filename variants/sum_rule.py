"""The sum rule (linear attention) and its named presets: linear, performer, dpfp, based, rebased,
with its forms on the other backends: the Triton kernels and flash-linear-attention's.

    S_t = S_{t-1} + φ(k_t) v_tᵀ,   z_t = z_{t-1} + φ(k_t),   y_t = S_tᵀ φ(q_t) / (z_t·φ(q_t) + ε)

Katharopoulos et al. 2020, eq. 9-12; Schlag et al. 2021, eq. 17-19. ``normalize=False``
drops the denominator (y_t = S_tᵀ φ(q_t)); with ``phi='identity'`` that is plain causal
(Q Kᵀ ⊙ M) V with no scale.
"""

from __future__ import annotations

import functools

import torch

from . import fla_backend as fla
from .base import UnsupportedBackend, register
from .chunk_scan import sum_rule_parallel
from .chunked import causal_read, sum_rule_chunk, sum_rule_chunked
from .compiled import chunk_form
from .fast_weights import FastWeightCore, FastWeightState, TritonForm
from .feature_maps import EPS

#: fla's ε in the normalised linear attention's denominator, φ(q)·z + ε (ours: feature_maps.EPS).
FLA_LINEAR_EPS = 1e-10


@register("linear")
class SumRule(FastWeightCore):
    """Linear attention: the sum rule with any φ (default elu+1) and, by default,
    Katharopoulos' normalisation. ``sum_norm`` (off by default) is Schlag's φ / Σφ. ``precision``
    ('ieee' or 'tf32', backend='triton' only): the dots of float32 inputs in the Triton kernels."""

    kernel_rule = "sum_rule"
    head_grouping = "gqa"

    def __init__(self, d_key, *, phi="elu1", normalize=True, sum_norm=False, **options):
        super().__init__(d_key, phi=phi, sum_norm=sum_norm, normalize=normalize, **options)

    def _run(self, q, k, v, state, causal, bounds=None):
        if causal:
            packed = {} if bounds is None else {"bounds": bounds}
            scan = sum_rule_parallel
            if self.scan_choice(q.device) == "loop":
                scan = functools.partial(sum_rule_chunked, chunk=chunk_form(self, sum_rule_chunk))
            read, weights, normaliser = scan(q, k, v, *state, self.chunk_size, phi=self.phi.for_queries, phi_k=self.phi.for_keys, **packed)
            return read, FastWeightState(weights, normaliser)
        # non-causal: every read meets the whole state, so all of it is in the state's dtype
        wide = state.weights.dtype
        features_q, features_k = self.phi.for_queries(q.to(wide)), self.phi.for_keys(k.to(wide))
        weights = state.weights + features_k.transpose(-1, -2) @ v.to(wide)
        read = features_q @ weights
        if not self.normalize:
            return read.to(v.dtype), FastWeightState(weights, None)
        normaliser = state.normaliser + features_k.sum(2)
        return (read / (features_q @ normaliser.unsqueeze(-1) + EPS)).to(v.dtype), FastWeightState(weights, normaliser)

    def _write(self, features_k, v_t, state, in_place):
        """S + φ(k) vᵀ in one ``addcmul`` (into S where ``in_place``)."""
        outer = features_k.unsqueeze(-1), v_t.unsqueeze(-2)
        return state.weights.addcmul_(*outer) if in_place else torch.addcmul(state.weights, *outer)

    def _chunk_flops(self, n, d_value):
        """φ(Q)φ(K)ᵀ and its product with V (n × n), the read φ(Q)S and the write φ(K)ᵀV."""
        return 2 * n * n * (self.d_dot + d_value) + 4 * n * self.d_dot * d_value

    def _step_flops_per_head(self, d_value):
        return 4 * self.d_dot * d_value

    def _reference(self, q, k, v, causal):
        """The O(T²) masked form: y_t = Σ_{i≤t} (φ(q_t)·φ(k_i)) v_i / Σ_{i≤t} φ(q_t)·φ(k_i)."""
        scores = self.phi.for_queries(q) @ self.phi.for_keys(k).transpose(-1, -2)
        if causal:
            scores = torch.tril(scores)
        read = causal_read(scores.matmul, v) if causal else scores @ v
        return read / (scores.sum(-1, keepdim=True) + EPS) if self.normalize else read


@register("performer", core=SumRule, fixes=("phi",))
def performer(d_key, *, m=None, d_dot=None, **options):
    """Performer: the sum rule with FAVOR+ (m random features, d_dot = 2m; default m = d_key).
    ``core.phi.redraw(seed)`` draws new features."""
    if m is None and d_dot is None:
        m = d_key
    return SumRule(d_key, phi="favor", m=m, d_dot=d_dot, **options)


@register("dpfp", core=SumRule, fixes=("phi",))
def dpfp(d_key, *, nu=None, d_dot=None, **options):
    """The sum rule with DPFP-ν (Schlag et al. 2021, eq. 37; d_dot = 2·d_key·ν; default ν = 1)."""
    if nu is None and d_dot is None:
        nu = 1
    return SumRule(d_key, phi="dpfp", nu=nu, d_dot=d_dot, **options)


@register("based", core=SumRule, fixes=("phi",))
def based(d_key, **options):
    """Based (Arora et al. 2024, §4.1): the normalised sum rule with the 2nd-order Taylor map of
    exp(q·k/√d_key), d_dot = 1 + d_key + d_key², on a low d_key (the paper projects to 16)."""
    return SumRule(d_key, phi="taylor", **options)


@register("rebased", core=SumRule, fixes=("phi",))
def rebased(d_key, **options):
    """ReBased (Aksenov et al. 2024, §4): the normalised sum rule with the learnable kernel
    (γ ⊙ LayerNorm(x) + β)², separate γ, β for queries and keys; d_dot = d_key²."""
    return SumRule(d_key, phi="rebased", **options)


# --- the sum rule on the other backends -------------------------------------------------------------


class _Triton(TritonForm):
    """The causal parallel form through ``kernels.sum_rule.sum_rule_triton`` (the non-causal one stays PyTorch's)."""

    def _run(self, q, k, v, state, causal, bounds=None):
        core = self.core
        if not causal:
            return SumRule._run(core, q, k, v, state, causal)
        features_q, features_k = core.phi.for_queries(q), core.phi.for_keys(k)
        read, weights, normaliser = self.kernel(q).sum_rule_triton(
            features_q, features_k, v, *state, normalize=core.normalize, chunk_size=core.chunk_size, precision=core.precision, cu_seqlens=bounds
        )
        return read, FastWeightState(weights, normaliser)  # float32, the state dtype of every input dtype it takes


class _FlaLinear(fla.FlaForm):
    """The sum rule (linear, performer, dpfp, any φ): fla's linear attention on φ(q), φ(k);
    ``normalize`` is fla's ``normalize``. Unnormalised: scale 1. Normalised, fla divides
    s φ(q)ᵀS by s φ(q)·z + 1e-10 (s its ``scale``) where we divide φ(q)ᵀS by φ(q)·z + ε with ε = 1e-6;
    s = 1e-10 / ε makes the two the same function exactly (the states S and z do not depend on s). Packed
    sequences go to fla as its ``cu_seqlens``; fla's linear attention has no grouped heads."""

    shapes = ("packed",)

    def __init__(self, core):
        super().__init__(core, {"chunk": "chunk_linear_attn", "recurrent": "fused_recurrent_linear_attn"})
        self.scale = FLA_LINEAR_EPS / EPS if core.normalize else 1.0

    def _call(self, q, k, v, state, where, cu_seqlens=None):
        core, ops = self.core, fla._ops("linear_attn")
        kernel = ops.chunk_linear_attn if where == "chunk" else ops.fused_recurrent_linear_attn
        initial = None
        if state is not None:
            initial = (state.weights, fla._fla(state.normaliser.unsqueeze(2))) if core.normalize else state.weights
        out, final = kernel(  # φ acts on each token's last dim: applied in fla's layout, its output is in it too
            core.phi.for_queries(fla._fla(q)),
            core.phi.for_keys(fla._fla(k)),
            fla._fla(v),
            scale=self.scale,
            initial_state=initial,
            output_final_state=state is not None,
            normalize=core.normalize,
            **fla._packed(cu_seqlens, q.device),
        )
        if state is None:
            return fla._ours(out), None
        wide = core.state_dtype(v.dtype)
        if core.normalize:
            weights, normaliser = final
            return fla._ours(out), FastWeightState(weights.to(wide), normaliser[:, 0].to(wide))
        return fla._ours(out), FastWeightState(final.to(wide), None)

    def _parallel(self, q, k, v, causal):
        fla._causal_only(self.core.variant_name, causal)
        return self._call(q, k, v, None, fla._where(self.core.variant_name, q.device))[0]

    def _prefill(self, q, k, v, state):
        if state is None:
            state = self.core.init_state(q.shape[0], q.shape[1], v.shape[-1], device=q.device, dtype=q.dtype)
        return self._call(q, k, v, state, fla._where(self.core.variant_name, q.device))

    def _step(self, q_t, k_t, v_t, state):
        fla._where(self.core.variant_name, q_t.device)
        out, state = self._call(q_t.unsqueeze(2), k_t.unsqueeze(2), v_t.unsqueeze(2), state, "recurrent")
        return out.squeeze(2), state


class _FlaQuadratic(fla.FlaForm):
    """Based (φ = the 2nd-order Taylor map of exp(q·k/√d)): fla's ``parallel_based`` with scale
    1/√d_key, whose 1 + s + s²/2 with s = q·k/√d is φ(q)·φ(k), normalised with the same ε = 1e-6.
    ReBased: q' = γ_q ⊙ LayerNorm(q) + β_q (and k' with the keys' γ, β) in PyTorch, then fla's
    ``parallel_rebased`` unscaled with ε = 1e-6, whose (q'·k')² is φ(q)·φ(k). These kernels form
    no state: prefill and step are refused. Both take ``[B, T, H, D]`` and transpose it back to
    ``[B, H, T, D]`` (made contiguous) for the kernel: our layout 'bhtd' passes through as views.
    They compute tiled quadratic attention: ``flops`` counts it as softmax's is counted."""

    replaces = (*fla.FlaForm.replaces, "flops")
    input_layout = "bhtd"

    def __init__(self, core):
        self.based = core.phi_name == "taylor"
        kernel = "parallel_based" if self.based else "parallel_rebased"
        if core.d_key > fla.PARALLEL_MAX_DIM:
            raise UnsupportedBackend(f"{core.variant_name}: fla's {kernel} takes d_key <= {fla.PARALLEL_MAX_DIM}, got {core.d_key}")
        if core.sum_norm:
            raise UnsupportedBackend(
                f"{core.variant_name}: fla's parallel Based/ReBased kernels apply the map themselves and have no sum normalisation (sum_norm=True)"
            )
        super().__init__(core, {"chunk": kernel, "recurrent": kernel})

    def _parallel(self, q, k, v, causal):
        core = self.core
        fla._causal_only(core.variant_name, causal)
        fla._where(core.variant_name, q.device)
        if self.based:
            q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # fla's [B, T, H, D] as views: the kernel transposes back
            return fla._ours(fla._ops("based").parallel_based(q, k, v, scale=core.d_key**-0.5, use_norm=core.normalize))
        maps = core.phi.query, core.phi.key
        q, k = (torch.nn.functional.layer_norm(x, (core.d_key,), m.gamma.to(x.dtype), m.beta.to(x.dtype)) for x, m in zip((q, k), maps))
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        return fla._ours(fla._ops("rebased").parallel_rebased(q, k, v, eps=EPS, use_scale=False, use_normalize=core.normalize))

    def flops(self, batch, heads, length, d_value, *, causal=True):
        """q·k and the weighted sum of the values over the visible pairs, T(T+1)/2 of them when causal
        (the Taylor or square map of each score is elementwise, not counted)."""
        pairs = length * (length + 1) // 2 if causal else length * length
        return 2 * batch * heads * pairs * (self.core.d_key + d_value)

    def _no_state(self, *args, **kwargs):
        raise UnsupportedBackend(f"{self.core.variant_name}: fla's {self.fla_kernels['chunk']} forms no recurrent state; decoding is backend='torch'")

    _prefill = _step = _no_state


def _fla_form(core: SumRule) -> fla.FlaForm:
    """Based and ReBased run fla's parallel kernels; every other φ its linear attention."""
    return _FlaQuadratic(core) if core.phi_name in ("taylor", "rebased") else _FlaLinear(core)


SumRule.backend_forms = {"triton": _Triton, "fla": _fla_form}

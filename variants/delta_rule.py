"""The delta rule: Schlag et al. 2021's fast weight programmer (§4.2, eq. 20-25).

    v̄_t = W_{t-1} φ(k_t),   W_t = W_{t-1} + β_t (v_t − v̄_t) ⊗ φ(k_t),   y_t = W_t φ(q_t)

with β_t = σ(W_β x_t) ∈ (0, 1) given per token and head, and, by default, the sum
normalisation φ'(x) = φ(x) / Σ_j φ(x)_j of keys and queries (eq. 29). ``normalize=True``
adds the attention normalisation the paper ablates (eq. 26-28): z_t = z_{t-1} + φ(k_t),
v̄_t = W_{t-1} φ(k_t) / (z_{t-1}·φ(k_t)) (v̄ = 0 while that is 0), y_t = W_t φ(q_t) / (z_t·φ(q_t) + ε).
With ``phi='identity', sum_norm=False`` this is the plain delta rule
W_t = W_{t-1} + β_t (v_t − W_{t-1} k_t) k_tᵀ, y_t = W_t q_t. Causal only.

``gated_delta`` is the gated delta rule (Yang, Kautz, Hatamizadeh 2024, "Gated Delta Networks",
arXiv:2412.06464, eq. 10), W_t = α_t W_{t-1}(I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ, i.e.
W_t = α_t W_{t-1} + β_t (v_t − α_t W_{t-1} k_t) k_tᵀ, with a data-dependent decay α_t = exp(g_t) ∈ (0, 1]
per token and head (``log_gate`` g) and, as in the paper, L2-normalised keys and queries.

``deltanet`` is the delta rule as DeltaNet parameterises it (Yang, Wang, Shen, Panda, Kim
2024, "Parallelizing Linear Transformers with the Delta Rule over Sequence Length", §3.3):
φ(x) = SiLU(x) / ‖SiLU(x)‖₂ for keys and queries, no sum normalisation.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from . import fla_backend as fla
from .base import TokenInput, UnsupportedBackend, VariantError, activated_linear, register, state_heads
from .chunk_scan import delta_rule_parallel
from .chunked import delta_rule_chunk, delta_rule_chunked, safe_reciprocal
from .compiled import chunk_form
from .fast_weights import FastWeightCore, FastWeightState, TritonForm, times_state
from .feature_maps import EPS

#: Write strength β_t of the delta rules (Schlag et al. 2021, eq. 21: β = σ(W_β x)).
BETA = TokenInput(
    "beta",
    "the write strength",
    draw=lambda shape, *, generator=None, device=None, dtype=None: torch.rand(shape, generator=generator, device=device, dtype=dtype),
    bounds=(0.0, 1.0),
    layer=activated_linear(torch.sigmoid),
    owner="the delta rule",
    projection="write_strength",
)


class DecayGate(nn.Module):
    """The gated delta rule's log decay, as Gated DeltaNet parameterises it after Mamba2 (Yang,
    Kautz, Hatamizadeh 2024, §3.3): g = −exp(A) · softplus(W_α x + b_dt) ≤ 0 per head, with
    A ~ U[1, 16] and softplus(b_dt) log-uniform in [0.001, 0.1] at initialisation, so the decay
    α = exp(g) starts between about 0.2 and 1 (near 1 for most heads: memory that lasts) and
    not at σ(0)-like values that halve the memory at every token."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.linear = nn.Linear(d_model, n_heads, bias=False)
        self.log_A = nn.Parameter(torch.empty(n_heads).uniform_(1, 16).log())
        step = torch.empty(n_heads).uniform_(math.log(1e-3), math.log(1e-1)).exp()
        self.step_bias = nn.Parameter(step + torch.log(-torch.expm1(-step)))  # softplus⁻¹(step)

    def forward(self, x):
        return -self.log_A.exp() * F.softplus(self.linear(x) + self.step_bias)


#: Log decay g_t = log α_t ≤ 0 of the gated delta rule (Yang, Kautz, Hatamizadeh 2024, eq. 10),
#: computed in the layer by ``DecayGate``. Drawn as −3u², u ~ U(0, 1): decays α from about 0.05 to 1.
LOG_GATE = TokenInput(
    "log_gate",
    "the log decay gate log α",
    draw=lambda shape, *, generator=None, device=None, dtype=None: -3 * torch.rand(shape, generator=generator, device=device, dtype=dtype) ** 2,
    bounds=(-math.inf, 0.0),
    layer=DecayGate,
    owner="the gated delta rule",
    projection="decay_gate",
)


@register("delta")
class DeltaRule(FastWeightCore):
    """The delta rule with any φ (default elu+1), sum normalisation on by default. ``precision``
    ('ieee' or 'tf32', backend='triton' only): the dots of float32 inputs in the Triton kernels."""

    token_inputs = (BETA,)
    supports_noncausal = False
    kernel_rule = "delta_rule"
    head_grouping = "gva"

    def __init__(self, d_key, *, phi="elu1", sum_norm=True, normalize=False, **options):
        super().__init__(d_key, phi=phi, sum_norm=sum_norm, normalize=normalize, **options)

    def _run(self, q, k, v, state, causal, beta, log_gate=None, bounds=None):
        packed = {} if bounds is None else {"bounds": bounds}
        scan = delta_rule_parallel
        if self.scan_choice(q.device) == "loop":
            scan = functools.partial(delta_rule_chunked, chunk=chunk_form(self, delta_rule_chunk))
        read, weights, normaliser = scan(q, k, v, beta, *state, self.chunk_size, phi=self.phi.for_queries, phi_k=self.phi.for_keys, log_gate=log_gate, **packed)
        return read, FastWeightState(weights, normaliser)

    def _write(self, features_k, v_t, state, in_place, beta, log_gate=None):
        """W ← αW, then W ← W + β (v − W φ(k)) ⊗ φ(k) (α = 1 ungated), the outer product by one ``addcmul``
        (into W where ``in_place``); ``beta``, ``log_gate``: ``[B, H]``."""
        weights = state.weights
        if log_gate is not None:
            decay = torch.exp(log_gate)[..., None, None]
            weights = weights.mul_(decay) if in_place else decay * weights
        retrieved = times_state(features_k.unsqueeze(-2), weights).squeeze(-2)
        if self.normalize:
            retrieved = retrieved * safe_reciprocal((state.normaliser * features_k).sum(-1, keepdim=True))
        outer = features_k.unsqueeze(-1), ((v_t - retrieved) * beta.unsqueeze(-1)).unsqueeze(-2)
        return weights.addcmul_(*outer) if in_place else torch.addcmul(weights, *outer)

    def _chunk_flops(self, n, d_value):
        """K Kᵀ and Q Kᵀ (n × n), the triangular solve for [U, W], W S, the read Q S, the
        intra product with U' and the write Kᵀ U'."""
        d_dot = self.d_dot
        return 4 * n * n * d_dot + n * n * (d_value + d_dot) + 2 * n * n * d_value + 6 * n * d_dot * d_value

    def _step_flops_per_head(self, d_value):
        return 6 * self.d_dot * d_value

    def _reference(self, q, k, v, causal, beta, log_gate=None):
        """Token by token, in the paper's notation: W is [Dv, d_dot], eq. 20-28 (gated: W ← α_t W first)."""
        features_q, features_k = self.phi.for_queries(q), self.phi.for_keys(k)
        batch, heads, length, _ = q.shape
        W = q.new_zeros(batch, heads, v.shape[-1], self.d_dot)
        z = q.new_zeros(batch, heads, self.d_dot)
        outputs = []
        for t in range(length):
            phi_k, phi_q = features_k[:, :, t], features_q[:, :, t]
            if log_gate is not None:
                W = torch.exp(log_gate[:, :, t, None, None]) * W
            v_bar = torch.einsum("bhvd,bhd->bhv", W, phi_k)
            if self.normalize:
                v_bar = v_bar * safe_reciprocal(torch.einsum("bhd,bhd->bh", z, phi_k)).unsqueeze(-1)
                z = z + phi_k
            W = W + torch.einsum("bhv,bhd->bhvd", beta[:, :, t, None] * (v[:, :, t] - v_bar), phi_k)
            y = torch.einsum("bhvd,bhd->bhv", W, phi_q)
            if self.normalize:
                y = y / (torch.einsum("bhd,bhd->bh", z, phi_q).unsqueeze(-1) + EPS)
            outputs.append(y)
        return torch.stack(outputs, dim=2)


@register("deltanet", core=DeltaRule)
def deltanet(d_key, *, phi="silu_l2", sum_norm=False, **options):
    """The delta rule with DeltaNet's keys and queries: φ = SiLU then L2 normalisation (d_dot = d_key)."""
    return DeltaRule(d_key, phi=phi, sum_norm=sum_norm, **options)


@register("gated_delta")
class GatedDeltaRule(DeltaRule):
    """The gated delta rule: the delta rule whose memory decays by α_t = exp(g_t) before each
    write; g = ``log_gate`` ``[B, H, T]`` (≤ 0) comes with the input like β (``AttentionLayer``
    computes it with the paper's ``DecayGate``). φ defaults to the paper's L2
    normalisation ('l2', d_dot = d_key); any φ of the delta rule works. No attention
    normaliser. ``backend='triton'`` runs the delta rule's kernels with their gate on."""

    token_inputs = (BETA, LOG_GATE)

    def __init__(self, d_key, *, phi="l2", sum_norm=False, normalize=False, **options):
        if normalize:
            raise VariantError("gated_delta: normalize=True is not defined for the gated rule (the decay has no normaliser counterpart)")
        super().__init__(d_key, phi=phi, sum_norm=sum_norm, **options)


# --- the delta rules on the other backends ----------------------------------------------------------


class _Triton(TritonForm):
    """The parallel form through ``kernels.delta_rule.delta_rule_triton`` (its gate on for the gated rule);
    the kernels have no attention normaliser. They take packed sequences and GVA's fewer q/k heads as they are."""

    replaces = (*TritonForm.replaces, "_grouped_run")
    shapes = ("packed", "grouped")

    def __init__(self, core):
        if core.normalize:
            raise UnsupportedBackend(
                f"{core.variant_name}: backend='triton' implements the delta rule without attention normalisation; use normalize=False or backend='torch'"
            )
        super().__init__(core)

    def _run(self, q, k, v, state, causal, beta, log_gate=None, bounds=None):
        core = self.core
        features_q, features_k = core.phi.for_queries(q), core.phi.for_keys(k)
        read, weights = self.kernel(q).delta_rule_triton(
            features_q, features_k, v, beta, state.weights, log_gate=log_gate, chunk_size=core.chunk_size, precision=core.precision, cu_seqlens=bounds
        )
        return read, FastWeightState(weights, None)  # float32, the state dtype of every input dtype it takes

    def _grouped_run(self, q, k, v, state, batch, bounds, causal=True, **token_inputs):
        """``_run`` from ``state`` (default empty, on the value heads) with q and k on their own heads: no repeat."""
        if state is None:
            state = self.core.init_state(batch, v.shape[1], v.shape[-1], device=q.device, dtype=q.dtype)
        return self._run(q, k, v, state, causal, bounds=bounds, **token_inputs)


class _Fla(fla.FlaForm):
    """The delta rule (φ and sum normalisation in PyTorch, no attention normaliser) and the gated
    delta rule: fla's (gated) delta rule on φ(q), φ(k) with scale 1, β as ``beta``, g as ``g``. Packed
    sequences go to fla as its ``cu_seqlens``; grouped value heads (GVA) to its gated rule as they are (fla's
    value head i reads q/k head i // (H_v / H), as ours), its ungated rule takes none."""

    def __init__(self, core):
        if core.normalize:
            raise UnsupportedBackend(
                f"{core.variant_name}: fla's delta rule has no attention normaliser (Schlag et al. 2021 eq. 26-28, normalize=True); use normalize=False"
            )
        self.gated = isinstance(core, GatedDeltaRule)
        self.shapes = ("packed", "grouped") if self.gated else ("packed",)
        rule = "gated_delta_rule" if self.gated else "delta_rule"
        super().__init__(core, {"chunk": f"chunk_{rule}", "recurrent": f"fused_recurrent_{rule}"})

    def refuses(self, dtype, device):
        """fla's chunk kernel (CUDA) of the ungated rule asserts 16-bit inputs."""
        if device is not None and device.type == "cuda" and dtype == torch.float32 and not self.gated:
            return f"{self.core.variant_name}: fla's chunk_delta_rule refuses float32 inputs (its assertion); use bfloat16 or float16"
        return None

    def _call(self, q, k, v, state, where, beta, log_gate=None, cu_seqlens=None):
        core = self.core
        ops = fla._ops("gated_delta_rule" if self.gated else "delta_rule")
        kernel = getattr(ops, self.fla_kernels[where])
        refused = self.refuses(q.dtype, q.device) if where == "chunk" else None
        if refused:
            raise UnsupportedBackend(refused)
        initial = None if state is None else state.weights
        if where == "recurrent" and torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, beta, log_gate)):
            if self.gated:
                raise UnsupportedBackend(
                    f"{core.variant_name}: fla's fused_recurrent_gated_delta_rule has no backward (NotImplementedError in fla); "
                    "training through fla runs its chunk kernel, on CUDA"
                )
            if initial is not None and not initial.requires_grad:  # fla's backward writes dh0 only for an h0 that requires grad
                initial = initial.detach().requires_grad_()
        gate = {"g": fla._fla(log_gate)} if self.gated else {}
        chunk = {"chunk_size": core.chunk_size} if where == "chunk" else {}
        out, final = kernel(
            core.phi.for_queries(fla._fla(q)),
            core.phi.for_keys(fla._fla(k)),
            fla._fla(v),
            **gate,
            beta=fla._fla(beta),
            scale=1.0,
            initial_state=initial,
            output_final_state=state is not None,
            **chunk,
            **fla._packed(cu_seqlens, q.device, host_copy=where == "chunk"),
        )
        return fla._ours(out), None if state is None else FastWeightState(final.to(core.state_dtype(v.dtype)), None)

    def _parallel(self, q, k, v, causal, beta, log_gate=None):
        return self._call(q, k, v, None, fla._where(self.core.variant_name, q.device), beta, log_gate)[0]

    def _prefill(self, q, k, v, state, beta, log_gate=None):
        if state is None:
            state = self.core.init_state(q.shape[0], state_heads(k, v), v.shape[-1], device=q.device, dtype=q.dtype)
        return self._call(q, k, v, state, fla._where(self.core.variant_name, q.device), beta, log_gate)

    def _step(self, q_t, k_t, v_t, state, beta, log_gate=None):
        fla._where(self.core.variant_name, q_t.device)
        gate = None if log_gate is None else log_gate.unsqueeze(2)
        out, state = self._call(q_t.unsqueeze(2), k_t.unsqueeze(2), v_t.unsqueeze(2), state, "recurrent", beta.unsqueeze(2), gate)
        return out.squeeze(2), state


DeltaRule.backend_forms = {"triton": _Triton, "fla": _Fla}

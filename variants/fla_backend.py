"""``backend='fla'``: flash-linear-attention's Triton kernels (package fla-core, ``attnbench[fla]``)
for the variants whose function they compute exactly; ``UnsupportedBackend`` naming the
difference for the others. The mapping of each variant is written down in docs/variants.md
("The fla backend").

Conventions mapped here, once for all: fla takes ``[B, T, H, D]`` (ours ``[B, H, T, D]``: a
transpose of dims 1 and 2 each way; the wrapped core's ``input_layout`` 'bthd' makes
``example_inputs`` lay its inputs out so, so that the transpose is a view and no copy runs
inside a timed call; Based's and ReBased's parallel kernels transpose back to ``[B, H, T, D]``
and keep 'bhtd'); its recurrent state ``[B, H, K, V]`` is our fast weight
matrix S = Wᵀ ``[B, H, d_dot, Dv]`` as it is; its ``scale`` multiplies the queries (we pass 1,
or Based's 1/√d_key); the feature map φ (with Schlag's sum normalisation where a variant has
it) is applied in PyTorch before the kernel, so the kernel sees φ(q), φ(k); β and the log
decay g = log α are fla's ``beta`` and ``g`` ``[B, T, H]`` as they are.

Which kernel runs: on CUDA tensors fla's chunk kernels (``chunk_linear_attn``,
``chunk_delta_rule``, ``chunk_gated_delta_rule``; Based and ReBased: ``parallel_based``,
``parallel_rebased``); on CPU tensors, through Triton's interpreter (TRITON_INTERPRET=1), the
``fused_recurrent_*`` kernels and the two parallel ones (fla's chunk kernels fail in the
interpreter), each autotuned kernel on its first configuration (the interpreter cannot benchmark);
the decode step is the fused recurrent kernel on one token, as fla's layers decode. fla's
``fused_recurrent_gated_delta_rule`` has no backward: the gated rule trains through fla on CUDA only.

The chunk size (fla-core 0.6.0): ``chunk_delta_rule`` and ``chunk_gated_delta_rule`` take the
core's ``chunk_size`` from 16, 32, 64; ``chunk_linear_attn`` takes none and runs 64; the
parallel Based/ReBased kernels have no chunk (tiled quadratic attention, counted as such by
``flops``). Any other ``chunk_size`` is refused when the core is built, so a swept chunk size
never measures one configuration under several labels. ``implementation_choices`` records the
kernel and chunk a cell runs (the recurrent kernels of the CPU path have no chunk).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import torch

from .base import UnsupportedBackend, VariantError
from .fast_weights import FastWeightState

#: The options ``backend='fla'`` takes (none: the kernel follows the device, see above).
OPTIONS: dict = {}
#: fla's ε in the normalised linear attention's denominator, φ(q)·z + ε (ours: feature_maps.EPS).
FLA_LINEAR_EPS = 1e-10
#: The largest query/key width of fla's parallel Based/ReBased kernels (their assertion).
PARALLEL_MAX_DIM = 128
#: The chunk sizes fla's chunk kernels run, by kernel: the delta rules check for 16, 32, 64
#: (ValueError otherwise); chunk_linear_attn calls chunk_simple_gla with its default of 64.
CHUNK_SIZES = {
    "chunk_linear_attn": (64,),
    "chunk_delta_rule": (16, 32, 64),
    "chunk_gated_delta_rule": (16, 32, 64),
}


def check_options(options: dict) -> dict:
    if options:
        raise VariantError(f"backend 'fla' takes no options, got {', '.join(options)}")
    return {}


def wrap(core):
    """Give ``core`` (a torch core) fla's kernels for its parallel form, prefill and step, or raise
    ``UnsupportedBackend`` naming why fla does not compute this variant's function."""
    name = core.variant_name
    if importlib.util.find_spec("fla") is None:
        raise UnsupportedBackend(f"{name}: backend 'fla' needs flash-linear-attention: pip install 'attnbench[fla]' (package fla-core)")
    mapping = _mapping(core)
    _check_chunk_size(core, mapping.kernels["chunk"])
    core._parallel = mapping.parallel
    core._prefill = mapping.prefill
    core._step = mapping.step
    core.implementation_choices = mapping.choices
    core.input_layout = mapping.layout
    if isinstance(mapping, _QuadraticMapping):
        core.flops = mapping.flops
    core.backend = "fla"
    core.fla_kernels = mapping.kernels
    return core


def _check_chunk_size(core, kernel: str) -> None:
    """Refuse a ``chunk_size`` that ``kernel`` does not run (UnsupportedBackend, naming those it does)."""
    from .fast_weights import DEFAULT_CHUNK

    accepted = CHUNK_SIZES.get(kernel, (DEFAULT_CHUNK,))
    if core.chunk_size not in accepted:
        runs = f"runs chunk_size {', '.join(map(str, accepted))}" if kernel in CHUNK_SIZES else f"has no chunk (leave chunk_size at {DEFAULT_CHUNK})"
        raise UnsupportedBackend(f"{core.variant_name}: fla's {kernel} {runs}, got chunk_size={core.chunk_size}")


def _mapping(core):
    """The fla mapping of ``core``'s family, after checking that its definition matches fla's."""
    from .delta_rule import DeltaRule, GatedDeltaRule
    from .rwkv import RWKV
    from .sum_rule import SumRule

    name = core.variant_name
    if isinstance(core, GatedDeltaRule):
        return _DeltaMapping(core, gated=True)
    if isinstance(core, DeltaRule):
        if core.normalize:
            raise UnsupportedBackend(
                f"{name}: fla's delta rule has no attention normaliser (Schlag et al. 2021 eq. 26-28, normalize=True); use normalize=False"
            )
        return _DeltaMapping(core, gated=False)
    if isinstance(core, SumRule):
        if core.phi_name in ("taylor", "rebased"):
            if core.d_key > PARALLEL_MAX_DIM:
                kernel = "parallel_based" if core.phi_name == "taylor" else "parallel_rebased"
                raise UnsupportedBackend(f"{name}: fla's {kernel} takes d_key <= {PARALLEL_MAX_DIM}, got {core.d_key}")
            if core.sum_norm:
                raise UnsupportedBackend(f"{name}: fla's parallel Based/ReBased kernels apply the map themselves and have no sum normalisation (sum_norm=True)")
            return _QuadraticMapping(core)
        return _LinearMapping(core)
    if isinstance(core, RWKV):
        raise UnsupportedBackend(
            f"{name}: fla's fused_recurrent_rwkv4 (RWKV-4's WKV over [B, T, channels]) is not mapped yet "
            "(mapped: linear, performer, dpfp, based, rebased, delta, deltanet, gated_delta)"
        )
    raise UnsupportedBackend(
        f"{name}: flash-linear-attention has no kernel computing this variant's function "
        "(mapped: linear, performer, dpfp, based, rebased, delta, deltanet, gated_delta)"
    )


def _ops(module: str):
    """``fla.ops.<module>``, or UnsupportedBackend with the reason fla cannot be imported."""
    try:
        ops = importlib.import_module(f"fla.ops.{module}")
    except Exception as exc:  # fla's import runs device detection and Triton set-up: any failure means no backend
        raise UnsupportedBackend(f"backend 'fla': importing fla.ops.{module} failed: {type(exc).__name__}: {exc}") from exc
    if os.environ.get("TRITON_INTERPRET") == "1":
        _first_configs()
    return ops


def _first_configs() -> None:
    """Under Triton's interpreter, every ``@triton.autotune``d fla kernel keeps only its first
    configuration: the interpreter has no GPU to benchmark candidates on (Triton raises "0 active
    drivers"), and any configuration computes the same function (they differ in tiles and warps)."""
    from triton.runtime.autotuner import Autotuner, KernelInterface

    for name, module in list(sys.modules.items()):
        if not name.startswith("fla.ops"):
            continue
        for kernel in vars(module).values():
            while isinstance(kernel, KernelInterface):  # Heuristics -> Autotuner -> JITFunction, each through .fn
                if isinstance(kernel, Autotuner):
                    kernel.configs = kernel.configs[:1]
                kernel = getattr(kernel, "fn", None)


def _where(variant: str, device: torch.device) -> str:
    """'chunk' on CUDA, 'recurrent' on CPU tensors under Triton's interpreter; else UnsupportedBackend."""
    if device.type == "cuda":
        return "chunk"
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return "recurrent"
    raise UnsupportedBackend(
        f"{variant}: backend 'fla' runs Triton kernels: CUDA tensors, or CPU tensors through Triton's interpreter "
        f"(TRITON_INTERPRET=1 before Python starts; slow, for tests), got {device.type} tensors"
    )


def _fla(x):
    """Our ``[B, H, T, D]`` (or ``[B, H, T]``) as fla's ``[B, T, H, D]`` (``[B, T, H]``): a view of
    inputs laid out 'bthd' (``AttentionCore.input_layout``), a copy only of others."""
    return x.transpose(1, 2).contiguous()


def _ours(x):
    return x.transpose(1, 2)


def _causal_only(variant: str, causal: bool) -> None:
    if not causal:
        raise UnsupportedBackend(f"{variant}: fla's kernels are causal only; causal=False is backend='torch'")


class _Mapping:
    """What every mapping shares: the kernels by where they run (``kernels``), the layout its
    inputs should have (``layout``) and what a call on given inputs runs (``choices``)."""

    layout = "bthd"

    def choices(self, q, k, v, *, causal=True, **token_inputs) -> dict:
        """``{"fla_kernel": name, "chunk_size": C}`` for a call on ``q``'s device (C None for a kernel without chunks)."""
        where = _where(self.core.variant_name, q.device)
        kernel = self.kernels[where]
        return {"fla_kernel": kernel, "chunk_size": self.core.chunk_size if kernel in CHUNK_SIZES else None}


class _LinearMapping(_Mapping):
    """The sum rule (linear, performer, dpfp, any φ): fla's linear attention on φ(q), φ(k);
    ``normalize`` is fla's ``normalize``. Unnormalised: scale 1. Normalised, fla divides
    s φ(q)ᵀS by s φ(q)·z + 1e-10 (s its ``scale``) where we divide φ(q)ᵀS by φ(q)·z + ε with ε = 1e-6;
    s = 1e-10 / ε makes the two the same function exactly (the states S and z do not depend on s)."""

    def __init__(self, core):
        from .feature_maps import EPS

        self.core = core
        self.scale = FLA_LINEAR_EPS / EPS if core.normalize else 1.0
        self.kernels = {"chunk": "chunk_linear_attn", "recurrent": "fused_recurrent_linear_attn"}

    def _call(self, q, k, v, state, where):
        core, ops = self.core, _ops("linear_attn")
        kernel = ops.chunk_linear_attn if where == "chunk" else ops.fused_recurrent_linear_attn
        initial = None
        if state is not None:
            initial = (state.weights, _fla(state.normaliser.unsqueeze(2))) if core.normalize else state.weights
        out, final = kernel(  # φ acts on each token's last dim: applied in fla's layout, its output is in it too
            core.phi.for_queries(_fla(q)), core.phi.for_keys(_fla(k)), _fla(v), scale=self.scale, initial_state=initial,
            output_final_state=state is not None, normalize=core.normalize,
        )
        if state is None:
            return _ours(out), None
        if core.normalize:
            weights, normaliser = final
            return _ours(out), FastWeightState(weights.to(core.state_dtype(v.dtype)), normaliser[:, 0].to(core.state_dtype(v.dtype)))
        return _ours(out), FastWeightState(final.to(core.state_dtype(v.dtype)), None)

    def parallel(self, q, k, v, causal):
        _causal_only(self.core.variant_name, causal)
        return self._call(q, k, v, None, _where(self.core.variant_name, q.device))[0]

    def prefill(self, q, k, v, state):
        if state is None:
            state = self.core.init_state(q.shape[0], q.shape[1], v.shape[-1], device=q.device, dtype=q.dtype)
        return self._call(q, k, v, state, _where(self.core.variant_name, q.device))

    def step(self, q_t, k_t, v_t, state):
        _where(self.core.variant_name, q_t.device)
        out, state = self._call(q_t.unsqueeze(2), k_t.unsqueeze(2), v_t.unsqueeze(2), state, "recurrent")
        return out.squeeze(2), state


class _DeltaMapping(_Mapping):
    """The delta rule (φ and sum normalisation in PyTorch, no attention normaliser) and the gated
    delta rule: fla's (gated) delta rule on φ(q), φ(k) with scale 1, β as ``beta``, g as ``g``."""

    def __init__(self, core, gated: bool):
        self.core, self.gated = core, gated
        rule = "gated_delta_rule" if gated else "delta_rule"
        self.kernels = {"chunk": f"chunk_{rule}", "recurrent": f"fused_recurrent_{rule}"}

    def _call(self, q, k, v, state, where, beta, log_gate=None):
        core = self.core
        ops = _ops("gated_delta_rule" if self.gated else "delta_rule")
        kernel = getattr(ops, self.kernels[where])
        if where == "chunk" and not self.gated and q.dtype == torch.float32:
            raise UnsupportedBackend(f"{core.variant_name}: fla's chunk_delta_rule refuses float32 inputs (its assertion); use bfloat16 or float16")
        initial = None if state is None else state.weights
        if where == "recurrent" and torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, beta, log_gate)):
            if self.gated:
                raise UnsupportedBackend(
                    f"{core.variant_name}: fla's fused_recurrent_gated_delta_rule has no backward (NotImplementedError in fla); "
                    "training through fla runs its chunk kernel, on CUDA"
                )
            if initial is not None and not initial.requires_grad:  # fla's backward writes dh0 only for an h0 that requires grad
                initial = initial.detach().requires_grad_()
        gate = {"g": _fla(log_gate)} if self.gated else {}
        chunk = {"chunk_size": core.chunk_size} if where == "chunk" else {}
        out, final = kernel(
            core.phi.for_queries(_fla(q)), core.phi.for_keys(_fla(k)), _fla(v), **gate, beta=_fla(beta),
            scale=1.0, initial_state=initial, output_final_state=state is not None, **chunk,
        )
        return _ours(out), None if state is None else FastWeightState(final.to(core.state_dtype(v.dtype)), None)

    def parallel(self, q, k, v, causal, beta, log_gate=None):
        return self._call(q, k, v, None, _where(self.core.variant_name, q.device), beta, log_gate)[0]

    def prefill(self, q, k, v, state, beta, log_gate=None):
        if state is None:
            state = self.core.init_state(q.shape[0], q.shape[1], v.shape[-1], device=q.device, dtype=q.dtype)
        return self._call(q, k, v, state, _where(self.core.variant_name, q.device), beta, log_gate)

    def step(self, q_t, k_t, v_t, state, beta, log_gate=None):
        _where(self.core.variant_name, q_t.device)
        gate = None if log_gate is None else log_gate.unsqueeze(2)
        out, state = self._call(q_t.unsqueeze(2), k_t.unsqueeze(2), v_t.unsqueeze(2), state, "recurrent", beta.unsqueeze(2), gate)
        return out.squeeze(2), state


class _QuadraticMapping(_Mapping):
    """Based (φ = the 2nd-order Taylor map of exp(q·k/√d)): fla's ``parallel_based`` with scale
    1/√d_key, whose 1 + s + s²/2 with s = q·k/√d is φ(q)·φ(k), normalised with the same ε = 1e-6.
    ReBased: q' = γ_q ⊙ LayerNorm(q) + β_q (and k' with the keys' γ, β) in PyTorch, then fla's
    ``parallel_rebased`` unscaled with ε = 1e-6, whose (q'·k')² is φ(q)·φ(k). These kernels form
    no state: prefill and step are refused. Both take ``[B, T, H, D]`` and transpose it back to
    ``[B, H, T, D]`` (made contiguous) for the kernel: our layout 'bhtd' passes through as views.
    They compute tiled quadratic attention: ``flops`` counts it as softmax's is counted."""

    layout = "bhtd"

    def __init__(self, core):
        self.core = core
        self.based = core.phi_name == "taylor"
        self.kernels = {"chunk": "parallel_based" if self.based else "parallel_rebased"}
        self.kernels["recurrent"] = self.kernels["chunk"]

    def parallel(self, q, k, v, causal):
        from .feature_maps import EPS

        core = self.core
        _causal_only(core.variant_name, causal)
        _where(core.variant_name, q.device)
        if self.based:
            q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # fla's [B, T, H, D] as views: the kernel transposes back
            return _ours(_ops("based").parallel_based(q, k, v, scale=core.d_key**-0.5, use_norm=core.normalize))
        maps = core.phi.query, core.phi.key
        q, k = (torch.nn.functional.layer_norm(x, (core.d_key,), m.gamma.to(x.dtype), m.beta.to(x.dtype)) for x, m in zip((q, k), maps))
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        return _ours(_ops("rebased").parallel_rebased(q, k, v, eps=EPS, use_scale=False, use_normalize=core.normalize))

    def flops(self, batch, heads, length, d_value, *, causal=True):
        """q·k and the weighted sum of the values over the visible pairs, T(T+1)/2 of them when causal
        (the Taylor or square map of each score is elementwise, not counted)."""
        pairs = length * (length + 1) // 2 if causal else length * length
        return 2 * batch * heads * pairs * (self.core.d_key + d_value)

    def _no_state(self, *args, **kwargs):
        raise UnsupportedBackend(f"{self.core.variant_name}: fla's {self.kernels['chunk']} forms no recurrent state; decoding is backend='torch'")

    prefill = step = _no_state

"""The common interface of every attention core, its shape checks and the registry.

Tensors are ``[B, H, T, D]`` (batch, heads, time, head dim), as in
``torch.nn.functional.scaled_dot_product_attention``. A core has three faces that
compute the same function:

* ``core(q, k, v, *, beta=None, causal=True)``: the parallel (training) form;
* ``core.init_state(...)`` and ``core.step(q_t, k_t, v_t, state, *, beta_t=None)``:
  the recurrent form for autoregressive decoding, one token at a time;
* ``core.reference(q, k, v, *, beta=None, causal=True)``: the plainest correct form,
  used by the tests in float64.

A gated core (``needs_gate``, the gated delta rule) also takes ``log_gate=`` (``[B, H, T]``,
g_t = log α_t ≤ 0) in every form, ``log_gate_t=`` (``[B, H]``) in ``step``; it is passed on
to ``_parallel``, ``_reference`` and ``_step`` as the keyword ``log_gate`` only for such cores,
so the other cores' signatures stay as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

_REGISTRY: dict[str, Callable[..., AttentionCore]] = {}


class VariantError(ValueError):
    """Bad input to a variant: an unknown name, a wrong shape, a parameter out of range."""


class UnsupportedBackend(VariantError):
    """A known backend that this variant (or this configuration of it) has no implementation for."""


def register(name: str) -> Callable:
    """Decorator of a core class or factory: make ``variants.create(name, ...)`` build it."""

    def add(factory):
        if name in _REGISTRY:
            raise VariantError(f"variant {name!r} is registered twice")
        _REGISTRY[name] = factory
        if isinstance(factory, type):
            factory.variant_name = name
        return factory

    return add


def names() -> list[str]:
    """The registered variant names, sorted."""
    return sorted(_REGISTRY)


def create(name: str, d_key: int, *, backend: str = "torch", **params: Any) -> AttentionCore:
    """Build the attention core registered as ``name`` for head dimension ``d_key``.

    ``backend`` picks the implementation of the parallel form: 'torch' (every variant) or
    'triton' (the linear-time rules); a core class that takes no ``backend`` is torch only."""
    if name not in _REGISTRY:
        raise VariantError(f"unknown variant {name!r}; known variants: {', '.join(names())}")
    if not isinstance(d_key, int) or d_key < 1:
        raise VariantError(f"{name}: d_key must be a positive int, got {d_key!r}")
    if backend != "torch":
        params["backend"] = backend
    try:
        core = _REGISTRY[name](d_key, **params)
    except TypeError as exc:  # an unexpected keyword argument
        if "'backend'" in str(exc):
            raise UnsupportedBackend(f"{name}: has only the 'torch' backend, got backend={backend!r}") from None
        raise VariantError(f"{name}: {exc}") from None
    core.variant_name = name
    return core


class AttentionCore(nn.Module):
    """Base class of every variant: argument checks around the three forms.

    Subclasses set ``d_dot`` (the dimension after the feature map, the size of the
    memory's key side; None for softmax, whose KV cache has no fixed size), ``needs_beta``,
    ``needs_gate``, ``token_shift`` (the layer should token-shift its inputs, RWKV) and
    ``supports_noncausal`` and implement ``_parallel``, ``_reference``, ``init_state``
    and ``_step``.
    """

    variant_name = "?"
    needs_beta = False
    needs_gate = False
    token_shift = False
    supports_noncausal = True

    def __init__(self, d_key: int):
        super().__init__()
        self.d_key = d_key
        self.d_dot = d_key

    # --- the three faces -------------------------------------------------------
    def forward(self, q, k, v, *, beta=None, log_gate=None, causal: bool = True) -> torch.Tensor:
        """Parallel form: ``q, k: [B, H, T, Dk]``, ``v: [B, H, T, Dv]``, ``beta, log_gate: [B, H, T]``
        -> ``[B, H, T, Dv]``."""
        self._check_sequence(q, k, v, beta, causal, log_gate)
        return self._parallel(q, k, v, beta, causal, **self._gate(log_gate))

    def reference(self, q, k, v, *, beta=None, log_gate=None, causal: bool = True) -> torch.Tensor:
        """The plainest correct implementation of the same function (for tests)."""
        self._check_sequence(q, k, v, beta, causal, log_gate)
        return self._reference(q, k, v, beta, causal, **self._gate(log_gate))

    def step(self, q_t, k_t, v_t, state, *, beta_t=None, log_gate_t=None):
        """Recurrent form: ``q_t, k_t: [B, H, Dk]``, ``v_t: [B, H, Dv]``, ``beta_t, log_gate_t: [B, H]``
        -> ``(out_t [B, H, Dv], new_state)``. The output at time t includes token t."""
        self._check_token(q_t, k_t, v_t, beta_t, log_gate_t)
        return self._step(q_t, k_t, v_t, state, beta_t, **self._gate(log_gate_t))

    def prefill(self, q, k, v, *, beta=None, log_gate=None, state=None):
        """Causal parallel form that also returns the decoding state after its last token,
        continuing from ``state`` when given: ``(out [B, H, T, Dv], state)``."""
        raise NotImplementedError

    def init_state(self, batch: int, heads: int, d_value: int, *, device=None, dtype=None):
        """The empty decoding state (a KV cache, or the fast weight matrix and normaliser)."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"d_key={self.d_key}, d_dot={self.d_dot}"

    # --- metadata for the harness (a multiply-add counts as 2 FLOPs) -------------------
    def flops(self, batch: int, heads: int, length: int, d_value: int, *, causal: bool = True) -> int:
        """Matmul FLOPs of one call of the parallel form, as implemented."""
        raise NotImplementedError

    def step_flops(self, batch: int, heads: int, d_value: int, position: int) -> int:
        """Matmul FLOPs of one ``step`` at 0-based ``position`` (``position`` tokens before it)."""
        raise NotImplementedError

    def state_numel(self, batch: int, heads: int, d_value: int, length: int) -> int:
        """Elements of the decoding state after ``length`` tokens."""
        raise NotImplementedError

    # --- implemented by each family ---------------------------------------------
    def _parallel(self, q, k, v, beta, causal):
        raise NotImplementedError

    def _reference(self, q, k, v, beta, causal):
        raise NotImplementedError

    def _step(self, q_t, k_t, v_t, state, beta_t):
        raise NotImplementedError

    # --- checks --------------------------------------------------------------------
    def _gate(self, log_gate) -> dict:
        """The keyword a gated core's implementation takes (none for the other cores)."""
        return {"log_gate": log_gate} if self.needs_gate else {}

    def _check_sequence(self, q, k, v, beta, causal, log_gate=None) -> None:
        name = self.variant_name
        for label, x in (("q", q), ("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor) or x.dim() != 4:
                shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise VariantError(f"{name}: {label} must be a 4-d tensor [B, H, T, D], got {shape}")
        self._check_common(q, k, v, "[B, H, T, D]")
        if q.shape[2] == 0:
            raise VariantError(f"{name}: the sequence is empty (T = 0); give at least one token")
        if not causal and not self.supports_noncausal:
            raise VariantError(f"{name}: this variant is causal only; causal=False is not defined for it")
        self._check_beta(beta, q.shape[:3], "beta", "[B, H, T]")
        self._check_log_gate(log_gate, q.shape[:3], "log_gate", "[B, H, T]")

    def _check_token(self, q_t, k_t, v_t, beta_t, log_gate_t=None) -> None:
        name = self.variant_name
        for label, x in (("q_t", q_t), ("k_t", k_t), ("v_t", v_t)):
            if not isinstance(x, torch.Tensor) or x.dim() != 3:
                shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise VariantError(f"{name}: {label} must be a 3-d tensor [B, H, D], got {shape}")
        self._check_common(q_t, k_t, v_t, "[B, H, D]")
        self._check_beta(beta_t, q_t.shape[:2], "beta_t", "[B, H]")
        self._check_log_gate(log_gate_t, q_t.shape[:2], "log_gate_t", "[B, H]")

    def _check_common(self, q, k, v, layout: str) -> None:
        name = self.variant_name
        if q.shape != k.shape:
            raise VariantError(f"{name}: q and k must have the same shape {layout}, got {tuple(q.shape)} and {tuple(k.shape)}")
        if v.shape[:-1] != q.shape[:-1]:
            raise VariantError(
                f"{name}: v must match q in every dim but the last {layout}, got q {tuple(q.shape)} and v {tuple(v.shape)}"
            )
        if q.shape[-1] != self.d_key:
            raise VariantError(f"{name}: the last dim of q and k must be d_key={self.d_key}, got {q.shape[-1]}")
        if not (q.dtype == k.dtype == v.dtype):
            raise VariantError(f"{name}: q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")

    def _check_beta(self, beta, shape, label: str, layout: str) -> None:
        name = self.variant_name
        if not self.needs_beta:
            if beta is not None:
                raise VariantError(f"{name}: this variant takes no {label} (only the delta rule does)")
            return
        if beta is None:
            raise VariantError(f"{name}: the delta rule needs the write strength {label} {layout}, in (0, 1)")
        if tuple(beta.shape) != tuple(shape):
            raise VariantError(f"{name}: {label} must have shape {layout} = {tuple(shape)}, got {tuple(beta.shape)}")

    def _check_log_gate(self, log_gate, shape, label: str, layout: str) -> None:
        name = self.variant_name
        if not self.needs_gate:
            if log_gate is not None:
                raise VariantError(f"{name}: this variant takes no {label} (only the gated delta rule does)")
            return
        if log_gate is None:
            raise VariantError(f"{name}: the gated rule needs the log decay gate {label} {layout}, log α ≤ 0")
        if tuple(log_gate.shape) != tuple(shape):
            raise VariantError(f"{name}: {label} must have shape {layout} = {tuple(shape)}, got {tuple(log_gate.shape)}")

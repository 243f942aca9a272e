"""attnbench's variant library: one interface for every attention variant.

``names()`` lists the registered variants, ``create(name, d_key, backend=..., **params)`` builds an
attention core (parallel form, recurrent ``step``, ``reference``) on one of ``BACKENDS``
(``supports(...)`` says which compute it), and ``AttentionLayer``
wraps a core with its projections. ``core.example_inputs(...)`` draws valid inputs (q, k, v
and the per-token inputs the core declares, ``TokenInput``); ``token_slice`` and
``time_slice`` cut them for ``step`` and ``prefill``. See docs/variants.md for every definition.
"""

# Importing the families registers them.
from . import delta_rule, lsh, rwkv, softmax, sum_rule  # noqa: E402,F401
from .backends import BACKENDS, backend_option_owners, backend_options_for, check_backend_options, create, supports
from .base import (
    ActivatedLinear,
    AttentionCore,
    BackendForm,
    TokenInput,
    UnsupportedBackend,
    VariantError,
    activated_linear,
    debug_checks,
    names,
    register,
)
from .delta_rule import BETA, LOG_GATE, DecayGate
from .fast_weights import FastWeightState
from .inputs import in_layout, time_slice, token_slice
from .layer import AttentionLayer
from .softmax import KVCache

__all__ = [
    "BACKENDS",
    "BETA",
    "LOG_GATE",
    "ActivatedLinear",
    "AttentionCore",
    "AttentionLayer",
    "BackendForm",
    "DecayGate",
    "FastWeightState",
    "KVCache",
    "TokenInput",
    "UnsupportedBackend",
    "VariantError",
    "activated_linear",
    "backend_option_owners",
    "backend_options_for",
    "check_backend_options",
    "create",
    "debug_checks",
    "in_layout",
    "names",
    "register",
    "supports",
    "time_slice",
    "token_slice",
]

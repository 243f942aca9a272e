"""attnbench's variant library: one interface for every attention variant.

``names()`` lists the registered variants, ``create(name, d_key, **params)`` builds an
attention core (parallel form, recurrent ``step``, ``reference``), and ``AttentionLayer``
wraps a core with its projections. See docs/variants.md for every definition.
"""

# Importing the families registers them.
from . import delta_rule, rwkv, softmax, sum_rule  # noqa: E402,F401
from .base import AttentionCore, UnsupportedBackend, VariantError, create, names, register
from .fast_weights import FastWeightState
from .layer import AttentionLayer
from .softmax import KVCache

__all__ = [
    "AttentionCore",
    "AttentionLayer",
    "FastWeightState",
    "KVCache",
    "UnsupportedBackend",
    "VariantError",
    "create",
    "names",
    "register",
]

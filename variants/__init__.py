"""attnbench's variant library: one interface for every attention variant.

``names()`` lists the registered variants, ``create(name, d_key, backend=..., **params)`` builds an
attention core (parallel form, recurrent ``step``, ``reference``) on one of ``BACKENDS``
(``supports(...)`` says which compute it), and ``AttentionLayer``
wraps a core with its projections. ``core.example_inputs(...)`` draws valid inputs (q, k, v
and the per-token inputs the core declares, ``TokenInput``); ``token_slice`` and
``time_slice`` cut them for ``step`` and ``prefill``. See docs/variants.md for every definition.

Importing ``variants`` loads neither torch nor a variant: the first of these names used imports
``backends`` (which imports the families: they register their variants) and the module that holds it, so ``variants.params`` (each variant's
parameters, torch-free) answers a scenario's mistakes at once.
"""

from __future__ import annotations

import importlib

#: Each public name -> the module of this package that holds it.
_HOMES = {
    **dict.fromkeys(("BACKENDS", "backend_option_owners", "backend_options_for", "check_backend_options", "create", "supports"), "backends"),
    **dict.fromkeys(("ActivatedLinear", "AttentionCore", "BackendForm", "TokenInput", "activated_linear", "debug_checks", "names", "register"), "base"),
    **dict.fromkeys(("UnsupportedBackend", "VariantError"), "errors"),
    **dict.fromkeys(("BETA", "LOG_GATE", "DecayGate"), "delta_rule"),
    **dict.fromkeys(("in_layout", "time_slice", "token_slice"), "inputs"),
    "FastWeightState": "fast_weights",
    "AttentionLayer": "layer",
    "KVCache": "softmax",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'variants' has no attribute {name!r}")
    importlib.import_module(".backends", __name__)  # which imports the families: they register their variants
    value = getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})

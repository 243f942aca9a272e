"""Triton kernels for the two linear-time rules, one file per rule, each with its autograd
wrapper: ``sum_rule.sum_rule_triton`` and ``delta_rule.delta_rule_triton``; what they share
(buffers, tile sizes, checks, the launch, @triton.jit tile helpers) is in ``_common``. Each rule
module also lists what ``attnbench kernels`` compiles: ``compile_configs()``, ``config_label(config)``
and ``record_launches(config, capability)``.

They are imported lazily (``load``), after the caller chose the backend, because Triton
decides at import time whether its kernels run natively or through its interpreter
(``TRITON_INTERPRET=1``, the way the tests run them on a CPU).
"""

from __future__ import annotations

import importlib
import importlib.util
import os

from ..base import UnsupportedBackend, VariantError

BACKENDS = ("torch", "triton")
#: The kernel modules, one per rule.
RULES = ("sum_rule", "delta_rule")
#: The largest d_dot and d_value the Triton kernels take.
MAX_HEAD_DIM = 256
#: ``precision`` of the Triton backend: the dots of float32 inputs, IEEE fp32 (default) or TF32 (sm_80 on).
PRECISIONS = ("ieee", "tf32")


def check_backend(variant: str, backend: str, supported=BACKENDS) -> None:
    """Refuse an unknown backend, or one this variant has no implementation for."""
    if backend not in supported:
        kind = UnsupportedBackend if backend in BACKENDS else VariantError
        raise kind(f"{variant}: backend must be one of {', '.join(supported)}, got {backend!r}")
    if backend == "triton" and importlib.util.find_spec("triton") is None:
        raise VariantError(f"{variant}: backend='triton' needs the triton package: pip install 'attnbench[triton]'")


def check_precision(variant: str, backend: str, precision) -> None:
    """``precision`` is one of ``PRECISIONS``; "tf32" only with ``backend='triton'`` (the torch forms follow torch's own matmul settings)."""
    if precision not in PRECISIONS:
        raise VariantError(f"{variant}: precision must be one of {', '.join(map(repr, PRECISIONS))}, got {precision!r}")
    if precision != "ieee" and backend != "triton":
        raise UnsupportedBackend(f"{variant}: precision={precision!r} is a Triton kernel option; use backend='triton' or precision='ieee'")


def require_device(variant: str, device) -> None:
    """Triton runs natively on CUDA tensors; CPU tensors need its interpreter."""
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise VariantError(
            f"{variant}: backend='triton' got CPU tensors; Triton runs them only through its interpreter: "
            "set TRITON_INTERPRET=1 before starting Python (slow, meant for tests), or move the inputs to a CUDA device"
        )
    if device.type not in ("cpu", "cuda"):
        raise VariantError(f"{variant}: backend='triton' runs on CUDA devices (or the CPU interpreter), got {device.type}")


def load(rule: str):
    """The kernel module of ``rule`` ('sum_rule' or 'delta_rule')."""
    return importlib.import_module(f"{__name__}.{rule}")

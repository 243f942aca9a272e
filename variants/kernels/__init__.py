"""Triton kernels for the two linear-time rules, one file per rule, each with its autograd
wrapper: ``sum_rule.sum_rule_triton`` and ``delta_rule.delta_rule_triton``; what they share
(buffers, tile sizes, checks, the launch, @triton.jit tile helpers) is in ``_common``. Each rule
module also lists what ``attnbench kernels`` compiles: ``compile_configs()``, ``config_label(config)``
and ``record_launches(config, capability)``. ``identity`` notes what a call launched (kernel source hashes,
configurations, autotuning, compile seconds) for the cells of the triton backend.

They are imported lazily (``load``), after the caller chose the backend, because Triton
decides at import time whether its kernels run natively or through its interpreter
(``TRITON_INTERPRET=1``, the way the tests run them on a CPU).
"""

from __future__ import annotations

import importlib
import os

from ..base import UnsupportedBackend, VariantError

#: The kernel modules, one per rule.
RULES = ("sum_rule", "delta_rule")
#: The largest d_dot and d_value the Triton kernels take.
MAX_HEAD_DIM = 256
#: ``precision`` of the Triton kernels: the dots of float32 inputs, IEEE fp32 (default) or TF32 (sm_80 on).
PRECISIONS = ("ieee", "tf32")
#: The chunk sizes the Triton kernels take (``chunk_sizes`` narrows them per rule and d_dot): powers of two ≥ 16,
#: since a chunk is padded to one (any other size only adds padding). ``attnbench kernels`` compiles every one.
CHUNK_SIZES = (16, 32, 64, 128)
#: The delta rule's limits: its backward's [C, C] fp32 tiles need 200 KB of shared memory at C = 128 (over every
#: target's), and its passes hold [C, d_dot] tiles, which fit a V100's 96 KB up to C · d_dot = 64 · 128.
DELTA_MAX_CHUNK, DELTA_MAX_CHUNK_TIMES_D_DOT = 64, 64 * 128


def chunk_sizes(rule: str, d_dot: int) -> tuple[int, ...]:
    """The chunk sizes ``rule``'s kernels ('sum_rule' or 'delta_rule') take at this d_dot (padded to a power of two ≥ 16)."""
    if rule == "sum_rule":
        return CHUNK_SIZES
    padded = max(16, 1 << (d_dot - 1).bit_length())
    return tuple(c for c in CHUNK_SIZES if c <= DELTA_MAX_CHUNK and c * padded <= DELTA_MAX_CHUNK_TIMES_D_DOT)


def default_chunk_size(rule: str, d_dot: int) -> int:
    """The chunk ``rule``'s kernels run when none is asked for: the largest they take up to 64."""
    return max(c for c in chunk_sizes(rule, d_dot) if c <= 64)


def check_chunk_size(name: str, rule: str, d_dot: int, chunk_size) -> None:
    """``chunk_size`` is one of ``chunk_sizes(rule, d_dot)`` (an int, not a bool or a float), else UnsupportedBackend."""
    accepted = chunk_sizes(rule, d_dot)
    if type(chunk_size) is not int or chunk_size not in accepted:
        raise UnsupportedBackend(f"{name}: the Triton kernels take chunk_size in ({', '.join(map(str, accepted))}) at d_dot={d_dot}, got {chunk_size!r}")


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

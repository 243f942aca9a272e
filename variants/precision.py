"""The dtype policy of every form: which dtype a state and a product are kept in, and how far a
form may be from the float64 reference in each dtype.

One table for the tests and the harness. Error is the relative L2 error ‖y − y_ref‖ / ‖y_ref‖ of an
output (or a gradient) against the float64 reference on the same inputs (the inputs rounded to the
dtype first, so that only the arithmetic is judged). The 16-bit bounds leave room for the rounding
of every product to 8 (bfloat16) or 11 (float16) bits of mantissa.
"""

from __future__ import annotations

import torch

#: The largest relative L2 error of a form (output or gradient) against the float64 reference.
REL_ERROR_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖actual − expected‖₂ / ‖expected‖₂, in float64 (inf for a nonzero error against a zero reference)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    error, norm = (actual - expected).norm().item(), expected.norm().item()
    return error / norm if norm > 0 else (0.0 if error == 0 else float("inf"))


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a recurrent state for inputs of ``dtype``: at least float32. A 16-bit sum of T
    outer products loses each late write against the large total (bfloat16 keeps 8 bits) and
    overflows in float16 (beyond 65,504) long before a long sequence ends."""
    return torch.promote_types(dtype, torch.float32)

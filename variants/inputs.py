"""Sequence inputs ``[B, H, T, ...]``: their memory layout, their slices for ``step`` and ``prefill``, and
the lengths of a right-padded batch (``prefill(..., lengths=)``)."""

from __future__ import annotations

import torch

from .errors import VariantError


def in_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """``x`` ``[B, H, T, ...]`` with its storage in ``layout`` ('bhtd': contiguous; 'bthd': a
    ``[B, H, T, ...]`` view of contiguous ``[B, T, H, ...]``), copied only when it is not already."""
    if layout == "bthd":
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if layout != "bhtd":
        raise VariantError(f"input_layout must be 'bhtd' or 'bthd', got {layout!r}")
    return x.contiguous()


def token_slice(inputs: dict[str, torch.Tensor], t: int) -> dict[str, torch.Tensor]:
    """The inputs of ``step`` at time ``t`` from sequence inputs (``example_inputs``' keys):
    ``{"q_t": q[:, :, t], "k_t": ..., "v_t": ..., "beta_t": ...}``, so ``core.step(**token_slice(inputs, t), state=s)``."""
    return {f"{name}_t": x[:, :, t] for name, x in inputs.items()}


def time_slice(inputs: dict[str, torch.Tensor], start: int, stop: int | None = None) -> dict[str, torch.Tensor]:
    """The sequence inputs at times ``start:stop`` (same keys), e.g. a prompt for ``prefill``."""
    return {name: x[:, :, start:stop] for name, x in inputs.items()}


def padded_lengths(variant: str, q, lengths, *, state, cu_seqlens) -> list[int]:
    """``lengths`` of a right-padded batch ``q [N, H, T, D]`` as N ints in [1, T] (row n: its first
    lengths[n] tokens real, the rest padding), prefilled from an empty state; VariantError otherwise."""
    given = lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths
    batch, steps = q.shape[0], q.shape[2]
    if not isinstance(given, (list, tuple)) or len(given) != batch or not all(isinstance(n, int) and 1 <= n <= steps for n in given):
        raise VariantError(f"{variant}: lengths must be one integer in [1, T] per row of the padded batch q [N, H, T, D], got {given!r}")
    if cu_seqlens is not None:
        raise VariantError(f"{variant}: prefill takes lengths (a padded batch) or cu_seqlens (a packed row), not both")
    if state is not None:
        raise VariantError(f"{variant}: a padded prefill (lengths) starts from an empty state; continue each row with step")
    return list(given)

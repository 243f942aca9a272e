"""The one dtype policy of the quality tasks: what ``axes.dtype`` means for a cell that trains.

The weights (and the optimiser's state) stay float32, the master copy, in every dtype; the
dtype says in which precision the forward and backward passes compute:

- ``float32``: everything in float32;
- ``bfloat16``: under ``torch.autocast`` (on the CPU too), no loss scaling (bfloat16 has
  float32's exponent range);
- ``float16``: under ``torch.autocast`` with a gradient scaler (``torch.amp.GradScaler``):
  the loss is multiplied by a scale before the backward pass so small gradients do not flush
  to zero, the gradients are unscaled before clipping and the step, and a step whose
  gradients overflowed is skipped while the scale shrinks (Micikevicius et al. 2018).

``check`` refuses any other dtype when a scenario loads, before torch does (this module loads
torch only when a ``Precision`` is made); ``Precision`` is what the trainer
(``harness.tasks.training``) and a task's evaluation run under.
"""

from __future__ import annotations

import contextlib
import functools

#: The dtypes a quality cell trains in; the 16-bit ones are also what autocast computes in.
TRAIN_DTYPES = ("float32", "bfloat16", "float16")


def check(dtype: str) -> None:
    """ValueError naming the dtypes a quality cell trains in, unless ``dtype`` is one of them."""
    if dtype not in TRAIN_DTYPES:
        raise ValueError(
            f"a quality task trains in {', '.join(TRAIN_DTYPES)} (float32 master weights; bfloat16 under autocast, "
            f"float16 under autocast with a gradient scaler), not {dtype!r}"
        )


class Precision:
    """The mixed precision of one training on ``device``: ``autocast()`` around forward passes
    (a no-op in float32) and ``scaler`` (a ``GradScaler``, enabled in float16 only)."""

    def __init__(self, dtype: str, device):
        import torch

        check(dtype)
        self.dtype, self.device = dtype, torch.device(device)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=dtype == "float16")
        self._autocast = contextlib.nullcontext if dtype == "float32" else functools.partial(torch.autocast, self.device.type, dtype=getattr(torch, dtype))

    def autocast(self):
        """A context that computes in the policy's 16-bit dtype (``torch.autocast``), or nothing."""
        return self._autocast()

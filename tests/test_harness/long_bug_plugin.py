"""A plugin variant wrong only at long sequences: linear attention (elu+1) whose parallel form is 1 % off
from token 1,024 on (``y_t ↦ 1.01 y_t``, t ≥ 1024), where a timed cell's float64 reference stops being
``core.reference``; its reference, recurrent step and prefill are right (tests/test_harness/test_long_reference.py)."""

from __future__ import annotations

import torch

import variants
from variants.sum_rule import SumRule

#: The first token the parallel form gets wrong.
WRONG_FROM = 1024


@variants.register("wrong_beyond_1024")
class WrongBeyond1024(SumRule):
    def _parallel(self, q, k, v, causal, **token_inputs):
        out = super()._parallel(q, k, v, causal, **token_inputs)
        late = torch.arange(out.shape[2], device=out.device) >= WRONG_FROM
        return torch.where(late[:, None], 1.01 * out, out)

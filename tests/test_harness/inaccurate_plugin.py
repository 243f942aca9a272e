"""A plugin variant that is fast because it is wrong: linear attention (elu+1) whose parallel form
is 1 % off its reference (``y ↦ 1.01 y``); its reference and recurrent step are right."""

from __future__ import annotations

import variants
from variants.sum_rule import SumRule


@variants.register("off_by_one_percent")
class OffByOnePercent(SumRule):
    def _parallel(self, q, k, v, causal, **token_inputs):
        return 1.01 * super()._parallel(q, k, v, causal, **token_inputs)

"""A plugin for the runner tests (loaded with --plugin): ``fault_sticky`` imitates a sticky CUDA
error on the CPU. Its cell at T=16 fails and leaves its process unusable, as an illegal memory
access leaves a CUDA context; every later call in that process fails too, while a fresh process
runs the variant (linear attention) as usual."""

import variants
from variants.sum_rule import SumRule

#: Whether a call in this process has hit the injected error.
_broken = []


@variants.register("fault_sticky")
class _Sticky(SumRule):
    def forward(self, q, k, v, **kwargs):
        if _broken:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (left by an earlier cell in this process)")
        if q.shape[-2] == 16:
            _broken.append(True)
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
        return super().forward(q, k, v, **kwargs)

"""aten operations and time of one decode step of every core variant (docs/performance.md, "Decode steps").

Each variant with its decode scenario parameters, B = 1, H = 8, d = 64 (Based, ReBased: d_key 16),
fp32, one thread, without autograd: a prefill of ``--context`` tokens, then steps. The operations
are those one step dispatches (a ``TorchDispatchMode`` counting every aten call, views included);
the time is the median of ``--steps`` steps. Usage:
``python benchmarks/step_ops.py [--context 256] [--steps 64]``; run it on two revisions to compare.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import variants
from harness.demo import OWN_D_KEY
from harness.measuring.profiling import OperationCount

#: The decode scenario's variants and their parameters (scenarios/decode.yaml), LSH at one round.
VARIANTS = {"performer": {"m": 64}, "dpfp": {"nu": 1}, "lsh": {"n_rounds": 1}}


def measure(name: str, context: int, steps: int) -> tuple[int, float]:
    """(aten operations of one step, median seconds of a step) after a prefill of ``context`` tokens."""
    core = variants.create(name, OWN_D_KEY.get(name, 64), **VARIANTS.get(name, {}))
    inputs = core.example_inputs(1, 8, context + steps + 1, 64)
    tokens = [{name: x.contiguous() for name, x in variants.token_slice(inputs, t).items()} for t in range(context, context + steps + 1)]
    with torch.no_grad():
        _, state = core.prefill(**variants.time_slice(inputs, 0, context))
        with OperationCount() as counted:
            _, state = core.step(**tokens[0], state=state)
        seconds = []
        for token in tokens[1:]:
            start = time.perf_counter()
            _, state = core.step(**token, state=state)
            seconds.append(time.perf_counter() - start)
    return counted.count, statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| variant | aten operations a step | median step (µs) |\n|:--|--:|--:|")
    for name in variants.names():
        operations, seconds = measure(name, args.context, args.steps)
        print(f"| {name} | {operations} | {seconds * 1e6:.1f} |")


if __name__ == "__main__":
    main()

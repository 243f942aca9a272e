"""Compile time of backend='compile' and its speed against eager, in one process (docs/performance.md).

``python benchmarks/compile_time.py NAME T MODE SCAN``: ``variants.create(NAME, 64, backend="compile",
scan=SCAN)`` on B = 4, H = 8, d = 64, fp32 (MODE: forward, without autograd, or train: forward and
backward); its first call timed (tracing, compiling, one run) with a new Inductor cache
(``TORCHINDUCTOR_CACHE_DIR``), then the eager core (``scan="auto"``) and the compiled one timed in
alternation, median of 5 calls each. ``THREADS`` (default 2) sets torch's threads.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-"))

import torch  # noqa: E402

import variants  # noqa: E402
from variants.compiled import compiled_frames  # noqa: E402


def main() -> None:
    name, length, mode, scan = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.manual_seed(0)
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    eager, compiled = variants.create(name, 64), variants.create(name, 64, backend="compile", scan=scan)
    inputs = eager.example_inputs(4, 8, length, 64, requires_grad=mode == "train")

    def call(core):
        start = time.perf_counter()
        out = core(**inputs)
        if mode == "train":
            out.sum().backward()
        return time.perf_counter() - start

    with torch.set_grad_enabled(mode == "train"):
        compile_s = call(compiled)
        frames = compiled_frames()
        call(eager)
        times = [(call(eager), call(compiled)) for _ in range(5)]
    eager_s, compiled_s = (sorted(column)[2] for column in zip(*times))
    again = compiled_frames() - frames
    print(
        f"{name} T={length} {mode} scan={scan}: compile {compile_s:.1f} s ({frames} frames, {again} compiled after), "
        f"eager {eager_s * 1e3:.1f} ms, compiled {compiled_s * 1e3:.1f} ms, eager / compiled {eager_s / compiled_s:.2f}, "
        f"load average {os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    main()

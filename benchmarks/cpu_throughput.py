"""Forward tokens/s of each variant's parallel form against SDPA and the token loop.

The table of docs/performance.md: every registered variant's parallel form with its defaults
(Based and ReBased at their own d_key = 16, ``harness.demo.OWN_D_KEY``), plain linear attention
and the delta rule's token loop, each on its own ``example_inputs`` (q, k, v and its per-token
inputs). fp32, B=4, H=8, D=64 by default; every cell is the
median of ``--repeats`` runs after a warm-up, with the p20-p80 spread. All cells are timed
in interleaved rounds (each cell once per round) so that the ratios are comparable. Usage: ``python benchmarks/cpu_throughput.py [--lengths ...]``.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform

import pandas as pd
import torch

import variants
from harness.demo import OWN_D_KEY
from harness.measuring.measure import time_interleaved

#: (label, variant, params, form)
CONTENDERS = [(name, name, {}, "parallel") for name in variants.names()] + [
    ("linear, phi=identity, unnormalised", "linear", {"phi": "identity", "normalize": False}, "parallel"),
    ("delta (token loop)", "delta", {}, "reference"),
]


def measure(lengths, loop_lengths, batch, heads, dim, repeats):
    """Every (contender, T) cell timed in interleaved rounds, so all share the machine's drift."""
    calls = {}
    for length in lengths:
        for label, name, params, form in CONTENDERS:
            if form == "reference" and length not in loop_lengths:
                continue
            core = variants.create(name, OWN_D_KEY.get(name, dim), **params)
            inputs = core.example_inputs(batch, heads, length, dim, generator=torch.Generator().manual_seed(0))
            calls[label, length] = functools.partial(getattr(core, "forward" if form == "parallel" else "reference"), **inputs)
    with torch.no_grad():
        timings = time_interleaved(calls, warmup=1, repeats=repeats)
    rows = []
    for (label, length), timing in timings.items():
        rows.append(
            {
                "contender": label,
                "T": length,
                "median_ms": 1e3 * timing.median_s,
                "p20_ms": 1e3 * timing.p20_s,
                "p80_ms": 1e3 * timing.p80_s,
                "tokens_per_s": batch * length / timing.median_s,
            }
        )
    return pd.DataFrame(rows)


def _has_tabulate() -> bool:
    try:
        import tabulate  # noqa: F401
    except ImportError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 16384])
    parser.add_argument("--loop-lengths", type=int, nargs="+", default=[2048], help="T at which the delta token loop runs")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args()
    print(
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"fp32, B={args.batch} H={args.heads} D={args.dim}, median of {args.repeats} after 1 warm-up"
    )
    table = measure(args.lengths, args.loop_lengths, args.batch, args.heads, args.dim, args.repeats)
    tokens = args.batch * table["T"]
    table["cell"] = [
        f"{rate / 1e3:,.0f}k ({low / 1e3:,.0f}-{high / 1e3:,.0f})"
        for rate, low, high in zip(table["tokens_per_s"], tokens / table["p80_ms"] * 1e3, tokens / table["p20_ms"] * 1e3)
    ]
    wide = table.pivot(index="contender", columns="T", values="cell").reindex([c[0] for c in CONTENDERS])
    print("\ntokens/s: median (p20-p80 of the per-run rates)")
    print(wide.fillna("-").to_markdown() if _has_tabulate() else wide.fillna("-").to_string())
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(table.to_dict(orient="records"), handle, indent=1)


if __name__ == "__main__":
    main()

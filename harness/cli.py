"""The ``attnbench`` command line."""

from __future__ import annotations

import argparse
import sys

import torch


def _demo(args) -> int:
    from .demo import DemoShape, format_table, run_demo

    shape = DemoShape(batch=args.batch, heads=args.heads, length=args.seq_len, d_key=args.d_key, d_value=args.d_key)
    print(
        f"attnbench demo: B={shape.batch} H={shape.heads} T={shape.length} D={shape.d_key}, float32 on the CPU, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}; median of {args.repeats} runs after a warm-up"
    )
    print(format_table(run_demo(shape, repeats=args.repeats)))
    print("max_abs_err: largest |form - float64 reference|; tokens_per_s = B*T / median time of the whole form.")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="attnbench", description="Benchmark attention variants across hardware.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run every variant's forms on a small CPU input and print a table")
    demo.add_argument("--batch", type=int, default=2)
    demo.add_argument("--heads", type=int, default=4)
    demo.add_argument("--seq-len", type=int, default=256)
    demo.add_argument("--d-key", type=int, default=64)
    demo.add_argument("--repeats", type=int, default=5)
    demo.set_defaults(handler=_demo)
    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())

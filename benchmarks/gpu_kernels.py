"""Check and time attnbench's Triton kernels on a GPU.

First every kernel is checked against the float64 PyTorch reference (forward and every
gradient) on small awkward shapes; a kernel that fails is reported and not timed. Then
forward and forward+backward are timed with CUDA events (L2 flushed before each call,
warm-up including compilation first) over T = 512 ... 16384, B·H = 64, d = 64 and 128,
bf16 and fp32, against SDPA (causal), the chunked PyTorch forms and, where the package is
importable, flash-linear-attention's ``chunk_linear_attn`` / ``chunk_delta_rule``.

Usage: ``python benchmarks/gpu_kernels.py [--quick] [--json out.json]``. Prints a table.
On a CPU (``--device cpu`` with TRITON_INTERPRET=1) it runs as a smoke test of itself.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform

import pandas as pd
import torch
import torch.nn.functional as F

from harness.measure import time_interleaved
from variants import chunked
from variants.kernels import load

EPS = 1e-6


def _feature_inputs(batch, heads, length, dim, device, dtype, seed=0):
    """Positive, sum-normalised features (well-conditioned for both rules), values, β."""
    gen = torch.Generator(device=device).manual_seed(seed)
    make = lambda: torch.randn(batch, heads, length, dim, generator=gen, device=device)  # noqa: E731
    q, k = F.elu(make()) + 1, F.elu(make()) + 1
    q, k = q / q.sum(-1, keepdim=True), k / k.sum(-1, keepdim=True)
    v = make()
    beta = torch.rand(batch, heads, length, generator=gen, device=device)
    return [t.to(dtype) for t in (q, k, v, beta)]


# --- the contenders: (q, k, v, beta) -> output -----------------------------------------
def ours_sum(q, k, v, beta, *, normalize):
    return load("sum_rule").sum_rule_triton(q, k, v, normalize=normalize)[0]


def ours_delta(q, k, v, beta):
    return load("delta_rule").delta_rule_triton(q, k, v, beta)[0]


def torch_sum(q, k, v, beta, *, normalize):
    batch, heads, _, dim = q.shape
    weights = q.new_zeros(batch, heads, dim, v.shape[-1])
    return chunked.sum_rule_chunked(q, k, v, weights, q.new_zeros(batch, heads, dim) if normalize else None, 64)[0]


def torch_delta(q, k, v, beta):
    weights = q.new_zeros(q.shape[0], q.shape[1], q.shape[-1], v.shape[-1])
    return chunked.delta_rule_chunked(q, k, v, beta, weights, None, 64)[0]


def sdpa(q, k, v, beta):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _fla():
    try:
        from fla.ops.delta_rule import chunk_delta_rule
        from fla.ops.linear_attn import chunk_linear_attn
    except ImportError:
        return {}
    to_bthd = lambda t: t.transpose(1, 2).contiguous()  # noqa: E731

    def fla_sum(q, k, v, beta):
        return chunk_linear_attn(to_bthd(q), to_bthd(k), to_bthd(v), scale=1.0, normalize=False)[0]

    def fla_delta(q, k, v, beta):
        return chunk_delta_rule(to_bthd(q), to_bthd(k), to_bthd(v), beta.transpose(1, 2).contiguous(), scale=1.0)[0]

    return {"fla chunk_linear_attn": fla_sum, "fla chunk_delta_rule": fla_delta}


def contenders() -> dict:
    return {
        "sdpa causal": sdpa,
        "torch chunked sum": functools.partial(torch_sum, normalize=False),
        "triton sum": functools.partial(ours_sum, normalize=False),
        "triton sum (normalised)": functools.partial(ours_sum, normalize=True),
        "torch chunked delta": torch_delta,
        "triton delta": ours_delta,
        **_fla(),
    }


# --- correctness --------------------------------------------------------------------------
CHECKS = {
    "triton sum": (functools.partial(ours_sum, normalize=False), functools.partial(torch_sum, normalize=False)),
    "triton sum (normalised)": (functools.partial(ours_sum, normalize=True), functools.partial(torch_sum, normalize=True)),
    "triton delta": (ours_delta, torch_delta),
}


def check(device) -> list[dict]:
    """Kernel (fp32) vs the float64 reference: forward and every gradient, awkward shapes."""
    rows = []
    for name, (kernel, reference) in CHECKS.items():
        for batch, heads, length, dim in [(1, 1, 1, 16), (2, 3, 63, 32), (1, 2, 130, 64), (2, 2, 200, 128)]:
            inputs = _feature_inputs(batch, heads, length, dim, device, torch.float64, seed=length)
            leaves64 = [t.clone().requires_grad_() for t in inputs]
            leaves32 = [t.float().clone().requires_grad_() for t in inputs]
            cotangent = torch.randn_like(inputs[2])
            expected = reference(*leaves64)
            got = kernel(*leaves32)
            grads64 = torch.autograd.grad(expected, leaves64, cotangent, allow_unused=True)
            grads32 = torch.autograd.grad(got, leaves32, cotangent.float(), allow_unused=True)
            errors = {"out": _relative_error(got, expected)}
            for label, g32, g64 in zip(("dq", "dk", "dv", "dbeta"), grads32, grads64):
                if g64 is not None:
                    errors[label] = _relative_error(g32, g64)
            worst = max(errors.values())
            rows.append({"kernel": name, "shape": f"B{batch} H{heads} T{length} d{dim}", **errors, "ok": worst < 1e-3})
    return rows


def _relative_error(actual, expected) -> float:
    """Largest deviation over the reference's scale (at least 1: the inputs are of unit scale,
    so a near-zero gradient is compared in absolute terms)."""
    if actual is None:
        return float("inf")
    return float((actual.double() - expected).abs().max() / expected.abs().max().clamp_min(1.0))


# --- timing -------------------------------------------------------------------------------
def time_all(lengths, dims, dtypes, device, repeats, batch_heads=(8, 8), exclude=()) -> list[dict]:
    rows = []
    for dim in dims:
        for dtype in dtypes:
            for length in lengths:
                inputs = _feature_inputs(*batch_heads, length, dim, device, dtype)
                calls = {}
                for name, fn in contenders().items():
                    if name in exclude:
                        continue
                    calls[name, "fwd"] = functools.partial(_forward, fn, inputs)
                    calls[name, "fwd+bwd"] = functools.partial(_forward_backward, fn, inputs)
                for (name, mode), timing in _time_safely(calls, device, repeats).items():
                    rows.append({"contender": name, "mode": mode, "T": length, "d": dim, "dtype": str(dtype).removeprefix("torch."), **timing})
                print(f"d={dim} {dtype} T={length}: done", flush=True)
    return rows


def _forward(fn, inputs):
    with torch.no_grad():
        return fn(*inputs)


def _forward_backward(fn, inputs):
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(torch.ones_like(out))


def _time_safely(calls, device, repeats) -> dict:
    """Time each call alone (so that one failing contender costs only its own cells)."""
    results = {}
    for key, call in calls.items():
        try:
            timing = time_interleaved({key: call}, warmup=3, repeats=repeats, device=device)[key]
            results[key] = {"median_ms": 1e3 * timing.median_s, "p20_ms": 1e3 * timing.p20_s, "p80_ms": 1e3 * timing.p80_s, "status": "ok"}
        except Exception as exc:  # noqa: BLE001 - an OOM or an unsupported shape is a result
            results[key] = {"median_ms": None, "p20_ms": None, "p80_ms": None, "status": f"{type(exc).__name__}: {str(exc)[:120]}"}
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="T = 1024, 4096, 16384; d = 64; bf16 only")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--batch-heads", type=int, nargs=2, default=[8, 8], metavar=("B", "H"))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", help="write checks and timings to this file")
    args = parser.parse_args()
    device = torch.device(args.device)
    lengths, dims, dtypes = args.lengths, args.dims, [getattr(torch, name) for name in args.dtypes]
    if args.quick:
        lengths, dims, dtypes = [1024, 4096, 16384], [64], [torch.bfloat16]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    print(f"{name}; torch {torch.__version__}; fla importable: {bool(_fla())}")
    checks = pd.DataFrame(check(device))
    print(checks.to_string(index=False, float_format=lambda x: f"{x:.1e}"))
    wrong = sorted(set(checks.loc[~checks.ok, "kernel"]))
    if wrong:
        print(f"\nNOT TIMED, wrong against the reference: {', '.join(wrong)}")
    timings = pd.DataFrame(time_all(lengths, dims, dtypes, device, args.repeats, tuple(args.batch_heads), exclude=wrong))
    table = timings.pivot_table(index=["d", "dtype", "mode", "contender"], columns="T", values="median_ms")
    print(f"\nmedian ms (CUDA events, L2 flushed, B={args.batch_heads[0]} H={args.batch_heads[1]}):")
    print(table.to_string(float_format=lambda x: f"{x:.3f}"))
    failed = timings[timings.status != "ok"]
    if len(failed):
        print("\nnot timed:\n" + failed[["contender", "mode", "T", "d", "dtype", "status"]].to_string(index=False))
    if args.json:
        with open(args.json, "w") as handle:
            record = {"device": name, "torch": torch.__version__, "checks": checks.to_dict("records"), "timings": timings.to_dict("records")}
            json.dump(record, handle, indent=1)


if __name__ == "__main__":
    main()

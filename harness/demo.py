"""The demo: every variant's forms on one small CPU input, checked and timed.

For each variant it runs the parallel form, the recurrent step loop and the reference,
reports each form's largest deviation from the float64 reference, and times the
parallel form and a decoding step (median with the p20-p80 spread).
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import torch

import variants

from .measure import time_callable

#: (variant, parameters) shown by the demo: the five core variants.
DEMO_VARIANTS = [
    ("softmax", {}),
    ("linear", {}),
    ("performer", {"m": 64}),
    ("dpfp", {"nu": 1}),
    ("delta", {}),
]


@dataclass(frozen=True)
class DemoShape:
    batch: int = 2
    heads: int = 4
    length: int = 256
    d_key: int = 64
    d_value: int = 64


def _inputs(core, shape: DemoShape, generator):
    dims = (shape.batch, shape.heads, shape.length)
    q = torch.randn(*dims, shape.d_key, generator=generator)
    k = torch.randn(*dims, shape.d_key, generator=generator)
    v = torch.randn(*dims, shape.d_value, generator=generator)
    beta = torch.rand(*dims, generator=generator) if core.needs_beta else None
    return q, k, v, beta


def _step_loop(core, q, k, v, beta):
    state = core.init_state(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype)
    outputs = []
    for t in range(q.shape[2]):
        out, state = core.step(q[:, :, t], k[:, :, t], v[:, :, t], state, beta_t=None if beta is None else beta[:, :, t])
        outputs.append(out)
    return torch.stack(outputs, dim=2)


def run_demo(shape: DemoShape = DemoShape(), *, repeats: int = 5, seed: int = 0) -> pd.DataFrame:
    """One row per (variant, form): error against the float64 reference and timing."""
    generator = torch.Generator().manual_seed(seed)
    tokens = shape.batch * shape.length
    rows = []
    for name, params in DEMO_VARIANTS:
        core = variants.create(name, shape.d_key, **params)
        q, k, v, beta = _inputs(core, shape, generator)
        with torch.no_grad():
            double = [t.double() if t is not None else None for t in (q, k, v, beta)]
            expected = core.double().reference(*double[:3], beta=double[3]).float()
            core.float()
            forms = {
                "parallel": lambda: core(q, k, v, beta=beta),
                "step loop": lambda: _step_loop(core, q, k, v, beta),
                "reference": lambda: core.reference(q, k, v, beta=beta),
            }
            for form, fn in forms.items():
                error = (fn() - expected).abs().max().item()
                timing = time_callable(fn, warmup=1, repeats=repeats)
                rows.append(
                    {
                        "variant": name,
                        "params": ", ".join(f"{key}={value}" for key, value in params.items()),
                        "d_dot": core.d_dot,
                        "form": form,
                        "max_abs_err": error,
                        "median_ms": 1e3 * timing.median_s,
                        "p20_ms": 1e3 * timing.p20_s,
                        "p80_ms": 1e3 * timing.p80_s,
                        "tokens_per_s": tokens / timing.median_s,
                    }
                )
    return pd.DataFrame(rows)


def format_table(table: pd.DataFrame) -> str:
    formatters = {
        "max_abs_err": "{:.1e}".format,
        "median_ms": "{:.2f}".format,
        "p20_ms": "{:.2f}".format,
        "p80_ms": "{:.2f}".format,
        "tokens_per_s": "{:,.0f}".format,
    }
    return table.to_string(index=False, formatters=formatters)

"""The demo: every variant's forms on one small CPU input, checked and timed.

For every registered variant (``variants.names()``, each with its defaults) it runs the
parallel form, the recurrent step loop and the reference on the core's own example inputs
(``core.example_inputs``: q, k, v and its token inputs), reports each form's largest
deviation from the float64 reference, and times each form (median with the p20-p80 spread).
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import torch

import variants

from .measuring.measure import time_callable

#: Variants with their own query/key width, as in the shipped scenarios (Based's and ReBased's
#: 16-dim projection; at d_key = 64 Based's d_dot would be 4161); values keep the shape's d_value.
OWN_D_KEY = {"based": 16, "rebased": 16}


@dataclass(frozen=True)
class DemoShape:
    batch: int = 2
    heads: int = 4
    length: int = 256
    d_key: int = 64
    d_value: int = 64


def run_demo(shape: DemoShape = DemoShape(), *, repeats: int = 5, seed: int = 0) -> pd.DataFrame:
    """One row per (variant, form): error against the float64 reference and timing."""
    generator = torch.Generator().manual_seed(seed)
    tokens = shape.batch * shape.length
    rows = []
    for name in variants.names():
        d_key = OWN_D_KEY.get(name, shape.d_key)
        core = variants.create(name, d_key)
        inputs = core.example_inputs(shape.batch, shape.heads, shape.length, shape.d_value, generator=generator)
        with torch.no_grad():
            expected = core.double().reference(**{key: x.double() for key, x in inputs.items()}).float()
            core.float()
            forms = {
                "parallel": lambda: core(**inputs),
                "step loop": lambda: core.step_loop(inputs)[0],
                "reference": lambda: core.reference(**inputs),
            }
            for form, fn in forms.items():
                error = (fn() - expected).abs().max().item()
                timing = time_callable(fn, warmup=1, repeats=repeats)
                rows.append(
                    {
                        "variant": name,
                        "d_key": d_key,
                        "d_dot": core.d_dot,
                        "form": form,
                        "max_abs_err": error,
                        "median_ms": 1e3 * timing.median_s,
                        "p20_ms": 1e3 * timing.p20_s,
                        "p80_ms": 1e3 * timing.p80_s,
                        "tokens_per_s": tokens / timing.median_s,
                    }
                )
    return pd.DataFrame(rows).astype({"d_dot": "Int64"})  # softmax has none: <NA>, the others stay integers


def format_table(table: pd.DataFrame) -> str:
    formatters = {
        "max_abs_err": "{:.1e}".format,
        "median_ms": "{:.2f}".format,
        "p20_ms": "{:.2f}".format,
        "p80_ms": "{:.2f}".format,
        "tokens_per_s": "{:,.0f}".format,
    }
    return table.to_string(index=False, formatters=formatters)

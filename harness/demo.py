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
    """One row per (variant, form): error against the float64 reference and timing; a form that raises or returns no
    tensor of the reference's shape (a plugin's) has why in ``failed``, and is not timed."""
    generator = torch.Generator().manual_seed(seed)
    tokens = shape.batch * shape.length
    rows = []
    for name in variants.names():
        d_key = OWN_D_KEY.get(name, shape.d_key)
        try:
            core = variants.create(name, d_key)
            inputs = core.example_inputs(shape.batch, shape.heads, shape.length, shape.d_value, generator=generator)
            with torch.no_grad():
                expected = core.double().reference(**{key: x.double() for key, x in inputs.items()}).float()
        except Exception as exc:  # noqa: BLE001 - a plugin's variant: any error is its failure
            rows.append({"variant": name, "d_key": d_key, "form": "reference", "failed": f"{type(exc).__name__}: {exc}"})
            continue
        with torch.no_grad():
            core.float()
            forms = {
                "parallel": lambda: core(**inputs),
                "step loop": lambda: core.step_loop(inputs)[0],
                "reference": lambda: core.reference(**inputs),
            }
            for form, fn in forms.items():
                row = {"variant": name, "d_key": d_key, "d_dot": core.d_dot, "form": form}
                out, failed = _output(fn, expected)
                if failed:
                    rows.append({**row, "failed": failed})
                    continue
                error = (out - expected).abs().max().item()
                timing = time_callable(fn, warmup=1, repeats=repeats)
                rows.append(
                    {
                        **row,
                        "max_abs_err": error,
                        "median_ms": 1e3 * timing.median_s,
                        "p20_ms": 1e3 * timing.p20_s,
                        "p80_ms": 1e3 * timing.p80_s,
                        "tokens_per_s": tokens / timing.median_s,
                    }
                )
    return pd.DataFrame(rows).astype({"d_dot": "Int64"})  # softmax has none: <NA>, the others stay integers


def _output(fn, expected: torch.Tensor) -> tuple[torch.Tensor | None, str | None]:
    """(what form ``fn`` returns, None), or (None, why it cannot be compared with ``expected``: it raised, or returned
    no tensor of its shape)."""
    try:
        out = fn()
    except Exception as exc:  # noqa: BLE001
        return None, f"raised {type(exc).__name__}: {exc}"
    if isinstance(out, torch.Tensor) and out.shape == expected.shape:
        return out, None
    got = f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
    return None, f"returned {got}, not a tensor of shape {tuple(expected.shape)}"


def format_table(table: pd.DataFrame) -> str:
    """The table of the forms that ran, then a line for each that failed (``attnbench check`` tells more)."""
    failed = table[table["failed"].notna()] if "failed" in table else table.iloc[:0]
    ran = table.drop(index=failed.index, columns=["failed"], errors="ignore")
    lines = [f"FAIL  {row.variant} {row.form}: {row.failed} (attnbench check {row.variant} tells more)" for row in failed.itertuples()]
    return "\n".join([_format_ran(ran), *lines])


def _format_ran(table: pd.DataFrame) -> str:
    formatters = {
        "max_abs_err": "{:.1e}".format,
        "median_ms": "{:.2f}".format,
        "p20_ms": "{:.2f}".format,
        "p80_ms": "{:.2f}".format,
        "tokens_per_s": "{:,.0f}".format,
    }
    return table.to_string(index=False, formatters=formatters)

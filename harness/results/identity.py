"""Which loaded results are the same cell: the identity columns of ``results.load``'s frame.

A cell is what it measures: scenario, variant, backend, params, axes, mode and target
(``CELL_KEY``, ``params`` and ``axes`` as canonical JSON), whatever file, run or machine holds
it; measured again, the latest measurement stands (``latest``). compare, the report and the
seed tables match cells this way.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from ..common.formatting import present
from ..scenarios import axes as axis_table

#: The columns that identify a cell across files (``params`` and ``axes`` as canonical JSON).
CELL_KEY = ["scenario", "variant", "backend", "params_key", "axes_key", "mode", "target"]


def _plain(value):
    """A JSON-friendly scalar: numpy scalars unwrapped, integral floats as ints (pandas turns
    an int column with holes into floats, and ``m=32`` must match ``m=32.0``)."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def nested(record: dict, prefix: str, ignore=()) -> dict:
    """The dict ``load`` flattened into ``prefix.*`` columns, without holes or ``ignore``d keys."""
    start = len(prefix) + 1
    return {key[start:]: _plain(value) for key, value in record.items() if key.startswith(prefix + ".") and present(value) and key[start:] not in ignore}


def params_text(params: dict) -> str:
    """``m=32,phi=dpfp`` (empty for no parameters)."""
    return ",".join(f"{key}={value}" for key, value in sorted(params.items()))


def axes_text(axes: dict) -> str:
    """``T=64 B=1 H=2 Dk=16 Dv=16 float32 cpu``, then any other axis as ``name=value``."""
    parts = [f"{short}={axes[name]}" for name, short in axis_table.SHORT.items() if name in axes]
    parts += [str(axes[name]) for name in ("dtype", "device") if name in axes]
    parts += [f"{name}={value}" for name, value in sorted(axes.items()) if name not in axis_table.SHORT and name not in ("dtype", "device")]
    return " ".join(parts)


def machine_name(record: dict) -> str:
    """``hostname (GPU name)``, or ``hostname (CPU model)`` for a machine without a GPU."""
    hardware = record.get("machine.gpu.name")
    if not present(hardware):
        hardware = record.get("machine.cpu.model")
    return f"{record.get('machine.hostname')} ({hardware if present(hardware) else 'unknown hardware'})"


def identify(frame: pd.DataFrame, *, ignore_axes=()) -> pd.DataFrame:
    """``frame`` (from ``load``) with the identity columns added: ``params_key`` and
    ``axes_key`` (canonical JSON; ``ignore_axes`` left out), ``params_text``, ``axes_text``,
    ``machine_key`` (the run line's machine_id), ``machine`` and ``gpu`` (its GPU name or None)."""
    records = frame.to_dict("records")
    params = [nested(record, "params") for record in records]
    axes = [nested(record, "axes", ignore_axes) for record in records]
    gpu = frame["machine.gpu.name"] if "machine.gpu.name" in frame else pd.Series(None, index=frame.index)
    return frame.assign(
        params_key=[json.dumps(p, sort_keys=True) for p in params],
        axes_key=[json.dumps(a, sort_keys=True) for a in axes],
        params_text=[params_text(p) for p in params],
        axes_text=[axes_text(a) for a in axes],
        machine_key=frame["machine.machine_id"] if "machine.machine_id" in frame else frame["machine_id"],
        machine=[machine_name(record) for record in records],
        gpu=[value if present(value) else None for value in gpu],
    )


def latest(frame: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """One row per ``keys``: the cell measured last (a cell measured again supersedes the old one)."""
    return frame.sort_values("started_at", kind="stable").drop_duplicates(keys, keep="last")

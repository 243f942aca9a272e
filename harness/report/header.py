"""The report's header: each machine's fingerprint, its runs and how to repeat them, its throttled cells."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..common.formatting import counted, gib, present, si, text
from ..results import read_records
from ..results.compare import is_unstable
from .cells import TIMED_MODES
from .figures import Table, table
from .tables import cell_columns


def runs_of(files) -> list[dict]:
    """The run lines of every file, each with its file."""
    return [dict(record, file=str(path)) for path in files for record in read_records(path) if record["kind"] == "run"]


def _gpu_facts(gpu: dict | None, versions: dict) -> list[tuple[str, str]]:
    if not gpu:
        return [("GPU", "none")]
    return [
        ("GPU", f"{gpu.get('name')}, {gib(gpu.get('memory_bytes'))}, compute capability {text(gpu.get('compute_capability'))}"),
        (
            "driver / CUDA",
            f"driver {text(gpu.get('driver_version'))}, CUDA driver {text(gpu.get('cuda_driver_version'))}, CUDA runtime {text(versions.get('cuda'))}",
        ),
        ("power limit / ECC", f"{text(gpu.get('power_limit_w'))} W, ECC {text(gpu.get('ecc_enabled'))}"),
    ]


def _machine_facts(machine: dict) -> list[tuple[str, str]]:
    """The fingerprint as (label, text) rows."""
    cpu, versions = machine.get("cpu") or {}, machine.get("versions") or {}
    return [
        ("hostname", text(machine.get("hostname"))),
        ("platform", f"{text(machine.get('platform'))}, Python {text(machine.get('python'))}"),
        (
            "CPU",
            f"{text(cpu.get('model'))}, {text(cpu.get('usable_cores'))} usable of {text(cpu.get('logical_cores'))} cores, "
            f"torch's default {text(cpu.get('torch_threads'))} threads",
        ),
        ("memory", gib(machine.get("memory_bytes"))),
        *_gpu_facts(machine.get("gpu"), versions),
        (
            "versions",
            f"torch {text(versions.get('torch'))}, triton {text(versions.get('triton'))}, cudnn {text(versions.get('cudnn'))}, "
            f"numpy {text(versions.get('numpy'))}",
        ),
        *_calibration_facts(machine.get("calibration")),
        ("machine id", machine["machine_id"]),
    ]


def _calibration_facts(calibration: dict | None) -> list[tuple[str, str]]:
    """The calibrated (and datasheet) peaks as (label, text) rows; none for a run without calibration."""
    if not calibration:
        return []
    flops = ", ".join(f"{dtype} {si(value)}FLOP/s" for dtype, value in calibration["matmul_flops_per_s"].items())
    threads = calibration["torch_threads"]
    rows = [
        (
            "calibrated peaks",
            f"matmul {flops}; copy {si(calibration['bandwidth_bytes_per_s'])}B/s, measured on {counted(threads, 'torch thread')} "
            "(a cell timed on fewer is held to the matmul peak scaled to its threads)",
        )
    ]
    sheet = calibration.get("datasheet")
    if sheet:
        peaks = ", ".join(f"{key} {si(value)}FLOP/s" for key, value in sheet.items() if key not in ("name", "bandwidth_bytes_per_s"))
        rows.append(
            (
                "datasheet peaks",
                f"{sheet['name']}: {peaks}; memory {si(sheet['bandwidth_bytes_per_s'])}B/s; SM clock {text(calibration.get('sm_clock_mhz'))} MHz",
            )
        )
    return rows


def _threads_fact(runs: list[dict], cells: pd.DataFrame) -> list[tuple[str, str]]:
    """The torch threads the machine's cells ran on (``metrics.torch_threads``): one count for every
    timed CPU cell of a run, chosen at its start (its run line's ``torch_threads``), or several (runs
    that chose differently, or files written before); the quality cells' own (their task's ``threads``)."""
    if "metrics.torch_threads" not in cells:
        return []
    measured = cells[cells["metrics.torch_threads"].map(present)]
    quality = measured["mode"] == "quality"

    def counts(group: pd.DataFrame) -> str:
        found = sorted({int(value) for value in group["metrics.torch_threads"]})
        return " or ".join(map(str, found)) + (" (not the same for every cell: their times are not on the same terms)" if len(found) > 1 else "")

    parts = []
    if len(timed := measured[~quality & (measured["axes.device"] == "cpu")]):
        chosen = sorted({run["torch_threads"] for run in runs if run.get("torch_threads") is not None})
        when = "" if not chosen else ", chosen once at the start of its run" + (f" ({' or '.join(map(str, chosen))})" if len(chosen) > 1 else "")
        parts.append(f"timed CPU cells: {counts(timed)}{when}")
    if quality.any():
        parts.append(f"quality cells: {counts(measured[quality])}, their task's threads")
    return [("torch threads", "; ".join(parts))] if parts else []


def _while_measured(cells: pd.DataFrame) -> str:
    """What a run's timed cells met while they were measured (their records, not a setting): the cores other
    processes kept busy (``metrics.load.other_cores``: on average and at most, of the machine's), how many
    were unstable and, where the records say, disturbed (``metrics.disturbed``)."""
    timed = cells[(cells["status"] == "ok") & cells["mode"].isin(TIMED_MODES)]
    if timed.empty:
        return "no timed cell"
    metric = lambda name: timed.get(f"metrics.{name}", pd.Series(np.nan, index=timed.index))
    busy, cores = metric("load.other_cores").dropna(), metric("load.cores").dropna()
    disturbed = metric("disturbed").map(lambda value: value is True)
    load = f"; other processes kept {busy.mean():.2f} cores{f' of {cores.max():g}' if len(cores) else ''} busy on average (at most {busy.max():.2f})"
    return (
        counted(len(timed), "timed cell")
        + (load if len(busy) else "; their load was not recorded")
        + f"; {(metric('unstable').map(is_unstable) | disturbed).sum()} unstable"
        + (f" ({disturbed.sum()} of them disturbed)" if metric("disturbed").map(present).any() else "")
    )


def _measured_fact(runs: list[dict], cells: pd.DataFrame) -> list[tuple[str, str]]:
    """``_while_measured`` for each run of the machine (its run id and scenario first where there are several)."""
    parts = [(run, cells[cells["run_id"] == run["run_id"]]) for run in runs]
    if len(parts) == 1:
        return [("while measured", _while_measured(parts[0][1]))]
    return [("while measured", " · ".join(f"run {run['run_id'][:8]} ({run['scenario']}): {_while_measured(own)}" for run, own in parts if len(own)))]


def _commit_text(run: dict) -> str:
    commit = run.get("commit")
    return "-" if not commit else commit[:12] + (" (dirty: uncommitted changes)" if run.get("dirty") else "")


def _reproduce(run: dict) -> str:
    """The shell lines that repeat a run: check out its commit, then its exact command."""
    checkout = f"git checkout {run['commit']}\n" if run.get("commit") else ""
    command = run.get("command") or f"attnbench run {run.get('scenario_file') or run['scenario']}"
    return checkout + command


def _run_view(run: dict) -> dict:
    """What the page shows of a run line (fields the format does not require may be missing)."""
    return {
        "run_id": run["run_id"],
        "scenario": run["scenario"],
        "started_at": run["started_at"],
        "scenario_file": run.get("scenario_file") or "-",
        "sha256": (run.get("scenario_sha256") or "-")[:12],
        "preset": run.get("preset") or "none",
        "overrides": " ".join(run.get("overrides") or []) or "none",
        "resumed_from": run.get("resumed_from"),
        "commit": _commit_text(run),
        "reproduce": _reproduce(run),
    }


@dataclass
class MachineSection:
    name: str
    facts: list[tuple[str, str]]
    runs: list[dict]
    throttled: Table | None
    throttled_count: int


def _throttled(cells: pd.DataFrame) -> pd.DataFrame:
    return cells[cells["metrics.throttled"].map(lambda value: value is True)]


def _machine_section(name: str, runs: list[dict], cells: pd.DataFrame) -> MachineSection:
    throttled = _throttled(cells)
    dates = sorted(run["started_at"] for run in runs)
    facts = (
        _machine_facts(runs[-1]["machine"])
        + _threads_fact(runs, cells)
        + _measured_fact(runs, cells)
        + [
            ("commits", ", ".join(dict.fromkeys(_commit_text(run) for run in runs))),
            ("run dates", dates[0] if dates[0] == dates[-1] else f"{dates[0]} to {dates[-1]}"),
        ]
    )
    reasons = [(f"reasons {when}", f"metrics.throttle_{when}.reasons", text) for when in ("before", "after")]
    throttled_table = table("Throttled cells", throttled, [("scenario", "scenario", text), *cell_columns(cells), *reasons]) if len(throttled) else None
    return MachineSection(name, facts, [_run_view(run) for run in runs], throttled_table, len(throttled))


def machine_sections(cells: pd.DataFrame, runs: list[dict]) -> list[MachineSection]:
    names = dict(zip(cells["machine_key"], cells["machine"]))
    sections = []
    for key, name in names.items():
        own = [run for run in runs if run["machine"]["machine_id"] == key]
        sections.append(_machine_section(name, own, cells[cells["machine_key"] == key]))
    return sections

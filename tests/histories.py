"""Histories built from real results lines: a results file measured on the development VM
(reports/examples/), copied to each commit of a scratch git repository and each machine, its
timings scaled by a chosen factor and ±3 % noise (fixed seeds)."""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
from helpers import git

from harness.results import TIMINGS, read_records

ROOT = Path(__file__).parents[1]
TEMPLATE = ROOT / "reports" / "examples" / "cpu-dev-vm" / "cuda-variants-20261205T083558Z.jsonl"
#: The template's cells a history holds: softmax forward, train and decode, linear forward (index in the file's ok cells).
CELLS = (0, 2, 4, 6)
MACHINES = {"box-a": "aaaaaaaaaaaaaaaa", "box-b": "bbbbbbbbbbbbbbbb"}
NOISE = 0.03


def repository(path: Path, commits: int) -> list[str]:
    """A scratch git repository of ``commits`` empty commits; their hashes, oldest first."""
    path.mkdir(parents=True)
    git(path, "init", "-q")
    for number in range(commits):
        git(path, "commit", "-q", "--allow-empty", "-m", f"commit {number}")
    return git(path, "rev-list", "--reverse", "HEAD").split()


def template() -> tuple[dict, list[dict]]:
    records = read_records(TEMPLATE)
    ok = [record for record in records if record["kind"] == "cell" and record["status"] == "ok"]
    return records[0], [ok[index] for index in CELLS]


def scaled(metrics: dict, factor: float) -> dict:
    """``metrics`` with every timing multiplied by ``factor``."""
    out = dict(metrics)
    for name in TIMINGS:
        if name in out:
            out[name] = [value * factor for value in out[name]] if isinstance(out[name], list) else out[name] * factor
    return out


def write_history(
    out: Path, commits: list[str | None], factor: Callable[[int, str, int], float], *, seed: int = 0, machines: dict = MACHINES, scenario: str | None = None
) -> Path:
    """One results file per commit and machine in ``out``: the template's run line and ``CELLS``, the
    timings of cell ``c`` at commit ``i`` on machine ``m`` scaled by ``factor(i, m, c)`` and ±3 % noise."""
    run, cells = template()
    rng = np.random.default_rng(seed)
    start = dt.datetime(2026, 11, 1, tzinfo=dt.timezone.utc)
    out.mkdir(parents=True, exist_ok=True)
    for number, commit in enumerate(commits):
        for name, machine_id in machines.items():
            run_id = uuid.uuid4().hex
            started = (start + dt.timedelta(days=number)).isoformat(timespec="seconds")
            machine = {**run["machine"], "hostname": name, "machine_id": machine_id, "git": {"commit": commit, "dirty": False, "describe": None}}
            lines = [{**run, "run_id": run_id, "started_at": started, "machine": machine, "commit": commit, **({"scenario": scenario} if scenario else {})}]
            for index, cell in enumerate(cells):
                noise = 1 + rng.uniform(-NOISE, NOISE)
                cell_started = (start + dt.timedelta(days=number, seconds=index)).isoformat(timespec="seconds")
                lines.append(
                    {
                        **cell,
                        "run_id": run_id,
                        "machine_id": machine_id,
                        "commit": commit,
                        "started_at": cell_started,
                        "metrics": scaled(cell["metrics"], factor(number, name, index) * noise),
                        **({"scenario": scenario} if scenario else {}),
                    }
                )
            (out / f"{name}-{number:02d}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return out

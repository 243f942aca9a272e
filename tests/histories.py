"""Histories built from real results lines: a results file measured on the development VM
(reports/examples/), copied to each commit of a scratch git repository and each machine, its
timings scaled by a chosen factor and ±3 % noise (fixed seeds); or, for rates and scale, any number
of cells each a series of given log times (``write_series``). Run as a script it writes a large
history to time ``attnbench history`` on (docs/history.md):

    python tests/histories.py DIR --commits 500 --cells 40 --machines 3
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))  # helpers, when run as a script
from helpers import git  # noqa: E402

from harness.results import TIMINGS, read_records  # noqa: E402

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


def write_series(out: Path, commits: list[str], log_times: np.ndarray, *, rel_ci: float = 0.005, names=("box-a", "box-b", "box-c")) -> Path:
    """One results file per commit and machine in ``out``: cell ``c`` (the template's first cell, at batch ``c + 1``) at
    commit ``i`` on machine ``m`` timed at the template's time x exp(``log_times[i, m, c]``), its interval ``rel_ci``
    (its median and interval only: the fields a history reads)."""
    run, (cell, *_) = template()
    start = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    out.mkdir(parents=True, exist_ok=True)
    for number, commit in enumerate(commits):
        for m, name in enumerate(names[: log_times.shape[1]]):
            machine_id, run_id = f"{m:016x}", uuid.uuid4().hex
            started = (start + dt.timedelta(hours=number)).isoformat(timespec="seconds")
            machine = {**run["machine"], "hostname": name, "machine_id": machine_id, "git": {"commit": commit, "dirty": False, "describe": None}}
            lines = [{**run, "run_id": run_id, "started_at": started, "machine": machine, "commit": commit}]
            for c, log_time in enumerate(log_times[number, m]):
                metrics = {"median_s": cell["metrics"]["median_s"] * float(np.exp(log_time)), "rel_ci": rel_ci, "unstable": False}
                axes = {**cell["axes"], "batch": c + 1}
                lines.append({**cell, "cell_id": f"{c:016x}", "axes": axes, "run_id": run_id, "machine_id": machine_id, "commit": commit,
                              "started_at": started, "metrics": metrics})  # fmt: skip
            (out / f"{name}-{number:05d}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return out


def two_levels(rng: np.random.Generator, shape) -> np.ndarray:
    """Log times on one of two levels 10 % apart at random, 1 % scatter about each (a GPU's two clock states)."""
    return np.log(1.1) * rng.integers(0, 2, shape) + rng.normal(0.0, 0.01, shape)


def main() -> None:
    """A large history: two-level noise in every cell, one cell 20 % slower from the middle commit on the first machine."""
    parser = argparse.ArgumentParser(description="write a large synthetic history (a scratch repository and its results files)")
    parser.add_argument("out", type=Path)
    parser.add_argument("--commits", type=int, default=500)
    parser.add_argument("--cells", type=int, default=40)
    parser.add_argument("--machines", type=int, default=3)
    parser.add_argument(
        "--no-repo", action="store_true", help="made-up commits, ordered by their runs' start time (a repository of 10,000 commits takes minutes)"
    )
    args = parser.parse_args()
    commits = [f"{number:040x}"[::-1] for number in range(args.commits)] if args.no_repo else repository(args.out / "repo", args.commits)
    log_times = two_levels(np.random.default_rng(0), (args.commits, args.machines, args.cells))
    log_times[args.commits // 2 :, 0, 0] += np.log(1.2)
    write_series(args.out / "results", commits, log_times)
    repo = [] if args.no_repo else ["--repo", str(args.out / "repo")]
    print(shlex.join(["attnbench", "history", str(args.out / "results"), *repo, "--out", str(args.out / "page")]))


if __name__ == "__main__":
    main()

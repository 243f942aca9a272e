"""Fixtures of the harness tests: a run that tests of several modules read, measured once a session."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import attnbench


@dataclass(frozen=True)
class Measured:
    """The ``attnbench run`` arguments of a run (without ``--out`` and ``--executor``) and its results directory."""

    args: tuple[str, ...]
    out: Path


#: The shipped smoke scenario's ci preset, exactly 2 samples a cell, its 36 cells in one worker (a fresh worker a CPU
#: cell, the main job's default, is for exact peak memory and costs 2-3 s a cell, more than the rest of the run).
SMOKE_CI = ("smoke-cpu", "--preset", "ci", "--set", "measure.repeats=2", "--set", "measure.target_rel_ci=null", "--set", "measure.fresh_worker=false")


@pytest.fixture(scope="session")
def smoke_ci(tmp_path_factory) -> Measured:
    """``SMOKE_CI`` measured by the local executor, once for test_runner's end-to-end check and
    test_ray's local side. Its runs directory is its own, as each test's (tests/conftest.py)."""
    root = tmp_path_factory.mktemp("smoke-ci")
    done = attnbench("run", *SMOKE_CI, "--out", str(root / "local"), "--no-progress", env={"ATTNBENCH_RUNS_DIR": str(root / "runs")})
    assert done.returncode == 0, done.stderr
    return Measured(SMOKE_CI, root / "local")

"""Fixtures of every test: the interpreter for Triton kernels without a GPU, a fresh seed per
test, the thread count restored, a runs directory of its own. Helpers the tests import live in tests/helpers.py."""

from __future__ import annotations

import os
import random

import pytest
import torch

# Triton decides when its kernels are imported whether they run natively or through its
# interpreter; without a GPU, every kernel test runs through the interpreter on the CPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A pytest-xdist worker (nox -s tests: one a core) computes on one thread: two workers' OpenMP threads on two cores
# wait for each other (637 variant tests: 44 s with two threads a worker, 15 s with one). The serial phase keeps all.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def keep_thread_count():
    """Tests that run with ``threads=1`` must not leave the rest of the session on one thread."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def seed(request) -> int:
    """A fresh seed per test (or ATTNBENCH_TEST_SEED), shown in the report when a test fails."""
    value = int(os.environ.get("ATTNBENCH_TEST_SEED", random.randrange(2**31)))
    request.node.user_properties.append(("seed", value))
    return value


@pytest.fixture(autouse=True)
def own_runs_directory(tmp_path_factory, monkeypatch):
    """Runs started by a test announce themselves in a directory of the test's own
    (``ATTNBENCH_RUNS_DIR``), so a test's output never depends on other attnbench runs on the
    machine (another suite, a benchmark beside it)."""
    monkeypatch.setenv("ATTNBENCH_RUNS_DIR", str(tmp_path_factory.mktemp("runs")))

"""Fixtures of every test: the interpreter for Triton kernels without a GPU, a fresh seed per
test, the thread count restored. Helpers the tests import live in tests/helpers.py."""

from __future__ import annotations

import os
import random

import pytest
import torch

# Triton decides when its kernels are imported whether they run natively or through its
# interpreter; without a GPU, every kernel test runs through the interpreter on the CPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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

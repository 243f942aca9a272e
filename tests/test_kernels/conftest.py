"""Where the kernel tests run: ``ATTNBENCH_TEST_DEVICE=cpu`` (the default: Triton's interpreter on the
CPU, TRITON_INTERPRET=1, set here before any kernel module is imported) or ``ATTNBENCH_TEST_DEVICE=cuda``
(the kernels compiled natively for the GPU: ``ATTNBENCH_TEST_DEVICE=cuda pytest tests/test_kernels``).
The test modules read the same variable (``DEVICE`` below, default "cpu"). The report's header names the Triton
and numpy that ran (the kernels are checked under the oldest and the newest supported Triton: ``nox -s triton-versions``)."""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = os.environ.get("ATTNBENCH_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
elif DEVICE == "cuda":
    if not torch.cuda.is_available():
        raise pytest.UsageError("ATTNBENCH_TEST_DEVICE=cuda, but torch sees no CUDA device")
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise pytest.UsageError("ATTNBENCH_TEST_DEVICE=cuda runs the kernels natively: unset TRITON_INTERPRET (it is 1)")
else:
    raise pytest.UsageError(f"ATTNBENCH_TEST_DEVICE must be 'cpu' (Triton's interpreter) or 'cuda', got {DEVICE!r}")


def pytest_report_header(config) -> str:
    import numpy
    import triton

    where = "its interpreter on the CPU" if DEVICE == "cpu" else "natively on CUDA"
    return f"kernels: triton {triton.__version__} ({where}), numpy {numpy.__version__}, torch {torch.__version__}"

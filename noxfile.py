"""nox sessions: ``nox -s tests`` (the default), ``nox -s demo``, ``nox -s microbench``, ``nox -s perf_cpu``.

Every session installs attnbench into its own virtual environment. PyTorch comes from the
spec in ATTNBENCH_TORCH (default ``torch>=2.4``); CI sets ``ATTNBENCH_TORCH=torch==2.13.0``
to take the CPU build, and a CUDA machine can name its own build there.
"""

import os

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

TORCH = os.environ.get("ATTNBENCH_TORCH", "torch>=2.4")


def install(session, extras: str = "test") -> None:
    session.install(TORCH)
    session.install("-e", f".[{extras}]")


@nox.session
def tests(session):
    """The test suite (micro-benchmarks run once each, untimed)."""
    install(session)
    session.run("pytest", "-q", "--benchmark-disable", *session.posargs)


@nox.session
def demo(session):
    """The main job for now: every variant's forms on the CPU, checked and timed."""
    install(session)
    session.run("attnbench", "demo", *session.posargs)


@nox.session
def microbench(session):
    """pytest-benchmark micro-benchmarks of each variant's parallel form and decode step."""
    install(session)
    session.run("pytest", "tests/test_microbench.py", "--benchmark-only", "--benchmark-sort=name", *session.posargs)


@nox.session(name="perf_cpu")
def perf_cpu(session):
    """The tokens/s table of docs/performance.md (chunked forms vs SDPA and the token loop)."""
    install(session)
    session.run("python", "benchmarks/cpu_throughput.py", *session.posargs)

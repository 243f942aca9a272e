"""nox sessions. A bare ``nox`` runs only ``tests``; the benchmarks are named explicitly.

- ``tests``: the test suite (micro-benchmarks run once each, untimed).
- ``tests-cuda-build``: the device-facing test modules under a CUDA build of torch, with or without a GPU.
- ``run``: the main job, ``attnbench run`` on the default set (smoke-cpu on a CPU machine,
  the GPU set where CUDA is present); posargs go to ``attnbench run``.
- ``bench-cpu`` / ``bench-gpu``: every shipped speed scenario on the CPU / on a CUDA GPU; ``bench-gpu-quick``: the
  quick form on a GPU (the ``gpu-quick`` presets, a few minutes).
- ``gpu-check``: ``attnbench gpu-check`` (the first command on a GPU machine) in its own virtual
  environment; on the GPU machine itself ``attnbench gpu-check`` needs neither nox nor internet.
- ``triton-versions``: the Triton kernels under the oldest and the newest supported Triton
  (``TRITON_VERSIONS``): the kernel tests through the interpreter and a sample of ``attnbench kernels``.
- ``report``: an HTML report from results files (default: results/ -> reports/latest/).
- ``regress``: ``attnbench regress`` (posargs: ``--base REV [--head REV] [SCENARIO] ...``),
  two git revisions checked and benchmarked in one interleaved run.
- ``microbench``, ``perf_cpu``, ``demo``, ``lint``.

Every session installs attnbench into its own virtual environment. PyTorch comes from the
spec in ATTNBENCH_TORCH (default ``torch>=2.4``); CI sets ``ATTNBENCH_TORCH=torch==2.13.0``
to take the CPU build, and a CUDA machine can name its own build there. ``tests-cuda-build`` takes its torch from
ATTNBENCH_TORCH_CUDA (default: the same ``torch>=2.4``, a CUDA build on Linux x86-64); CI pins ``torch==2.14.1``.
"""

import os
import shutil

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

DEFAULT_TORCH = "torch>=2.4"
TORCH = os.environ.get("ATTNBENCH_TORCH", DEFAULT_TORCH)
#: The torch of ``tests-cuda-build``: $ATTNBENCH_TORCH_CUDA, else the default spec, which pip answers with a CUDA build on
#: Linux x86-64 (PyPI's torch wheels there are CUDA builds); the session refuses a CPU build (what other platforms get).
TORCH_CUDA = os.environ.get("ATTNBENCH_TORCH_CUDA", DEFAULT_TORCH)
#: The test modules that meet torch's CUDA detection: the machine's fingerprint, gpu-check, cuda:N devices, the kit, the
#: estimate of the GPU present, the timers. ``tests-cuda-build`` runs them under a CUDA build of torch.
DEVICE_TESTS = [f"tests/test_harness/test_{name}.py" for name in ("machine", "gpu_check", "devices", "kit", "estimate", "measure")]
SPEED_SCENARIOS = ["seq-sweep", "d-dot-sweep", "decode", "paper-small-lm"]
#: The oldest Triton the kernels support (pyproject: triton>=3.6; torch 2.11 pins it) and the newest checked.
TRITON_VERSIONS = ["3.6.0", "3.9.0"]
#: The sample of ``attnbench kernels`` that ``triton-versions`` compiles: one target, a 16-bit and the fp32 path.
KERNEL_SAMPLE = ["--arch", "sm_90", "--dtype", "bf16,fp32", "--d", "64", "--chunk", "64"]
CUDA_CHECK = (
    "import sys, torch; ok = torch.cuda.is_available(); "
    "print('CUDA:', torch.cuda.get_device_name(0) if ok else 'none', '| torch', torch.__version__); "
    "sys.exit(0 if ok else 'bench-gpu: this torch build sees no CUDA GPU; set ATTNBENCH_TORCH to a CUDA build of torch')"
)
CUDA_BUILD_CHECK = (
    "import sys, torch; print('torch', torch.__version__, '| CUDA', torch.version.cuda, '| GPU', torch.cuda.is_available()); "
    "sys.exit(None if torch.version.cuda else f'tests-cuda-build: torch {torch.__version__} is a CPU build; set ATTNBENCH_TORCH_CUDA to a CUDA build')"
)


#: The phases of ``nox -s tests``: (pytest options, marker expression). ``serial``: pyproject.toml's marker.
TEST_PHASES = {
    "parallel": (["-n", "auto", "--dist", "worksteal"], "not serial"),
    "serial": ([], "serial"),
}
TEST_OPTIONS = ["-q", "--benchmark-disable", "--durations=20"]


def _split_marks(args: list[str]) -> tuple[list[str], list[str]]:
    """(the marker expressions of ``-m EXPR`` in ``args``, the other arguments)."""
    marks, rest, it = [], [], iter(args)
    for arg in it:
        if arg == "-m":
            marks.append(next(it, ""))
        else:
            rest.append(arg)
    return marks, rest


def install(session, extras: str = "test,triton", torch: str = TORCH) -> None:
    session.install(torch)
    session.install("-e", f".[{extras}]")


@nox.session
def tests(session):
    """The test suite in two phases, each ending with its 20 slowest tests: those that do not mind company on every
    core (pytest-xdist), then the ``serial`` ones, whose verdict a test beside them could change (timings, the machine's
    load, Ray), one at a time. Both phases always run; posargs go to both (``-- -m "not slow"``: the quick loop)."""
    install(session, "test,triton,images,ray,fla")
    marks, rest = _split_marks(session.posargs)
    failed = []
    for name, (options, mark) in TEST_PHASES.items():
        try:  # exit code 5: the posargs selected none of this phase's tests
            session.run("pytest", *options, "-m", " and ".join(f"({m})" for m in (mark, *marks)), *rest, *TEST_OPTIONS, success_codes=[0, 5])
        except nox.command.CommandFailed:
            failed.append(name)
    if failed:
        session.error(f"tests failed in the {' and the '.join(failed)} phase")


@nox.session(name="tests-cuda-build")
def tests_cuda_build(session):
    """``DEVICE_TESTS`` (not the slow ones) under a CUDA build of torch (``TORCH_CUDA``), GPU or none: the build pip takes
    for the default spec on Linux x86-64, which ``tests`` in CI (the CPU build it pins) never sees. Posargs go to pytest."""
    install(session, "test,triton,fla", torch=TORCH_CUDA)
    session.run("python", "-c", CUDA_BUILD_CHECK)
    session.run("pytest", "-m", "not slow", *TEST_OPTIONS, *DEVICE_TESTS, *session.posargs)


@nox.session
def run(session):
    """The main job: attnbench run (default set; results under results/), then the HTML report of
    that run in reports/latest/ (its index.html printed last)."""
    install(session)
    session.run("attnbench", "run", "--report", "reports/latest", *session.posargs)


@nox.session(name="bench-cpu")
def bench_cpu(session):
    """Every shipped scenario on the CPU (smoke-cpu and the speed scenarios, default presets)."""
    install(session)
    session.run("attnbench", "run", "smoke-cpu", *SPEED_SCENARIOS, *session.posargs)


def bench_on_gpu(session, preset: str) -> None:
    """The speed scenarios at ``preset`` on a CUDA machine (``-- --dry-run``: their cells and estimated durations only)."""
    if shutil.which("nvidia-smi") is None:
        session.error(f"{session.name} needs a CUDA GPU and its driver (nvidia-smi not found); on this machine use nox -s bench-cpu")
    install(session)
    session.run("python", "-c", CUDA_CHECK)
    session.run("attnbench", "run", *SPEED_SCENARIOS, "--preset", preset, *session.posargs)


@nox.session(name="bench-gpu")
def bench_gpu(session):
    """The speed scenarios with their gpu presets, on a CUDA machine (730 cells; about 36 minutes on an H100 by the
    cost model: docs/performance.md, "Estimated sweep durations"). Posargs go to attnbench run, e.g. --budget 30m."""
    bench_on_gpu(session, "gpu")


@nox.session(name="bench-gpu-quick")
def bench_gpu_quick(session):
    """The quick form of bench-gpu: the gpu-quick presets, every core variant in a few minutes on an H100 by the cost model."""
    bench_on_gpu(session, "gpu-quick")


@nox.session(name="gpu-check")
def gpu_check(session):
    """``attnbench gpu-check`` in a fresh virtual environment with torch from ATTNBENCH_TORCH (posargs go
    to it: its directory, --dry-run, ...). The primary way is ``attnbench gpu-check`` itself, with the
    machine's own torch and triton, offline (README, "First contact with a GPU")."""
    install(session, "test,triton,fla")
    session.run("attnbench", "gpu-check", *session.posargs)


@nox.session(name="triton-versions")
@nox.parametrize("triton", TRITON_VERSIONS)
def triton_versions(session, triton):
    """The Triton kernels under each of ``TRITON_VERSIONS``: tests/test_kernels through the interpreter (the slow
    compile tests left out) and ``KERNEL_SAMPLE`` compiled (no GPU needed). That Triton is installed after torch,
    without dependencies, since a torch build pins its own; ``-s "triton-versions(triton='3.6.0')"`` runs one."""
    session.install(TORCH)
    session.install("--no-deps", f"triton=={triton}")
    session.install("-e", ".[test]")
    session.run("python", "-c", f"import triton; assert triton.__version__ == {triton!r}, triton.__version__")
    session.run("pytest", "-q", "-m", "not slow", "tests/test_kernels", *session.posargs, env={"ATTNBENCH_TEST_DEVICE": "cpu"})
    session.run("attnbench", "kernels", *KERNEL_SAMPLE)


@nox.session
def report(session):
    """attnbench report: posargs are results files and -o DIR (default: results/ -> reports/latest/)."""
    install(session)
    session.run("attnbench", "report", *(session.posargs or ["results", "-o", "reports/latest"]))


@nox.session
def regress(session):
    """attnbench regress: posargs are --base REV [--head REV] [SCENARIO] [--all-variants] ... (docs/regress.md)."""
    if not session.posargs:
        session.error("regress needs the base revision: nox -s regress -- --base REV [--head REV] [SCENARIO]")
    install(session)
    session.run("attnbench", "regress", *session.posargs)


@nox.session
def demo(session):
    """Every variant's forms on the CPU, checked against float64 and timed."""
    install(session)
    session.run("attnbench", "demo", *session.posargs)


@nox.session
def microbench(session):
    """pytest-benchmark micro-benchmarks of each variant's parallel form and decode step."""
    install(session)
    session.run("pytest", "tests/test_harness/test_microbench.py", "--benchmark-only", "--benchmark-sort=name", *session.posargs)


@nox.session(name="perf_cpu")
def perf_cpu(session):
    """The tokens/s table of docs/performance.md (chunked forms vs SDPA and the token loop)."""
    install(session)
    session.run("python", "benchmarks/cpu_throughput.py", *session.posargs)


@nox.session
def lint(session):
    """ruff over the whole tree: the lint rules and the formatting."""
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")

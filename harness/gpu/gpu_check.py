"""``attnbench gpu-check [DIR]``: the first command on a GPU machine, with the Python, torch and
triton already installed there, offline.

First it checks what it needs (``missing``: a CUDA build of torch that sees a GPU, triton, the
other packages attnbench imports, pytest and the kernel tests, the WikiText-2 of its LM cell) and
stops with one line per missing thing (exit code 2). Then the checks (``CHECKS``), in order:

1. ``kernel-tests``: ``pytest tests/test_kernels -m "not slow"`` with ``ATTNBENCH_TEST_DEVICE=cuda``,
   every kernel compiled natively and checked against float64 (JUnit XML in DIR); a failure
   stops the check: wrong kernels are not worth timing;
2. ``timing``: ``attnbench run gpu-check``, the kernels against SDPA, the torch forms and fla;
3. ``lm``: ``attnbench run quality/lm-wikitext --preset ci`` on CUDA;
4. ``report``: the HTML report of both results files in DIR/report.

DIR/summary.json holds each check's status and seconds, the time ratios of the kernels at the
largest T (``ratios``), the machine's GPU, driver and versions, and the plan. Exit code 0 when
every check passed, 1 when one failed. ``plan`` estimates each phase's seconds from the
scenarios' cells (``harness.running.estimate``, the one cost model) and ``COSTS`` (``attnbench gpu-check --dry-run``
prints it, without a GPU).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

EXIT_OK, EXIT_FAILED, EXIT_MISSING = 0, 1, 2
#: Minutes the whole check should take on one H100-class GPU.
BUDGET_S = 8 * 60
TIMING = ("gpu-check", None, [])
LM = ("quality/lm-wikitext", "ci", ["device=cuda"])
LM_DATA = "wikitext-2"  # the data set the LM task reads (harness.tasks.lm)
CHECKS = ("kernel-tests", "timing", "lm", "report")
KERNEL_TESTS = Path("tests") / "test_kernels"
PYTEST_ARGS = ("-m", "not slow", "-q", "-p", "no:cacheprovider")
#: A line of ``pytest --collect-only -q`` that is a test's node id (not a warning that quotes one).
NODE_ID = re.compile(r"\S+\.py::\S")
#: At most this many pytest processes share the kernel tests (compiling is single-threaded per process).
KERNEL_TEST_WORKERS = 8


@dataclass(frozen=True)
class Costs:
    """The terms of the plan that are gpu-check's own, in seconds, for one H100-class GPU and a cold Triton cache;
    its scenarios' cells are estimated by attnbench's one cost model (``harness.running.estimate``). Design estimates,
    except where a comment says measured (on an H200, 2026-12-04: docs/performance.md, "First GPU contact")."""

    preflight_s: float = 10.0  # import torch, start CUDA, fingerprint the machine, look up the data
    pytest_start_s: float = 8.0  # pytest imports torch and triton, collects the kernel tests
    #: one native kernel test, its compilations and autotuning included (measured on the H200, 2026-12-04, second
    #: session: 475 s of test time for the 140 tests, with a cold Triton cache)
    test_s: float = 3.4
    #: the slowest of the contiguous blocks of tests against their mean (measured: 133 s against 59 s)
    block_imbalance: float = 2.2
    kernel_test_workers: int = KERNEL_TEST_WORKERS  # pytest processes at once: a GPU host has 8 cores or more
    data_s: float = 6.0  # WikiText-2 tokenised on first use, cached afterwards (measured: 5.3 s on the 2-core development VM)
    report_s: float = 20.0  # the HTML report of about 40 cells (measured: 8 s for 8 cells on the 2-core development VM)


COSTS = Costs()


@dataclass
class Phase:
    """One phase of the plan: what it runs (``units``, e.g. "60 cells") and its estimated seconds."""

    name: str
    units: str
    seconds: float


@dataclass
class Check:
    """The outcome of one check: ``passed``, ``failed`` or ``skipped`` (with why), its seconds."""

    name: str
    status: str
    seconds: float = 0.0
    detail: str = ""
    command: list = field(default_factory=list)


def default_dir() -> Path:
    return Path("results") / f"gpu-check-{dt.datetime.now(dt.timezone.utc).strftime('%Y%m%dT%H%M%SZ')}"


def kernel_tests_dir() -> Path | None:
    """The kernel tests: beside the ``harness`` package (a checkout, or an editable install), else in
    the current directory (a checkout next to an installed wheel); None where neither has them."""
    for root in (Path(__file__).resolve().parents[2], Path.cwd()):
        if (root / KERNEL_TESTS).is_dir():
            return root / KERNEL_TESTS
    return None


# --- what the check needs ----------------------------------------------------------------------


def missing(kernel_tests: bool = True) -> list[str]:
    """One line for each thing the check needs and lacks, saying how to get it (empty: all there)."""
    lines = _missing_torch() + _missing_packages(kernel_tests)
    if kernel_tests and kernel_tests_dir() is None:
        lines.append(
            f"the kernel tests ({KERNEL_TESTS}) are neither beside attnbench nor in {Path.cwd()} (an installed wheel has none); "
            "run gpu-check from a checkout of attnbench, or pass --no-kernel-tests"
        )
    if not lines:  # the data lookup needs the scenario module, hence pydantic
        lines += _missing_data()
    return lines


def _missing_torch() -> list[str]:
    import torch

    if torch.version.cuda is None:
        return [f"torch {torch.__version__} is a CPU build and sees no CUDA GPU; install a CUDA build of torch"]
    if not torch.cuda.is_available():
        return [f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA GPU; check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES"]
    return []


def _missing_packages(kernel_tests: bool) -> list[str]:
    """attnbench's own requirements (its package metadata), triton and, for the kernel tests, pytest."""
    needed = {"triton": "install the triton your torch build pins (pip show torch names it)"}
    if kernel_tests:
        needed["pytest"] = "install attnbench's test extra: pip install 'attnbench[test]', offline from a kit (attnbench kit)"
    for name, spec in _requirements().items():
        needed.setdefault(name, f"pip install '{spec}', offline from a kit (attnbench kit)")
    lines = [f"{name} is not installed; {how}" for name, how in needed.items() if installed_version(name) is None]
    if os.environ.get("TRITON_INTERPRET") == "1":
        lines.append("TRITON_INTERPRET=1 is set, so the kernels would run in Triton's interpreter; unset it")
    return lines


def _requirements() -> dict[str, str]:
    """attnbench's required (not extra) distributions, name -> requirement, as its installed metadata
    lists them (none where attnbench runs from a checkout without being installed)."""
    try:
        requires = importlib.metadata.requires("attnbench") or []
    except importlib.metadata.PackageNotFoundError:
        return {}
    return {re.match(r"[A-Za-z0-9_.-]+", spec).group(0): spec for spec in requires if "extra ==" not in spec}


def quality_data() -> dict[str, Path]:
    """The data sets of the check's quality cells and where they are, looked up as their task looks
    them up (task.data, then $ATTNBENCH_DATA, then the shared data); a DataError names the directory
    searched and the files missing."""
    from ..scenarios.scenario import load_scenario
    from ..tasks.download import dataset_dir

    first = load_scenario(LM[0], preset=LM[1], overrides=LM[2]).cells()[0]  # the preset's cells share one task section
    return {LM_DATA: dataset_dir(LM_DATA, first.task.get("data"))}


def _missing_data() -> list[str]:
    from ..tasks.download import DataError

    try:
        quality_data()
    except DataError as exc:
        return [f"WikiText-2, the data of its LM cell, is not here: {exc} Or carry it from a machine that has it: attnbench kit"]
    return []


# --- the plan ----------------------------------------------------------------------------------


def plan(kernel_tests: bool = True, costs: Costs = COSTS, gpu: str | None = None) -> list[Phase]:
    """The estimated seconds of each phase: the cells of both scenarios as they expand, estimated on ``gpu``
    (default: the GPU present, else an H100: ``harness.running.estimate``), the kernel tests as pytest collects them, and ``costs``."""
    from ..running.estimate import Estimator, roofs_for
    from ..scenarios.scenario import load_scenario

    timing = load_scenario(TIMING[0], preset=TIMING[1], overrides=TIMING[2]).cells()
    lm = load_scenario(LM[0], preset=LM[1], overrides=LM[2]).cells()
    estimator = Estimator(roofs_for(timing + lm, gpu))
    phases = [Phase("preflight", "", costs.preflight_s)]
    if kernel_tests:
        try:
            tests = len(collect_kernel_tests())
        except CollectionError as exc:
            tests = 0
            print(f"gpu-check: {exc}", file=sys.stderr)
        units = f"{tests} tests in {costs.kernel_test_workers} pytest processes"
        slowest_block = costs.block_imbalance * tests * costs.test_s / costs.kernel_test_workers
        phases.append(Phase("kernel-tests", units, costs.pytest_start_s + slowest_block))
    cells = estimator.sweep(timing)
    units = f"{len(cells.measured)} cells ({len(timing) - len(cells.measured)} skipped), {len(cells.first_uses())} kernel first uses"
    phases.append(Phase("timing", units, cells.seconds()))
    phases.append(Phase("lm", f"{len(lm)} cells", costs.data_s + estimator.sweep(lm).seconds()))
    phases.append(Phase("report", "", costs.report_s))
    return phases


class CollectionError(RuntimeError):
    """pytest could not collect the kernel tests (a module failed to import or to parametrize)."""


def collect_kernel_tests(device: str = "cpu") -> list[str]:
    """The node ids of the non-slow kernel tests (none without the tests), collected by pytest in a
    subprocess with ``ATTNBENCH_TEST_DEVICE=device`` (their conftest picks Triton's interpreter for "cpu").
    A module pytest cannot collect is a CollectionError with pytest's error lines: a check that silently
    ran the tests it could collect would pass without the kernels' own tests."""
    tests = kernel_tests_dir()
    if tests is None:
        return []
    done = subprocess.run(
        [sys.executable, "-m", "pytest", str(tests), *PYTEST_ARGS, "--collect-only"],
        capture_output=True,
        text=True,
        env=_test_env(device),
        cwd=tests.parents[1],
    )
    if done.returncode not in (0, 5):  # 5: nothing collected
        errors = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith(("ERROR", "E "))]
        raise CollectionError(f"pytest could not collect the kernel tests (exit code {done.returncode}): " + " | ".join(errors[:6] or ["no error lines"]))
    return [line.strip() for line in done.stdout.splitlines() if NODE_ID.match(line.strip())]


def _test_env(device: str) -> dict:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    return env | {"ATTNBENCH_TEST_DEVICE": device}


def format_plan(phases: list[Phase]) -> str:
    total = sum(phase.seconds for phase in phases)
    lines = [f"gpu-check plan: estimated for one H100-class GPU with a cold Triton cache (a design estimate; budget {BUDGET_S} s)"]
    lines += [f"  {phase.name:<13} {phase.seconds:6.0f} s  {phase.units}" for phase in phases]
    lines.append(f"  {'total':<13} {total:6.0f} s  ({'within' if total <= BUDGET_S else 'OVER'} the budget)")
    return "\n".join(lines)


# --- the checks --------------------------------------------------------------------------------


def run_check(out: Path, *, kernel_tests: bool = True, progress: bool = True, keep_going: bool = False) -> int:
    """Run every check into ``out``, write ``out/summary.json``; the exit code (``EXIT_*``). A failed kernel
    test skips the rest, unless ``keep_going`` (the exit code still says it failed)."""
    lacking = missing(kernel_tests)
    if lacking:
        for line in lacking:
            print(f"gpu-check: {line}", file=sys.stderr)
        return EXIT_MISSING
    if importlib.util.find_spec("fla") is None:
        print("gpu-check: fla-core is not installed, so the fla cells are skipped (pip install 'attnbench[fla]', or from a kit)", file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    planned = plan(kernel_tests)
    print(format_plan(planned), flush=True)
    started, start = dt.datetime.now(dt.timezone.utc), time.perf_counter()
    checks, results = [], {}
    for name in CHECKS:
        if checks and checks[0].status == "failed" and not keep_going:
            checks.append(Check(name, "skipped", detail="the kernel tests failed: wrong kernels are not worth timing"))
            continue
        print(f"gpu-check: {name} ...", flush=True)
        began = time.perf_counter()
        if name == "kernel-tests":
            check = _kernel_tests(out) if kernel_tests else Check(name, "skipped", detail="--no-kernel-tests")
        elif name == "report":
            check = _report(out, [path for path in results.values() if path is not None])
        else:
            check, results[name] = _run_scenario(name, out, progress)
        check.seconds = round(time.perf_counter() - began, 1)
        print(f"gpu-check: {name} {check.status} in {check.seconds:.0f} s{': ' + check.detail if check.detail else ''}", flush=True)
        checks.append(check)
    code = EXIT_FAILED if any(check.status == "failed" for check in checks) else EXIT_OK
    summary = _summary(checks, results, started, time.perf_counter() - start, code, planned)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"gpu-check: {'passed' if code == EXIT_OK else 'FAILED'} in {summary['seconds']:.0f} s; summary: {out / 'summary.json'}")
    return code


def _kernel_tests(out: Path) -> Check:
    """The non-slow kernel tests compiled natively, split in contiguous blocks over up to
    ``KERNEL_TEST_WORKERS`` pytest processes at once (compiling is the slow part, one core each);
    each block's log and JUnit XML in ``out``."""
    tests = kernel_tests_dir()
    try:
        ids = collect_kernel_tests("cuda")
    except CollectionError as exc:
        return Check("kernel-tests", "failed", detail=str(exc))
    if not ids:
        how = f"ATTNBENCH_TEST_DEVICE=cuda {Path(sys.executable).name} -m pytest {tests} --collect-only"
        return Check("kernel-tests", "failed", detail=f"pytest collected no kernel tests in {tests} ({how} says why)")
    workers = max(1, min(KERNEL_TEST_WORKERS, os.cpu_count() or 1, len(ids)))
    blocks = [ids[len(ids) * i // workers : len(ids) * (i + 1) // workers] for i in range(workers)]
    failed = []
    with contextlib.ExitStack() as logs:
        running = []
        for i, block in enumerate(blocks, 1):
            command = [sys.executable, "-m", "pytest", *PYTEST_ARGS, f"--junitxml={(out / f'kernel-tests-{i}.xml').resolve()}", *block]
            log = logs.enter_context(open(out / f"kernel-tests-{i}.log", "w"))
            running.append((i, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=_test_env("cuda"), cwd=tests.parents[1])))
        for done, (i, process) in enumerate(running, 1):
            code = process.wait()
            print(f"gpu-check: kernel-tests: {done} of {workers} pytest processes done", flush=True)
            if code != 0:
                failed.append(i)
    for i in failed:
        print("\n".join((out / f"kernel-tests-{i}.log").read_text().splitlines()[-15:]), file=sys.stderr)
    where = f"logs and JUnit XML in {out}/kernel-tests-*.log, *.xml"
    if failed:
        return Check("kernel-tests", "failed", detail=f"pytest failed in block(s) {', '.join(map(str, failed))} of {workers}; {where}")
    return Check("kernel-tests", "passed", detail=f"{len(ids)} tests in {workers} pytest processes; {where}")


def _run_scenario(name: str, out: Path, progress: bool) -> tuple[Check, Path | None]:
    """``attnbench run`` of the check's scenario in a subprocess: passed when it exits 0; and its results file."""
    spec, preset, overrides = TIMING if name == "timing" else LM
    command = [sys.executable, "-m", "harness.cli", "run", spec, "--out", str(out)]
    command += (["--preset", preset] if preset else []) + [arg for override in overrides for arg in ("--set", override)]
    command += [] if progress else ["--no-progress"]
    before = set(out.glob("*.jsonl"))
    code = subprocess.run(command).returncode
    written = sorted(set(out.glob("*.jsonl")) - before)
    path = written[-1] if written else None
    statuses = _statuses(path) if path else {}
    counts = ", ".join(f"{count} {status}" for status, count in sorted(statuses.items())) or "no cells"
    check = Check(name, "passed" if code == 0 and path else "failed", detail=f"{counts}; attnbench run exit code {code}; {path}", command=command)
    return check, path


def _statuses(path: Path) -> dict:
    from ..results import read_records

    counts: dict = {}
    for record in read_records(path):
        if record["kind"] == "cell":
            counts[record["status"]] = counts.get(record["status"], 0) + 1
    return counts


def _report(out: Path, paths: list[Path]) -> Check:
    from ..report import build_report

    if not paths:
        return Check("report", "failed", detail="no results file to report")
    try:
        index = build_report(paths, out / "report", title="attnbench gpu-check")
    except (OSError, ValueError) as exc:
        return Check("report", "failed", detail=str(exc))
    return Check("report", "passed", detail=str(index))


# --- the summary -------------------------------------------------------------------------------


def ratios(path: Path) -> dict:
    """Median-time ratios of the Triton kernels at the largest T of ``path``'s ok cells: over the
    torch forms (``triton/torch``), over fla (``triton/fla``) and over SDPA (``triton/sdpa``: the
    softmax cell of the same shape and mode); below 1 the kernel is faster."""
    from ..results import read_records

    cells = [r for r in read_records(path) if r["kind"] == "cell" and r["status"] == "ok" and r["mode"] != "quality"]
    if not cells:
        return {"seq_len": None, "rows": []}
    longest = max(r["axes"]["seq_len"] for r in cells)
    shape = lambda r: (r["mode"], r["axes"]["batch"], r["axes"]["heads"], r["axes"]["d_key"], r["axes"]["dtype"])
    median = {(r["variant"], r["backend"], shape(r)): r["metrics"]["median_s"] for r in cells if r["axes"]["seq_len"] == longest}
    rows = []
    for (variant, backend, key), seconds in sorted(median.items()):
        if backend != "triton":
            continue
        mode, batch, heads, d_key, dtype = key
        row = {"variant": variant, "mode": mode, "batch": batch, "heads": heads, "d_key": d_key, "dtype": dtype, "triton_median_s": seconds}
        for label, other in (("triton/torch", (variant, "torch")), ("triton/fla", (variant, "fla")), ("triton/sdpa", ("softmax", "torch"))):
            baseline = median.get((*other, key))
            row[label] = round(seconds / baseline, 4) if baseline else None
        rows.append(row)
    return {"seq_len": longest, "rows": rows}


def _summary(checks: list[Check], results: dict, started, seconds: float, code: int, planned: list[Phase]) -> dict:
    from ..measuring import machine

    fp = machine.fingerprint("cuda")
    return {
        "passed": code == EXIT_OK,
        "exit_code": code,
        "started_at": started.isoformat(timespec="seconds"),
        "seconds": round(seconds, 1),
        "budget_s": BUDGET_S,
        "checks": [asdict(check) for check in checks],
        "ratios": ratios(results["timing"]) if results.get("timing") else None,
        "results": {name: str(path) for name, path in results.items() if path},
        "machine": {
            "gpu": fp["gpu"],
            "python": fp["python"],
            "hostname": fp["hostname"],
            "git": fp["git"],
            "versions": {**fp["versions"], "fla-core": installed_version("fla-core")},
        },
        "plan": [asdict(phase) for phase in planned],
    }


def installed_version(name: str) -> str | None:
    """The installed version of distribution ``name``, or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None

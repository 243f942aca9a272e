"""What the tests share (imported as ``helpers``; pyproject puts tests/ on the path): the variant
configurations under test, fresh random inputs, the forms-agree checks, the command line in a
subprocess, the shared-data skip, a cell built by hand, scratch git repositories of this project (regress, bisect). Fixtures are in
tests/conftest.py."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

import variants
from harness.scenarios.cell import Cell
from harness.tasks.download import SHARED_DATA
from variants.checking import cast_inputs as to  # noqa: F401 - the tests import it (and make_inputs) from here
from variants.checking import compare_forms, make_inputs  # noqa: F401

#: Skips a test that reads the shared WikiText-2 (``../shared/data`` beside the checkout).
needs_shared = pytest.mark.skipif(
    not (SHARED_DATA / "wikitext-2" / "wiki.train.tokens").is_file(),
    reason=f"the shared WikiText-2 is not at {SHARED_DATA / 'wikitext-2'}",
)


#: Where the Triton kernels run in this session (tests/test_kernels/conftest.py): "cpu", through
#: Triton's interpreter, where one kernel call takes a fraction of a second per program, or "cuda".
KERNEL_DEVICE = os.environ.get("ATTNBENCH_TEST_DEVICE", "cpu")


def slow_when_interpreted(test):
    """Mark ``test`` ``slow`` through Triton's interpreter and leave it unmarked natively (a decorator)."""
    return pytest.mark.slow(test) if KERNEL_DEVICE == "cpu" else test


def slow_interpreted(*values, id: str | None = None):
    """A parameter set of a kernel test that is ``slow`` through Triton's interpreter (seconds there: more
    programs, chunks or dtypes of a code path the quick loop already runs once) and quick natively, so
    the quick loop keeps one case of each path, and the whole suite, CI and ``gpu-check`` run them all.
    Natively it carries no mark (``pytest.param`` refuses a ``usefixtures()`` placeholder: the modules
    would not even collect on a GPU)."""
    return pytest.param(*values, id=id, marks=[pytest.mark.slow] if KERNEL_DEVICE == "cpu" else [])


@contextlib.contextmanager
def within(seconds: int):
    """Fail (instead of hanging the suite) when the body takes longer than ``seconds`` (SIGALRM: main thread only)."""

    def expire(signum, frame):
        raise TimeoutError(f"took more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


class LocalTestExecutor:
    """An executor for the runner's tests, on this machine (its fingerprint, uncalibrated); a subclass's ``measure``
    says what each cell gets."""

    same_machine = True

    def start(self, todo, fingerprint):
        self.machine = {**fingerprint, "calibration": None}
        return [self.machine]


def make_cell(**fields) -> Cell:
    """A cell of a test's own making: a CPU float32 forward core cell of linear attention, with ``fields`` in place."""
    base = dict(scenario="s", variant="linear", backend="torch", backend_options={}, params={}, axes={"device": "cpu", "dtype": "float32"},
                mode="forward", target="core", decode={"new_tokens": 1}, model=None, task=None, measure={"timeout_s": 60}, skip=None)  # fmt: skip
    return Cell(**{**base, **fields})


def attnbench(*args, env=None, **kwargs) -> subprocess.CompletedProcess:
    """``python -m harness.cli ARGS`` in a subprocess, output captured."""
    command = [sys.executable, "-m", "harness.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=300, **kwargs)


def attnbench_here(*args, env=None) -> subprocess.CompletedProcess:
    """``attnbench ARGS`` in this process (``harness.cli.main``: the same exit code and output as the
    command, ``env`` set meanwhile), for a command that stops before it measures: without an
    interpreter's start and its second import of torch, a second or more each in a subprocess."""
    from harness.cli import main

    out, err = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, env or {}), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(["attnbench", *args], code, out.getvalue(), err.getvalue())


#: (variant name, parameters): every registered variant, several settings each
#: (tests/test_variants/test_equivalence.py fails when a registered variant has none).
CONFIGS = [
    ("softmax", {}),
    ("softmax", {"scale": 0.3}),
    ("linear", {}),
    ("linear", {"chunk_size": 16}),
    ("linear", {"phi": "identity", "normalize": False, "chunk_size": 16}),
    ("linear", {"phi": "dpfp", "nu": 2, "sum_norm": True, "chunk_size": 32}),
    ("linear", {"scan": "parallel", "chunk_size": 16}),
    ("performer", {"m": 16, "chunk_size": 16}),
    ("performer", {"d_dot": 10, "seed": 3}),
    ("dpfp", {"nu": 1, "chunk_size": 16}),
    ("dpfp", {"nu": 3, "normalize": False}),
    ("delta", {}),
    ("delta", {"chunk_size": 16}),
    ("delta", {"phi": "identity", "sum_norm": False, "chunk_size": 16}),
    ("delta", {"normalize": True, "chunk_size": 16}),
    ("delta", {"phi": "dpfp", "nu": 2, "chunk_size": 16}),
    ("delta", {"phi": "favor", "m": 8, "normalize": True}),
    ("delta", {"normalize": True, "scan": "parallel", "chunk_size": 16}),
    ("deltanet", {}),
    ("deltanet", {"chunk_size": 16}),
    ("gated_delta", {}),
    ("gated_delta", {"chunk_size": 5}),
    ("gated_delta", {"phi": "elu1", "sum_norm": True, "chunk_size": 16}),
    ("gated_delta", {"scan": "parallel", "chunk_size": 5}),
    ("based", {"chunk_size": 16}),
    ("rebased", {"normalize": False}),
    ("lsh", {"n_buckets": 4, "chunk_size": 256}),
    ("lsh", {"n_rounds": 2, "n_buckets": 6, "chunk_size": 256, "seed": 3}),
    ("rwkv", {}),
    ("rwkv", {"chunk_size": 5}),
]

#: rtol and atol of a form against the float64 reference; atol is scaled by the largest
#: magnitude of the expected tensor (at least 1).
TOLERANCES = {torch.float64: (1e-9, 1e-10), torch.float32: (2e-4, 1e-4)}


def assert_close(actual, expected, dtype, what, seed):
    """``actual`` against ``expected`` with the tolerances of ``dtype``."""
    rtol, atol = TOLERANCES[dtype]
    scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected.to(dtype), rtol=rtol, atol=atol * scale, msg=lambda m: f"{what} (seed {seed}): {m}")


def config_id(config) -> str:
    name, params = config
    return name + "".join(f"-{key}={value}" for key, value in params.items())


def check_forms(core, reference, inputs: dict, dtype, seed, what, *, backward=True, cotangent=None):
    """Every form of ``core`` (in ``dtype``) agrees with ``reference.reference`` in float64 on the same
    ``inputs``, forward and, with ``backward``, every gradient: ``variants.checking.compare_forms``, the
    checker of ``attnbench check`` (a zero reference gradient fails: it would test nothing)."""
    checks = compare_forms(core, reference, inputs, dtype, backward=backward, cotangent=cotangent, seed=seed, label=f"{what} (seed {seed}): ")
    failed = [check.line() for check in checks if not check.ok]
    assert not failed, "\n".join(failed)


def layer_step_loop(layer, x, state=None):
    """An ``AttentionLayer``'s recurrent form over ``x [B, T, D]``, token by token."""
    state = layer.init_state(x.shape[0], dtype=x.dtype) if state is None else state
    outputs = []
    for t in range(x.shape[1]):
        y_t, state = layer.step(x[:, t], state)
        outputs.append(y_t)
    return torch.stack(outputs, dim=1)


def check_layer_forms(layer, x, gen, seed, tol=1e-10) -> dict:
    """A layer's parallel form == its step loop == a prefill chain (6 tokens, 4 more, one step),
    forward and the gradients of ``x`` and every parameter (``x``: 11 tokens or more).
    Returns the parallel form's gradients by name ("x", then the parameter names)."""
    parallel, stepped = layer(x), layer_step_loop(layer, x)
    torch.testing.assert_close(stepped, parallel, rtol=tol, atol=tol, msg=lambda m: f"step loop (seed {seed}): {m}")
    head, state = layer.prefill(x[:, :6])
    middle, state = layer.prefill(x[:, 6:10], state)
    last, _ = layer.step(x[:, 10], state)
    chained = torch.cat([head, middle, last[:, None]], 1)
    torch.testing.assert_close(chained, parallel[:, :11], rtol=tol, atol=tol, msg=lambda m: f"prefill chain (seed {seed}): {m}")
    names, leaves = ["x", *dict(layer.named_parameters())], [x, *layer.parameters()]
    cotangent = torch.randn(parallel.shape, generator=gen, dtype=parallel.dtype)
    grads_parallel = torch.autograd.grad((parallel * cotangent).sum(), leaves)
    grads_step = torch.autograd.grad((stepped * cotangent).sum(), leaves)
    for label, grad_parallel, grad_step in zip(names, grads_parallel, grads_step):
        torch.testing.assert_close(grad_step, grad_parallel, rtol=tol, atol=tol, msg=lambda m: f"d/d{label} (seed {seed}): {m}")
    return dict(zip(names, grads_parallel))


def build(config, d_key, dtype=torch.float64):
    name, params = config
    return variants.create(name, d_key, **params).to(dtype)


ROOT = Path(__file__).resolve().parents[1]


def git(repo: Path, *args: str) -> str:
    """``git -C repo ARGS`` (as a test user), its output; a failure raises."""
    command = ["git", "-C", str(repo), "-c", "user.name=test", "-c", "user.email=test@example.com", *args]
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip()


def project_repository(repo: Path) -> str:
    """A new git repository at ``repo`` holding this project as committed (``git archive HEAD``), its one commit
    "plain" returned; skips the test without git or outside a git checkout."""
    if shutil.which("git") is None or subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("needs git and a git checkout of attnbench")
    repo.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "HEAD"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(repo)], input=archive, check=True)
    git(repo, "init", "-q")
    return commit(repo, "plain")


def commit(repo: Path, message: str) -> str:
    """Commit everything in ``repo``'s working tree; the new commit."""
    git(repo, "add", "--all")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD")


def edit(repo: Path, path: str, old: str, new: str) -> None:
    """Replace the one ``old`` of ``repo/path`` with ``new`` (an assertion names the file when it is not there once)."""
    file = repo / path
    text = file.read_text()
    assert text.count(old) == 1, f"{path} no longer contains {old!r} once: update the test's edit"
    file.write_text(text.replace(old, new))

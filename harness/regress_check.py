"""Correctness check of one revision's variants, run inside that revision's checkout.

``attnbench regress`` (harness.regress) starts this file as a script in a fresh interpreter
whose working directory and ``PYTHONPATH`` are a revision's worktree, so ``import variants``
is that revision's code; this file imports nothing else of attnbench. For every
configuration (variant, backend, parameters, d_key) it compares, in float32 on a small
input, the parallel form (and, when decoding is measured, the recurrent step loop) with the
float64 ``reference`` of the torch backend, forward and every gradient, with the tolerances
of tests/test_backends.py. While it runs it records which files of the checkout executed,
which is how regress knows the variants a diff touches.

    cd WORKTREE && PYTHONPATH=WORKTREE python -c "$RUN_SCRIPT" PATH/regress_check.py < CONFIGS.json

(``harness.regress.RUN_SCRIPT`` runs a file by path without putting its directory on
sys.path) reads a JSON list of configurations on stdin and prints it back on one line, each
configuration with ``ok``, ``problems`` (what disagrees, by how much) and ``files`` (what
ran) added, and ``unsupported`` (the reason) for a backend the variant does not have.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch

BATCH, HEADS, LENGTH = 1, 2, 70  #: longer than one chunk of the default 64, and not a multiple of it
RTOL, ATOL = 2e-4, 1e-4  #: float32 against float64; ATOL is scaled by the largest |expected|


class FileTrace:
    """The files under ``root`` whose Python functions are called inside ``with trace:``
    (``sys.setprofile``; Triton's interpreter runs kernels as Python, so they count too)."""

    def __init__(self, root: Path):
        self.root = str(root) + os.sep
        self.files: set[str] = set()

    def _profile(self, frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(self.root):
            self.files.add(frame.f_code.co_filename[len(self.root) :])

    def __enter__(self):
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)
        return False


def _inputs(core, d_key: int, d_value: int, seed: int):
    """q, k, v, β and the log gate g ≤ 0 (None where the core takes none) in float64, as leaves
    that require grad. Older revisions' cores have no ``needs_gate``: they take no gate."""
    gen = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)
    q, k, v = make(BATCH, HEADS, LENGTH, d_key), make(BATCH, HEADS, LENGTH, d_key), make(BATCH, HEADS, LENGTH, d_value)
    if getattr(core, "phi_name", None) == "identity":  # keeps the plain rules stable, as in tests/conftest.py
        q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    beta = torch.rand(BATCH, HEADS, LENGTH, generator=gen, dtype=torch.float64) if core.needs_beta else None
    gate = -torch.rand(BATCH, HEADS, LENGTH, generator=gen, dtype=torch.float64) if getattr(core, "needs_gate", False) else None
    return [t.requires_grad_() if t is not None else None for t in (q, k, v, beta, gate)]


def _gate(log_gate, suffix: str = "") -> dict:
    """The gate keyword, only for a gated core (older revisions' forms do not take it)."""
    return {} if log_gate is None else {"log_gate" + suffix: log_gate}


def _step_loop(core, q, k, v, beta, log_gate):
    state = core.init_state(q.shape[0], q.shape[1], v.shape[-1], device=q.device, dtype=q.dtype)
    outputs = []
    for t in range(q.shape[2]):
        at_t = lambda x: None if x is None else x[:, :, t]  # noqa: E731
        out, state = core.step(q[:, :, t], k[:, :, t], v[:, :, t], state, beta_t=at_t(beta), **_gate(at_t(log_gate), "_t"))
        outputs.append(out)
    return torch.stack(outputs, dim=2)


def _mismatch(label: str, actual, expected) -> str | None:
    """A problem description when ``actual`` is not ``expected`` within the tolerances."""
    actual, expected = actual.detach().double().cpu(), expected.detach()
    if not torch.isfinite(actual).all():
        return f"{label}: not finite"
    error = (actual - expected).abs()
    allowed = ATOL * max(1.0, expected.abs().max().item()) + RTOL * expected.abs()
    if bool((error > allowed).any()):
        return f"{label}: max |error| {error.max().item():.3g} against the float64 reference (tolerance {ATOL:g} + {RTOL:g}·|ref|)"
    return None


def check(config: dict, device: torch.device, trace: FileTrace) -> list[str]:
    """The problems of one configuration (empty when it is correct); ``trace`` records the
    files the configuration's own forms run (not the reference's)."""
    import variants

    name, params, d_key = config["variant"], config["params"], config["d_key"]
    reference = variants.create(name, d_key, **params).double()
    inputs = _inputs(reference, d_key, d_key, seed=0)
    leaves = [t for t in inputs if t is not None]
    expected = reference.reference(*inputs[:3], beta=inputs[3], **_gate(inputs[4]))
    cotangent = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    expected_grads = torch.autograd.grad((expected * cotangent).sum(), leaves)
    low = [t.detach().float().to(device).requires_grad_() if t is not None else None for t in inputs]
    with trace:
        core = variants.create(name, d_key, backend=config["backend"], **params).to(device)
        out = core(*low[:3], beta=low[3], **_gate(low[4]))
        grads = torch.autograd.grad((out * cotangent.float().to(device)).sum(), [t for t in low if t is not None])
        if config.get("decode"):
            with torch.no_grad():
                steps = _step_loop(core, *[t.detach() if t is not None else None for t in low])
    labels = ["forward", "dq", "dk", "dv"] + ["dβ"] * (inputs[3] is not None) + ["dg"] * (inputs[4] is not None)
    problems = [_mismatch(label, got, want) for label, got, want in zip(labels, [out, *grads], [expected, *expected_grads])]
    if config.get("decode"):
        problems.append(_mismatch("step loop", steps, expected))
    return [problem for problem in problems if problem]


def main(configs: list[dict]) -> list[dict]:
    import variants

    root = Path.cwd().resolve()
    if not Path(variants.__file__).resolve().is_relative_to(root):
        raise SystemExit(f"regress_check: imported variants from {variants.__file__}, not from the checkout {root}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results = []
    for config in configs:
        trace = FileTrace(root)
        try:
            problems = check(config, device, trace)
        except variants.UnsupportedBackend as exc:  # e.g. softmax has no Triton backend: nothing to check
            results.append({**config, "ok": True, "problems": [], "files": [], "unsupported": str(exc)})
            continue
        except Exception as exc:  # noqa: BLE001 - a revision that cannot even run the variant is incorrect
            problems = ["".join(traceback.format_exception_only(type(exc), exc)).strip()]
        results.append({**config, "ok": not problems, "problems": problems, "files": sorted(trace.files)})
    return results


if __name__ == "__main__":
    print(json.dumps(main(json.load(sys.stdin))))

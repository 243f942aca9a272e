"""Correctness check of one revision's variants, run inside that revision's checkout.

``attnbench regress`` (harness.revisions.regress) starts this file as a script in a fresh interpreter
whose working directory and ``PYTHONPATH`` are a revision's worktree, so ``import variants``
is that revision's code; this file imports nothing else of attnbench (but its plugin loader, for the
plugins ``$ATTNBENCH_PLUGINS`` names: ``regress --plugin``). For every
configuration (variant, backend, parameters, d_key) it compares, in float32 on a small
input, the parallel form (and, when decoding is measured, the recurrent step loop) with the
float64 ``reference`` of the torch backend, forward and every gradient, with the tolerances
of tests/test_variants/test_backends.py. While it runs it records which files of the checkout executed,
which is how regress knows the variants a diff touches.

    cd WORKTREE && PYTHONPATH=WORKTREE python -c "$RUN_SCRIPT" PATH/regress_check.py < CONFIGS.json

(``harness.revisions.regress.RUN_SCRIPT`` runs a file by path without putting its directory on
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


def _inputs(core, d_key: int, d_value: int, seed: int) -> dict:
    """The core's inputs by keyword (q, k, v and its per-token inputs) in float64, as leaves that
    require grad: ``core.example_inputs`` where the revision has it. Older revisions' cores do not:
    for them q, k, v ~ N(0, 1) (unit-norm q, k for φ = identity, which keeps the plain rules
    stable), β ~ U(0, 1) where the core ``needs_beta`` and g = −u where it ``needs_gate`` (older
    still: no such attribute, no gate)."""
    gen = torch.Generator().manual_seed(seed)
    if hasattr(core, "example_inputs"):
        return core.example_inputs(BATCH, HEADS, LENGTH, d_value, dtype=torch.float64, generator=gen, requires_grad=True)
    make = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = make(BATCH, HEADS, LENGTH, d_key), make(BATCH, HEADS, LENGTH, d_key), make(BATCH, HEADS, LENGTH, d_value)
    if getattr(core, "phi_name", None) == "identity":
        q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    inputs = {"q": q, "k": k, "v": v}
    if core.needs_beta:
        inputs["beta"] = torch.rand(BATCH, HEADS, LENGTH, generator=gen, dtype=torch.float64)
    if getattr(core, "needs_gate", False):
        inputs["log_gate"] = -torch.rand(BATCH, HEADS, LENGTH, generator=gen, dtype=torch.float64)
    return {name: x.requires_grad_() for name, x in inputs.items()}


def _step_loop(core, inputs: dict):
    """The step form over the sequence; each token input ``name`` goes to ``step`` as ``name_t``
    (as ``variants.token_slice`` gives it; written out here for revisions without it)."""
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    state = core.init_state(q.shape[0], q.shape[1], v.shape[-1], device=q.device, dtype=q.dtype)
    outputs = []
    for t in range(q.shape[2]):
        per_token = {f"{name}_t": x[:, :, t] for name, x in inputs.items() if name not in ("q", "k", "v")}
        out, state = core.step(q[:, :, t], k[:, :, t], v[:, :, t], state, **per_token)
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
    expected = reference.reference(**inputs)
    cotangent = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    expected_grads = torch.autograd.grad((expected * cotangent).sum(), list(inputs.values()))
    low = {key: x.detach().float().to(device).requires_grad_() for key, x in inputs.items()}
    with trace:
        core = variants.create(name, d_key, backend=config["backend"], **params).to(device)
        out = core(**low)
        grads = torch.autograd.grad((out * cotangent.float().to(device)).sum(), list(low.values()))
        if config.get("decode"):
            with torch.no_grad():
                steps = _step_loop(core, {key: x.detach() for key, x in low.items()})
    labels = ["forward", *(f"d{key}" for key in inputs)]
    problems = [_mismatch(label, got, want) for label, got, want in zip(labels, [out, *grads], [expected, *expected_grads])]
    if config.get("decode"):
        problems.append(_mismatch("step loop", steps, expected))
    return [problem for problem in problems if problem]


def main(configs: list[dict]) -> list[dict]:
    import variants

    if plugins := [plugin for plugin in os.environ.get("ATTNBENCH_PLUGINS", "").split(",") if plugin]:
        from harness.scenarios.plugins import load_plugins

        load_plugins(plugins)

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

"""Packed variable-length sequences (``cu_seqlens``) through the Triton kernels of both rules: one packed row
equals each sequence run alone, forward (y, the final state of every sequence) and every gradient (q, k, v, β,
the log gate, the initial states), against the float64 chunked reference run on each sequence alone. And grouped
value heads (GVA) through the delta rule's kernels: equal to the reference on explicitly repeated q and k heads.

Lengths that are no multiple of the chunk, one of a single token and one exactly a chunk, so that chunks end at
every kind of boundary; each sequence starts from a state of its own. Every buffer the kernels write starts as
NaN (``POISON``). Tolerances: float32 max |error| ≤ 1e-4 · max(1, max |reference|) per output (as the rules' own
kernel tests); bfloat16 the relative L2 error within ``variants.precision.REL_ERROR_TOLERANCE`` (5 %).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from helpers import slow_interpreted  # noqa: E402

from variants.chunked import delta_rule_chunked, sum_rule_chunked  # noqa: E402
from variants.kernels import _common  # noqa: E402
from variants.kernels.delta_rule import delta_rule_triton  # noqa: E402
from variants.kernels.sum_rule import sum_rule_triton  # noqa: E402
from variants.precision import REL_ERROR_TOLERANCE, rel_error  # noqa: E402

DEVICE = os.environ.get("ATTNBENCH_TEST_DEVICE", "cpu")
F64 = torch.float64
CHUNK = 16
LENGTHS = (21, 1, 40, 16)
BOUNDS = [0, 21, 22, 62, 78]
HEADS, D_DOT, D_VALUE = 2, 5, 7
#: (rule, normalize or gated, its id)
RULES = [("sum", True, "sum-norm"), ("sum", False, "sum-plain"), ("delta", False, "delta"), ("delta", True, "gated_delta")]
#: Each rule in each dtype; the quick loop keeps the normalised sum rule in float32 and the gated delta rule in bfloat16.
QUICK_PACKED = {"sum-norm-float32", "gated_delta-bfloat16"}
PACKED_CASES = [
    (pytest.param if case in QUICK_PACKED else slow_interpreted)(rule, flag, dtype, id=case)
    for rule, flag, name in RULES
    for dtype in (torch.float32, torch.bfloat16)
    if (case := f"{name}-{str(dtype).removeprefix('torch.')}")
]


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(_common, "POISON", True)


def _inputs(rule: str, flag: bool, seed: int) -> dict:
    """float64 packed inputs ``[1, H, T, ·]`` and initial states ``[N, H, ...]`` (None where the rule has none)."""
    gen = torch.Generator().manual_seed(seed)
    total, sequences = BOUNDS[-1], len(LENGTHS)
    q, k = (torch.randn(1, HEADS, total, D_DOT, generator=gen, dtype=F64) for _ in range(2))
    if rule == "sum" and flag:  # positive features, as a normalised sum rule gets from φ
        q, k = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
    else:
        q, k = (x / x.norm(dim=-1, keepdim=True) for x in (q, k))
    v = torch.randn(1, HEADS, total, D_VALUE, generator=gen, dtype=F64)
    weights = 0.5 * torch.randn(sequences, HEADS, D_DOT, D_VALUE, generator=gen, dtype=F64)
    if rule == "sum":
        normaliser = torch.rand(sequences, HEADS, D_DOT, generator=gen, dtype=F64) * 4 if flag else None
        return {"q": q, "k": k, "v": v, "weights": weights, "normaliser": normaliser}
    beta = torch.rand(1, HEADS, total, generator=gen, dtype=F64) * 0.98 + 0.01
    log_gate = -3 * torch.rand(1, HEADS, total, generator=gen, dtype=F64) ** 2 if flag else None
    return {"q": q, "k": k, "v": v, "beta": beta, "log_gate": log_gate, "weights": weights}


def _run(rule: str, flag: bool, inputs: dict, *, kernel: bool, cu_seqlens=None) -> tuple:
    """The rule's outputs on ``inputs``: the kernels (over ``cu_seqlens`` where given), else the float64 reference."""
    args = inputs["q"], inputs["k"], inputs["v"]
    if rule == "sum":
        if kernel:
            return sum_rule_triton(*args, inputs["weights"], inputs.get("normaliser"), normalize=flag, chunk_size=CHUNK, cu_seqlens=cu_seqlens)
        return sum_rule_chunked(*args, inputs["weights"], inputs.get("normaliser"), CHUNK)
    if kernel:
        return delta_rule_triton(*args, inputs["beta"], inputs["weights"], log_gate=inputs.get("log_gate"), chunk_size=CHUNK, cu_seqlens=cu_seqlens)
    return delta_rule_chunked(*args, inputs["beta"], inputs["weights"], None, CHUNK, log_gate=inputs.get("log_gate"))[:2]


def _per_sequence(rule: str, flag: bool, inputs: dict) -> tuple:
    """The float64 reference on each sequence alone from its own state, outputs joined: y along time, states along N."""
    pieces = []
    for n, (start, stop) in enumerate(zip(BOUNDS[:-1], BOUNDS[1:])):
        piece = {name: None if x is None else x[n : n + 1] if name in ("weights", "normaliser") else x[:, :, start:stop] for name, x in inputs.items()}
        pieces.append(_run(rule, flag, piece, kernel=False))
    return tuple(None if parts[0] is None else torch.cat(parts, 2 if i == 0 else 0) for i, parts in enumerate(zip(*pieces)))


@pytest.mark.parametrize("rule, flag, dtype", PACKED_CASES)
def test_packed_equals_each_sequence_alone(rule, flag, dtype, seed):
    drawn = {name: x for name, x in _inputs(rule, flag, seed).items() if x is not None}
    state_dtype = {"weights": torch.float32, "normaliser": torch.float32}
    leaves = {name: x.to(DEVICE, state_dtype.get(name, dtype)).requires_grad_() for name, x in drawn.items()}
    exact = {name: x.to(state_dtype.get(name, dtype)).to(F64).requires_grad_() for name, x in drawn.items()}
    cu_seqlens = torch.tensor(BOUNDS, dtype=torch.int32)
    outputs = [x for x in _run(rule, flag, leaves, kernel=True, cu_seqlens=cu_seqlens) if x is not None]
    expected = [x for x in _per_sequence(rule, flag, exact) if x is not None]
    gen = torch.Generator().manual_seed(seed + 1)
    cotangents = [torch.randn(x.shape, generator=gen, dtype=F64) for x in expected]
    grads = torch.autograd.grad(outputs, list(leaves.values()), [c.to(DEVICE, x.dtype) for c, x in zip(cotangents, outputs)])
    grads_expected = torch.autograd.grad(expected, list(exact.values()), cotangents)
    labels = ["y", "S_T", "z_T"][: len(outputs)] + [f"d{name}" for name in leaves]
    for label, actual, reference in zip(labels, [*outputs, *grads], [*expected, *grads_expected]):
        assert not torch.isnan(actual).any(), f"{label}: NaN (an element the kernels did not write)"
        actual, reference = actual.detach().to("cpu", F64), reference.detach()
        if dtype == torch.float32:
            error = (actual - reference).abs().max().item()
            assert error <= 1e-4 * max(1.0, reference.abs().max().item()), f"{rule} {label}: max |error| {error:.2e} (seed {seed})"
        else:
            error = rel_error(actual, reference)
            assert error <= REL_ERROR_TOLERANCE[dtype], f"{rule} {label}: relative error {error:.2e} (seed {seed})"


def test_packing_is_built_once_per_offsets():
    """The chunk table is made on the host once per offsets and chunk size: a second call reuses it."""
    q = torch.zeros(1, 1, 78, 4)
    first = _common.packing("kernel", q, torch.tensor(BOUNDS, dtype=torch.int32), CHUNK)
    assert _common.packing("kernel", q, list(BOUNDS), CHUNK) is first
    assert first.chunks.tolist() == [[0, 16], [16, 21], [21, 22], [22, 38], [38, 54], [54, 62], [62, 78]]
    assert first.sequences.tolist() == [0, 2, 3, 6, 7] and first.num_sequences == 4


@pytest.mark.parametrize(
    "batch, bounds, match",
    [(2, BOUNDS, r"packed into one row, q \[1, H, total_T, F\]; got batch 2"), (1, [0, 21, 21, 78], "no empty sequence"), (1, [0, 21, 77], "from 0 to T=78")],
    ids=["batch", "empty", "short"],
)
def test_bad_packing_is_an_error(batch, bounds, match):
    q = torch.zeros(batch, 1, 78, 4, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        sum_rule_triton(q, q, q, normalize=False, cu_seqlens=bounds)


@pytest.mark.parametrize("gated, packed", [(False, False), slow_interpreted(True, True)], ids=["delta-dense", "gated_delta-packed"])
def test_grouped_value_heads_equal_repeated_heads(gated, packed, seed):
    """GVA: q, k on 2 heads, v, β, g and the states on 6; every value head reads its group's q/k head by index
    (no copy), dq and dk are summed over the group. Against the float64 reference on q, k repeated (float32)."""
    drawn = _inputs("delta", gated, seed)
    gen = torch.Generator().manual_seed(seed + 2)
    widen = {"v": D_VALUE, "beta": None, "log_gate": None, "weights": None}
    for name in [n for n in widen if drawn[n] is not None]:  # three value heads per q/k head
        extra = torch.randn((*drawn[name].shape[:1], 2 * HEADS, *drawn[name].shape[2:]), generator=gen, dtype=F64)
        extra = extra.abs().clamp(0.01, 0.99) if name == "beta" else -(extra**2) if name == "log_gate" else extra
        drawn[name] = torch.cat([drawn[name], extra], 1)
    if not packed:
        drawn["weights"] = drawn["weights"][:1]
    drawn = {name: x for name, x in drawn.items() if x is not None}
    leaves = {name: x.to(DEVICE, torch.float32).requires_grad_() for name, x in drawn.items()}
    exact = {name: x.clone().requires_grad_() for name, x in drawn.items()}
    repeated = exact | {name: exact[name].repeat_interleave(3, 1) for name in ("q", "k")}
    outputs = _run("delta", gated, leaves, kernel=True, cu_seqlens=BOUNDS if packed else None)
    expected = _per_sequence("delta", gated, repeated) if packed else _run("delta", gated, repeated, kernel=False)
    gen = torch.Generator().manual_seed(seed + 1)
    cotangents = [torch.randn(x.shape, generator=gen, dtype=F64) for x in expected]
    grads = torch.autograd.grad(outputs, list(leaves.values()), [c.to(DEVICE, torch.float32) for c in cotangents])
    grads_expected = torch.autograd.grad(expected, list(exact.values()), cotangents)
    for label, actual, reference in zip(["y", "S_T", *(f"d{name}" for name in leaves)], [*outputs, *grads], [*expected, *grads_expected]):
        assert not torch.isnan(actual).any(), f"{label}: NaN (an element the kernels did not write)"
        error = (actual.detach().to("cpu", F64) - reference.detach()).abs().max().item()
        assert error <= 1e-4 * max(1.0, reference.abs().max().item()), f"GVA {label}: max |error| {error:.2e} (seed {seed})"

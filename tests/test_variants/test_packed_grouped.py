"""Packed variable-length sequences (``cu_seqlens``) and grouped heads (GQA, GVA), in float64:
a packed row equals each sequence run alone, forward and backward; grouped heads equal the same
core on explicitly repeated heads, in every PyTorch form; everything else refuses in one line."""

from __future__ import annotations

import pytest
import torch
from helpers import CONFIGS, assert_close, config_id, make_inputs, slow_interpreted

import variants
from variants.base import repeat_heads

F64 = torch.float64
#: Lengths that are no multiple of the chunk (4), one of them a single token.
LENGTHS = (7, 1, 13, 4)
CU_SEQLENS = torch.tensor([0, 7, 8, 21, 25], dtype=torch.int32)
PACKED = [
    ("softmax", {}),
    ("softmax", {"packed": "block_mask"}),
    ("linear", {"chunk_size": 4}),
    ("linear", {"phi": "identity", "normalize": False, "chunk_size": 4}),
    ("delta", {"chunk_size": 4}),
    ("delta", {"normalize": True, "chunk_size": 4}),
    ("gated_delta", {"chunk_size": 4}),
    ("linear", {"chunk_size": 4, "scan": "parallel"}),
    ("delta", {"normalize": True, "chunk_size": 4, "scan": "parallel"}),
    ("gated_delta", {"chunk_size": 4, "scan": "parallel"}),
]
#: (variant, params, heads of q, k, v)
GROUPED = [
    ("softmax", {}, 4, 2, 2),
    ("softmax", {}, 3, 1, 1),
    ("linear", {"chunk_size": 4}, 4, 2, 2),
    ("linear", {"phi": "identity", "normalize": False, "chunk_size": 4}, 6, 2, 2),
    ("delta", {"chunk_size": 4}, 2, 2, 4),
    ("delta", {"normalize": True, "chunk_size": 4}, 1, 1, 2),
    ("gated_delta", {"chunk_size": 4}, 2, 2, 6),
    ("gated_delta", {"chunk_size": 4, "scan": "parallel"}, 1, 1, 2),
]


def _pieces(inputs: dict) -> list[dict]:
    bounds = CU_SEQLENS.tolist()
    return [variants.time_slice(inputs, a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def _grads(out: torch.Tensor, leaves: dict) -> dict:
    weights = torch.linspace(-1, 1, out.numel(), dtype=F64).reshape(out.shape)
    return dict(zip(leaves, torch.autograd.grad((out * weights).sum(), list(leaves.values()))))


@pytest.mark.parametrize("config", PACKED, ids=config_id)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_packed_equals_each_sequence_alone(config, causal, seed):
    """The parallel form and reference on a packed row == each sequence alone, and so do the gradients
    of q, k, v and the token inputs."""
    name, params = config
    params = dict(params)
    core = variants.create(name, 6, **{key: value for key, value in params.items() if key != "packed"}).double()
    if "packed" in params:  # softmax's choice off the CPU
        core.packed_choice = lambda device: params["packed"]
    if not causal and not core.supports_noncausal:
        pytest.skip("causal only")
    inputs = make_inputs(core, 1, 2, int(CU_SEQLENS[-1]), 3, dtype=F64, seed=seed, requires_grad=True)
    packed = core(**inputs, causal=causal, cu_seqlens=CU_SEQLENS)
    alone = torch.cat([core(**piece, causal=causal) for piece in _pieces(inputs)], 2)
    assert_close(packed, alone, F64, f"{name} packed", seed)
    assert_close(core.reference(**inputs, causal=causal, cu_seqlens=CU_SEQLENS), alone, F64, f"{name} packed reference", seed)
    expected = _grads(alone, inputs)
    for label, grad in _grads(packed, inputs).items():
        assert_close(grad, expected[label], F64, f"{name} d/d{label} packed", seed)


@pytest.mark.parametrize("config", [c for c in PACKED if c[0] != "softmax"], ids=config_id)
def test_packed_prefill_gives_each_sequences_state(config, seed):
    """``prefill(cu_seqlens=...)``: the outputs, and row n of the state is sequence n's own; from
    given states it continues each sequence."""
    name, params = config
    core = variants.create(name, 6, **params).double()
    first, second = (make_inputs(core, 1, 2, int(CU_SEQLENS[-1]), 3, dtype=F64, seed=seed + i) for i in (0, 1))
    out, states = core.prefill(**first, cu_seqlens=CU_SEQLENS)
    again, _ = core.prefill(**second, cu_seqlens=CU_SEQLENS, state=states)
    for n, (piece, next_piece) in enumerate(zip(_pieces(first), _pieces(second))):
        alone, state = core.prefill(**piece)
        then, _ = core.prefill(**next_piece, state=state)
        a, b = int(CU_SEQLENS[n]), int(CU_SEQLENS[n + 1])
        assert_close(out[:, :, a:b], alone, F64, f"{name} prefill, sequence {n}", seed)
        assert_close(again[:, :, a:b], then, F64, f"{name} continued prefill, sequence {n}", seed)
        for part, whole in zip(state, states):
            if part is not None:
                assert_close(whole[n : n + 1], part, F64, f"{name} state of sequence {n}", seed)


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_every_variant_packs_or_refuses(config):
    """Every registered configuration computes the packed row as its sequences alone, or refuses
    cu_seqlens in one line naming it (prefill too, unless it returns the sequences' states)."""
    name, params = config
    core = variants.create(name, 4, **params).double()
    inputs = make_inputs(core, 1, 2, int(CU_SEQLENS[-1]), 3, dtype=F64, seed=0)
    try:
        packed = core(**inputs, cu_seqlens=CU_SEQLENS)
    except variants.VariantError as exc:
        assert "cu_seqlens" in str(exc) and "\n" not in str(exc)
    else:
        assert_close(packed, torch.cat([core(**piece) for piece in _pieces(inputs)], 2), F64, f"{name} packed", 0)
    try:
        core.prefill(**inputs, cu_seqlens=CU_SEQLENS)
    except variants.VariantError as exc:
        assert "cu_seqlens" in str(exc) and "\n" not in str(exc)


@pytest.mark.parametrize("backend", ["triton", "fla", "compile"])
@pytest.mark.parametrize("name", ["linear", "delta", "gated_delta", "based"])
def test_what_supports_says_the_core_refuses(backend, name):
    """``supports(..., packed=, heads=)`` is the one place that says which backend takes packed sequences and grouped
    heads: what it refuses, the built core refuses in one line naming it (what it takes, other tests run)."""
    grouped = (2, 1, 1) if variants.create(name, 8).head_grouping == "gqa" else (1, 1, 2)
    shapes = {"packed": ("cu_seqlens", {"packed": True}), "grouped": ("grouped heads", {"heads": grouped})}
    for shape, (words, asked) in shapes.items():
        reason = variants.supports(name, 8, [backend], **asked)[backend]
        if reason is None or "takes no" not in reason:
            continue
        core = variants.create(name, 8, backend=backend)
        inputs = make_inputs(core, 1, 2, 25, 8, dtype=torch.float32, seed=0)
        call = {"cu_seqlens": CU_SEQLENS} if shape == "packed" else {}
        if shape == "grouped":
            fewer = "v" if core.head_grouping == "gqa" else "q"
            inputs |= {label: inputs[label][:, :1] for label in ("kv" if fewer == "v" else "qk")}
        with pytest.raises(variants.UnsupportedBackend, match=f"backend='{backend}' takes no {words}") as raised:
            core(**inputs, **call)
        assert "\n" not in str(raised.value)


def test_supports_names_the_shapes():
    assert variants.supports("delta", 8, ["torch", "triton", "compile"], packed=True, heads=(2, 2, 4)) == {
        "torch": None,
        "triton": None,
        "compile": "delta: backend 'compile' takes no cu_seqlens and no grouped heads for this variant",
    }
    assert variants.supports("linear", 8, ["triton"], heads=(2, 1, 1)) == {"triton": "linear: backend 'triton' takes no grouped heads for this variant"}
    with pytest.raises(variants.VariantError, match="rwkv: this variant takes no grouped heads"):
        variants.supports("rwkv", 8, ["torch"], heads=(2, 1, 1))


#: The kernels' chunk is at least 16: sequences of 7, 1, 33 (three chunks, the last partial) and 4 tokens.
TRITON_CU_SEQLENS = torch.tensor([0, 7, 8, 41, 45], dtype=torch.int32)


@pytest.mark.parametrize(
    "config",
    [
        ("linear", {}),
        slow_interpreted(("linear", {"phi": "identity", "normalize": False})),
        slow_interpreted(("delta", {})),
        slow_interpreted(("gated_delta", {})),
    ],
    ids=config_id,
)
def test_triton_packed_equals_each_sequence_alone(config, seed):
    """backend='triton' (its interpreter on a CPU): a packed row in float32 equals the float64 torch core on each
    sequence alone, forward and the gradient of every input, within float32's tolerance; so do prefill's states."""
    pytest.importorskip("triton")
    name, params = config
    core = variants.create(name, 6, backend="triton", chunk_size=16, **params)
    exact = variants.create(name, 6, chunk_size=16, **params).double()
    inputs = make_inputs(core, 1, 2, int(TRITON_CU_SEQLENS[-1]), 3, dtype=torch.float32, seed=seed, requires_grad=True)
    leaves = {label: x.detach().double().requires_grad_() for label, x in inputs.items()}
    bounds = TRITON_CU_SEQLENS.tolist()
    pieces = [variants.time_slice(leaves, a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    packed = core(**inputs, cu_seqlens=TRITON_CU_SEQLENS)
    alone = torch.cat([exact(**piece) for piece in pieces], 2)
    assert_close(packed, alone, torch.float32, f"{name} triton packed", seed)
    expected = _grads(alone, leaves)
    for label, grad in _grads(packed.double(), inputs).items():
        assert_close(grad, expected[label], torch.float32, f"{name} triton d/d{label} packed", seed)
    with torch.no_grad():
        _, states = core.prefill(**inputs, cu_seqlens=TRITON_CU_SEQLENS)
        for n, piece in enumerate(pieces):
            assert_close(states.weights[n : n + 1], exact.prefill(**piece)[1].weights, torch.float32, f"{name} triton state {n}", seed)


@pytest.mark.parametrize("name", [slow_interpreted("delta"), slow_interpreted("gated_delta")])
def test_triton_grouped_value_heads_equal_repeated_heads(name, seed):
    """backend='triton' takes GVA's fewer q/k heads as they are: float32 == the float64 torch core on explicitly
    repeated heads, forward and every gradient, dense and packed; the decoding state on the value heads."""
    pytest.importorskip("triton")
    core = variants.create(name, 6, backend="triton", chunk_size=16)
    exact = variants.create(name, 6, chunk_size=16).double()
    drawn = make_inputs(core, 1, 4, int(TRITON_CU_SEQLENS[-1]), 3, dtype=torch.float32, seed=seed)
    grouped = {n: x.detach().requires_grad_() for n, x in (drawn | {"q": drawn["q"][:, :2], "k": drawn["k"][:, :2]}).items()}
    leaves = {n: x.detach().double().requires_grad_() for n, x in grouped.items()}
    repeated = {n: repeat_heads(x, 4) for n, x in leaves.items()}
    for packed in ({}, {"cu_seqlens": TRITON_CU_SEQLENS}):
        out, expected = core(**grouped, **packed), exact(**repeated, **packed)
        assert_close(out, expected, torch.float32, f"{name} triton GVA {list(packed)}", seed)
        expected_grads = _grads(expected, leaves)
        for label, grad in _grads(out, grouped).items():
            assert_close(grad, expected_grads[label], torch.float32, f"{name} triton GVA d/d{label} {list(packed)}", seed)
    with torch.no_grad():
        assert core.prefill(**grouped)[1].weights.shape[1] == 4


@pytest.mark.parametrize(
    "cu_seqlens, match",
    [
        (torch.tensor([0, 7, 25]), "1-d int32 tensor"),
        ([0, 7, 25], "1-d int32 tensor"),
        (torch.tensor([0, 7, 24], dtype=torch.int32), "increase from 0 to T=25"),
        (torch.tensor([0, 7, 7, 25], dtype=torch.int32), "no empty sequence"),
    ],
    ids=["int64", "list", "short", "empty"],
)
def test_bad_cu_seqlens(cu_seqlens, match):
    core = variants.create("linear", 4)
    with pytest.raises(variants.VariantError, match=match):
        core(**core.example_inputs(1, 2, 25, 3), cu_seqlens=cu_seqlens)


def test_packed_rows_are_one_batch_row():
    core = variants.create("softmax", 4)
    with pytest.raises(variants.VariantError, match=r"packed into one row, q \[1, H, total_T, D\]; got batch 2"):
        core(**core.example_inputs(2, 2, 25, 3), cu_seqlens=CU_SEQLENS)


@pytest.mark.parametrize("config", GROUPED, ids=lambda c: f"{c[0]}-{c[2]}.{c[3]}.{c[4]}-{len(c[1])}")
def test_grouped_heads_equal_repeated_heads(config, seed):
    """GQA (softmax, linear) and GVA (delta rules): the parallel form, reference, chained prefill and
    step == the same core on explicitly repeated heads, with the gradients of every input; the
    state is on the state heads and ``state_numel`` counts it; packed grouped rows too."""
    name, params, hq, hk, hv = config
    core = variants.create(name, 6, **params).double()
    heads = max(hq, hv)
    drawn = make_inputs(core, 1, heads, int(CU_SEQLENS[-1]), 3, dtype=F64, seed=seed)
    grouped = {"q": drawn["q"][:, :hq], "k": drawn["k"][:, :hk], "v": drawn["v"][:, :hv]} | {n: x for n, x in drawn.items() if n not in "qkv"}
    grouped = {n: x.detach().clone().requires_grad_() for n, x in grouped.items()}
    repeated = {n: repeat_heads(x, heads) for n, x in grouped.items()}
    expected = core(**repeated)
    expected_grads = _grads(expected, grouped)
    out = core(**grouped)
    assert_close(out, expected, F64, f"{name} grouped", seed)
    for label, grad in _grads(out, grouped).items():
        assert_close(grad, expected_grads[label], F64, f"{name} grouped d/d{label}", seed)
    with torch.no_grad():
        assert_close(core.reference(**grouped), expected, F64, f"{name} grouped reference", seed)
        assert_close(core.step_loop(grouped)[0], expected, F64, f"{name} grouped step", seed)
        early, state = core.prefill(**variants.time_slice(grouped, 0, 9))
        late, state = core.prefill(**variants.time_slice(grouped, 9), state=state)
        assert_close(torch.cat([early, late], 2), expected, F64, f"{name} grouped prefill", seed)
        held = state.filled() if name == "softmax" else [x for x in state if x is not None]
        assert sum(x.numel() for x in held) == core.state_numel(1, hq, 3, int(CU_SEQLENS[-1]), heads_k=hk, heads_v=hv)
        assert {x.shape[1] for x in held} == {max(hk, hv)}
        packed = core(**grouped, cu_seqlens=CU_SEQLENS)
        assert_close(packed, core(**repeated, cu_seqlens=CU_SEQLENS), F64, f"{name} grouped packed", seed)


@pytest.mark.parametrize(
    "name, heads, match",
    [
        ("softmax", (2, 2, 4), r"k and v share their heads, a divisor of q's \(GQA\); got q 2, k 2, v 4"),
        ("linear", (4, 3, 3), "a divisor of q's"),
        ("delta", (4, 2, 2), r"q and k share their heads, a divisor of v's \(GVA\)"),
        ("gated_delta", (2, 2, 3), "a divisor of v's"),
        ("rwkv", (2, 1, 1), "this variant takes no grouped heads"),
        ("lsh", (2, 1, 1), "this variant takes no grouped heads"),
    ],
)
def test_grouped_heads_refused(name, heads, match):
    core = variants.create(name, 4)
    inputs = make_inputs(core, 1, max(heads), 9, 4, dtype=torch.float32, seed=0)
    inputs |= {label: inputs[label][:, :h] for label, h in zip("qkv", heads)}
    with pytest.raises(variants.VariantError, match=match):
        core(**inputs)


def test_grouped_flops():
    """GQA softmax: FLOPs on the query heads, the cache on the key/value heads; the fast weight rules
    on the output's heads (the forms repeat the fewer), the state on the state heads."""
    softmax, linear, delta = (variants.create(name, 8) for name in ("softmax", "linear", "delta"))
    assert softmax.flops(1, 8, 16, 8) == 2 * 8 * (16 * 17 // 2) * 16
    assert softmax.state_numel(1, 8, 8, 16, heads_k=2, heads_v=2) == softmax.state_numel(1, 2, 8, 16)
    assert linear.flops(1, 8, 16, 8, heads_k=2, heads_v=2) == linear.flops(1, 8, 16, 8)
    assert linear.state_numel(1, 8, 8, 16, heads_k=2, heads_v=2) == linear.state_numel(1, 2, 8, 16)
    assert linear.step_flops(1, 8, 8, 0, heads_k=2, heads_v=2) == 2 * linear.step_flops(1, 1, 8, 0) + 6 * 2 * linear.d_dot * 8
    assert delta.flops(1, 2, 16, 8, heads_k=2, heads_v=8) == delta.flops(1, 8, 16, 8)
    assert delta.state_numel(1, 2, 8, 16, heads_k=2, heads_v=8) == delta.state_numel(1, 8, 8, 16)


def test_softmax_records_how_it_runs_packed_sequences():
    core = variants.create("softmax", 4)
    inputs = core.example_inputs(1, 2, 25, 3)
    assert core.implementation_choices(**inputs, cu_seqlens=CU_SEQLENS)["packed"] == "per_sequence"  # on the CPU
    assert "packed" not in core.implementation_choices(**inputs)

"""Decoding a batch of mixed context lengths (issue 35): the prompts prefilled packed (``cu_seqlens``) or as
a right-padded dense batch (``prefill(lengths=)``), then stepped together, row n from its own length. Each
row's prefill outputs and steps equal its sequence decoded alone and the float64 reference (float64), and
stay within REL_ERROR_TOLERANCE of it in 16 bits; what cannot decode so refuses in one line."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close, make_inputs, slow_interpreted

import variants
from variants.precision import REL_ERROR_TOLERANCE, rel_error

F64 = torch.float64
#: Prompt lengths (one a single token, none a multiple of the chunk, 4) and the steps after them.
LENGTHS, NEW = (7, 1, 13, 4), 3
#: (variant, params, heads of q, k, v): dense heads and each core's grouping (GQA, GVA).
CONFIGS = [
    ("softmax", {}, (2, 2, 2)),
    ("softmax", {}, (4, 2, 2)),
    ("linear", {"chunk_size": 4}, (4, 2, 2)),
    ("linear", {"phi": "identity", "normalize": False, "chunk_size": 4, "scan": "parallel"}, (2, 2, 2)),
    ("delta", {"chunk_size": 4}, (2, 2, 4)),
    ("delta", {"normalize": True, "chunk_size": 4, "scan": "parallel"}, (2, 2, 2)),
    ("gated_delta", {"chunk_size": 4}, (2, 2, 2)),
]


def _id(config) -> str:
    name, params, heads = config
    return f"{name}-{'.'.join(map(str, heads))}-{len(params)}"


def _inputs(core, heads, dtype, seed) -> dict:
    """Row n's first LENGTHS[n] + NEW tokens are its sequence (the rest of the row is padding)."""
    drawn = make_inputs(core, len(LENGTHS), max(heads), max(LENGTHS) + NEW, 3, dtype=dtype, seed=seed)
    return drawn | {label: drawn[label][:, :h] for label, h in zip("qkv", heads)}


def _tokens(inputs: dict, i: int) -> dict:
    """Step i's inputs: row n's token LENGTHS[n] + i."""
    rows, at = torch.arange(len(LENGTHS)), torch.tensor(LENGTHS)
    return {f"{name}_t": x[rows, :, at + i] for name, x in inputs.items()}


def _decode(core, inputs: dict, packing: str) -> tuple[list, torch.Tensor]:
    """Each row's prefill outputs, and the NEW steps ``[N, H, NEW, Dv]`` of the batch decoded together."""
    if packing == "packed":
        prompt = {name: torch.cat([x[n : n + 1, :, :length] for n, length in enumerate(LENGTHS)], 2) for name, x in inputs.items()}
        bounds = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
        out, state = core.prefill(**prompt, cu_seqlens=torch.tensor(bounds, dtype=torch.int32))
        prefilled = [out[:, :, a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    else:
        out, state = core.prefill(**variants.time_slice(inputs, 0, max(LENGTHS)), lengths=list(LENGTHS))
        prefilled = [out[n : n + 1, :, :length] for n, length in enumerate(LENGTHS)]
    steps = []
    for i in range(NEW):
        out, state = core.step(**_tokens(inputs, i), state=state)
        steps.append(out)
    return prefilled, torch.stack(steps, 2)


@pytest.mark.parametrize("packing", ["packed", "padded"])
@pytest.mark.parametrize("config", CONFIGS, ids=_id)
def test_mixed_batch_decodes_each_sequence_as_alone(config, packing, seed):
    """float64: row n's prefill outputs and steps == sequence n prefilled and stepped alone == its reference."""
    name, params, heads = config
    core = variants.create(name, 6, **params).double()
    inputs = _inputs(core, heads, F64, seed)
    with torch.no_grad():
        prefilled, steps = _decode(core, inputs, packing)
        for n, length in enumerate(LENGTHS):
            row = {label: x[n : n + 1, :, : length + NEW] for label, x in inputs.items()}
            alone, state = core.prefill(**variants.time_slice(row, 0, length))
            alone_steps = []
            for i in range(NEW):
                out, state = core.step(**variants.token_slice(row, length + i), state=state)
                alone_steps.append(out)
            reference = core.reference(**row)
            what = f"{name} {packing} row {n}"
            assert_close(prefilled[n], alone, F64, f"{what} prefill", seed)
            assert_close(steps[n : n + 1], torch.stack(alone_steps, 2), F64, f"{what} steps", seed)
            assert_close(steps[n : n + 1], reference[:, :, length:], F64, f"{what} steps against the reference", seed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("packing", ["packed", "padded"])
@pytest.mark.parametrize("config", [CONFIGS[1], CONFIGS[4]], ids=_id)
def test_mixed_batch_decodes_in_16_bits(config, packing, dtype, seed):
    """16-bit inputs (softmax's cache and step in 16 bits; the rules' state in float32): every row's steps within
    the dtype's REL_ERROR_TOLERANCE of the float64 reference on the same (rounded) inputs."""
    name, params, heads = config
    core = variants.create(name, 6, **params)
    inputs = _inputs(core, heads, dtype, seed)
    exact = variants.create(name, 6, **params).double()
    with torch.no_grad():
        _, steps = _decode(core.to(dtype), inputs, packing)
        assert steps.dtype == dtype
        for n, length in enumerate(LENGTHS):
            reference = exact.reference(**{label: x[n : n + 1, :, : length + NEW].double() for label, x in inputs.items()})
            error = rel_error(steps[n : n + 1], reference[:, :, length:])
            assert error <= REL_ERROR_TOLERANCE[dtype], f"{name} {packing} row {n}: rel error {error:.3g} (seed {seed})"


def test_softmax_cache_holds_each_length():
    """The cache of a mixed batch: padded to the longest, each row's length; a step adds one to each."""
    core = variants.create("softmax", 4).double()
    inputs = _inputs(core, (2, 2, 2), F64, 0)
    cu_seqlens = torch.tensor([0, 7, 8, 21, 25], dtype=torch.int32)
    packed = {name: torch.cat([x[n : n + 1, :, :length] for n, length in enumerate(LENGTHS)], 2) for name, x in inputs.items()}
    with torch.no_grad():
        for _, state in (core.prefill(**packed, cu_seqlens=cu_seqlens), core.prefill(**variants.time_slice(inputs, 0, 13), lengths=LENGTHS)):
            assert (state.length, state.lengths.tolist(), state.keys.shape[:3]) == (13, list(LENGTHS), (4, 2, 13))
            _, state = core.step(**_tokens(inputs, 0), state=state)
            assert (state.length, state.lengths.tolist()) == (14, [n + 1 for n in LENGTHS])


@pytest.mark.parametrize(
    "name, call, match",
    [
        ("softmax", {"lengths": [3, 9]}, r"lengths must be one integer in \[1, T\] per row of the padded batch"),
        ("softmax", {"lengths": [3]}, "one integer in"),
        ("delta", {"lengths": [3, 4], "cu_seqlens": torch.tensor([0, 4], dtype=torch.int32)}, "or cu_seqlens .a packed row., not both"),
        ("linear", {"lengths": [3, 4], "state": "given"}, r"a padded prefill \(lengths\) starts from an empty state"),
        ("rwkv", {"lengths": [3, 4]}, "rwkv: prefill takes no lengths"),
        ("softmax", {"cu_seqlens": torch.tensor([0, 1, 4], dtype=torch.int32), "state": "given"}, "starts from an empty KV cache"),
        ("softmax", {"state": "mixed"}, "prefill continues a KV cache of one length; this one holds mixed context lengths"),
    ],
    ids=["too-long", "rows", "both", "state", "rwkv", "packed-state", "continue-mixed"],
)
def test_what_cannot_decode_a_mixed_batch_refuses_in_one_line(name, call, match):
    core = variants.create(name, 4)
    inputs = core.example_inputs(2, 2, 4, 4)
    if "cu_seqlens" in call and "lengths" not in call:
        inputs = variants.time_slice(core.example_inputs(1, 2, 4, 4), 0)
    state = call.pop("state", None)
    if state == "given":
        call["state"] = core.prefill(**inputs)[1]
    elif state == "mixed":
        call["state"] = core.prefill(**inputs, lengths=[2, 4])[1]
    with pytest.raises(variants.VariantError, match=match) as raised:
        core.prefill(**inputs, **call)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("name", ["linear", slow_interpreted("delta"), "gated_delta"])
def test_triton_padded_prefill_gives_each_rows_state(name, seed):
    """backend='triton' (its interpreter on a CPU): a padded prefill's outputs at the real tokens and each row's
    state in float32 == the float64 torch core on the row's own tokens, within float32's tolerance."""
    pytest.importorskip("triton")
    core = variants.create(name, 6, backend="triton", chunk_size=16)
    exact = variants.create(name, 6, chunk_size=16).double()
    inputs, lengths = make_inputs(core, 3, 2, 21, 3, dtype=torch.float32, seed=seed), [7, 21, 1]
    with torch.no_grad():
        out, states = core.prefill(**inputs, lengths=lengths)
        for n, length in enumerate(lengths):
            alone, state = exact.prefill(**{label: x[n : n + 1, :, :length].double() for label, x in inputs.items()})
            assert_close(out[n : n + 1, :, :length], alone, torch.float32, f"{name} triton padded row {n}", seed)
            assert_close(states.weights[n : n + 1], state.weights, torch.float32, f"{name} triton padded state {n}", seed)

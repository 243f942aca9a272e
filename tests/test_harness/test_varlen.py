"""Packed variable-length cells and grouped heads (issue 35 item 3): the length distributions, every
error they give (one line naming the file and field), their cells (packed and padded: real tokens
and FLOPs only, the same function on the same data), the skips of what cannot run them, and decoding a
batch of mixed context lengths."""

from __future__ import annotations

import pytest
import torch
import yaml

import variants
from harness.measuring import builders
from harness.running.workloads import measure_cell
from harness.scenarios import lengths
from harness.scenarios.cell import Cell
from harness.scenarios.scenario import ScenarioError, load_scenario

BASE = {
    "name": "v",
    "variants": {"softmax": {}, "linear": {"chunk_size": 4}, "delta": {"chunk_size": 4}},
    "axes": {"lengths": [{"kind": "list", "values": [7, 1, 13, 4]}], "packing": ["packed", "padded"], "heads": 2, "d_key": 4},
    "modes": ["forward", "train", "decode"],
    "decode": {"new_tokens": 3},
    "measure": {"warmup": 0, "repeats": 1, "max_time_s": 0},
}


def write(tmp_path, data, name="v.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def cells_of(tmp_path, **changes) -> list[Cell]:
    return load_scenario(write(tmp_path, {**BASE, **changes})).cells()


def with_axes(**axes) -> dict:
    return {"axes": {**BASE["axes"], **axes}}


def test_distributions_fill_the_budget_the_same_way_every_time(tmp_path):
    (tmp_path / "h.csv").write_text("# captured\n8,3\n100,1\n")
    specs = [
        {"kind": "uniform", "low": 3, "high": 50, "tokens": 500, "seed": 1},
        {"kind": "lognormal", "median": 20, "sigma": 1.5, "tokens": 500, "max": 64},
        {"kind": "histogram", "file": "h.csv", "tokens": 500},
    ]
    batches = lengths.parse(specs, "axes.lengths", tmp_path)
    assert [batch.tokens for batch in batches] == [500] * 3
    assert all(3 <= n <= 50 for n in batches[0].lengths[:-1]) and max(batches[1].lengths) <= 64
    assert set(batches[2].lengths[:-1]) <= {8, 100}
    assert batches == lengths.parse(specs, "axes.lengths", tmp_path), "the same seed draws the same lengths"
    assert lengths.parse({**specs[0], "seed": 2}, "x", tmp_path)[0].lengths != batches[0].lengths
    assert batches[2].label.startswith("histogram(h.csv:") and "/500#0" in batches[2].label


@pytest.mark.parametrize(
    "axes, expected",
    [
        ({"lengths": {"kind": "zipf"}}, "axes.lengths: expected a mapping with kind: list, uniform, lognormal, histogram"),
        ({"lengths": [{"kind": "uniform", "low": 16, "high": 8, "tokens": 64}]}, "axes.lengths[0].high: expected an integer >= low (16), got 8"),
        ({"lengths": {"kind": "uniform", "low": 1, "high": 8}}, "axes.lengths.tokens: required for kind uniform"),
        ({"lengths": {"kind": "list", "values": [3, 0]}}, "axes.lengths.values: expected a list of 1 to 65536 positive integers"),
        ({"lengths": {"kind": "list", "values": [3], "seed": 1}}, "axes.lengths.seed: not a field of kind list"),
        ({"lengths": {"kind": "lognormal", "median": 0.5, "sigma": 1, "tokens": 8}}, "axes.lengths.median: expected a number >= 1"),
        ({"lengths": {"kind": "histogram", "file": "none.csv", "tokens": 8}}, "axes.lengths.file: no such file"),
        ({"lengths": {"kind": "histogram", "file": "bad.csv", "tokens": 8}}, "bad.csv, line 2: expected 'length,count'"),
        ({"packing": "dense"}, 'axes.packing: expected packed or padded, got "dense"'),
        ({"lengths": None, "seq_len": 8}, "axes.packing: packs the sequences of axes.lengths, which is not set"),
        ({"seq_len": 8}, "axes.lengths: gives each cell's sequences, so seq_len must not be set"),
        ({"head_ratio": 3}, "axes.head_ratio: expected a divisor of every heads, got 3 for heads=2"),
    ],
    ids=["kind", "low-high", "tokens", "values", "extra", "median", "file", "line", "packing", "no-lengths", "seq_len", "ratio"],
)
def test_bad_axes_are_one_line_naming_file_and_field(tmp_path, axes, expected):
    (tmp_path / "bad.csv").write_text("8,1\n9;2\n")
    path = write(tmp_path, {**BASE, **with_axes(**axes)})
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    message = str(info.value)
    assert path in message and expected in message, message
    assert len(message.splitlines()) <= 2, message  # "<file>: invalid scenario" and the one field


def test_packed_axes_on_a_layer_are_refused(tmp_path):
    with pytest.raises(ScenarioError, match="axes.lengths: measured on attention cores only"):
        load_scenario(write(tmp_path, {**BASE, "target": "layer"}))


def test_cells_and_their_skips(tmp_path):
    """Each cell holds its batch (seq_len the longest, batch how many); every variant decodes it packed and
    padded but one whose prefill returns no states of mixed lengths (rwkv), a variant without grouped heads
    is refused by itself, and a backend that takes no cu_seqlens by ``variants.supports``."""
    cells = cells_of(tmp_path, variants={**BASE["variants"], "rwkv": {}}, **with_axes(head_ratio=[1, 2]))
    for cell in cells:
        assert (cell.axes["seq_len"], cell.axes["batch"], cell.lengths) == (13, 4, [7, 1, 13, 4])
        assert cell.axes["lengths"] == "[7,1,13,4]"
    skips = {(c.variant, c.mode, c.axes["packing"], c.axes["head_ratio"]): c.skip for c in cells}
    assert all(skips[(name, "decode", packing, 1)] is None for name in ("softmax", "linear", "delta") for packing in ("packed", "padded"))
    assert "rwkv: prefill takes no cu_seqlens" in skips[("rwkv", "decode", "packed", 1)]
    assert "rwkv: prefill takes no lengths" in skips[("rwkv", "decode", "padded", 1)]
    assert "rwkv: this variant takes no grouped heads" in skips[("rwkv", "forward", "packed", 2)]
    assert skips[("rwkv", "forward", "packed", 1)] is None and skips[("delta", "decode", "packed", 2)] is None
    for backend in variants.BACKENDS:
        reasons = [variants.supports("delta", 8, [backend], packed=True)[backend], variants.supports("delta", 8, [backend], heads=(2, 2, 4))[backend]]
        if backend == "torch":
            assert reasons == [None, None]
        elif variants.supports("delta", 8, [backend])[backend] is None:  # what it refuses, it names
            assert reasons[0] is None or "takes no cu_seqlens" in reasons[0], reasons
            assert reasons[1] is None or "takes no grouped heads" in reasons[1], reasons


def test_a_padded_decode_needs_what_its_prefill_runs(tmp_path):
    """The sum and delta rules' padded prefill runs its rows packed: on a backend that takes no cu_seqlens their padded
    decode is skipped with its reason; softmax's runs the padded batch densely, so its cell is not."""
    cells = cells_of(tmp_path, backends=["compile"], modes=["decode"], **with_axes(packing="padded"))
    skips = {c.variant: c.skip for c in cells}
    assert skips["softmax"] is None and "delta: backend 'compile' takes no cu_seqlens" in skips["delta"], skips
    core = variants.create("delta", 4, backend="compile")
    with pytest.raises(variants.UnsupportedBackend, match="takes no cu_seqlens .the padded prefill of the sum and delta rules runs its rows packed"):
        core.prefill(**core.example_inputs(2, 1, 3, 4), lengths=[1, 3])


def test_axes_are_absent_unless_set(tmp_path):
    cells = load_scenario(write(tmp_path, {**BASE, "axes": {"seq_len": 8, "heads": 2, "d_key": 4}})).cells()
    assert all(set(c.axes) <= {"seq_len", "batch", "heads", "d_key", "d_value", "dtype", "device", "new_tokens"} and c.lengths is None for c in cells)


@pytest.mark.parametrize("mode", ["forward", "train"])
@pytest.mark.parametrize("ratio", [1, 2])
def test_packed_and_padded_count_the_real_tokens_and_compute_the_same(tmp_path, mode, ratio):
    """Both count the real tokens (25, not 4 x 13), the FLOPs and bytes of the real sequences (packed:
    and its cu_seqlens), and give the same outputs at the real positions."""
    cells = cells_of(tmp_path, modes=[mode], **with_axes(head_ratio=ratio))
    for variant in ("softmax", "linear", "delta"):
        packed, padded = (next(c for c in cells if c.variant == variant and c.axes["packing"] == p) for p in ("packed", "padded"))
        one, other = (builders.core_workload(cell, torch.device("cpu"), torch.float64) for cell in (packed, padded))
        core = one.module
        heads = builders.head_counts(core, packed.axes)
        assert (one.tokens, one.flops) == (other.tokens, other.flops)
        assert 0 < one.min_bytes - other.min_bytes <= 2 * 5 * 4, "the bytes of the real tokens, and the packed row's 5 int32 offsets"
        query_heads, grouped = builders.head_arguments(core, packed.axes)
        assert one.tokens == 25 and one.flops == sum(core.flops(1, query_heads, n, 4, **grouped) for n in (7, 1, 13, 4)) * (3 if mode == "train" else 1)
        assert (one.inputs["q"].shape[1], one.inputs["k"].shape[1], one.inputs["v"].shape[1]) == heads
        rows = torch.cat([other.run()[n : n + 1, :, :length] for n, length in enumerate((7, 1, 13, 4))], 2)
        torch.testing.assert_close(one.run(), rows)


@pytest.mark.parametrize("packing", ["packed", "padded"])
def test_a_mixed_decode_batch_steps_each_sequence_from_its_own_context(tmp_path, packing):
    """Prefilled each to its own length (packed, or padded to the longest), then stepped together: row n's
    steps are sequence n's reference at positions lengths[n] ... lengths[n] + new_tokens - 1."""
    cells = cells_of(tmp_path, modes=["decode"], **with_axes(packing=packing, head_ratio=2))
    assert len(cells) == 3 and not any(cell.skip for cell in cells)
    for cell in cells:
        decoder = builders.build_decoder(cell, torch.device("cpu"), torch.float64, None, 3)
        _, state = decoder.prefill()
        steps = []
        for i in range(3):
            out, state = decoder.step(i, state)
            steps.append(out)
        steps = torch.stack(steps, 2)
        for n, length in enumerate(cell.lengths):
            row = {name: x[n : n + 1, :, : length + 3] for name, x in decoder.inputs.items()}
            torch.testing.assert_close(steps[n : n + 1], decoder.core.reference(**row)[:, :, length:], msg=f"{cell.variant} row {n}")


@pytest.mark.parametrize("variant", [{"delta": {"chunk_size": 4}}, pytest.param({"softmax": {}}, marks=pytest.mark.slow)], ids=["delta", "softmax"])
def test_measured_packed_cells_are_ok_and_accurate(tmp_path, variant):
    """Every cell, packed and padded, forward, training and decode, ok and accurate; a decode cell counts its
    sequences' real steps (4 x 3) and their FLOPs at each one's own position, packed and padded alike."""
    cells = cells_of(tmp_path, variants=variant, **with_axes(head_ratio=2))
    assert len(cells) == 6 and not any(c.skip for c in cells)
    decoded = {}
    for cell in cells:
        result = measure_cell(cell)
        metrics = result["metrics"]
        assert result["status"] == "ok" and not metrics["inaccurate"] and metrics["lengths"] == [7, 1, 13, 4], (cell.mode, result)
        assert metrics["tokens"] == (4 * 3 if cell.mode == "decode" else 25)
        if cell.mode == "decode":
            decoded[cell.axes["packing"]] = (metrics["flops"], metrics["state_numel"], metrics["min_bytes"])
    assert decoded["packed"] == decoded["padded"]

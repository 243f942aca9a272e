"""AttentionLayer over packed sequences and grouped heads, in float64: a packed row equals each
sequence through the same layer alone (the short convolution and the token shift restart at each
boundary, like the core), forward, parameter gradients and prefill states; a grouped layer equals
an equal-heads layer whose fewer projections are repeated; grouped decoding equals the parallel form."""

from __future__ import annotations

import pytest
import torch
from helpers import layer_step_loop
from test_layer import randomise

import variants
from variants.base import VariantError

F64 = torch.float64
D_MODEL = 8
LENGTHS = (5, 1, 11, 3)
#: (variant, layer settings): each with a core that takes packed sequences; short_conv and RWKV's
#: token shift are the layer parts that read neighbouring tokens.
PACKED = [
    ("linear", {"chunk_size": 4}),
    ("linear", {"chunk_size": 4, "short_conv": 3}),
    ("delta", {"chunk_size": 4, "short_conv": 2}),
    ("gated_delta", {"chunk_size": 4}),
    ("softmax", {}),
    ("rwkv", {}),
]
#: (variant, layer settings, n_heads, heads_k, heads_v)
GROUPED = [
    ("softmax", {}, 4, 2, 2),
    ("linear", {"chunk_size": 4}, 4, 1, 1),
    ("delta", {"chunk_size": 4}, 2, 2, 4),
    ("gated_delta", {"chunk_size": 4, "short_conv": 2}, 1, 1, 3),
]


def _id(config) -> str:
    return config[0] + "".join(f"-{key}={value}" for key, value in config[1].items()) + "".join(f"-{h}" for h in config[2:])


def _layer(name, settings, seed, n_heads=2, **heads):
    layer = variants.AttentionLayer(D_MODEL, n_heads, name, d_key=4, d_value=4, **settings, **heads).double()
    randomise(layer, torch.Generator().manual_seed(seed))
    return layer


@pytest.mark.parametrize("config", PACKED, ids=_id)
def test_packed_layer_equals_each_sequence_alone(config, seed):
    layer = _layer(*config, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    pieces = [torch.randn(1, length, D_MODEL, generator=gen, dtype=F64) for length in LENGTHS]
    cu_seqlens = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    weights = torch.randn(1, sum(LENGTHS), D_MODEL, generator=gen, dtype=F64)
    params = list(layer.parameters())

    packed = layer(torch.cat(pieces, 1), cu_seqlens=cu_seqlens)
    alone = torch.cat([layer(piece) for piece in pieces], 1)
    torch.testing.assert_close(packed, alone, rtol=1e-10, atol=1e-10, msg=lambda m: f"output (seed {seed}): {m}")
    assert alone.abs().max() > 1e-3
    for name, got, expected in zip(
        dict(layer.named_parameters()), torch.autograd.grad((packed * weights).sum(), params), torch.autograd.grad((alone * weights).sum(), params)
    ):
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9, msg=lambda m, name=name: f"d/d{name} (seed {seed}): {m}")


@pytest.mark.parametrize("config", [c for c in PACKED if c[0] in ("linear", "delta", "gated_delta", "softmax")], ids=_id)
def test_packed_prefill_gives_each_sequence_its_state(config, seed):
    """Each sequence's state (core and layer buffers) from a packed prefill == its own prefill's, so
    that decoding on from either gives the same next output."""
    layer = _layer(*config, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    pieces = [torch.randn(1, length, D_MODEL, generator=gen, dtype=F64) for length in LENGTHS]
    cu_seqlens = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    _, packed_state = layer.prefill(torch.cat(pieces, 1), cu_seqlens=cu_seqlens)
    x_next = torch.randn(len(LENGTHS), D_MODEL, generator=gen, dtype=F64)
    packed_next, _ = layer.step(x_next, packed_state)
    for i, piece in enumerate(pieces):
        _, state = layer.prefill(piece)
        alone_next, _ = layer.step(x_next[i : i + 1], state)
        torch.testing.assert_close(packed_next[i : i + 1], alone_next, rtol=1e-10, atol=1e-10, msg=lambda m, i=i: f"sequence {i} (seed {seed}): {m}")


def _repeat_rows(weight: torch.Tensor, heads: int, wanted: int) -> torch.Tensor:
    """A projection's rows ``[heads * D, d_model]`` with each head's block repeated for its group of ``wanted``."""
    return weight.unflatten(0, (heads, -1)).repeat_interleave(wanted // heads, 0).flatten(0, 1)


@pytest.mark.parametrize("config", GROUPED, ids=_id)
def test_grouped_layer_equals_repeated_projections(config, seed):
    name, settings, n_heads, heads_k, heads_v = config
    grouped = _layer(name, settings, seed, n_heads, heads_k=heads_k, heads_v=heads_v)
    heads = max(n_heads, heads_v)
    full = _layer(name, settings, seed, heads)
    with torch.no_grad():
        for part, have in (("query", n_heads), ("key", heads_k), ("value", heads_v)):
            getattr(full, part).weight.copy_(_repeat_rows(getattr(grouped, part).weight, have, heads))
        for part, module in grouped.named_children():
            if part not in ("query", "key", "value", "core"):
                getattr(full, part).load_state_dict(module.state_dict())
    x = torch.randn(2, 9, D_MODEL, generator=torch.Generator().manual_seed(seed + 1), dtype=F64)
    expected = full(x)
    torch.testing.assert_close(grouped(x), expected, rtol=1e-10, atol=1e-10, msg=lambda m: f"parallel (seed {seed}): {m}")
    torch.testing.assert_close(layer_step_loop(grouped, x), expected, rtol=1e-10, atol=1e-10, msg=lambda m: f"steps (seed {seed}): {m}")
    assert expected.abs().max() > 1e-3


@pytest.mark.parametrize(
    ("name", "heads", "message"),
    [
        ("rwkv", {"heads_k": 1}, "no grouped heads"),
        ("delta", {"heads_k": 1}, "q 2, k 1, v 1"),
        ("linear", {"heads_v": 4}, "q 2, k 2, v 4"),
    ],
)
def test_a_grouping_the_core_does_not_take_is_refused_when_built(name, heads, message):
    with pytest.raises(VariantError, match=message):
        variants.AttentionLayer(D_MODEL, 2, name, **heads)


def test_packed_input_must_be_one_row():
    layer = variants.AttentionLayer(D_MODEL, 2, "linear")
    with pytest.raises(VariantError, match=r"x \[1, total_T, d_model\]"):
        layer(torch.randn(2, 6, D_MODEL), cu_seqlens=torch.tensor([0, 3, 6], dtype=torch.int32))

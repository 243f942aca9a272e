"""harness.models: the decoder-only LM. Parallel logits == step loop, gradients, tying, presets, errors."""

from __future__ import annotations

import math

import pytest
import torch

import variants
from harness.models import LM_PRESETS, DecoderConfig, lm_config
from harness.models.decoder import DecoderLM

BATCH, VOCAB, CONTEXT = 2, 50, 24


def tiny_config(variant: str, **overrides) -> DecoderConfig:
    sizes = dict(vocab_size=VOCAB, n_layers=2, d_model=16, n_heads=2, d_ff=32, context=CONTEXT, variant=variant)
    return DecoderConfig(**{**sizes, **overrides})


def build(variant: str, seed: int, **overrides) -> DecoderLM:
    """A float64 tiny model, initialised from ``seed`` (the global RNG is left as it was)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return DecoderLM(tiny_config(variant, **overrides)).double()


def randomise(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Redraw every parameter (scaled by fan-in), so that attention is far from uniform."""
    with torch.no_grad():
        for param in model.parameters():
            fan_in = param.shape[-1] if param.dim() > 1 else 1
            param.copy_(torch.randn(param.shape, generator=gen, dtype=param.dtype) / math.sqrt(fan_in))


def step_loop(model: DecoderLM, tokens):
    states = model.init_state(tokens.shape[0])
    logits = []
    for t in range(tokens.shape[1]):
        logits_t, states = model.step(tokens[:, t], t, states)
        logits.append(logits_t)
    return torch.stack(logits, dim=1)


@pytest.mark.parametrize("variant", variants.names())
def test_parallel_logits_equal_step_loop(variant, seed):
    model = build(variant, seed).eval()
    gen = torch.Generator().manual_seed(seed)
    randomise(model, gen)
    tokens = torch.randint(VOCAB, (BATCH, CONTEXT), generator=gen)
    parallel = model(tokens)
    assert parallel.shape == (BATCH, CONTEXT, VOCAB) and parallel.dtype == torch.float64
    stepped = step_loop(model, tokens)
    assert stepped.shape == (BATCH, CONTEXT, VOCAB)
    torch.testing.assert_close(parallel, stepped, rtol=1e-9, atol=1e-9, msg=lambda m: f"{variant}: parallel vs step loop (seed {seed}): {m}")
    spread = (parallel - parallel.mean(-1, keepdim=True)).abs().max()
    assert spread > 1e-2, f"{variant} (seed {seed}): logits are (almost) constant; the comparison says nothing"
    # A shorter prefix gives the same logits: nothing leaks from later tokens.
    torch.testing.assert_close(model(tokens[:, :7]), parallel[:, :7], rtol=1e-9, atol=1e-9, msg=lambda m: f"{variant}: causality (seed {seed}): {m}")


@pytest.mark.parametrize("variant", variants.names())
def test_loss_and_gradients(variant, seed):
    model = build(variant, seed)  # as initialised for training
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(VOCAB, (BATCH, CONTEXT + 1), generator=gen)
    loss = model.loss(tokens[:, :-1], tokens[:, 1:])
    assert loss.dim() == 0 and torch.isfinite(loss), f"{variant} (seed {seed}): loss {loss}"
    # Near-uniform predictions at initialisation: the loss is close to log(vocab).
    assert abs(loss.item() - math.log(VOCAB)) < 0.5, f"{variant} (seed {seed}): initial loss {loss.item():.3f}"
    loss.backward()
    named = dict(model.named_parameters())
    if variant == "delta":
        assert "blocks.0.attn.write_strength.weight" in named and "blocks.1.attn.write_strength.bias" in named
    for name, param in named.items():
        assert param.grad is not None, f"{variant} (seed {seed}): {name} has no gradient"
        assert torch.isfinite(param.grad).all(), f"{variant} (seed {seed}): d loss/d {name} is not finite"
        assert param.grad.abs().max() > 0, f"{variant} (seed {seed}): d loss/d {name} is zero"


def test_tied_embeddings_share_storage(seed):
    tied = build("softmax", seed)
    assert tied.head.weight is tied.embed.weight
    assert tied.head.weight.data_ptr() == tied.embed.weight.data_ptr()
    untied = build("softmax", seed, tie_embeddings=False)
    assert untied.head.weight.data_ptr() != untied.embed.weight.data_ptr()
    assert untied.num_parameters() == tied.num_parameters() + VOCAB * 16


def small_lm_parameters(vocab, d_model, context, n_layers, d_ff, n_heads, write_strength=False):
    """The parameter count of the "small" LM from its formula (tied output, bias-free attention)."""
    layer_norm = 2 * d_model
    attention = 4 * d_model * d_model + (d_model * n_heads + n_heads if write_strength else 0)
    feed_forward = d_model * d_ff + d_ff + d_ff * d_model + d_model
    block = 2 * layer_norm + attention + feed_forward
    return vocab * d_model + context * d_model + n_layers * block + layer_norm


@pytest.mark.parametrize("variant", ["softmax", "delta"])
def test_small_preset(variant):
    config = lm_config("small", 1000, variant=variant)
    assert (config.n_layers, config.d_model, config.n_heads, config.d_ff, config.context) == (16, 128, 8, 2048, 256)
    model = DecoderLM(config)
    assert len(model.blocks) == 16
    assert all(block.ln1.normalized_shape == (128,) and block.attn.out.out_features == 128 for block in model.blocks)
    assert model.embed.weight.shape == (1000, 128) and model.positions.weight.shape == (256, 128)
    expected = small_lm_parameters(1000, 128, 256, 16, 2048, 8, write_strength=variant == "delta")
    assert model.num_parameters() == expected


def test_presets_and_overrides():
    assert set(LM_PRESETS) == {"small", "medium", "cpu"}
    medium = lm_config("medium", 300)
    assert (medium.vocab_size, medium.n_layers, medium.d_model, medium.n_heads, medium.d_ff, medium.context) == (
        300,
        16,
        256,
        8,
        4096,
        384,
    )
    config = lm_config("cpu", 100, variant="delta", variant_params={"chunk_size": 8}, dropout=0.1)
    assert (config.variant, config.variant_params, config.dropout, config.tie_embeddings) == ("delta", {"chunk_size": 8}, 0.1, True)
    assert lm_config("cpu", 100).variant_params == {}, "variant_params must not be shared between configs"


def test_too_long_sequence_raises(seed):
    model = build("linear", seed)
    tokens = torch.zeros(1, CONTEXT + 1, dtype=torch.long)
    with pytest.raises(ValueError, match=rf"T={CONTEXT + 1}.*context={CONTEXT}"):
        model(tokens)
    with pytest.raises(ValueError, match=rf"position={CONTEXT}.*context"):
        model.step(tokens[:, 0], CONTEXT, model.init_state(1))


def test_unknown_preset_raises():
    with pytest.raises(ValueError, match=r"unknown LM preset 'large'.*small, medium, cpu"):
        lm_config("large", 100)


def test_unknown_override_raises():
    with pytest.raises(ValueError, match=r"override\(s\) n_layer\b.*n_layers"):
        lm_config("cpu", 100, n_layer=2)

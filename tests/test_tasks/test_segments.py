"""Segment-level recurrence of the language model: Transformer-XL, the Recurrent Memory
Transformer and the carried fast-weight state (harness.models.SegmentConfig)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import attnbench, needs_shared

from harness.models import DecoderConfig, SegmentConfig
from harness.models.decoder import DecoderLM
from harness.tasks.lm import LMConfig, evaluate_segments, evaluate_windows, main, run_lm

VOCAB = 40

LENGTH = 4


def segment_model(variant: str, seed: int, segment: SegmentConfig | None, **overrides) -> DecoderLM:
    """A float64 two-layer model with weights far from zero, positions for one segment."""
    torch.manual_seed(seed)
    context = segment.positions() if segment else LENGTH
    config = DecoderConfig(vocab_size=VOCAB, n_layers=2, d_model=16, n_heads=2, d_ff=32, context=context, variant=variant, segment=segment, **overrides)
    model = DecoderLM(config).double().eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 1 / math.sqrt(param.shape[-1]))
    return model


def random_tokens(seed: int, *shape, low: int = 0, high: int = VOCAB) -> torch.Tensor:
    return torch.randint(low, high, shape, generator=torch.Generator().manual_seed(seed))


# --- configuration -------------------------------------------------------------------


def test_bad_segment_options_name_the_field():
    with pytest.raises(ValueError, match="segment.kind"):
        SegmentConfig("lstm")
    with pytest.raises(ValueError, match="segment.length"):
        SegmentConfig("xl", length=0)
    with pytest.raises(ValueError, match="segment.memory"):
        SegmentConfig("rmt", length=4)
    with pytest.raises(ValueError, match="segment.memory"):
        SegmentConfig("xl", length=4, memory=2)
    with pytest.raises(ValueError, match="segment.bptt"):
        SegmentConfig("xl", length=4, bptt=2)
    too_long = SegmentConfig("rmt", length=4, memory=1)  # 6 positions
    with pytest.raises(ValueError, match="context=5"):
        DecoderLM(DecoderConfig(vocab_size=VOCAB, n_layers=1, d_model=8, n_heads=2, d_ff=8, context=5, segment=too_long))


def test_config_validates_the_segment_field():
    from pydantic import ValidationError

    assert LMConfig(segment={"kind": "xl", "length": 8}).segment == {"kind": "xl", "length": 8}
    assert LMConfig(segment="carry_state").segment == {"kind": "carry_state"}
    with pytest.raises(ValidationError, match="segment.kind"):
        LMConfig(segment={"kind": "nope"})
    with pytest.raises(ValidationError, match="unknown segment field"):
        LMConfig(segment={"kind": "xl", "size": 8})


# --- Transformer-XL --------------------------------------------------------------------


def xl_by_hand(model: DecoderLM, tokens, cached) -> torch.Tensor:
    """Dai et al. 2019, eq. in §3.2 with pre-LayerNorm blocks: q from ln(h), k and v from
    ln([m; h]); query t sees all M cached positions and the current ones up to t."""
    x = model.embed(tokens) + model.positions.weight[: tokens.shape[1]]
    length, size = tokens.shape[1], cached[0].shape[1]
    visible = torch.ones(length, size + length, dtype=torch.bool).tril(size)
    for block, memory in zip(model.blocks, cached):
        layer, layer_heads = block.attn, (block.attn.n_heads, -1)
        normed, everything = block.ln1(x), block.ln1(torch.cat([memory, x], 1))
        q = layer.query(normed).view(*x.shape[:2], *layer_heads).transpose(1, 2)
        k = layer.key(everything).view(*everything.shape[:2], *layer_heads).transpose(1, 2)
        v = layer.value(everything).view(*everything.shape[:2], *layer_heads).transpose(1, 2)
        scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~visible, -math.inf)
        attended = (scores.softmax(-1) @ v).transpose(1, 2).flatten(2)
        x = x + layer.out(attended)
        x = x + block.ff(block.ln2(x))
    return model.head(model.ln_f(x))


def test_xl_attends_to_the_cached_segment_and_stops_its_gradient(seed):
    model = segment_model("softmax", seed, SegmentConfig("xl", length=LENGTH)).train()  # dropout 0
    first, second = random_tokens(seed, 2, LENGTH), random_tokens(seed + 1, 2, LENGTH)
    logits_first, cached = model.segment(first)
    # the cache holds each block's input of segment 1, detached
    x = model.embed(first) + model.positions.weight[:LENGTH]
    for block, memory in zip(model.blocks, cached):
        torch.testing.assert_close(memory, x, rtol=1e-12, atol=1e-12)
        assert not memory.requires_grad and memory.grad_fn is None
        x = block(x)
    assert logits_first.requires_grad
    logits, _ = model.segment(second, cached)
    torch.testing.assert_close(logits, xl_by_hand(model, second, cached), rtol=1e-10, atol=1e-10, msg=f"seed={seed}")
    alone, _ = model.segment(second)
    assert (logits - alone).abs().max() > 1e-3, "the cache changes segment 2"
    # a loss on segment 2 gives segment 1's token embeddings no gradient (tokens disjoint, untied head)
    model = segment_model("softmax", seed, SegmentConfig("xl", length=LENGTH), tie_embeddings=False)
    first, second = random_tokens(seed, 1, LENGTH, high=10), random_tokens(seed, 1, LENGTH, low=20)
    nll = model.segments(torch.cat([first, second], 1), torch.cat([second, second], 1))[0]
    nll[:, LENGTH:].sum().backward()
    assert model.embed.weight.grad[:10].abs().max() == 0 and model.embed.weight.grad[20:].abs().max() > 0


def test_xl_refuses_other_attention(seed):
    with pytest.raises(ValueError, match="softmax"):
        segment_model("linear", seed, SegmentConfig("xl", length=LENGTH))


# --- Recurrent Memory Transformer ------------------------------------------------------


@pytest.mark.parametrize("variant", ["softmax", "delta"])
def test_rmt_memory_carries_information_and_gradients_follow_bptt(seed, variant):
    def rmt(bptt):
        segment = SegmentConfig("rmt", length=LENGTH, memory=2, bptt=bptt)
        return segment_model(variant, seed, segment, tie_embeddings=False)

    model = rmt(2)
    first, second = random_tokens(seed, 1, LENGTH, high=10), random_tokens(seed, 1, LENGTH, low=20)
    _, memory = model.segment(first)
    assert memory.shape == (1, 2, 16)
    assert (model.segment(second, memory)[0] - model.segment(second)[0]).abs().max() > 1e-3, "memory written by segment 1"
    tokens, targets = torch.cat([first, second], 1), torch.cat([second, second], 1)
    touched = {}
    for bptt in (1, 2):
        model = rmt(bptt)
        model.segments(tokens, targets)[0][:, LENGTH:].sum().backward()
        touched[bptt] = model.embed.weight.grad[:10].abs().max().item()  # rows only segment 1 reads
        assert model.embed.weight.grad[20:].abs().max() > 0
    assert touched[1] == 0 and touched[2] > 1e-6, f"{variant}, seed={seed}: {touched}"


# --- the carried fast-weight state -----------------------------------------------------


@pytest.mark.parametrize("variant, params", [("linear", {}), ("delta", {"chunk_size": 2})])
def test_carried_state_equals_one_parallel_pass_forward_and_backward(seed, variant, params):
    """Segments of L tokens each continuing from the previous state (positions restarting)
    are one causal pass over the concatenation with positions i mod L, gradients included."""
    carried = segment_model(variant, seed, SegmentConfig("carry_state", length=LENGTH), variant_params=params)
    plain = segment_model(variant, seed, None, variant_params=params)
    tokens, targets = random_tokens(seed, 2, 11), random_tokens(seed + 1, 2, 11)  # 2.75 segments
    by_segment = carried(tokens, targets=targets)
    parallel = plain(tokens, positions=torch.arange(11) % LENGTH, targets=targets)
    torch.testing.assert_close(by_segment, parallel, rtol=1e-10, atol=1e-12, msg=f"{variant}, seed={seed}")
    by_segment.sum().backward()
    parallel.sum().backward()
    for (name, a), b in zip(carried.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-11, msg=f"{variant} {name}, seed={seed}")
    with torch.no_grad():
        whole = evaluate_segments(carried, torch.cat([tokens[0], targets[0, -1:]]))
        windows = evaluate_windows(carried, torch.cat([tokens[0], targets[0, -1:]]), LENGTH)
    assert abs(whole - windows) > 1e-6, "the carried state changes the predictions"


def test_carry_state_refuses_softmax(seed):
    with pytest.raises(ValueError, match="linear-time"):
        segment_model("softmax", seed, SegmentConfig("carry_state", length=LENGTH))


# --- training through the task, the command line and the runner ------------------------

TINY = {"n_layers": 1, "d_model": 32, "n_heads": 2, "d_ff": 64}


@needs_shared
@pytest.mark.parametrize(
    "variant, segment",
    [
        ("softmax", {"kind": "rmt", "length": 16, "segments": 2, "memory": 2}),
        ("delta", {"kind": "carry_state", "length": 16, "segments": 3, "bptt": 2}),
    ],
)
def test_segment_training_lowers_the_loss(variant, segment):
    config = LMConfig(steps=30, batch=8, lr=3e-3, warmup=3, dropout=0.0, model_overrides=TINY, eval_tokens=300, log_every=5, threads=1, segment=segment)
    metrics = run_lm(variant, {}, config, context=16)
    curve = [loss for _, loss in metrics["losses"]]
    assert curve[-1] < curve[0] - 0.5, curve
    assert metrics["words"] == 30 * 8 * segment["segments"] * 16 and metrics["segment"]["kind"] == segment["kind"]
    assert 1 < metrics["valid_ppl_segment"] < 1e5 and 1 < metrics["test_ppl_segment"] < 1e5 and metrics["test_ppl"] > 1
    assert "valid_ppl_sliding" not in metrics and "valid_ppl_carry" not in metrics


@needs_shared
@pytest.mark.slow
def test_command_line_trains_transformer_xl(tmp_path, capsys):
    args = [
        "--variant",
        "softmax",
        "--segment",
        "{kind: xl, length: 16, segments: 2}",
        "--steps",
        "30",
        "--batch",
        "8",
        "--lr",
        "3e-3",
        "--warmup",
        "3",
        "--dropout",
        "0",
        "--eval-tokens",
        "300",
        "--threads",
        "1",
        "--out",
        str(tmp_path),
    ]
    assert main(args) == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    # logged at steps 25 and 30; an untrained model's loss is about log V = 10.4
    assert metrics["losses"][-1][1] < math.log(metrics["vocab_size"]) - 2, metrics["losses"]
    assert metrics["context"] == 16 and metrics["words"] == 30 * 8 * 2 * 16 and metrics["valid_ppl_segment"] > 1
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(["--variant", "softmax", "--segment", "rmt", "--out", str(tmp_path / "x")])
    assert exit_.value.code == 2 and capsys.readouterr().err.startswith("error: --segment: segment.memory: rmt needs memory >= 1")


@needs_shared
@pytest.mark.slow
def test_ci_segment_preset_runs_through_the_runner(tmp_path):
    from harness.results import load

    done = attnbench("run", "quality/lm-wikitext", "--preset", "ci-segment", "--out", str(tmp_path), "--no-progress")
    assert done.returncode == 0, done.stderr
    table = load([tmp_path])
    assert set(table["status"]) == {"ok"}, table[["variant", "error"]]
    assert (table["metrics.valid_ppl_segment"] > 1).all() and (table["metrics.test_ppl_segment"] > 1).all()


def test_segment_scores_match_a_plain_loss(seed):
    """Without targets, segments return log-softmax-able logits whose NLLs are the target path's."""
    model = segment_model("softmax", seed, SegmentConfig("rmt", length=LENGTH, memory=1))
    tokens, targets = random_tokens(seed, 2, 9), random_tokens(seed + 1, 2, 9)
    logits, _ = model.segments(tokens)
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(2, 9)
    torch.testing.assert_close(model.segments(tokens, targets)[0], expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("preset", ["xl", "rmt", "carry", "ci-segment"])
def test_segment_presets_build_their_models(preset):
    """Every cell of the shipped segment presets is a model the segment kind accepts."""
    from harness.models import lm_config
    from harness.scenarios.scenario import load_scenario

    cells = load_scenario("quality/lm-wikitext", preset=preset).cells()
    assert cells and all(cell.task["segment"]["kind"] != "none" for cell in cells)
    for cell in cells:
        segment = SegmentConfig(**dict(cell.task["segment"], length=cell.axes["seq_len"]))
        sizes = dict(cell.task["model_overrides"], context=segment.positions())
        model = DecoderLM(lm_config(cell.task["preset"], VOCAB, variant=cell.variant, variant_params=cell.params, segment=segment, **sizes))
        assert (model.memory is not None) == (segment.kind == "rmt"), cell.variant


def test_segment_targets_cover_every_position(seed):
    model = segment_model("linear", seed, SegmentConfig("carry_state", length=LENGTH))
    with pytest.raises(ValueError, match="targets must have the tokens' shape"):
        model(random_tokens(seed, 1, 6), targets=random_tokens(seed, 1, 1))
    with pytest.raises(ValueError, match="no positions"):
        model(random_tokens(seed, 1, 3), positions=torch.arange(3))

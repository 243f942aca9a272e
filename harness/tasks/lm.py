"""Word-level language modelling on WikiText with any attention variant (Schlag et al. 2021, §6.3).

A ``harness.models.DecoderLM`` is trained on random contiguous windows of the training stream
(``WindowBatches``) by the shared engine (``harness.tasks.training``), then evaluated by
perplexity, exp of the mean negative log-likelihood per token, under three protocols:

- ``evaluate_windows``: the stream cut into non-overlapping windows of ``context`` tokens; each
  token is predicted once, from the tokens before it in its window (0 .. context − 1 of them).
- ``evaluate_sliding``: the paper's protocol: batch 1, a window of ``context`` tokens sliding by
  one; the first window counts all its predictions, every later window only its last one, so
  each token after the first window is predicted from exactly context − 1 tokens before it.
- ``evaluate_carry`` (linear-time variants): consecutive windows of ``context`` tokens, each
  continuing from the fast-weight state the previous one left (``DecoderLM.prefill``); positions
  restart at 0 in every window, so this is the model run over the whole stream without
  truncating its context ("carrying the state across segments").

A segment model (``segment``: Transformer-XL, the Recurrent Memory Transformer, or the
fast-weight state carried, ``harness.models.SegmentConfig``) trains on samples of ``segments``
consecutive segments and is evaluated by ``evaluate_segments``: the whole split as one run of
segments, each continuing from the cache, memory or state the previous one left.

``python -m harness.tasks.lm`` (or ``torchrun --nproc_per_node N -m harness.tasks.lm``) runs one
training; the harness runs the same through ``run_lm`` as the cells of an ``lm`` scenario.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from variants import VariantError

from ..models import SEGMENT_KINDS, DecoderLM, SegmentConfig, lm_config
from .download import DataError
from .training import CheckpointError, Distributed, TrainConfig, train
from .wikitext import load_wikitext

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# --- data ------------------------------------------------------------------------------


class WindowBatches:
    """Training batches of the token stream ``tokens`` (1-D): ``batch`` windows of ``context + 1``
    tokens at uniformly random offsets, as ``(inputs, targets)`` of ``[batch / world_size,
    context]`` each (targets are the inputs shifted by one). Every rank draws the same global
    offsets from a generator seeded with ``seed`` and keeps its own rows, so the global batch
    does not depend on the number of ranks. The position is the generator's state."""

    def __init__(self, tokens: torch.Tensor, context: int, batch: int, *, seed: int, rank: int = 0,
                 world_size: int = 1, device="cpu"):
        if batch % world_size:
            raise ValueError(f"batch={batch} must be divisible by the number of processes ({world_size})")
        if len(tokens) < context + 1:
            raise ValueError(f"the training stream has {len(tokens)} tokens, fewer than context + 1 = {context + 1}")
        self.tokens, self.context, self.batch, self.device = tokens, context, batch, torch.device(device)
        per_rank = batch // world_size
        self.rows = slice(rank * per_rank, (rank + 1) * per_rank)
        self.generator = torch.Generator().manual_seed(seed)
        self.offsets = torch.arange(context + 1)

    def next(self):
        starts = torch.randint(0, len(self.tokens) - self.context, (self.batch,), generator=self.generator)
        windows = self.tokens[starts[self.rows, None] + self.offsets].to(self.device)
        return windows[:, :-1], windows[:, 1:]

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


def lm_loss(model, batch) -> tuple[torch.Tensor, int]:
    """Mean next-token cross-entropy of a ``(inputs, targets)`` batch and its number of words."""
    inputs, targets = batch
    return model(inputs, targets=targets).mean(), targets.numel()


# --- evaluation ------------------------------------------------------------------------


def _nll_sum(model, inputs, targets) -> float:
    """Summed NLL of ``targets [B, T']`` at the last T' positions of ``inputs [B, T]``."""
    return model(inputs, targets=targets).double().sum().item()


def _prefix(tokens: torch.Tensor, limit: int | None) -> torch.Tensor:
    """The first ``limit`` tokens (all when None); at least two are needed for one prediction."""
    tokens = tokens if limit is None else tokens[:limit]
    if len(tokens) < 2:
        raise ValueError(f"evaluation needs at least 2 tokens, got {len(tokens)}")
    return tokens


@torch.no_grad()
def evaluate_windows(model: DecoderLM, tokens: torch.Tensor, context: int, *, batch: int = 16,
                     limit: int | None = None) -> float:
    """Mean NLL (nats) per predicted token over non-overlapping windows of ``context`` inputs
    (the last window may be shorter): token i + 1 is predicted from tokens ⌊i/c⌋c .. i."""
    tokens = _prefix(tokens, limit)
    device = model.embed.weight.device
    inputs, targets = tokens[:-1].to(device), tokens[1:].to(device)
    full = len(inputs) // context * context
    total = 0.0
    windows_x, windows_y = inputs[:full].view(-1, context), targets[:full].view(-1, context)
    for start in range(0, len(windows_x), batch):
        total += _nll_sum(model, windows_x[start : start + batch], windows_y[start : start + batch])
    if full < len(inputs):
        total += _nll_sum(model, inputs[None, full:], targets[None, full:])
    return total / len(inputs)


@torch.no_grad()
def evaluate_sliding(model: DecoderLM, tokens: torch.Tensor, context: int, *, batch: int = 32,
                     limit: int | None = None) -> float:
    """Mean NLL (nats) per predicted token under the sliding-window protocol (module docstring).
    With inputs x_0 .. x_{L−1} and targets y_i = x_{i+1}: for i < c, y_i is scored from the
    window x_0 .. x_{c−1} at position i; for i ≥ c, from the window x_{i−c+1} .. x_i at its last
    position. The later windows are evaluated ``batch`` at a time (each is independent, so
    this equals batch 1)."""
    tokens = _prefix(tokens, limit)
    device = model.embed.weight.device
    inputs, targets = tokens[:-1].to(device), tokens[1:].to(device)
    first = min(context, len(inputs))
    total = _nll_sum(model, inputs[None, :first], targets[None, :first])
    # window s = x_s .. x_{s+c−1} scores y_{s+c−1}; s = 1 .. L − c
    later = inputs.unfold(0, context, 1)[1:] if len(inputs) > context else inputs[:0].view(0, context)
    for start in range(0, len(later), batch):
        windows = later[start : start + batch]
        scored = targets[context + start : context + start + len(windows)]
        total += _nll_sum(model, windows, scored[:, None])
    return total / len(inputs)


@torch.no_grad()
def evaluate_carry(model: DecoderLM, tokens: torch.Tensor, context: int, *, limit: int | None = None) -> float:
    """Mean NLL (nats) per predicted token over consecutive windows of ``context`` inputs, each
    continuing from the state the previous window left (positions restart at 0 in each)."""
    if not model.linear_time:
        raise ValueError("carry-state evaluation needs a linear-time variant (a fixed-size fast-weight state); "
                         "softmax attention's KV cache would grow with the whole stream")
    tokens = _prefix(tokens, limit)
    device = model.embed.weight.device
    inputs, targets = tokens[:-1].to(device), tokens[1:].to(device)
    total, states = 0.0, None
    for start in range(0, len(inputs), context):
        nll, states = model.prefill(inputs[None, start : start + context], states, targets=targets[None, start : start + context])
        total += nll.double().sum().item()
    return total / len(inputs)


@torch.no_grad()
def evaluate_segments(model: DecoderLM, tokens: torch.Tensor, *, limit: int | None = None) -> float:
    """Mean NLL (nats) per predicted token of a segment model run over the whole stream (batch
    1): consecutive segments of ``segment.length`` inputs, each continuing from the cache,
    memory or state the previous one left (``DecoderLM.segments``)."""
    if model.config.segment is None or not model.config.segment.active:
        raise ValueError("evaluate_segments needs a segment model (an active LMConfig.segment)")
    tokens = _prefix(tokens, limit)
    device = model.embed.weight.device
    return _nll_sum(model, tokens[None, :-1].to(device), tokens[None, 1:].to(device)) / (len(tokens) - 1)


def perplexity(nll: float) -> float:
    return math.exp(nll)


# --- one run ---------------------------------------------------------------------------


def run_lm(
    variant: str,
    params: dict,
    *,
    preset: str,
    steps: int,
    batch: int,
    lr: float,
    warmup: int = 0,
    dropout: float = 0.1,
    weight_decay: float = 0.0,
    clip: float | None = 1.0,
    context: int | None = None,
    eval_tokens: int | None = None,
    sliding_tokens: int | None = 2048,
    carry: bool = True,
    eval_every: int | None = None,
    log_every: int = 25,
    data: str | None = None,
    seed: int = 0,
    device="cpu",
    dtype: str = "float32",
    adaptive_cutoffs: list[int] | None = None,
    model_overrides: dict | None = None,
    checkpoint_dir: str | None = None,
    checkpoint_every: int | None = None,
    threads: int | None = None,
    segment: dict | SegmentConfig | None = None,
    dist: Distributed | None = None,
    progress: bool = False,
) -> dict:
    """Train a DecoderLM of ``preset`` (``context`` overrides the preset's) with attention
    ``variant(**params)`` on WikiText and evaluate it; returns the metrics as a JSON-ready dict
    (complete on the main rank). ``eval_tokens`` / ``sliding_tokens`` limit the evaluations to
    the first so many tokens of each split (None: all); ``carry`` adds the carry-state
    evaluation for linear-time variants. ``batch`` is the global batch (over all ranks);
    ``adaptive_cutoffs`` (e.g. [2000, 10000]) replace the tied output layer by an adaptive softmax.
    ``segment`` (a ``SegmentConfig`` or its fields) makes it a segment model: ``length`` defaults
    to the context, a training sample is ``segments`` segments, and the final evaluation reports
    ``valid_ppl_segment`` / ``test_ppl_segment`` (docs/language-modelling.md)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)} (bfloat16 runs under autocast), got {dtype!r}")
    if threads:
        torch.set_num_threads(threads)
    dist = dist or Distributed(0, 1, torch.device(device))
    corpus = load_wikitext(data)
    overrides = dict(model_overrides or {}, dropout=dropout, variant=variant, variant_params=dict(params))
    if adaptive_cutoffs:
        overrides["adaptive_cutoffs"] = tuple(adaptive_cutoffs)
    if context is not None:
        overrides["context"] = context
    segment = SegmentConfig(**segment) if isinstance(segment, dict) else segment
    if segment is not None and segment.active:
        length = segment.length or overrides.get("context") or lm_config(preset, corpus.vocab_size).context
        segment = replace(segment, length=length)
        overrides.update(segment=segment, context=segment.positions())
    else:
        segment = None
    config = lm_config(preset, corpus.vocab_size, **overrides)
    torch.manual_seed(seed)
    model = DecoderLM(config).to(dist.device)
    autocast = torch.autocast(dist.device.type, dtype=DTYPES[dtype], enabled=dtype != "float32")
    # the window of the plain evaluations (a segment model: one segment from the initial memory)
    context = segment.length if segment else config.context

    def evaluate(m):
        with autocast:
            return {"valid_ppl": perplexity(evaluate_windows(m, corpus["valid"], context, limit=eval_tokens))}

    def loss_fn(m, batch_):
        with autocast:
            return lm_loss(m, batch_)

    sample = context * segment.segments if segment else context
    batches = WindowBatches(corpus["train"], sample, batch, seed=seed, rank=dist.rank, world_size=dist.world_size,
                            device=dist.device)
    train_config = TrainConfig(
        steps=steps, lr=lr, warmup=warmup, clip=clip, weight_decay=weight_decay, eval_every=eval_every,
        checkpoint_every=checkpoint_every, checkpoint_dir=checkpoint_dir, log_every=log_every, seed=seed,
    )
    result = train(model, loss_fn, batches, train_config, evaluate=evaluate, dist=dist, progress=progress)
    metrics = {
        "steps": result.steps,
        "loss": result.losses[-1][1],
        "loss_curve": [list(point) for point in result.losses],
        "evaluations": [[step, values] for step, values in result.evaluations],
        "words": result.units,
        "words_per_s": result.units_per_s,
        "train_s": result.train_s,
        "wall_s": result.wall_s,
        "peak_mem_bytes": result.peak_mem_bytes,
        "memory_kind": result.memory_kind,
        "resumed_from": result.resumed_from,
        "processes": dist.world_size,
        "torch_threads": torch.get_num_threads(),
        "num_parameters": model.num_parameters(),
        "vocab_size": corpus.vocab_size,
        "context": context,
        "segment": asdict(segment) if segment else None,
        "batch": batch,
        "data": str(corpus.directory),
        "unigram_ppl": math.exp(corpus.unigram_entropy()),
    }
    if dist.is_main:
        started = time.perf_counter()
        if segment:
            metrics.update(_segment_evaluation(model, corpus, context, autocast, eval_tokens))
        else:
            metrics.update(_final_evaluation(model, corpus, context, autocast, eval_tokens, sliding_tokens, carry))
        metrics["valid_ppl"] = result.evaluations[-1][1]["valid_ppl"]
        metrics["final_eval_s"] = time.perf_counter() - started
        metrics["wall_s"] += metrics["final_eval_s"]
    return metrics


def _final_evaluation(model, corpus, context, autocast, eval_tokens, sliding_tokens, carry) -> dict:
    """Test perplexity, sliding-window valid perplexity and (linear-time) carry-state perplexities."""
    model.eval()
    with autocast:
        metrics = {
            "test_ppl": perplexity(evaluate_windows(model, corpus["test"], context, limit=eval_tokens)),
            "valid_ppl_sliding": perplexity(evaluate_sliding(model, corpus["valid"], context, limit=sliding_tokens)),
            "eval_tokens": {split: len(_prefix(corpus[split], eval_tokens)) for split in ("valid", "test")},
            "sliding_tokens": len(_prefix(corpus["valid"], sliding_tokens)),
        }
        if carry and model.linear_time:
            for split in ("valid", "test"):
                metrics[f"{split}_ppl_carry"] = perplexity(evaluate_carry(model, corpus[split], context, limit=eval_tokens))
    return metrics


def _segment_evaluation(model, corpus, length, autocast, eval_tokens) -> dict:
    """A segment model's test perplexity over segments taken alone (``test_ppl``: non-overlapping
    windows of ``length``, each from the initial cache, memory or state) and its perplexities
    with the recurrence carried over the whole of each split (``*_ppl_segment``)."""
    model.eval()
    with autocast:
        metrics = {
            "test_ppl": perplexity(evaluate_windows(model, corpus["test"], length, limit=eval_tokens)),
            "eval_tokens": {split: len(_prefix(corpus[split], eval_tokens)) for split in ("valid", "test")},
        }
        for split in ("valid", "test"):
            metrics[f"{split}_ppl_segment"] = perplexity(evaluate_segments(model, corpus[split], limit=eval_tokens))
    return metrics


# --- command line ----------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m harness.tasks.lm",
        description="Train and evaluate one WikiText language model (also under torchrun --nproc_per_node N).",
    )
    parser.add_argument("--variant", required=True, help="attention variant (softmax, linear, performer, dpfp, delta, ...)")
    parser.add_argument("--params", default="{}", help='variant parameters as JSON, e.g. \'{"m": 64}\'')
    parser.add_argument("--preset", default="cpu", help="model preset of harness.models.LM_PRESETS (default: cpu)")
    parser.add_argument("--data", help="a WikiText directory (default: $ATTNBENCH_DATA/wikitext-2, else the shared data)")
    parser.add_argument("--out", required=True, help="directory for metrics.json and checkpoints/ (a rerun resumes)")
    parser.add_argument("--steps", type=int, default=700)
    parser.add_argument("--batch", type=int, default=16, help="global batch in windows (over all processes)")
    parser.add_argument("--context", type=int, help="training context (default: the preset's)")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--adaptive-cutoffs", type=_cutoffs, default=[2000, 10000],
                        help="adaptive softmax cutoffs (default: 2000,10000); 'none': a full softmax tied to the embedding")
    parser.add_argument("--eval-tokens", type=_count_or_all, help="evaluate on the first N tokens of valid/test (default: all)")
    parser.add_argument("--sliding-tokens", type=_count_or_all, default=2048,
                        help="sliding-window evaluation on the first N valid tokens (default: 2048; 'all': the whole split)")
    parser.add_argument("--no-carry", action="store_true", help="skip the carry-state evaluation")
    parser.add_argument("--segment", choices=SEGMENT_KINDS, default="none",
                        help="segment-level recurrence: xl (Transformer-XL), rmt (Recurrent Memory Transformer), "
                             "carry_state (linear-time variants); default none")
    parser.add_argument("--segment-length", type=int, help="tokens per segment (default: the context)")
    parser.add_argument("--segments", type=int, default=2, help="consecutive segments per training sample (default: 2)")
    parser.add_argument("--memory", type=int, default=0, help="rmt: memory tokens")
    parser.add_argument("--bptt", type=int, help="segments that gradients flow through (default: all of a sample)")
    parser.add_argument("--eval-every", type=int)
    parser.add_argument("--checkpoint-every", type=int, default=250)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda:LOCAL_RANK if available, else cpu)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (CPU)")
    return parser


def _count_or_all(text: str) -> int | None:
    if text.lower() == "all":
        return None
    if not text.isdigit() or int(text) < 2:
        raise argparse.ArgumentTypeError(f"expected a number of tokens >= 2 or 'all', got {text!r}")
    return int(text)


def _cutoffs(text: str) -> list[int] | None:
    if text.lower() == "none":
        return None
    try:
        return [int(cutoff) for cutoff in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 2000,10000, or none; got {text!r}") from None


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        params = json.loads(args.params)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"--params: not valid JSON ({exc}): {args.params}") from None
    try:
        segment = SegmentConfig(args.segment, args.segment_length, args.segments, args.memory, args.bptt)
    except ValueError as exc:
        raise SystemExit(f"--segment options: {exc}") from None
    dist = Distributed.from_env(args.device)
    out = Path(args.out)
    try:
        metrics = run_lm(
            args.variant, params, preset=args.preset, steps=args.steps, batch=args.batch, lr=args.lr, warmup=args.warmup,
            dropout=args.dropout, adaptive_cutoffs=args.adaptive_cutoffs, context=args.context,
            eval_tokens=args.eval_tokens, sliding_tokens=args.sliding_tokens,
            carry=not args.no_carry, eval_every=args.eval_every, data=args.data, seed=args.seed, dtype=args.dtype, threads=args.threads,
            checkpoint_dir=str(out / "checkpoints"), checkpoint_every=args.checkpoint_every, segment=segment, dist=dist, progress=True,
        )
        if dist.is_main:
            metrics["config"] = {key: value for key, value in vars(args).items()}
            out.mkdir(parents=True, exist_ok=True)
            temporary = out / f"metrics.json.{os.getpid()}.tmp"
            temporary.write_text(json.dumps(metrics, indent=1))
            os.replace(temporary, out / "metrics.json")
            summary = {k: metrics.get(k) for k in ("valid_ppl", "test_ppl", "valid_ppl_sliding", "valid_ppl_carry",
                                                    "valid_ppl_segment", "words_per_s", "wall_s")}
            print(json.dumps(summary))
    except (DataError, VariantError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        dist.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Word-level language modelling on WikiText with any attention variant (Schlag et al. 2021, §6.3).

A ``harness.models.decoder.DecoderLM`` is trained on random contiguous windows of the training stream
(``harness.tasks.batches.WindowBatches``) by the shared trainer (``harness.tasks.training``), then evaluated by
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

``LMConfig`` (``harness.tasks.lm_config``) holds every setting of a run, with its default. ``python -m harness.tasks.lm`` (or
``torchrun --nproc_per_node N -m harness.tasks.lm``) runs one training with an option per
setting; the harness runs the cells of an ``lm`` scenario through ``run_cell``.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from variants import VariantError

from ..common.files import write_json_atomic
from ..models import SegmentConfig, lm_config
from ..models.decoder import DecoderLM
from .batches import WindowBatches
from .command_line import CommandLine, command_line, parse_command_line
from .distributed import Distributed
from .download import DataError
from .lm_config import LMConfig
from .precision import TRAIN_DTYPES, Precision
from .training import CheckpointError, TrainConfig, train, training_metrics
from .wikitext import load_wikitext

if TYPE_CHECKING:
    from ..scenarios.cell import Cell

# --- loss ------------------------------------------------------------------------------


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
def evaluate_windows(model: DecoderLM, tokens: torch.Tensor, context: int, *, batch: int = 16, limit: int | None = None) -> float:
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
def evaluate_sliding(model: DecoderLM, tokens: torch.Tensor, context: int, *, batch: int = 32, limit: int | None = None) -> float:
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
        raise ValueError(
            "carry-state evaluation needs a linear-time variant (a fixed-size fast-weight state); softmax attention's KV cache would grow with the whole stream"
        )
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
    config: LMConfig,
    *,
    context: int | None = None,
    device="cpu",
    dtype: str = "float32",
    out_dir=None,
    checkpoint_every: int | None = None,
    dist: Distributed | None = None,
    progress: bool = False,
) -> dict:
    """Train a DecoderLM with attention ``variant(**params)`` on WikiText as ``config`` says and
    evaluate it; returns the metrics as a JSON-ready dict on the main rank, {} on the others.
    ``context``: the model's window (None: the preset's); a segment model's segments are
    ``segment.length`` tokens, by default the context, and its final evaluation adds
    ``valid_ppl_segment`` / ``test_ppl_segment`` (docs/language-modelling.md). ``dtype``:
    float32, bfloat16 or float16 (``harness.tasks.precision``). Every ``checkpoint_every`` steps a checkpoint goes to
    ``out_dir/checkpoints``, from which a rerun resumes. ``dist``: this process's place under
    torchrun (default: one process on ``device``)."""
    if config.threads:
        torch.set_num_threads(config.threads)
    dist = dist or Distributed(0, 1, torch.device(device))
    precision = Precision(dtype, dist.device)
    corpus = load_wikitext(config.data)
    overrides = dict(config.model_overrides, dropout=config.dropout, variant=variant, variant_params=dict(params))
    if config.adaptive_cutoffs:
        overrides["adaptive_cutoffs"] = tuple(config.adaptive_cutoffs)
    if context is not None:
        overrides["context"] = context
    segment = SegmentConfig(**config.segment) if config.segment else None
    if segment is not None and segment.active:
        length = segment.length or overrides.get("context") or lm_config(config.preset, corpus.vocab_size).context
        segment = replace(segment, length=length)
        overrides.update(segment=segment, context=segment.positions())
    else:
        segment = None
    model_config = lm_config(config.preset, corpus.vocab_size, **overrides)
    torch.manual_seed(config.seed)
    model = DecoderLM(model_config).to(dist.device)
    # the window of the plain evaluations (a segment model: one segment from the initial memory)
    context = segment.length if segment else model_config.context

    def evaluate(m, _index):
        return {"valid_ppl": perplexity(evaluate_windows(m, corpus["valid"], context, limit=config.eval_tokens))}

    sample = context * segment.segments if segment else context
    batches = WindowBatches(corpus["train"], sample, config.batch, seed=config.seed, rank=dist.rank, world_size=dist.world_size, device=dist.device)
    train_config = TrainConfig(
        steps=config.steps,
        lr=config.lr,
        warmup=config.warmup,
        clip=config.clip,
        weight_decay=config.weight_decay,
        dtype=dtype,
        eval_every=config.eval_every,
        checkpoint_every=checkpoint_every,
        log_every=config.log_every,
        seed=config.seed,
        checkpoint_dir=str(Path(out_dir) / "checkpoints") if out_dir is not None else None,
    )
    result = train(
        model,
        lm_loss,
        batches,
        train_config,
        evaluate=evaluate,
        identity=dict(config.model_dump(exclude={"threads"}), variant=variant, params=dict(params), context=context),
        dist=dist,
        progress=progress,
    )
    if not dist.is_main:
        return {}
    metrics = {
        **training_metrics(result, dist, model),
        "words": result.units,
        "words_per_s": result.units_per_s,
        # seconds a training step takes: what the paper's 20,000 steps would cost at this setting
        "step_s": result.train_s / result.steps if result.steps else None,
        "vocab_size": corpus.vocab_size,
        "context": context,
        "segment": asdict(segment) if segment else None,
        "data": str(corpus.directory),
        "unigram_ppl": math.exp(corpus.unigram_entropy()),
        "config": config.model_dump(),
    }
    started = time.perf_counter()
    if segment:
        metrics.update(_segment_evaluation(model, corpus, context, precision, config.eval_tokens))
    else:
        metrics.update(_final_evaluation(model, corpus, context, precision, config.eval_tokens, config.sliding_tokens, config.carry))
    metrics["valid_ppl"] = result.evaluations[-1][1]["valid_ppl"]
    metrics["final_eval_s"] = time.perf_counter() - started
    metrics["wall_s"] += metrics["final_eval_s"]
    return metrics


def run_cell(cell: Cell) -> dict:
    """The metrics of a scenario cell of this task: ``cell.task`` validated as an LMConfig,
    the cell's variant with its parameters and backend, ``axes.seq_len`` as the context, on
    ``axes.device`` in ``axes.dtype``; a checkpoint at every evaluation into the cell's
    ``checkpoint_dir``, from which the cell continues when it is measured again."""
    axes = cell.axes
    params = dict(cell.params, backend=cell.backend)
    config = LMConfig.model_validate(cell.task)
    return run_lm(
        cell.variant,
        params,
        config,
        context=axes["seq_len"],
        device=axes["device"],
        dtype=axes["dtype"],
        out_dir=cell.checkpoint_dir,
        checkpoint_every=config.eval_every,
    )


def _final_evaluation(model, corpus, context, precision, eval_tokens, sliding_tokens, carry) -> dict:
    """Test perplexity, sliding-window valid perplexity and (linear-time) carry-state perplexities."""
    model.eval()
    with precision.autocast():
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


def _segment_evaluation(model, corpus, length, precision, eval_tokens) -> dict:
    """A segment model's test perplexity over segments taken alone (``test_ppl``: non-overlapping
    windows of ``length``, each from the initial cache, memory or state) and its perplexities
    with the recurrence carried over the whole of each split (``*_ppl_segment``)."""
    model.eval()
    with precision.autocast():
        metrics = {
            "test_ppl": perplexity(evaluate_windows(model, corpus["test"], length, limit=eval_tokens)),
            "eval_tokens": {split: len(_prefix(corpus[split], eval_tokens)) for split in ("valid", "test")},
        }
        for split in ("valid", "test"):
            metrics[f"{split}_ppl_segment"] = perplexity(evaluate_segments(model, corpus[split], limit=eval_tokens))
    return metrics


# --- command line ----------------------------------------------------------------------


def _command_line() -> CommandLine:
    parser = command_line(
        LMConfig,
        prog="python -m harness.tasks.lm",
        checkpoint_every=250,
        description="Train and evaluate one WikiText language model (also under torchrun --nproc_per_node N).",
    )
    parser.add_argument("--context", type=int, help="the model's context in tokens (default: the preset's)")
    parser.add_argument("--dtype", default="float32", choices=list(TRAIN_DTYPES), help="bfloat16 and float16 run under autocast (default: float32)")
    return parser


def main(argv=None) -> int:
    """Run ``python -m harness.tasks.lm``: one training, its metrics in OUT/metrics.json."""
    args, config = parse_command_line(_command_line(), LMConfig, argv)
    dist = Distributed.from_env(args.device)
    try:
        metrics = run_lm(
            args.variant,
            args.params,
            config,
            context=args.context,
            dtype=args.dtype,
            out_dir=args.out,
            checkpoint_every=args.checkpoint_every,
            dist=dist,
            progress=True,
        )
        if dist.is_main:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            write_json_atomic(Path(args.out) / "metrics.json", dict(metrics, arguments=vars(args)))
            summary = {
                k: metrics.get(k) for k in ("valid_ppl", "test_ppl", "valid_ppl_sliding", "valid_ppl_carry", "valid_ppl_segment", "words_per_s", "wall_s")
            }
            print(json.dumps(summary))
    except (DataError, VariantError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        dist.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

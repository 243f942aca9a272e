"""Machine translation quality runs: train a Seq2Seq model on parallel text, decode, score BLEU.

* Data: ``parallel_text`` (``{split}.{lang}`` files, a joint sentencepiece vocabulary). A
  source is its subwords then EOS; the decoder reads BOS + target and predicts target + EOS.
* Batches (``harness.tasks.batches.LengthBatches``): every batch holds sentences of ONE source length (so no
  padding ever reaches a non-causal attention, see ``harness.models.seq2seq``) and at most ``batch_tokens``
  padded tokens (sentences × the longer of the source and the longest target).
* Training: label-smoothed cross-entropy (Szegedy et al. 2016; ε = 0.1 as in Vaswani et al.
  2017, §5.4) with the shared trainer ``training.train`` (AdamW, warm-up and cosine decay,
  clipping, mixed precision, checkpoints, torchrun). Throughput is counted in target-side words (whitespace
  words of the raw target text) per second of training.
* Decoding: greedy or beam search (length penalty: score / length^α, as fairseq) with the
  decoder's recurrent step; timed on its own (sentences/s).
* Scoring: the detokenised output (sentencepiece decode) against the raw reference text with
  ``sacrebleu.metrics.BLEU`` (default 13a tokenisation); its signature is recorded.

``MTConfig`` (``harness.tasks.mt_config``) holds every setting of a run (``PRESETS`` the values of those left None); the
command line has an option per setting, and the harness runs the cells of an ``mt`` scenario
through ``run_cell``:

    python -m harness.tasks.mt --variant linear --preset cpu --out results/mt-linear
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

import variants

from ..common.files import write_json_atomic
from ..measuring.measure import synchronize
from ..models import config_from_preset
from ..models.seq2seq import POSITIONS, Seq2Seq, Seq2SeqConfig
from .batches import Batch, Example, LengthBatches, collate, encode_examples, groups_by_source_length
from .command_line import CommandLine, command_line, parse_command_line
from .distributed import Distributed
from .mt_config import DATASETS, PRESETS, MTConfig
from .parallel_text import BOS, EOS, PAD, dataset_dir, read_parallel, train_vocabulary
from .precision import Precision
from .training import TrainConfig, train, training_metrics

if TYPE_CHECKING:
    from ..scenarios.cell import Cell


def mt_config(preset: str, vocab_size: int, **overrides) -> Seq2SeqConfig:
    """The Seq2SeqConfig of a preset's model (``PRESETS``) for ``vocab_size`` with ``overrides`` (any field)."""
    return config_from_preset(Seq2SeqConfig, {name: sizes["model"] for name, sizes in PRESETS.items()}, "MT", preset, vocab_size, overrides)


# --- loss --------------------------------------------------------------------------------


def label_smoothed_loss(model, batch: Batch, smoothing: float = 0.1):
    """Mean label-smoothed cross-entropy over the real target tokens, and the batch's target words."""
    logits = model(batch.src, batch.tgt_in)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), batch.tgt_out.flatten(), ignore_index=PAD, label_smoothing=smoothing)
    return loss, batch.words


@torch.no_grad()
def validation_loss(model, examples: list[Example], *, device, max_sentences: int = 256) -> float:
    """Cross-entropy per target token (no smoothing) over ``examples``, teacher-forced."""
    total, tokens = 0.0, 0
    for group in groups_by_source_length(examples, max_sentences):
        batch = collate([examples[i] for i in group], device)
        logits = model(batch.src, batch.tgt_in)
        total += F.cross_entropy(logits.flatten(0, 1).float(), batch.tgt_out.flatten(), ignore_index=PAD, reduction="sum").item()
        tokens += int((batch.tgt_out != PAD).sum())
    return total / tokens


# --- decoding -----------------------------------------------------------------------------


def max_target_length(source_length: int) -> int:
    """The longest output decoded for a source of ``source_length`` tokens (EOS included)."""
    return 2 * source_length + 10


@torch.no_grad()
def greedy(model: Seq2Seq, src: torch.Tensor, max_length: int | None = None) -> list[list[int]]:
    """Greedy decoding with the recurrent step: ``src [B, S]`` (no padding) -> B token lists
    (EOS not included). Finished rows leave the batch."""
    max_length = max_target_length(src.shape[1]) if max_length is None else max_length
    state = model.start(model.encode(src))
    tokens = torch.full((src.shape[0],), BOS, dtype=torch.long, device=src.device)
    outputs: list[list[int]] = [[] for _ in range(src.shape[0])]
    alive = list(range(src.shape[0]))
    for _ in range(max_length):
        logits, state = model.step(tokens, state)
        tokens = logits.argmax(-1)
        keep = []
        for row, (sentence, token) in enumerate(zip(alive, tokens.tolist())):
            if token != EOS:
                outputs[sentence].append(token)
                keep.append(row)
        if len(keep) < len(alive):
            if not keep:
                break
            rows = torch.tensor(keep, device=src.device)
            state, tokens, alive = state.select(rows), tokens[rows], [alive[row] for row in keep]
    return outputs


@torch.no_grad()
def beam_search(model: Seq2Seq, src: torch.Tensor, beam: int, *, length_penalty: float = 1.0, max_length: int | None = None) -> list[list[int]]:
    """Beam search with the recurrent step: ``src [B, S]`` (no padding) -> B token lists (EOS
    not included), the finished hypothesis of the highest ``log p / length^length_penalty``
    (length counts EOS). Each step expands every live hypothesis, keeps the 2·beam best
    candidates, finishes those among the first ``beam`` that end in EOS and continues the
    best ``beam`` others; a sentence is done when it has ``beam`` finished hypotheses, and
    live ones are finished at ``max_length``. With beam 1 this is greedy decoding."""
    if isinstance(beam, bool) or not isinstance(beam, int) or beam < 1:
        raise ValueError(f"beam must be a positive int, got {beam!r}")
    max_length = max_target_length(src.shape[1]) if max_length is None else max_length
    batch, device = src.shape[0], src.device
    state = model.start(model.encode(src).repeat_interleave(beam, 0))
    scores = torch.full((batch, beam), float("-inf"), device=device)
    scores[:, 0] = 0.0  # the first step expands one hypothesis per sentence
    tokens = torch.full((batch * beam,), BOS, dtype=torch.long, device=device)
    history = torch.empty(batch * beam, 0, dtype=torch.long, device=device)
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(batch)]
    alive = list(range(batch))
    for length in range(1, max_length + 1):
        logits, state = model.step(tokens, state)
        log_probs = torch.log_softmax(logits.float(), -1).view(len(alive), beam, -1)
        vocab = log_probs.shape[-1]
        top_scores, top_ids = (scores[:, :, None] + log_probs).view(len(alive), -1).topk(2 * beam, dim=1)
        origins, words = top_ids // vocab, top_ids % vocab
        ends = words == EOS
        first_ends, first_scores, first_origins = (t[:, :beam].tolist() for t in (ends, top_scores, origins))
        for row, sentence in enumerate(alive):
            for rank in range(beam):
                if first_ends[row][rank] and first_scores[row][rank] > float("-inf"):
                    hypothesis = history[row * beam + first_origins[row][rank]].tolist()
                    finished[sentence].append((first_scores[row][rank] / length**length_penalty, hypothesis))
        continuing = top_scores.masked_fill(ends, float("-inf")).topk(beam, dim=1).indices  # [alive, beam]
        scores = top_scores.gather(1, continuing)
        words, origins = words.gather(1, continuing), origins.gather(1, continuing)
        rows = (torch.arange(len(alive), device=device)[:, None] * beam + origins).flatten()
        history = torch.cat([history[rows], words.flatten()[:, None]], 1)
        state, tokens = state.select(rows), words.flatten()
        if length == max_length:
            for row, sentence in enumerate(alive):
                if len(finished[sentence]) < beam:
                    for j in range(beam):
                        finished[sentence].append((scores[row, j].item() / length**length_penalty, history[row * beam + j].tolist()))
            break
        keep = [row for row, sentence in enumerate(alive) if len(finished[sentence]) < beam]
        if len(keep) < len(alive):
            if not keep:
                break
            kept = torch.tensor(keep, device=device)
            rows = (kept[:, None] * beam + torch.arange(beam, device=device)).flatten()
            state, tokens, history, scores = state.select(rows), tokens[rows], history[rows], scores[kept]
            alive = [alive[row] for row in keep]
    return [max(hypotheses, key=lambda scored: scored[0])[1] for hypotheses in finished]


def translate(model: Seq2Seq, vocab, sources: list[str], *, beam: int = 1, length_penalty: float = 1.0, device=None, max_sentences: int = 128):
    """Translate ``sources`` (raw text) to raw text, in order, in batches of one source length.
    Returns ``(hypotheses, seconds)``: the search alone is timed (encoding text and decoding
    subwords are not)."""
    examples = encode_examples(sources, [""] * len(sources), vocab)
    hypotheses: list[list[int] | None] = [None] * len(examples)
    was_training = model.training
    model.eval()
    seconds = 0.0
    for group in groups_by_source_length(examples, max_sentences):
        src = torch.tensor([examples[i].source for i in group], dtype=torch.long, device=device)
        synchronize(src.device)
        started = time.perf_counter()
        outputs = greedy(model, src) if beam == 1 else beam_search(model, src, beam, length_penalty=length_penalty)
        synchronize(src.device)
        seconds += time.perf_counter() - started
        for index, output in zip(group, outputs):
            hypotheses[index] = output
    model.train(was_training)
    return vocab.decode(hypotheses), seconds


def bleu(hypotheses: list[str], references: list[str]) -> tuple[float, str]:
    """Corpus BLEU (Papineni et al. 2002) of detokenised ``hypotheses`` against raw
    ``references`` with sacrebleu's defaults, and sacrebleu's signature string."""
    from sacrebleu.metrics import BLEU

    if len(hypotheses) != len(references):
        raise ValueError(f"bleu: {len(hypotheses)} hypotheses but {len(references)} references")
    metric = BLEU()
    return metric.corpus_score(hypotheses, [references]).score, str(metric.get_signature())


# --- one run --------------------------------------------------------------------------------


def position_variants(variant: str, params: dict, d_key: int, *, encoder: str | None = None, cross: str | None = None, fallback: str = "linear") -> dict:
    """The MTConfig fields of the attention at each position for a run of ``variant`` (head
    width ``d_key``): the decoder self-attention always gets ``variant`` with ``params``;
    encoder and cross-attention get it too unless named explicitly (``encoder``/``cross``,
    default parameters) or unless ``variant`` is causal only (the delta rule): then they get
    ``fallback`` (default 'linear', so that a delta-rule run differs from the all-linear run in
    the decoder's update rule alone)."""
    causal_only = not variants.create(variant, d_key, **params).supports_noncausal
    fields = {"decoder": variant, "decoder_params": dict(params)}
    for position, chosen in (("encoder", encoder), ("cross", cross)):
        if chosen is not None:
            fields[position], fields[f"{position}_params"] = chosen, {}
        elif causal_only:
            fields[position], fields[f"{position}_params"] = fallback, {}
        else:
            fields[position], fields[f"{position}_params"] = variant, dict(params)
    return fields


def run_mt(
    variant: str,
    params: dict,
    config: MTConfig,
    *,
    device="cpu",
    dtype: str = "float32",
    out_dir=None,
    checkpoint_every: int | None = None,
    dist: Distributed | None = None,
    progress: bool = False,
) -> dict:
    """Train a Seq2Seq model as ``config`` says (its None settings from the preset, see
    ``MTConfig.resolved``) with ``variant(**params)`` (see ``position_variants``), translate the
    test split and score it. Returns the metrics as a JSON-ready dict on the main rank (under
    torchrun every rank trains and the main rank evaluates), {} on the others. ``out_dir``
    receives the test translations (``{test}.hyp.{lang}``) and, every ``checkpoint_every``
    steps, a checkpoint in ``checkpoints/``, from which a rerun resumes. ``dist``: this
    process's place under torchrun (default: one process on ``device``). ``dtype``: float32,
    bfloat16 or float16 (``harness.tasks.precision``), validation and decoding under its autocast."""
    settings = config.resolved()
    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    spec = DATASETS[settings.dataset]
    directory = dataset_dir(settings.data or spec.directory)
    test_directory = directory if (directory / f"{spec.test}.en").is_file() or spec.test_directory is None else dataset_dir(spec.test_directory)
    dist = dist or Distributed(0, 1, torch.device(device))
    torch.manual_seed(settings.seed)

    vocab = train_vocabulary(directory, vocab_size=settings.vocab_size, split=spec.train)
    training = read_parallel(directory, spec.train, limit=settings.max_sentences)
    examples = encode_examples(training.sources, training.targets, vocab, max_length=256)
    batches = LengthBatches(examples, settings.batch_tokens, seed=settings.seed, rank=dist.rank, world_size=dist.world_size, device=dist.device)
    valid = None
    if spec.valid is not None and (directory / f"{spec.valid}.en").is_file():
        text = read_parallel(directory, spec.valid)
        valid = encode_examples(text.sources, text.targets, vocab)
    test = read_parallel(test_directory, spec.test, limit=settings.test_sentences)

    fields = position_variants(variant, dict(params), settings.head_width, encoder=settings.encoder, cross=settings.cross, fallback=settings.fallback)
    model = Seq2Seq(mt_config(settings.preset, len(vocab), **fields)).to(dist.device)
    train_config = TrainConfig(
        steps=settings.steps,
        lr=settings.lr,
        warmup=settings.warmup,
        clip=1.0,
        dtype=dtype,
        eval_every=settings.eval_every,
        checkpoint_every=checkpoint_every,
        checkpoint_dir=str(Path(out_dir) / "checkpoints") if out_dir is not None else None,
        log_every=max(1, settings.steps // 20),
        seed=settings.seed,
    )
    evaluate = (lambda m, _index: {"valid_loss": validation_loss(m, valid, device=dist.device)}) if valid is not None else None
    result = train(
        model,
        label_smoothed_loss,
        batches,
        train_config,
        evaluate=evaluate,
        dist=dist,
        progress=progress,
        identity=dict(settings.model_dump(exclude={"threads"}), variant=variant, params=dict(params)),
    )
    if not dist.is_main:
        return {}

    started = time.perf_counter()
    with Precision(dtype, dist.device).autocast():
        hypotheses, decode_s = translate(model, vocab, test.sources, beam=settings.beam, length_penalty=settings.length_penalty, device=dist.device)
    score, signature = bleu(hypotheses, test.targets)
    metrics = {
        **training_metrics(result, dist, model),
        "words": result.units,
        "words_per_s": result.units_per_s,
        "bleu": score,
        "bleu_signature": signature,
        "test_set": f"{test.directory.name}/{spec.test}",
        "test_sentences": len(test),
        "sentences_per_s": len(test) / decode_s,
        "decode_s": decode_s,
        "valid_loss": result.evaluations[-1][1]["valid_loss"] if result.evaluations else None,
        "vocab_size": len(vocab),
        "positions": {position: [fields[position], fields[f"{position}_params"]] for position in POSITIONS},
        "data": str(directory),
        "config": settings.model_dump(),
        "final_eval_s": time.perf_counter() - started,
    }
    metrics["wall_s"] += metrics["final_eval_s"]
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{spec.test}.hyp.{test.tgt_lang}").write_text("".join(h + "\n" for h in hypotheses), encoding="utf-8")
    return metrics


def run_cell(cell: Cell) -> dict:
    """The metrics of a scenario cell of this task: ``cell.task`` validated as an MTConfig,
    the cell's variant with its parameters and backend, on ``axes.device``; a checkpoint at every
    evaluation into the cell's ``checkpoint_dir``, from which the cell continues when it is
    measured again."""
    params = dict(cell.params, backend=cell.backend)
    config = MTConfig.model_validate(cell.task)
    return run_mt(
        cell.variant, params, config, device=cell.device, dtype=cell.axes["dtype"], out_dir=cell.checkpoint_dir, checkpoint_every=config.resolved().eval_every
    )


def _command_line() -> CommandLine:
    return command_line(MTConfig, prog="python -m harness.tasks.mt", description=__doc__.split("\n\n")[0], checkpoint_every=None)


def main(argv=None) -> int:
    """Run ``python -m harness.tasks.mt``: one training, its metrics in OUT/metrics.json."""
    args, config = parse_command_line(_command_line(), MTConfig, argv)
    dist = Distributed.from_env(args.device)
    try:
        metrics = run_mt(args.variant, args.params, config, out_dir=args.out, checkpoint_every=args.checkpoint_every, dist=dist, progress=True)
        if dist.is_main:
            write_json_atomic(Path(args.out) / "metrics.json", dict(metrics, arguments=vars(args)))
            print(
                f"BLEU {metrics['bleu']:.2f} ({metrics['bleu_signature']}) on {metrics['test_set']}; "
                f"{metrics['words_per_s']:.0f} words/s training, {metrics['sentences_per_s']:.1f} sentences/s decoding, "
                f"{metrics['wall_s']:.0f} s -> {Path(args.out) / 'metrics.json'}"
            )
    except ValueError as exc:  # a DataError, VariantError or CheckpointError, or settings the data cannot meet
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        dist.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Synthetic associative retrieval (Schlag et al. 2021, §6.1).

There are S keys and S values; value i is the one-hot vector v_i ∈ R^S. A sequence is L
(key, value) pairs followed by one query key, and the model must return the value bound
to the query. Keys are embedded by a learned e: K → R^{d_emb}; the memory is written with
keys k = W_K [e(k); v] and values v, and read with q = W_Q e(q). The loss is
l = Σ_j ½ (v*_j − v̂_j)².

* Setting 1 (capacity): L = S, keys and values drawn without replacement (a random pairing).
* Setting 2 (update rules): L = 2S, keys and values drawn with replacement; the query is a
  key present in the sequence and its answer is the value most recently bound to it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

import variants

from ..models import check_positive_int
from ..models.retrieval import RetrievalModel
from . import training as trainer
from .batches import GeneratorBatches
from .retrieval_config import RetrievalConfig
from .training import TrainConfig

if TYPE_CHECKING:
    from ..scenarios.cell import Cell

SETTINGS = (1, 2)


@dataclass
class RetrievalBatch:
    """``keys``, ``values``: ``[batch, L]``; ``query``, ``answer``: ``[batch]`` (all long)."""

    keys: torch.Tensor
    values: torch.Tensor
    query: torch.Tensor
    answer: torch.Tensor


@dataclass
class RetrievalResult:
    """One training run (Schlag et al. 2021, §6.1 report the best validation loss)."""

    loss: float
    final_loss: float
    steps: int
    evaluations: list[tuple[int, float]] = field(default_factory=list)
    wall_s: float = 0.0
    stopped: str = "max_steps"
    seed: int = 0
    tokens: int = 0  # the training tokens (key-value pairs) seen
    train_s: float = 0.0  # the training steps' seconds, evaluations left out
    resumed_from: int | None = None  # the step this run continued from a checkpoint at


# --- data ------------------------------------------------------------------------------


def _check_setting(setting) -> None:
    if isinstance(setting, bool) or setting not in SETTINGS:
        raise ValueError(f"setting must be 1 (capacity) or 2 (update rules), got {setting!r}")


def _check_generator(generator) -> None:
    if not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")


def sequence_length(setting: int, S: int) -> int:
    """L = S in setting 1, L = 2S in setting 2 (Schlag et al. 2021, §6.1)."""
    return S if setting == 1 else 2 * S


def _sample_pairs(setting: int, S: int, batch: int, generator: torch.Generator):
    """Keys and values ``[batch, L]``: permutations in setting 1, uniform draws in setting 2."""
    if setting == 1:
        keys = torch.rand(batch, S, generator=generator).argsort(dim=1)
        values = torch.rand(batch, S, generator=generator).argsort(dim=1)
        return keys, values
    L = sequence_length(setting, S)
    return torch.randint(S, (batch, L), generator=generator), torch.randint(S, (batch, L), generator=generator)


def _present(keys: torch.Tensor, S: int) -> torch.Tensor:
    """``[batch, S]`` bool: which keys occur in each sequence."""
    return F.one_hot(keys, S).sum(dim=1) > 0


def _answers(keys: torch.Tensor, values: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """The value most recently bound to ``query`` in each sequence (the query must occur)."""
    positions = torch.arange(keys.shape[1]).expand_as(keys)
    last = torch.where(keys == query[:, None], positions, -1).amax(dim=1)
    return values.gather(1, last[:, None]).squeeze(1)


def make_batch(setting: int, S: int, batch: int, generator: torch.Generator) -> RetrievalBatch:
    """``batch`` training sequences, each with one query drawn uniformly among its keys
    (Schlag et al. 2021, §6.1)."""
    _check_setting(setting)
    check_positive_int("S", S)
    check_positive_int("batch", batch)
    _check_generator(generator)
    keys, values = _sample_pairs(setting, S, batch, generator)
    scores = torch.rand(batch, S, generator=generator).masked_fill(~_present(keys, S), -1.0)
    query = scores.argmax(dim=1)
    return RetrievalBatch(keys, values, query, _answers(keys, values, query))


def make_eval_batch(setting: int, S: int, sequences: int = 20, *, generator: torch.Generator) -> RetrievalBatch:
    """``sequences`` sequences, each queried with every distinct key it contains: "we sample
    20 sequences and test all possible queries" (Schlag et al. 2021, §6.1)."""
    _check_setting(setting)
    check_positive_int("S", S)
    check_positive_int("sequences", sequences)
    _check_generator(generator)
    keys, values = _sample_pairs(setting, S, sequences, generator)
    row, query = _present(keys, S).nonzero(as_tuple=True)
    keys, values = keys[row], values[row]
    return RetrievalBatch(keys, values, query, _answers(keys, values, query))


# --- loss ------------------------------------------------------------------------------


def retrieval_loss(v_hat: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
    """Mean over the batch of Σ_j ½ (v*_j − v̂_j)² (Schlag et al. 2021, §6.1)."""
    v_hat = v_hat.to(torch.promote_types(v_hat.dtype, torch.float32))  # a 16-bit read: the loss in float32
    target = F.one_hot(answer, v_hat.shape[-1]).to(v_hat.dtype)
    return 0.5 * (target - v_hat).pow(2).sum(dim=-1).mean()


# --- training --------------------------------------------------------------------------


def _eval_generator(seed: int, index: int) -> torch.Generator:
    """A generator for the ``index``-th evaluation, apart from the training data stream."""
    return torch.Generator().manual_seed((seed + 1) * 1_000_003 + index)


@torch.no_grad()
def evaluate(model: RetrievalModel, batch: RetrievalBatch, *, chunk: int = 256) -> float:
    """Mean loss over ``batch``. Each distinct sequence is written once (``model.memory``) and
    the queries asked of it read that memory, ``chunk`` queries at a time to bound memory: an
    evaluation set of N sequences and all their keys (``make_eval_batch``) costs N sequences'
    writes, not one per query."""
    was_training = model.training
    model.eval()
    length = batch.keys.shape[1]
    distinct, sequence = torch.unique(torch.cat([batch.keys, batch.values], dim=1), dim=0, return_inverse=True)
    memory = model.memory(distinct[:, :length], distinct[:, length:])
    total = 0.0
    n = batch.query.shape[0]
    for start in range(0, n, chunk):
        rows = slice(start, start + chunk)
        v_hat = model.read(memory, batch.query[rows], sequence[rows])
        total += retrieval_loss(v_hat, batch.answer[rows]).item() * v_hat.shape[0]
    model.train(was_training)
    return total / n


def _stop_reason(evaluations: list[tuple[int, float]], max_steps: int, patience: int, target_loss: float) -> str | None:
    """Why training stops after ``evaluations`` ([step, loss]): ``target`` (the last loss is at
    most ``target_loss``), ``patience`` (that many evaluations since the first best one),
    ``max_steps``, or None (go on)."""
    if not evaluations:
        return None
    last_step, last_loss = evaluations[-1]
    first_best = min(range(len(evaluations)), key=lambda i: evaluations[i][1])
    if last_loss <= target_loss:
        return "target"
    if len(evaluations) - 1 - first_best >= patience:
        return "patience"
    return "max_steps" if last_step >= max_steps else None


def train(model: RetrievalModel, config: RetrievalConfig, S: int, *, dtype: str = "float32", checkpoint_dir=None) -> RetrievalResult:
    """Adam on fresh batches (the shared trainer, ``harness.tasks.training``); evaluate every
    ``eval_every`` steps (and at the last step) on a fresh evaluation set; stop at
    ``target_loss``, after ``patience`` evaluations without a new best, or at ``max_steps``
    (Schlag et al. 2021, §6.1). With ``checkpoint_dir`` the state is saved there after every
    evaluation and a later call resumes from it."""
    _check_setting(config.setting)
    check_positive_int("S", S)
    if S != model.S:
        raise ValueError(f"S must match the model's S={model.S}, got {S}")

    def loss_fn(m, batch):
        return retrieval_loss(m(batch), batch.answer), batch.keys.numel()

    def evaluation_loss(m, index):
        return evaluate(m, make_eval_batch(config.setting, S, generator=_eval_generator(config.seed, index)))

    def stop(evaluations):
        return _stop_reason(evaluations, config.max_steps, config.patience, config.target_loss)

    batches = GeneratorBatches(lambda generator: make_batch(config.setting, S, config.batch, generator), config.seed)
    settings = TrainConfig(
        steps=config.max_steps,
        lr=config.lr,
        optimizer="adam",
        schedule="constant",
        clip=None,
        dtype=dtype,
        eval_every=config.eval_every,
        log_every=config.eval_every,
        seed=None,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=config.eval_every if checkpoint_dir is not None else None,
    )
    result = trainer.train(model, loss_fn, batches, settings, evaluate=evaluation_loss, stop=stop, identity=dict(config.model_dump(), S=S), progress=False)
    values = [value for _, value in result.evaluations]
    return RetrievalResult(
        min(values, default=math.nan),
        values[-1] if values else math.nan,
        result.steps,
        result.evaluations,
        result.wall_s,
        result.stopped or "max_steps",
        config.seed,
        result.units,
        result.train_s,
        result.resumed_from,
    )


def run_retrieval(variant: str, params: dict, config: RetrievalConfig, *, S: int, d_key: int = 64, dtype: str = "float32", checkpoint_dir=None) -> dict:
    """One harness cell: build the model under ``torch.manual_seed(seed)``, train it (resuming
    from ``checkpoint_dir`` where a checkpoint is), and return the result as a JSON-ready dict
    (Schlag et al. 2021, §6.1)."""
    torch.manual_seed(config.seed)
    model = RetrievalModel(S, variant, d_key=d_key, **params)
    result = train(model, config, S, dtype=dtype, checkpoint_dir=checkpoint_dir)
    return {
        "loss": result.loss,
        "final_loss": result.final_loss,
        "steps": result.steps,
        "wall_s": result.wall_s,
        "stopped": result.stopped,
        "words_per_s": result.tokens / result.train_s,
        "seed": result.seed,
        "evaluations": [list(e) for e in result.evaluations],
        "resumed_from": result.resumed_from,
    }


# --- the task, as scenarios, the runner and the report see it ---------------------------------


def run_cell(cell: Cell) -> dict:
    """Train and evaluate one cell (axes S and d_key); its metrics also carry the variant's d_dot,
    the capacity its loss is read against."""
    axes = cell.axes
    metrics = run_retrieval(
        cell.variant,
        dict(cell.params, backend=cell.backend),
        RetrievalConfig.model_validate(cell.task),
        S=axes["S"],
        d_key=axes["d_key"],
        dtype=axes["dtype"],
        checkpoint_dir=cell.checkpoint_dir,
    )
    metrics["d_dot"] = variants.create(cell.variant, axes["d_key"], backend=cell.backend, **cell.params).d_dot
    return metrics

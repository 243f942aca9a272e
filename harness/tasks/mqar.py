"""Multi-query associative recall, MQAR (Arora et al. 2023, "Zoology"; used by Based and ReBased).

The vocabulary of size V is split in two: token 0 is the filler, keys come from the key half
[1, V // 2) and values from the value half [V // 2, V). A sequence of length T starts with N
key-value pairs ``k1 v1 k2 v2 ... kN vN`` (keys distinct, values distinct). The remaining
T − 2N positions are cut into (T − 2N) // 2 slots of two tokens; N slots, drawn uniformly,
hold the N keys, each queried once in a random order, with the key's value in the slot's
second token (as in Zoology's inputs); every other position is the filler 0. The target at a
query key's position is its value (the next token); every other target is ignored (−100).
Hence 4N ≤ T is needed (2N for the pairs, 2N for the query slots).

The model is a small Zoology-style stack (``harness.models.mqar.MQARModel``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..models import check_positive_int
from ..models.mqar import MQARModel
from . import training as trainer
from .batches import GeneratorBatches
from .mqar_config import MQARConfig
from .training import TrainConfig

if TYPE_CHECKING:
    from ..scenarios.cell import Cell

IGNORE = -100


@dataclass
class MQARResult:
    """One training run; ``accuracy`` is the best evaluation accuracy over the queried positions."""

    accuracy: float
    final_accuracy: float
    loss: float
    steps: int
    wall_s: float = 0.0
    seed: int = 0
    evaluations: list[tuple[int, float]] = field(default_factory=list)
    tokens: int = 0  # the training tokens seen
    train_s: float = 0.0  # the training steps' seconds, evaluations left out
    resumed_from: int | None = None  # the step this run continued from a checkpoint at


# --- data ------------------------------------------------------------------------------


def _check_generator(generator) -> None:
    if not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")


def key_range(vocab_size: int) -> tuple[int, int]:
    """Keys are ``[1, V // 2)`` (token 0 is the filler)."""
    return 1, vocab_size // 2


def value_range(vocab_size: int) -> tuple[int, int]:
    """Values are ``[V // 2, V)``."""
    return vocab_size // 2, vocab_size


def resolve_num_pairs(seq_len: int, num_pairs: int | None) -> int:
    """``num_pairs``, or T // 8 when None (at least 1)."""
    return max(1, seq_len // 8) if num_pairs is None else num_pairs


def _check_task(seq_len, num_pairs, vocab_size) -> int:
    """Validate (T, N, V); return N (T // 8 when ``num_pairs`` is None)."""
    check_positive_int("seq_len", seq_len, 4)
    check_positive_int("vocab_size", vocab_size, 4)
    num_pairs = resolve_num_pairs(seq_len, num_pairs)
    check_positive_int("num_pairs", num_pairs)
    if 4 * num_pairs > seq_len:
        raise ValueError(
            f"num_pairs={num_pairs} does not fit in seq_len={seq_len}: the pairs take 2N tokens and the N "
            f"queries 2N more (key, value), so num_pairs must be <= seq_len // 4 = {seq_len // 4}"
        )
    lo, hi = key_range(vocab_size)
    if num_pairs > hi - lo:
        raise ValueError(
            f"num_pairs={num_pairs} exceeds the {hi - lo} distinct keys of vocab_size={vocab_size} "
            f"(keys are tokens [{lo}, {hi})); raise vocab_size or lower num_pairs"
        )
    return num_pairs


def _draw_distinct(count: int, lo: int, hi: int, batch: int, generator: torch.Generator) -> torch.Tensor:
    """``[batch, count]`` distinct tokens from ``[lo, hi)`` per row, in random order."""
    return torch.rand(batch, hi - lo, generator=generator).argsort(dim=1)[:, :count] + lo


def make_batch(seq_len: int, num_pairs: int | None, vocab_size: int, batch: int, generator: torch.Generator):
    """``(inputs, targets)``, both ``[batch, seq_len]`` long; targets are −100 except at the N
    query positions, where they hold the queried key's value (see the module docstring)."""
    num_pairs = _check_task(seq_len, num_pairs, vocab_size)
    check_positive_int("batch", batch)
    _check_generator(generator)
    N = num_pairs
    keys = _draw_distinct(N, *key_range(vocab_size), batch, generator)  # [B, N]
    values = _draw_distinct(N, *value_range(vocab_size), batch, generator)  # [B, N]
    inputs = torch.zeros(batch, seq_len, dtype=torch.long)
    inputs[:, 0 : 2 * N : 2] = keys
    inputs[:, 1 : 2 * N : 2] = values
    slots = (seq_len - 2 * N) // 2
    # slot[:, i]: the slot that queries key i; distinct slots, a uniformly random assignment
    slot = torch.rand(batch, slots, generator=generator).argsort(dim=1)[:, :N]
    position = 2 * N + 2 * slot  # [B, N]: where key i is queried
    inputs.scatter_(1, position, keys)
    inputs.scatter_(1, position + 1, values)
    targets = torch.full((batch, seq_len), IGNORE, dtype=torch.long)
    targets.scatter_(1, position, values)
    return inputs, targets


# --- loss ------------------------------------------------------------------------------


def mqar_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the queried positions (targets of −100 are ignored)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)


# --- training --------------------------------------------------------------------------

#: Batches of each evaluation (the same fixed set every time).
EVAL_BATCHES = 4


def _eval_generator(seed: int) -> torch.Generator:
    """The evaluation data's generator, apart from the training stream (same set at every evaluation)."""
    return torch.Generator().manual_seed((seed + 1) * 1_000_003)


@torch.no_grad()
def evaluate(model: MQARModel, seq_len, num_pairs, vocab_size, *, batch: int, batches: int, seed: int) -> float:
    """Accuracy of the argmax prediction over the queried positions of ``batches`` fresh batches."""
    was_training = model.training
    model.eval()
    generator = _eval_generator(seed)
    correct = total = 0
    for _ in range(batches):
        inputs, targets = make_batch(seq_len, num_pairs, vocab_size, batch, generator)
        mask = targets != IGNORE
        prediction = model(inputs).argmax(dim=-1)
        correct += (prediction[mask] == targets[mask]).sum().item()
        total += mask.sum().item()
    model.train(was_training)
    return correct / total


def train(model: MQARModel, config: MQARConfig, seq_len: int, *, dtype: str = "float32", checkpoint_dir=None) -> MQARResult:
    """Adam on fresh batches for ``config.steps`` steps, cosine decay to 0 (the shared trainer,
    ``harness.tasks.training``); evaluate every ``eval_every`` steps and at the last on a fixed
    set of ``EVAL_BATCHES`` batches. ``loss`` is the last training loss. With
    ``checkpoint_dir`` the state is saved there after every evaluation and a later call resumes
    from it."""
    num_pairs = _check_task(seq_len, config.num_pairs, config.vocab_size)
    if config.vocab_size != model.vocab_size:
        raise ValueError(f"vocab_size must match the model's vocab_size={model.vocab_size}, got {config.vocab_size}")
    if seq_len > model.max_len:
        raise ValueError(f"seq_len={seq_len} exceeds the model's max_len={model.max_len}")

    def loss_fn(m, batch):
        inputs, targets = batch
        return mqar_loss(m(inputs), targets), inputs.numel()

    def accuracy(m, _index):
        return evaluate(m, seq_len, num_pairs, config.vocab_size, batch=config.batch, batches=EVAL_BATCHES, seed=config.seed)

    batches = GeneratorBatches(lambda generator: make_batch(seq_len, num_pairs, config.vocab_size, config.batch, generator), config.seed)
    settings = TrainConfig(
        steps=config.steps,
        lr=config.lr,
        optimizer="adam",
        clip=None,
        dtype=dtype,
        eval_every=config.eval_every,
        log_every=config.eval_every,
        seed=None,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=config.eval_every if checkpoint_dir is not None else None,
    )
    result = trainer.train(model, loss_fn, batches, settings, evaluate=accuracy, identity=dict(config.model_dump(), seq_len=seq_len), progress=False)
    values = [value for _, value in result.evaluations]
    return MQARResult(
        max(values, default=math.nan),
        values[-1] if values else math.nan,
        result.losses[-1][1],
        result.steps,
        result.wall_s,
        config.seed,
        result.evaluations,
        result.units,
        result.train_s,
        result.resumed_from,
    )


def run_mqar(variant: str, params: dict, config: MQARConfig, *, seq_len: int, d_model: int, dtype: str = "float32", checkpoint_dir=None) -> dict:
    """One harness cell: build the model under ``torch.manual_seed(seed)``, train it (resuming
    from ``checkpoint_dir`` where a checkpoint is), and return the result as a JSON-ready dict."""
    _check_task(seq_len, config.num_pairs, config.vocab_size)
    torch.manual_seed(config.seed)
    model = MQARModel(config.vocab_size, d_model, variant, max_len=seq_len, **params)
    result = train(model, config, seq_len, dtype=dtype, checkpoint_dir=checkpoint_dir)
    return {
        "accuracy": result.accuracy,
        "final_accuracy": result.final_accuracy,
        "loss": result.loss,
        "steps": result.steps,
        "wall_s": result.wall_s,
        "words_per_s": result.tokens / result.train_s,
        "seed": result.seed,
        "evaluations": [list(e) for e in result.evaluations],
        "resumed_from": result.resumed_from,
    }


# --- the task, as scenarios, the runner and the report see it ---------------------------------


def run_cell(cell: Cell) -> dict:
    """Train and evaluate one cell (axes seq_len and d_model, in axes.dtype)."""
    axes = cell.axes
    return run_mqar(
        cell.variant,
        dict(cell.params, backend=cell.backend),
        MQARConfig.model_validate(cell.task),
        seq_len=axes["seq_len"],
        d_model=axes["d_model"],
        dtype=axes["dtype"],
        checkpoint_dir=cell.checkpoint_dir,
    )

"""The copy task, the convergence experiment of Katharopoulos et al. 2020 (§4.1, Figure 2).

A sequence of T = ``seq_len`` positions holds a separator, L symbols drawn uniformly from
``n_symbols`` (10 in the paper), the separator again and the same L symbols, then padding:

    inputs   SEP x1 .. xL SEP x1 .. xL PAD ..        (T tokens)
    targets  x1 .. xL SEP x1 .. xL PAD ..             (the inputs shifted by one)

The copy length L is drawn per sequence uniformly from [1, (T − 1) // 2], so the separators and
both copies fit in the T + 1 tokens the inputs and targets cover. T is the model's whole
context: "sequences of up to 128 symbols" is read as T = 128, at most 63 symbols copied. Only
the second copy's predictions are scored (the first is random: nothing can predict it); every
other target is ignored. Tokens: 0 the separator, 1 .. n_symbols the symbols, n_symbols + 1 padding.

The model is ``harness.models.decoder.DecoderLM`` (pre-LayerNorm, learned positions; 4 layers and 8
heads in the paper), trained with RAdam at 1e-3, then 1e-4 after 3000 updates
(``harness.tasks.training.TrainConfig.loss_curve``). A cell records the training-loss curve (nats per copied
symbol, chance ln(n_symbols)), the steps it took to reach ``loss_threshold``, and the
accuracy of the copied half on fresh sequences (teacher-forced argmax; ``exact``: the share
of sequences copied without a mistake).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..models import DecoderConfig
from ..models.decoder import DecoderLM
from .batches import GeneratorBatches
from .copy_config import CopyConfig
from .precision import Precision
from .training import TrainConfig, train

if TYPE_CHECKING:
    from ..scenarios.cell import Cell

SEPARATOR = 0
IGNORE = -100


def padding(n_symbols: int) -> int:
    """The padding token after the symbols 1 .. n_symbols."""
    return n_symbols + 1


def max_copy(seq_len: int) -> int:
    """The longest copy that fits: 2L + 2 tokens in the T + 1 that inputs and targets cover."""
    return (seq_len - 1) // 2


def make_batch(seq_len: int, n_symbols: int, batch: int, generator: torch.Generator):
    """``(inputs, targets)``, both ``[batch, seq_len]`` long (see the module docstring): targets
    are −100 except where they are the second copy's symbols."""
    if seq_len < 3 or n_symbols < 1 or batch < 1:
        raise ValueError(f"copy task needs seq_len >= 3, n_symbols >= 1, batch >= 1; got {seq_len}, {n_symbols}, {batch}")
    longest = max_copy(seq_len)
    lengths = torch.randint(1, longest + 1, (batch, 1), generator=generator)
    symbols = torch.randint(1, n_symbols + 1, (batch, longest), generator=generator)
    position = torch.arange(seq_len + 1)
    offset = position - lengths - 2  # index into the second copy
    first = (position >= 1) & (position <= lengths)
    second = (offset >= 0) & (offset < lengths)
    sequence = torch.full((batch, seq_len + 1), padding(n_symbols), dtype=torch.long)
    sequence[(position == 0) | (position == lengths + 1)] = SEPARATOR
    sequence[first] = symbols.gather(1, (position - 1).clamp(0, longest - 1).expand(batch, -1))[first]
    sequence[second] = symbols.gather(1, offset.clamp(0, longest - 1))[second]
    targets = torch.where(second[:, 1:], sequence[:, 1:], IGNORE)
    return sequence[:, :-1], targets


def steps_to_threshold(losses: list[list[float]], threshold: float) -> int | None:
    """The step of the first curve point whose loss is at most ``threshold``; None if none is."""
    if not math.isfinite(threshold):
        raise ValueError(f"threshold must be a finite number, got {threshold!r}")
    return next((int(step) for step, loss in losses if loss <= threshold), None)


def copy_loss(model: DecoderLM, batch) -> tuple[torch.Tensor, int]:
    """Mean cross-entropy over the second copy's symbols, and how many there are."""
    inputs, targets = batch
    logits = model(inputs)
    scored = int((targets != IGNORE).sum())
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE), scored


@torch.no_grad()
def evaluate(model: DecoderLM, seq_len: int, n_symbols: int, *, batch: int, batches: int, seed: int) -> dict:
    """Teacher-forced argmax ``accuracy`` over the copied symbols of ``batches`` fresh batches,
    and ``exact``, the share of sequences whose whole copy is right."""
    generator = torch.Generator().manual_seed((seed + 1) * 1_000_003)
    correct = total = exact = sequences = 0
    for _ in range(batches):
        inputs, targets = make_batch(seq_len, n_symbols, batch, generator)
        scored = targets != IGNORE
        right = (model(inputs).argmax(-1) == targets) | ~scored
        correct += int((right & scored).sum())
        total += int(scored.sum())
        exact += int(right.all(1).sum())
        sequences += batch
    return {"accuracy": correct / total, "exact": exact / sequences}


def run_copy(variant: str, params: dict, config: CopyConfig, *, seq_len: int, device="cpu", dtype: str = "float32") -> dict:
    """One cell: build the model under ``torch.manual_seed(seed)``, train it, evaluate it."""
    if seq_len < 3:
        raise ValueError(f"copy task: seq_len must be >= 3 (two separators and a symbol), got {seq_len}")
    torch.manual_seed(config.seed)
    model_config = DecoderConfig(
        vocab_size=config.n_symbols + 2,
        n_layers=config.n_layers,
        d_model=config.d_model,
        n_heads=config.n_heads,
        d_ff=config.d_ff or 4 * config.d_model,
        context=seq_len,
        variant=variant,
        variant_params=params,
    )
    model = DecoderLM(model_config).to(device)
    batches = GeneratorBatches(lambda generator: tuple(t.to(device) for t in make_batch(seq_len, config.n_symbols, config.batch, generator)), config.seed)
    result = train(model, copy_loss, batches, TrainConfig.loss_curve(config, dtype), progress=False)
    losses = [list(point) for point in result.losses]
    final = losses[-1][1]
    evaluation = {}
    if math.isfinite(final):
        with Precision(dtype, device).autocast():
            evaluation = evaluate(model, seq_len, config.n_symbols, batch=config.batch, batches=config.eval_batches, seed=config.seed)
    return {
        "loss": final,
        "losses": losses,
        "steps_to_threshold": steps_to_threshold(losses, config.loss_threshold),
        "loss_threshold": config.loss_threshold,
        **evaluation,
        "steps": result.steps,
        "train_s": result.train_s,
        "words_per_s": result.units_per_s,
        "seed": config.seed,
        "num_parameters": model.num_parameters(),
    }


def run_cell(cell: Cell) -> dict:
    """Train and evaluate one cell (axis seq_len)."""
    config = CopyConfig.model_validate(cell.task)
    params = dict(cell.params, backend=cell.backend)
    return run_copy(cell.variant, params, config, seq_len=cell.axes["seq_len"], device=cell.device, dtype=cell.axes["dtype"])

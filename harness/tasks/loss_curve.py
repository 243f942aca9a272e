"""Training with a loss curve, as in the convergence and image experiments of Katharopoulos et
al. 2020 (§4.1, §4.2): RAdam (Liu et al. 2020, ``torch.optim.RAdam``) at a learning rate that
drops tenfold after ``lr_drop_step`` updates, the training loss recorded against gradient steps.

The curve holds one point every ``log_every`` steps: the mean training loss of those steps
(the last point the mean since the previous one). ``steps_to_threshold`` reads the first point
of a curve at or below a threshold.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

#: The learning rate is multiplied by this after ``lr_drop_step`` updates (1e-3 -> 1e-4 in §4.1).
LR_DROP = 0.1


@dataclass
class Curve:
    """``losses``: [step, mean training loss of the steps since the previous point]; ``units``:
    the counted units (tokens, pixels) trained on; ``train_s``: seconds of the training steps."""

    losses: list[list[float]]
    units: int
    train_s: float


def steps_to_threshold(losses: list[list[float]], threshold: float) -> int | None:
    """The step of the first curve point whose loss is at most ``threshold``; None if none is."""
    if not math.isfinite(threshold):
        raise ValueError(f"threshold must be a finite number, got {threshold!r}")
    return next((int(step) for step, loss in losses if loss <= threshold), None)


def lr_multiplier(lr_drop_step: int | None) -> Callable[[int], float]:
    """The ``LambdaLR`` multiplier after ``s`` updates: 1, then ``LR_DROP`` once ``s >= lr_drop_step``."""
    return lambda updates: LR_DROP if lr_drop_step is not None and updates >= lr_drop_step else 1.0


def train(
    model: nn.Module,
    loss_of: Callable[[nn.Module, object], tuple[torch.Tensor, int]],
    next_batch: Callable[[], object],
    *,
    steps: int,
    lr: float,
    lr_drop_step: int | None,
    log_every: int,
) -> Curve:
    """Train ``model`` for ``steps`` RAdam updates on ``next_batch()``; ``loss_of(model, batch)``
    gives the mean loss and the number of units it averages. Stops early at a non-finite loss
    (its point is recorded, so the cell reads ``nan``)."""
    if steps < 1 or log_every < 1:
        raise ValueError(f"steps and log_every must be >= 1, got steps={steps}, log_every={log_every}")
    optimizer = torch.optim.RAdam(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(lr_drop_step))
    losses, pending, units, train_s = [], [], 0, 0.0
    model.train()
    for step in range(1, steps + 1):
        started = time.perf_counter()
        loss, count = loss_of(model, next_batch())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        train_s += time.perf_counter() - started
        units += int(count)
        pending.append(loss.item())
        if step % log_every == 0 or step == steps or not math.isfinite(pending[-1]):
            losses.append([step, sum(pending) / len(pending)])
            pending = []
            if not math.isfinite(losses[-1][1]):
                break
    model.eval()
    return Curve(losses, units, train_s)


def loss_at(losses: list[list[float]], step: int) -> float | None:
    """The loss of the curve's point at ``step`` (None if the curve has no such point)."""
    return next((loss for at, loss in losses if int(at) == step), None)

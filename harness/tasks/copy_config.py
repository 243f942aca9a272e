"""The ``task:`` section of a copy-task scenario (``harness.tasks.copy`` trains it), torch-free so that a
scenario is checked before torch loads."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from . import MAX_BATCH, MAX_LAYERS, MAX_VOCAB, MAX_WIDTH, Seed, Steps, TaskConfig


class CopyConfig(TaskConfig):
    """A scenario's ``task:`` section for the copy task (Katharopoulos et al. 2020, §4.1)."""

    name: Literal["copy"]
    n_symbols: int = Field(10, ge=1, le=MAX_VOCAB)
    n_layers: int = Field(4, ge=1, le=MAX_LAYERS)
    n_heads: int = Field(8, ge=1, le=MAX_LAYERS)
    d_model: int = Field(128, ge=1, le=MAX_WIDTH)
    d_ff: int | None = Field(None, ge=1, le=MAX_WIDTH, description="default 4 d_model")
    batch: int = Field(64, ge=1, le=MAX_BATCH)
    steps: Steps = 10000
    lr: float = Field(1e-3, gt=0)
    lr_drop_step: Steps | None = Field(3000, description="the learning rate drops tenfold after this many updates")
    log_every: Steps = Field(50, description="one point of the loss curve: the mean training loss of this many steps")
    loss_threshold: float = Field(0.1, gt=0, description="steps_to_threshold: the first curve point at or below this loss (nats)")
    eval_batches: int = Field(8, ge=1, le=MAX_BATCH)
    seed: Seed = 0

"""The ``task:`` section of a multi-query associative recall scenario (``harness.tasks.mqar`` trains it),
torch-free so that a scenario is checked before torch loads."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from . import MAX_BATCH, MAX_VOCAB, Seed, Steps, TaskConfig


class MQARConfig(TaskConfig):
    """A scenario's ``task:`` section for multi-query associative recall (Arora et al. 2023, Zoology)."""

    name: Literal["mqar"]
    steps: Steps = 2000
    batch: int = Field(64, ge=1, le=MAX_BATCH)
    lr: float = Field(1e-3, gt=0)
    eval_every: Steps = 100
    num_pairs: int | None = Field(None, ge=1, le=MAX_VOCAB)
    vocab_size: int = Field(256, ge=4, le=MAX_VOCAB)
    seed: Seed = 0

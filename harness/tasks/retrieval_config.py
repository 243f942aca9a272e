"""The ``task:`` section of an associative retrieval scenario (``harness.tasks.retrieval`` trains it),
torch-free so that a scenario is checked before torch loads."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from . import MAX_BATCH, Seed, Steps, TaskConfig


class RetrievalConfig(TaskConfig):
    """A scenario's ``task:`` section for associative retrieval (Schlag et al. 2021, §6.1)."""

    name: Literal["retrieval"] = "retrieval"
    setting: Literal[1, 2] = 1
    max_steps: Steps = 20000
    eval_every: Steps = 100
    patience: Steps = 10
    target_loss: float = Field(1e-3, gt=0)
    lr: float = Field(1e-3, gt=0)
    batch: int = Field(32, ge=1, le=MAX_BATCH)
    seed: Seed = 0

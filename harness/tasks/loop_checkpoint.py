"""Checkpoints of the small training loops that run as one harness cell (retrieval, MQAR).

The runner gives each quality cell a directory of its own (``cell["checkpoint_dir"]``, beside
the results file). A loop saves its state there after every evaluation and, when it starts,
restores the latest one: the model, the optimiser (and scheduler), the training data
generator's position, the RNG states (torch, Python, CUDA), and the evaluations, tokens and
seconds so far. A cell stopped by Ctrl-C, a crash or its timeout therefore continues where it
stopped when the run is resumed, on the same trajectory as an uninterrupted run. Files are written atomically and read
as data only (``harness.tasks.training``: ``save_checkpoint``, ``load_checkpoint``); in a harness worker each carries its
cell's identity, and one of another cell is refused (``cell_checkpoints``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .training import CheckpointError, latest_checkpoint, load_checkpoint, rng_state, save_checkpoint, set_rng_state

#: What every loop checkpoint holds, with its type (checked on load).
FIELDS = {
    "step": int, "model": dict, "optimizer": dict, "scheduler": (dict, type(None)), "data": torch.Tensor, "rng": dict,
    "evaluations": list, "loss": (float, type(None)), "tokens": int, "train_s": (int, float), "wall_s": (int, float), "config": dict,
}


@dataclass
class Progress:
    """How far a loop has come: the step of its last evaluation, the evaluations ([step, value]),
    the last training loss, the training tokens and seconds (steps only, evaluations left out),
    the wall seconds of the segments before this one, and the step this segment resumed from
    (None: a fresh start)."""

    step: int = 0
    evaluations: list = field(default_factory=list)
    loss: float | None = None
    tokens: int = 0
    train_s: float = 0.0
    earlier_wall_s: float = 0.0
    resumed_from: int | None = None
    segment_start: float = field(default_factory=time.perf_counter)

    @property
    def wall_s(self) -> float:
        """Wall seconds over every segment so far."""
        return self.earlier_wall_s + time.perf_counter() - self.segment_start


class LoopCheckpoint:
    """Saves and restores one loop's state in ``directory`` (None: never). ``config`` names the
    training (its hyperparameters and seed); a checkpoint written under another config is refused."""

    def __init__(self, directory, config: dict, model: torch.nn.Module, optimizer, data: torch.Generator, scheduler=None):
        self.directory = Path(directory) if directory is not None else None
        self.config, self.model, self.optimizer, self.data, self.scheduler = config, model, optimizer, data, scheduler

    def restore(self) -> Progress:
        """The progress of the latest checkpoint, with every state restored; a fresh ``Progress``
        where there is none."""
        path = latest_checkpoint(self.directory) if self.directory is not None else None
        if path is None:
            return Progress()
        saved = load_checkpoint(path, "cpu", FIELDS)
        if saved["config"] != self.config:
            differing = sorted(k for k in {*saved["config"], *self.config} if saved["config"].get(k) != self.config.get(k))
            raise CheckpointError(f"{path}: written by another training (differs in {', '.join(differing)}); remove it to start afresh")
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(saved["scheduler"])
        self.data.set_state(saved["data"])
        set_rng_state(saved["rng"])
        return Progress(step=saved["step"], evaluations=[tuple(e) for e in saved["evaluations"]], loss=saved["loss"], tokens=saved["tokens"],
                        train_s=saved["train_s"], earlier_wall_s=saved["wall_s"], resumed_from=saved["step"])

    def save(self, progress: Progress) -> None:
        """Write the state at ``progress.step`` (replacing the previous checkpoint)."""
        if self.directory is None:
            return
        save_checkpoint(self.directory, progress.step, {
            "step": progress.step, "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None, "data": self.data.get_state(),
            "rng": rng_state(), "evaluations": [list(e) for e in progress.evaluations], "loss": progress.loss,
            "tokens": progress.tokens, "train_s": progress.train_s, "wall_s": progress.wall_s, "config": self.config,
        })

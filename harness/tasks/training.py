"""A small training engine shared by the quality tasks (language modelling, translation).

``train`` runs AdamW with a linear warm-up and cosine decay (``warmup_cosine``), gradient
clipping, periodic evaluation and atomic checkpoints, on one process or under ``torchrun``
with DistributedDataParallel (``Distributed``). A run that finds a checkpoint in its
``checkpoint_dir`` resumes from it: model, optimiser, scheduler, the data stream's position,
the RNG states and the losses so far are restored, so the resumed run follows the same
trajectory as an uninterrupted one.

The data is a ``BatchStream``: each rank draws its own shard of the global batch, and the
stream's position is part of the checkpoint. The task supplies ``loss_fn(model, batch) ->
(mean loss, counted units)``; units are what throughput is reported in (words for LM).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import math
import os
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as torch_dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from ..measure import PeakMemory, synchronize

#: Collective operations wait this long (a rank may evaluate for a while before the others go on).
COLLECTIVE_TIMEOUT = dt.timedelta(hours=2)
CHECKPOINT_PREFIX = "step-"


@dataclass
class TrainConfig:
    """``steps`` optimiser steps at peak learning rate ``lr`` (after ``warmup`` steps of linear
    warm-up, then cosine decay to 0); gradients clipped to norm ``clip`` (None: no clipping);
    evaluation every ``eval_every`` steps and at the end; checkpoints every ``checkpoint_every``
    steps into ``checkpoint_dir``; the loss recorded every ``log_every`` steps and at the end.
    A fresh run seeds rank r's torch and ``random`` generators (dropout, ...) with
    ``seed · 1000 + r``, after the model was built; a resumed run restores them instead."""

    steps: int
    lr: float
    warmup: int = 0
    clip: float | None = 1.0
    weight_decay: float = 0.0
    eval_every: int | None = None
    checkpoint_every: int | None = None
    checkpoint_dir: str | None = None
    log_every: int = 50
    seed: int = 0

    def __post_init__(self):
        for name in ("steps", "log_every"):
            _check_int(name, getattr(self, name), 1)
        _check_int("warmup", self.warmup, 0)
        for name in ("eval_every", "checkpoint_every"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1)
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not self.lr > 0:
            raise ValueError(f"TrainConfig.lr must be a positive number, got {self.lr!r}")
        if self.clip is not None and not self.clip > 0:
            raise ValueError(f"TrainConfig.clip must be positive or None, got {self.clip!r}")
        if self.weight_decay < 0:
            raise ValueError(f"TrainConfig.weight_decay must be >= 0, got {self.weight_decay!r}")
        if self.checkpoint_every is not None and self.checkpoint_dir is None:
            raise ValueError("TrainConfig.checkpoint_every needs a checkpoint_dir")


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"TrainConfig.{name} must be an int >= {minimum}, got {value!r}")


def warmup_cosine(warmup: int, steps: int) -> Callable[[int], float]:
    """The learning-rate multiplier of ``LambdaLR`` after ``s`` scheduler steps: ``s / warmup``
    while ``s < warmup``, then ``½ (1 + cos(π (s − warmup) / (steps − warmup)))``, reaching 0 at
    ``s = steps``. Step ``s`` (0-based) of training uses the multiplier of ``s``."""
    if warmup < 0 or steps < 1 or warmup > steps:
        raise ValueError(f"warmup_cosine needs 0 <= warmup <= steps and steps >= 1, got warmup={warmup}, steps={steps}")

    def multiplier(step: int) -> float:
        if step < warmup:
            return step / warmup
        if steps == warmup:
            return 1.0
        progress = min(1.0, (step - warmup) / (steps - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return multiplier


class Distributed:
    """This process's place in a data-parallel run: from torchrun's environment (``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), or a single process
    when ``WORLD_SIZE`` is unset or 1. NCCL on CUDA devices, gloo on the CPU."""

    def __init__(self, rank: int, world_size: int, device: torch.device):
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self.is_main = rank == 0

    @classmethod
    def from_env(cls, device=None) -> Distributed:
        """Join the process group torchrun describes (a no-op for one process). ``device``
        defaults to ``cuda:LOCAL_RANK`` where CUDA is available, else the CPU."""
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
        if device is None:
            device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        if world_size > 1 and not torch_dist.is_initialized():
            if device.type == "cuda":
                torch.cuda.set_device(device)
            backend = "nccl" if device.type == "cuda" else "gloo"
            torch_dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
        return cls(rank, world_size, device)

    def wrap(self, model: nn.Module) -> nn.Module:
        """``model`` in DistributedDataParallel (gradients averaged over ranks), or as is.
        Parameters that a batch does not reach (an adaptive softmax's tail clusters when no
        target falls in them) are allowed: their gradient is zero on that rank."""
        if self.world_size == 1:
            return model
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids, find_unused_parameters=True)

    def _all_reduce(self, value: float, op) -> float:
        if self.world_size == 1:
            return float(value)
        tensor = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        torch_dist.all_reduce(tensor, op=op)
        return tensor.item()

    def all_reduce_mean(self, value: float) -> float:
        """The mean of ``value`` over the ranks."""
        return self._all_reduce(value, torch_dist.ReduceOp.SUM) / self.world_size

    def all_reduce_sum(self, value: float) -> float:
        """The sum of ``value`` over the ranks."""
        return self._all_reduce(value, torch_dist.ReduceOp.SUM)

    def all_gather(self, obj) -> list:
        """Every rank's ``obj`` (picklable), in rank order."""
        if self.world_size == 1:
            return [obj]
        gathered = [None] * self.world_size
        torch_dist.all_gather_object(gathered, obj)
        return gathered

    def barrier(self) -> None:
        if self.world_size > 1:
            torch_dist.barrier()

    def close(self) -> None:
        """Leave the process group (if this process joined one)."""
        if self.world_size > 1 and torch_dist.is_initialized():
            torch_dist.destroy_process_group()


class BatchStream(Protocol):
    """A data source: ``next()`` gives this rank's shard of the next global batch; its position
    (``state_dict``) is saved with every checkpoint and restored on resume."""

    def next(self) -> Any: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class TrainResult:
    """``losses``: (step, loss averaged over ranks); ``evaluations``: (step, metrics) (main rank
    only); ``wall_s``: the whole run including evaluations and checkpoints, summed over resumed
    segments; ``units``: counted units seen, summed over ranks; ``units_per_s``: units per
    second of training alone (evaluation and checkpoint time excluded); ``peak_mem_bytes``:
    this rank's peak memory during its latest segment (``harness.measure.PeakMemory``)."""

    losses: list[tuple[int, float]]
    evaluations: list[tuple[int, dict]]
    steps: int
    wall_s: float
    units: int
    units_per_s: float
    peak_mem_bytes: int | None
    memory_kind: str = "unavailable"
    train_s: float = 0.0
    resumed_from: int | None = None


def training_metrics(result: TrainResult, dist: Distributed, model: nn.Module) -> dict:
    """The metrics of a training that every task reports, one name each: ``steps``, ``loss``
    (the last logged), ``losses`` ([step, loss]), ``evaluations`` ([step, metrics]),
    ``train_s``, ``wall_s``, ``peak_mem_bytes``, ``memory_kind``, ``resumed_from``,
    ``world_size``, ``torch_threads``, ``num_parameters`` (a tied weight counted once)."""
    return {
        "steps": result.steps,
        "loss": result.losses[-1][1],
        "losses": [list(point) for point in result.losses],
        "evaluations": [[step, values] for step, values in result.evaluations],
        "train_s": result.train_s,
        "wall_s": result.wall_s,
        "peak_mem_bytes": result.peak_mem_bytes,
        "memory_kind": result.memory_kind,
        "resumed_from": result.resumed_from,
        "world_size": dist.world_size,
        "torch_threads": torch.get_num_threads(),
        "num_parameters": sum(p.numel() for p in model.parameters()),
    }


def rng_state() -> dict:
    """The states of torch's, Python's ``random`` and (where there is a GPU) CUDA's generators."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what ``rng_state`` returned."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def latest_checkpoint(directory) -> Path | None:
    """The checkpoint with the highest step in ``directory`` (None if there is none)."""
    directory = Path(directory)
    found = sorted(directory.glob(f"{CHECKPOINT_PREFIX}*.pt")) if directory.is_dir() else []
    return found[-1] if found else None


class CheckpointError(ValueError):
    """A checkpoint file that is not one this engine wrote (foreign, corrupt or truncated)."""


#: The fields ``train`` writes into every checkpoint and reads back on resume, with their types.
CHECKPOINT_FIELDS = {
    "step": int, "world_size": int, "model": dict, "optimizer": dict, "scheduler": dict, "batches": list,
    "rng": list, "losses": list, "evaluations": list, "units": int, "train_s": (int, float), "wall_s": (int, float), "config": dict,
}


#: The identity of the cell this process measures now (``cell_checkpoints``): saved into every
#: checkpoint and required of every checkpoint loaded; None outside a cell (no check).
_cell_identity: dict | None = None

#: The keys of a harness cell that name what its checkpoints belong to.
CELL_IDENTITY = ("cell_id", "variant", "backend", "params", "axes", "task")


@contextlib.contextmanager
def cell_checkpoints(cell: dict):
    """``with cell_checkpoints(cell):`` every checkpoint saved meanwhile carries the cell's id,
    variant, parameters, axes and task config, and one loaded must carry the same (else
    ``CheckpointError`` naming the file and what differs): a checkpoint copied from another
    cell's directory is refused, not continued."""
    global _cell_identity
    saved, _cell_identity = _cell_identity, {key: cell.get(key) for key in CELL_IDENTITY}
    try:
        yield
    finally:
        _cell_identity = saved


def _check_cell(path, saved: dict) -> None:
    """``CheckpointError`` unless the checkpoint ``saved`` (read from ``path``) is the current cell's."""
    if _cell_identity is None:
        return
    owner = saved.get("cell")
    if not isinstance(owner, dict):
        raise CheckpointError(f"{path}: a checkpoint that names no cell, so not this cell's ({_cell_identity['cell_id']}); remove it to start afresh")
    differing = [key for key in CELL_IDENTITY if owner.get(key) != _cell_identity[key]]
    if differing:
        shown = ", ".join(f"{key} {owner.get(key)!r:.80} (this cell: {_cell_identity[key]!r:.80})" for key in differing)
        raise CheckpointError(f"{path}: a checkpoint of another cell: {shown}; remove it to start afresh")


def load_checkpoint(path, device, fields: dict = CHECKPOINT_FIELDS) -> dict:
    """The payload of the checkpoint ``path``, read as data only: ``torch.load(weights_only=True)``
    admits tensors and plain containers and never runs code from the file (a pickle that asks
    for any other object is refused). A file that does not unpickle that way, or lacks one of
    ``fields`` (name: type; default this engine's ``CHECKPOINT_FIELDS``), raises
    ``CheckpointError`` naming the path and what is wrong."""
    try:
        saved = torch.load(path, map_location=device, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - every way a foreign file fails to load is the same answer
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"{path}: not a checkpoint of attnbench's training engine, or corrupt ({reason}); "
            "remove it or use another checkpoint directory"
        ) from None
    if not isinstance(saved, dict):
        raise CheckpointError(f"{path}: expected a checkpoint (a dict of {', '.join(fields)}), got {type(saved).__name__}")
    for name, kind in fields.items():
        value = saved.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            expected = " or ".join(k.__name__ for k in kind) if isinstance(kind, tuple) else kind.__name__
            got = "nothing" if name not in saved else f"{type(value).__name__} {value!r:.60}"
            raise CheckpointError(f"{path}: field {name!r}: expected {expected}, got {got}")
    _check_cell(path, saved)
    return saved


def save_checkpoint(directory: Path, step: int, payload: dict) -> None:
    """Write ``step-XXXXXXXX.pt`` atomically (a new temporary file of its own, ``mkstemp``, so
    never through a planted link, then ``os.replace``), with the current cell's identity
    (``cell_checkpoints``), and remove older checkpoints."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{CHECKPOINT_PREFIX}{step:09d}.pt"
    if _cell_identity is not None:
        payload = {**payload, "cell": _cell_identity}
    handle, temporary = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as file:
            torch.save(payload, file)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise
    for older in directory.glob(f"{CHECKPOINT_PREFIX}*.pt"):
        if older != path:
            older.unlink()


def train(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], tuple[torch.Tensor, int]],
    batches: BatchStream,
    config: TrainConfig,
    *,
    evaluate: Callable[[nn.Module], dict] | None = None,
    dist: Distributed | None = None,
    progress: bool = True,
) -> TrainResult:
    """Train ``model`` (already on ``dist.device``) for ``config.steps`` steps; see the module
    docstring. ``evaluate(model)`` runs on the main rank under ``torch.no_grad`` in eval mode."""
    dist = dist or Distributed(0, 1, next(model.parameters()).device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(config.warmup, config.steps))
    losses: list[tuple[int, float]] = []
    evaluations: list[tuple[int, dict]] = []
    start_step, units, train_s, previous_wall_s, resumed_from = 0, 0, 0.0, 0.0, None

    checkpoint = latest_checkpoint(config.checkpoint_dir) if config.checkpoint_dir else None
    if checkpoint is not None:
        saved = load_checkpoint(checkpoint, dist.device)
        if saved["world_size"] != dist.world_size:
            raise ValueError(
                f"{checkpoint}: saved by a run of world size {saved['world_size']}; resume it with the same "
                f"world size (this run has {dist.world_size}), or use another checkpoint_dir"
            )
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        batches.load_state_dict(saved["batches"][dist.rank])
        set_rng_state(saved["rng"][dist.rank])
        start_step = resumed_from = saved["step"]
        losses, evaluations = saved["losses"], saved["evaluations"]
        units, train_s, previous_wall_s = saved["units"], saved["train_s"], saved["wall_s"]
    else:
        torch.manual_seed(config.seed * 1000 + dist.rank)
        random.seed(config.seed * 1000 + dist.rank)
    wrapped = dist.wrap(model)

    def run_evaluation(step: int) -> None:
        if evaluate is not None and dist.is_main:
            model.eval()
            with torch.no_grad():
                evaluations.append((step, evaluate(model)))
            model.train()
        dist.barrier()

    def write_checkpoint(step: int) -> None:
        batch_states, rng_states = dist.all_gather(batches.state_dict()), dist.all_gather(rng_state())
        total_units = int(dist.all_reduce_sum(local_units))
        if dist.is_main:
            payload = {
                "step": step, "world_size": dist.world_size, "model": model.state_dict(),
                "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "batches": batch_states, "rng": rng_states, "losses": losses, "evaluations": evaluations,
                "units": units + total_units, "train_s": train_s + segment_train_s,
                "wall_s": previous_wall_s + time.perf_counter() - started, "config": vars(config),
            }
            save_checkpoint(Path(config.checkpoint_dir), step, payload)
        dist.barrier()

    model.train()
    local_units, segment_train_s = 0, 0.0
    started = time.perf_counter()
    bar = tqdm(total=config.steps, initial=start_step, disable=not (progress and dist.is_main), desc="train", unit="step")
    with PeakMemory(dist.device) as peak:
        for step in range(start_step + 1, config.steps + 1):
            synchronize(dist.device)
            step_started = time.perf_counter()
            loss, count = loss_fn(wrapped, batches.next())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if config.clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip)
            optimizer.step()
            scheduler.step()
            local_units += int(count)
            if step % config.log_every == 0 or step == config.steps:
                losses.append((step, dist.all_reduce_mean(loss.item())))
                bar.set_postfix(loss=f"{losses[-1][1]:.3f}")
            synchronize(dist.device)
            segment_train_s += time.perf_counter() - step_started
            bar.update()
            if (config.eval_every and step % config.eval_every == 0) or step == config.steps:
                run_evaluation(step)
            if config.checkpoint_every and (step % config.checkpoint_every == 0 or step == config.steps):
                write_checkpoint(step)
    bar.close()
    units += int(dist.all_reduce_sum(local_units))
    train_s += dist.all_reduce_mean(segment_train_s)
    return TrainResult(
        losses=losses,
        evaluations=evaluations,
        steps=config.steps,
        wall_s=previous_wall_s + time.perf_counter() - started,
        units=units,
        units_per_s=units / train_s if train_s > 0 else 0.0,
        peak_mem_bytes=peak.bytes,
        memory_kind=peak.kind,
        train_s=train_s,
        resumed_from=resumed_from,
    )

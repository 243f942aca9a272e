"""The one trainer of every quality task (language modelling, translation, MQAR, retrieval,
copy, image generation): ``train`` and its ``TrainConfig``.

What differs between the tasks is configuration: the optimiser (``adamw``, ``adam``,
``radam``), the learning-rate schedule (``warmup_cosine``, ``constant``, ``step_drop``),
gradient clipping, the dtype (``harness.tasks.precision``: float32, or bfloat16 / float16
under autocast with float32 master weights, float16 with a gradient scaler), how losses are
recorded, the evaluation cadence (every ``eval_every`` steps and at the end) with an optional
early stop, and checkpoints every ``checkpoint_every`` steps into ``checkpoint_dir``. The task
supplies the model, ``loss_fn(model, batch) -> (mean loss, counted units)`` (units are what
throughput is reported in: words, tokens, pixels) and a ``BatchStream``
(``harness.tasks.batches``).

A run that finds a checkpoint in its ``checkpoint_dir`` resumes from it: model, optimiser,
scheduler, gradient scaler, the data stream's position, the RNG states and the losses and
evaluations so far are restored, so the resumed run follows the same trajectory as an
uninterrupted one. Checkpoints are written atomically (a temporary file, then ``os.replace``)
and read as data only; one of another training or another cell is refused by name. The same
loop runs one process or every rank of a torchrun (``harness.tasks.distributed``).
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import re
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from tqdm import tqdm

from ..common.files import atomic_file
from ..measuring.measure import PeakMemory, synchronize
from .batches import BatchStream
from .distributed import Distributed
from .precision import Precision, check

if TYPE_CHECKING:
    from ..scenarios.cell import Cell

CHECKPOINT_PREFIX = "step-"
#: The optimisers a training can name (``TrainConfig.optimizer``).
OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "radam": torch.optim.RAdam}
SCHEDULES = ("warmup_cosine", "constant", "step_drop")
#: ``step_drop`` multiplies the learning rate by this after ``drop_step`` updates (1e-3 -> 1e-4,
#: Katharopoulos et al. 2020, §4.1).
LR_DROP = 0.1
#: Settings that do not change the trajectory: a checkpoint may be resumed with other values.
_NOT_IDENTITY = ("checkpoint_dir", "checkpoint_every")


@dataclass
class TrainConfig:
    """``steps`` updates of ``optimizer`` at peak learning rate ``lr`` (``weight_decay``),
    following ``schedule``: ``warmup_cosine`` (``warmup`` steps of linear warm-up, then cosine
    decay to 0), ``constant``, or ``step_drop`` (×``LR_DROP`` from ``drop_step`` updates on);
    gradients clipped to norm ``clip`` (None: no clipping); forward and backward passes in
    ``dtype`` (``harness.tasks.precision``). Evaluation every ``eval_every`` steps and at the
    end; checkpoints every ``checkpoint_every`` steps (and at the end, or an early stop) into
    ``checkpoint_dir``. A loss point every ``log_every`` steps and at the end: the step's loss,
    or with ``log_mean`` the mean of the steps since the previous point (a loss curve). A fresh
    run seeds rank r's torch and ``random`` generators with ``seed · 1000 + r`` after the model
    was built (None: leaves them as they are); a resumed run restores them instead."""

    steps: int
    lr: float
    optimizer: str = "adamw"
    schedule: str = "warmup_cosine"
    warmup: int = 0
    drop_step: int | None = None
    clip: float | None = 1.0
    weight_decay: float = 0.0
    dtype: str = "float32"
    eval_every: int | None = None
    checkpoint_every: int | None = None
    checkpoint_dir: str | None = None
    log_every: int = 50
    log_mean: bool = False
    seed: int | None = 0

    def __post_init__(self):
        for name in ("steps", "log_every"):
            _check_int(name, getattr(self, name), 1)
        _check_int("warmup", self.warmup, 0)
        for name in ("eval_every", "checkpoint_every", "drop_step"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1)
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not self.lr > 0:
            raise ValueError(f"TrainConfig.lr must be a positive number, got {self.lr!r}")
        if self.optimizer not in OPTIMIZERS or self.schedule not in SCHEDULES:
            raise ValueError(
                f"TrainConfig: optimizer must be one of {', '.join(OPTIMIZERS)} and schedule one of {', '.join(SCHEDULES)}, "
                f"got {self.optimizer!r}, {self.schedule!r}"
            )
        if (self.schedule == "step_drop") != (self.drop_step is not None):
            raise ValueError(f"TrainConfig.drop_step goes with schedule 'step_drop' (and only there), got {self.drop_step!r}")
        if self.clip is not None and not self.clip > 0:
            raise ValueError(f"TrainConfig.clip must be positive or None, got {self.clip!r}")
        if self.weight_decay < 0:
            raise ValueError(f"TrainConfig.weight_decay must be >= 0, got {self.weight_decay!r}")
        if self.checkpoint_every is not None and self.checkpoint_dir is None:
            raise ValueError("TrainConfig.checkpoint_every needs a checkpoint_dir")
        try:
            check(self.dtype)
        except ValueError as exc:
            raise ValueError(f"TrainConfig.dtype: {exc}") from None

    @classmethod
    def loss_curve(cls, task, dtype: str = "float32") -> TrainConfig:
        """The training of the convergence and image experiments of Katharopoulos et al. 2020
        (§4.1, §4.2) for a task config with ``steps``, ``lr``, ``lr_drop_step`` and ``log_every``:
        RAdam (Liu et al. 2020), the rate dropping tenfold after ``lr_drop_step`` updates, no
        clipping, the curve's points the mean training loss of ``log_every`` steps."""
        schedule = "constant" if task.lr_drop_step is None else "step_drop"
        return cls(
            steps=task.steps,
            lr=task.lr,
            optimizer="radam",
            schedule=schedule,
            drop_step=task.lr_drop_step,
            clip=None,
            dtype=dtype,
            log_every=task.log_every,
            log_mean=True,
            seed=None,
        )

    def multiplier(self) -> Callable[[int], float]:
        """The learning-rate multiplier of ``LambdaLR`` after ``s`` updates, as ``schedule`` says."""
        if self.schedule == "warmup_cosine":
            return warmup_cosine(self.warmup, self.steps)
        drop = self.drop_step if self.schedule == "step_drop" else math.inf
        return lambda updates: LR_DROP if updates >= drop else 1.0


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


@dataclass
class TrainResult:
    """``losses``: (step, loss averaged over ranks); ``evaluations``: (step, what ``evaluate``
    returned) (main rank only); ``steps``: the last step trained; ``stopped``: why training
    ended before ``steps`` (the early stop's reason, ``non-finite loss``), else None;
    ``wall_s``: the whole run including evaluations and checkpoints, summed over resumed
    segments; ``units``: counted units seen, summed over ranks; ``units_per_s``: units per
    second of training alone (evaluation and checkpoint time excluded); ``peak_mem_bytes``:
    this rank's peak memory during its latest segment (``harness.measuring.measure.PeakMemory``)."""

    losses: list[tuple[int, float]]
    evaluations: list[tuple[int, Any]]
    steps: int
    wall_s: float
    units: int
    units_per_s: float
    peak_mem_bytes: int | None
    memory_kind: str = "unavailable"
    train_s: float = 0.0
    resumed_from: int | None = None
    stopped: str | None = None


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


# --- checkpoints ---------------------------------------------------------------------------


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
    """A checkpoint file that is not one this engine wrote (foreign, corrupt, truncated, of
    another training or cell), or one that could not be written (a full disk)."""


class ForeignCheckpoint(CheckpointError):
    """A checkpoint of another cell, or of none, in the directory of the cell measured now (``cell_checkpoints``)."""


#: The fields ``train`` writes into every checkpoint and reads back on resume, with their types.
CHECKPOINT_FIELDS = {
    "step": int,
    "world_size": int,
    "model": dict,
    "optimizer": dict,
    "scheduler": dict,
    "scaler": dict,
    "batches": list,
    "rng": list,
    "pending": list,
    "losses": list,
    "evaluations": list,
    "units": int,
    "train_s": (int, float),
    "wall_s": (int, float),
    "config": dict,
}


#: The identity of the cell this process measures now (``cell_checkpoints``): saved into every
#: checkpoint and required of every checkpoint loaded; None outside a cell (no check).
_cell_identity: dict | None = None

#: The keys of a harness cell that name what its checkpoints belong to.
CELL_IDENTITY = ("cell_id", "variant", "backend", "params", "axes", "task")


@contextlib.contextmanager
def cell_checkpoints(cell: Cell):
    """``with cell_checkpoints(cell):`` every checkpoint saved meanwhile carries the cell's id,
    variant, parameters, axes and task config, and one loaded must carry the same (else
    ``ForeignCheckpoint`` naming the file and what differs): a checkpoint copied from another
    cell's directory is never continued (``own_checkpoint`` sets it aside)."""
    global _cell_identity
    saved, _cell_identity = _cell_identity, {key: getattr(cell, key) for key in CELL_IDENTITY}
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
        raise ForeignCheckpoint(f"{path}: a checkpoint that names no cell, so not this cell's ({_cell_identity['cell_id']})")
    differing = [key for key in CELL_IDENTITY if owner.get(key) != _cell_identity[key]]
    if differing:
        shown = ", ".join(f"{key} {owner.get(key)!r:.80} (this cell: {_cell_identity[key]!r:.80})" for key in differing)
        raise ForeignCheckpoint(f"{path}: a checkpoint of another cell: {shown}")


#: What a checkpoint of another cell is renamed to (``own_checkpoint``): no longer a ``step-*.pt`` the trainer reads.
FOREIGN_PREFIX = "foreign-"


def own_checkpoint(directory, device) -> tuple[Path | None, dict | None]:
    """The latest checkpoint in ``directory`` and its payload (``load_checkpoint``), or (None, None). One of another
    cell (``ForeignCheckpoint``: copied from another cell's directory) is never continued, nor does it fail the cell
    on every resume until someone finds it: it is set aside (renamed ``foreign-step-….pt``, removed with the
    directory once the cell is recorded) with a note on stderr naming it and what differs, and the cell trains afresh."""
    while (path := latest_checkpoint(directory)) is not None:
        try:
            return path, load_checkpoint(path, device)
        except ForeignCheckpoint as exc:
            aside = path.with_name(FOREIGN_PREFIX + path.name)
            os.replace(path, aside)
            print(f"note: {exc}: not continued; set aside as {aside.name}, the cell trains afresh", file=sys.stderr)
    return None, None


def load_checkpoint(path, device) -> dict:
    """The payload of the checkpoint ``path``, read as data only: ``torch.load(weights_only=True)``
    admits tensors and plain containers and never runs code from the file (a pickle that asks
    for any other object is refused). A file that does not unpickle that way, or lacks one of
    ``CHECKPOINT_FIELDS`` (name: type), or is another cell's (``cell_checkpoints``), raises
    ``CheckpointError`` naming the path and what is wrong."""
    try:
        saved = torch.load(path, map_location=device, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - every way a foreign file fails to load is the same answer
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"{path}: not a checkpoint of attnbench's training engine, or corrupt ({reason}); remove it or use another checkpoint directory"
        ) from None
    if not isinstance(saved, dict):
        raise CheckpointError(f"{path}: expected a checkpoint (a dict of {', '.join(CHECKPOINT_FIELDS)}), got {type(saved).__name__}")
    for name, kind in CHECKPOINT_FIELDS.items():
        value = saved.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            expected = " or ".join(k.__name__ for k in kind) if isinstance(kind, tuple) else kind.__name__
            got = "nothing" if name not in saved else f"{type(value).__name__} {value!r:.60}"
            raise CheckpointError(f"{path}: field {name!r}: expected {expected}, got {got}")
    _check_cell(path, saved)
    return saved


def save_checkpoint(directory: Path, step: int, payload: dict) -> None:
    """Write ``step-XXXXXXXXX.pt`` atomically (``atomic_file``: a new temporary file of its own, so
    never through a planted link, then ``os.replace``), with the current cell's identity
    (``cell_checkpoints``), and remove older checkpoints. A write that fails (a full disk)
    removes the temporary file and raises ``CheckpointError`` naming the checkpoint: the
    previous checkpoint stays the latest, and no truncated file is ever left for a resume."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{CHECKPOINT_PREFIX}{step:09d}.pt"
    if _cell_identity is not None:
        payload = {**payload, "cell": _cell_identity}
    try:
        with atomic_file(path) as file:
            torch.save(payload, file)
    except (OSError, RuntimeError) as exc:  # torch.save reports a failed write as a RuntimeError
        reason = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise CheckpointError(f"{path}: could not write the checkpoint ({reason}); the previous one is kept") from None
    for older in directory.glob(f"{CHECKPOINT_PREFIX}*.pt"):
        if older != path:
            older.unlink()


def _identity(config: TrainConfig, task: dict | None) -> dict:
    """What a checkpoint must have been written under to be continued: the training's settings
    (but where checkpoints go) and the task's own (``task.<name>``)."""
    own = {name: value for name, value in asdict(config).items() if name not in _NOT_IDENTITY}
    return {**own, **{f"task.{name}": value for name, value in (task or {}).items()}}


def _restore(path, saved: dict, identity: dict, dist: Distributed) -> None:
    """``CheckpointError`` unless ``saved`` (from ``path``) was written by this training at this world size."""
    if saved["config"] != identity:
        differing = sorted(k for k in {*saved["config"], *identity} if saved["config"].get(k) != identity.get(k))
        raise CheckpointError(f"{path}: written by another training (differs in {', '.join(differing)}); remove it to start afresh")
    if saved["world_size"] != dist.world_size:
        raise CheckpointError(
            f"{path}: saved by a run of world size {saved['world_size']}; resume it with the same "
            f"world size (this run has {dist.world_size}), or use another checkpoint_dir"
        )


def train(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], tuple[torch.Tensor, int]],
    batches: BatchStream,
    config: TrainConfig,
    *,
    evaluate: Callable[[nn.Module, int], Any] | None = None,
    stop: Callable[[list], str | None] | None = None,
    identity: dict | None = None,
    dist: Distributed | None = None,
    progress: bool = True,
) -> TrainResult:
    """Train ``model`` (already on ``dist.device``, in float32) for ``config.steps`` steps; see
    the module docstring. ``evaluate(model, index)`` (``index``: the evaluations before it) runs
    on the main rank in eval mode, under ``torch.no_grad`` and the config's autocast; after each,
    ``stop(evaluations)`` may end training early with a reason. ``identity``: the task's
    settings, which a checkpoint must match besides the config's."""
    dist = dist or Distributed(0, 1, next(model.parameters()).device)
    precision = Precision(config.dtype, dist.device)
    optimizer = OPTIMIZERS[config.optimizer](model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, config.multiplier())
    identity = _identity(config, identity)
    losses: list[tuple[int, float]] = []
    evaluations: list[tuple[int, Any]] = []
    pending: list[float] = []  # the losses since the last point (log_mean)
    start_step, units, train_s, previous_wall_s, resumed_from = 0, 0, 0.0, 0.0, None

    checkpoint, saved = own_checkpoint(config.checkpoint_dir, dist.device) if config.checkpoint_dir else (None, None)
    if checkpoint is not None:
        _restore(checkpoint, saved, identity, dist)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        precision.scaler.load_state_dict(saved["scaler"])
        batches.load_state_dict(saved["batches"][dist.rank])
        set_rng_state(saved["rng"][dist.rank])
        start_step = resumed_from = saved["step"]
        losses, evaluations, pending = [tuple(p) for p in saved["losses"]], [tuple(e) for e in saved["evaluations"]], saved["pending"][dist.rank]
        units, train_s, previous_wall_s = saved["units"], saved["train_s"], saved["wall_s"]
    elif config.seed is not None:
        torch.manual_seed(config.seed * 1000 + dist.rank)
        random.seed(config.seed * 1000 + dist.rank)
    wrapped = dist.wrap(model)

    def stop_reason() -> str | None:
        """Why training ends now (every rank gets the main rank's answer), or None."""
        if losses and not math.isfinite(losses[-1][1]):
            return "non-finite loss"
        return dist.all_gather(stop(evaluations) if dist.is_main and evaluations else None)[0] if stop is not None else None

    def run_evaluation(step: int) -> None:
        if dist.is_main:
            model.eval()
            with torch.no_grad(), precision.autocast():
                evaluations.append((step, evaluate(model, len(evaluations))))
            model.train()
        dist.barrier()

    def write_checkpoint(step: int) -> None:
        batch_states, rng_states, pending_losses = dist.all_gather(batches.state_dict()), dist.all_gather(rng_state()), dist.all_gather(pending)
        total_units = int(dist.all_reduce_sum(local_units))
        if dist.is_main:
            payload = {
                "step": step,
                "world_size": dist.world_size,
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "scaler": precision.scaler.state_dict(),
                "batches": batch_states,
                "rng": rng_states,
                "pending": pending_losses,
                "losses": losses,
                "evaluations": evaluations,
                "units": units + total_units,
                "train_s": train_s + segment_train_s,
                "wall_s": previous_wall_s + time.perf_counter() - started,
                "config": identity,
            }
            save_checkpoint(Path(config.checkpoint_dir), step, payload)
        dist.barrier()

    model.train()
    local_units, segment_train_s, step = 0, 0.0, start_step
    stopped = stop_reason()
    started = time.perf_counter()
    bar = tqdm(total=config.steps, initial=start_step, disable=not (progress and dist.is_main), desc="train", unit="step")
    with PeakMemory(dist.device) as peak:
        for step in range(start_step + 1, config.steps + 1) if stopped is None else ():
            synchronize(dist.device)
            step_started = time.perf_counter()
            with precision.autocast():
                loss, count = loss_fn(wrapped, batches.next())
            optimizer.zero_grad(set_to_none=True)
            precision.scaler.scale(loss).backward()
            if config.clip is not None:
                precision.scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip)
            precision.scaler.step(optimizer)  # the optimiser's step, unless float16 gradients overflowed
            precision.scaler.update()
            with warnings.catch_warnings():  # a step the scaler skipped is still a step of the schedule
                warnings.filterwarnings("ignore", re.escape("Detected call of `lr_scheduler.step()` before"))
                scheduler.step()
            local_units += int(count)
            if config.log_mean:
                pending.append(loss.item())
            diverged = dist.world_size == 1 and config.log_mean and not math.isfinite(pending[-1])
            if step % config.log_every == 0 or step == config.steps or diverged:
                value = sum(pending) / len(pending) if config.log_mean else loss.item()
                losses.append((step, dist.all_reduce_mean(value)))
                pending = []
                bar.set_postfix(loss=f"{losses[-1][1]:.3f}")
            synchronize(dist.device)
            segment_train_s += time.perf_counter() - step_started
            bar.update()
            if losses and not math.isfinite(losses[-1][1]):
                stopped = stop_reason()
                break
            if evaluate is not None and ((config.eval_every and step % config.eval_every == 0) or step == config.steps):
                run_evaluation(step)
                stopped = stop_reason()
            if config.checkpoint_every and (step % config.checkpoint_every == 0 or step == config.steps or stopped):
                write_checkpoint(step)
            if stopped:
                break
    bar.close()
    model.eval()
    units += int(dist.all_reduce_sum(local_units))
    train_s += dist.all_reduce_mean(segment_train_s)
    return TrainResult(
        losses=losses,
        evaluations=evaluations,
        steps=step,
        wall_s=previous_wall_s + time.perf_counter() - started,
        units=units,
        units_per_s=units / train_s if train_s > 0 else 0.0,
        peak_mem_bytes=peak.bytes,
        memory_kind=peak.kind,
        train_s=train_s,
        resumed_from=resumed_from,
        stopped=stopped,
    )

"""Every training batch stream of the quality tasks, in one room.

A ``BatchStream`` gives this rank's shard of the next global batch (``next``) and holds its
position (``state_dict``), which the trainer (``harness.tasks.training``) saves with every
checkpoint and restores on resume:

- ``GeneratorBatches``: fresh synthetic batches drawn from a seeded generator (MQAR,
  retrieval, copy, image generation);
- ``WindowBatches``: random windows of a token stream (language modelling);
- ``LengthBatches``: sentence pairs of one source length (translation; ``Example``,
  ``encode_examples``, ``collate``, ``groups_by_source_length``).
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .parallel_text import BOS, EOS, PAD


class BatchStream(Protocol):
    """A data source: ``next()`` gives this rank's shard of the next global batch; its position
    (``state_dict``) is saved with every checkpoint and restored on resume."""

    def next(self) -> Any: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class GeneratorBatches:
    """A ``BatchStream`` of batches drawn by ``draw(generator)`` from a CPU generator seeded
    with ``seed`` (the synthetic tasks' fresh batches); its position is the generator's state."""

    def __init__(self, draw: Callable[[torch.Generator], Any], seed: int):
        self.draw, self.generator = draw, torch.Generator().manual_seed(seed)

    def next(self) -> Any:
        return self.draw(self.generator)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


class WindowBatches:
    """Training batches of the token stream ``tokens`` (1-D): ``batch`` windows of ``context + 1``
    tokens at uniformly random offsets, as ``(inputs, targets)`` of ``[batch / world_size,
    context]`` each (targets are the inputs shifted by one). Every rank draws the same global
    offsets from a generator seeded with ``seed`` and keeps its own rows, so the global batch
    does not depend on the number of ranks. The position is the generator's state."""

    def __init__(self, tokens: torch.Tensor, context: int, batch: int, *, seed: int, rank: int = 0, world_size: int = 1, device="cpu"):
        if batch % world_size:
            raise ValueError(f"batch={batch} must be divisible by the number of processes ({world_size})")
        if len(tokens) < context + 1:
            raise ValueError(f"the training stream has {len(tokens)} tokens, fewer than context + 1 = {context + 1}")
        self.tokens, self.context, self.batch, self.device = tokens, context, batch, torch.device(device)
        per_rank = batch // world_size
        self.rows = slice(rank * per_rank, (rank + 1) * per_rank)
        self.generator = torch.Generator().manual_seed(seed)
        self.offsets = torch.arange(context + 1)

    def next(self):
        starts = torch.randint(0, len(self.tokens) - self.context, (self.batch,), generator=self.generator)
        windows = self.tokens[starts[self.rows, None] + self.offsets].to(self.device)
        return windows[:, :-1], windows[:, 1:]

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


@dataclass
class Batch:
    """``src [B, S]`` (one source length, no padding), ``tgt_in``/``tgt_out [B, T]`` (PAD after
    the end), ``words``: target-side words in the batch."""

    src: torch.Tensor
    tgt_in: torch.Tensor
    tgt_out: torch.Tensor
    words: int

    def to(self, device) -> Batch:
        return Batch(self.src.to(device), self.tgt_in.to(device), self.tgt_out.to(device), self.words)


@dataclass
class Example:
    source: list[int]
    target: list[int]
    words: int


def encode_examples(sources: list[str], targets: list[str], vocab, *, max_length: int | None = None) -> list[Example]:
    """Source subwords + EOS and target subwords per pair; pairs with a side longer than
    ``max_length`` tokens are dropped (training only)."""
    examples = [Example(source + [EOS], target, len(text.split())) for source, target, text in zip(vocab.encode(sources), vocab.encode(targets), targets)]
    if max_length is not None:
        examples = [e for e in examples if len(e.source) <= max_length and len(e.target) + 1 <= max_length]
    return examples


def collate(examples: list[Example], device=None) -> Batch:
    """Pad one group of examples with a common source length into a Batch."""
    length = max(len(e.target) for e in examples) + 1
    src = torch.tensor([e.source for e in examples], dtype=torch.long)
    tgt_in = torch.full((len(examples), length), PAD, dtype=torch.long)
    tgt_out = torch.full((len(examples), length), PAD, dtype=torch.long)
    for row, e in enumerate(examples):
        tgt_in[row, : len(e.target) + 1] = torch.tensor([BOS] + e.target)
        tgt_out[row, : len(e.target) + 1] = torch.tensor(e.target + [EOS])
    return Batch(src, tgt_in, tgt_out, sum(e.words for e in examples)).to(device)


class LengthBatches:
    """A ``training.BatchStream`` of batches of one source length and at most ``batch_tokens``
    padded tokens. Each epoch (seeded by ``seed`` and the epoch number) shuffles the sentences
    of each source length, sorts them by target length, cuts them into batches and shuffles
    the batches; rank r of a data-parallel run takes batches r, r + world_size, ..."""

    def __init__(self, examples: list[Example], batch_tokens: int, *, seed: int = 0, rank: int = 0, world_size: int = 1, device=None):
        if not examples:
            raise ValueError("LengthBatches: no training examples")
        longest = max(max(len(e.source), len(e.target) + 1) for e in examples)
        if batch_tokens < longest:
            raise ValueError(f"batch_tokens={batch_tokens} is below the longest sentence ({longest} tokens); raise it or drop long pairs")
        self.examples, self.batch_tokens, self.seed = examples, batch_tokens, seed
        self.rank, self.world_size, self.device = rank, world_size, device
        self.epoch, self.cursor = 0, 0
        self._plan = self._epoch_plan(0)

    def _epoch_plan(self, epoch: int) -> list[list[int]]:
        """This rank's batches (lists of example indices) of ``epoch``."""
        rng = random.Random(self.seed * 1_000_003 + epoch)
        by_length = defaultdict(list)
        for index, example in enumerate(self.examples):
            by_length[len(example.source)].append(index)
        batches = []
        for source_length in sorted(by_length):
            indices = by_length[source_length]
            rng.shuffle(indices)
            indices.sort(key=lambda i: len(self.examples[i].target))
            current, width = [], source_length
            for index in indices:
                width_with = max(width, len(self.examples[index].target) + 1)
                if current and width_with * (len(current) + 1) > self.batch_tokens:
                    batches.append(current)
                    current, width_with = [], max(source_length, len(self.examples[index].target) + 1)
                current.append(index)
                width = width_with
            batches.append(current)
        rng.shuffle(batches)
        mine = batches[self.rank :: self.world_size]
        if not mine:
            raise ValueError(f"LengthBatches: {len(batches)} batches cannot feed {self.world_size} ranks")
        return mine

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        return len(self._plan)

    def next(self) -> Batch:
        if self.cursor == len(self._plan):
            self.epoch, self.cursor = self.epoch + 1, 0
            self._plan = self._epoch_plan(self.epoch)
        batch = collate([self.examples[i] for i in self._plan[self.cursor]], self.device)
        self.cursor += 1
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self._plan = self._epoch_plan(self.epoch)


def groups_by_source_length(examples: list[Example], max_sentences: int) -> list[list[int]]:
    """Indices of ``examples`` in groups of one source length and at most ``max_sentences`` (for decoding)."""
    by_length = defaultdict(list)
    for index, example in enumerate(examples):
        by_length[len(example.source)].append(index)
    return [indices[i : i + max_sentences] for _, indices in sorted(by_length.items()) for i in range(0, len(indices), max_sentences)]

"""Hostile input and faults (issue 16): files are data, never code; errors name what is wrong."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness.tasks.training import CheckpointError, TrainConfig, load_checkpoint, train


class _CreatesFile:
    """An object whose unpickling calls ``open(path, "w")``: what a crafted checkpoint does."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


class _Stream:
    def __init__(self):
        self.generator = torch.Generator().manual_seed(0)

    def next(self):
        x = torch.randn(4, 3, generator=self.generator)
        return x, x.sum(-1, keepdim=True)

    def state_dict(self):
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state):
        self.generator.set_state(state["generator"])


def _mse(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y), len(x)


def test_a_crafted_checkpoint_runs_no_code_and_is_refused(tmp_path):
    """Resuming from a checkpoint whose unpickling would create a file creates nothing and
    raises a CheckpointError that names the file."""
    marker = tmp_path / "pwned"
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    crafted = checkpoints / "step-000000001.pt"
    torch.save({"step": 1, "world_size": 1, "payload": _CreatesFile(marker)}, crafted)
    config = TrainConfig(steps=2, lr=1e-2, checkpoint_dir=str(checkpoints), checkpoint_every=1)
    with pytest.raises(CheckpointError, match=str(crafted)):
        train(nn.Linear(3, 1), _mse, _Stream(), config, progress=False)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"", "not a checkpoint"),
        (b"\x00garbage" * 10, "not a checkpoint"),
        ({"step": 1}, "field 'world_size': expected int, got nothing"),
        ([1, 2, 3], "expected a checkpoint"),
    ],
)
def test_foreign_or_corrupt_checkpoints_are_refused_with_path_and_reason(tmp_path, content, expected):
    path = tmp_path / "step-000000001.pt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save(content, path)
    with pytest.raises(CheckpointError, match=expected) as caught:
        load_checkpoint(path, "cpu")
    assert str(path) in str(caught.value)


def test_a_checkpoint_the_engine_wrote_loads_as_data(tmp_path):
    """The engine's own checkpoints (tensors, optimiser state, RNG states, losses) pass the
    weights-only loader (test_training's resume tests rely on it)."""
    config = TrainConfig(steps=2, lr=1e-2, checkpoint_dir=str(tmp_path), checkpoint_every=2)
    train(nn.Linear(3, 1), _mse, _Stream(), config, progress=False)
    saved = load_checkpoint(tmp_path / "step-000000002.pt", "cpu")
    assert saved["step"] == 2 and saved["world_size"] == 1 and len(saved["losses"]) == 1

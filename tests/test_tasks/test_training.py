"""The shared training engine: schedule, checkpoint/resume, data-parallel runs."""

from __future__ import annotations

import json
import math
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from harness.files import write_json_atomic
from harness.tasks.training import Distributed, TrainConfig, latest_checkpoint, train, warmup_cosine

GLOBAL_BATCH, D_IN = 8, 6


class RegressionStream:
    """Global batches of a fixed random linear regression; each rank takes its rows."""

    def __init__(self, seed: int, rank: int = 0, world_size: int = 1):
        self.generator = torch.Generator().manual_seed(seed)
        self.target = torch.randn(D_IN, 1, generator=torch.Generator().manual_seed(seed + 1))
        self.rows = slice(rank * GLOBAL_BATCH // world_size, (rank + 1) * GLOBAL_BATCH // world_size)

    def next(self):
        x = torch.randn(GLOBAL_BATCH, D_IN, generator=self.generator)[self.rows]
        return x, x @ self.target + 0.1 * torch.sin(3 * x[:, :1])

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


def make_model(seed: int, dropout: float) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D_IN, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 1))


def mse(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y), len(x)


def test_warmup_cosine_values():
    f = warmup_cosine(4, 12)
    assert [f(s) for s in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]
    for s in range(4, 13):
        assert f(s) == pytest.approx(0.5 * (1 + math.cos(math.pi * (s - 4) / 8)))
    assert f(8) == pytest.approx(0.5) and f(12) == pytest.approx(0.0)
    assert warmup_cosine(0, 10)(0) == 1.0
    with pytest.raises(ValueError, match="warmup"):
        warmup_cosine(11, 10)


def test_train_follows_the_schedule_and_counts(seed):
    """Step 1 of a warm-up runs at learning rate 0 (multiplier 0/warmup), so it leaves the
    parameters unchanged; step 2 moves them."""
    model = make_model(seed, 0.0)
    snapshots = []

    def recording_mse(m, batch):
        snapshots.append([p.detach().clone() for p in m.parameters()])
        return mse(m, batch)

    config = TrainConfig(steps=6, lr=0.01, warmup=2, log_every=1)
    result = train(model, recording_mse, RegressionStream(seed), config, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(snapshots[0], snapshots[1])), f"seed={seed}"
    assert not all(torch.equal(a, b) for a, b in zip(snapshots[1], snapshots[2])), f"seed={seed}"
    assert [s for s, _ in result.losses] == list(range(1, 7))
    assert result.units == 6 * GLOBAL_BATCH and result.units_per_s > 0 and result.resumed_from is None


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="steps"):
        TrainConfig(steps=0, lr=1e-3)
    with pytest.raises(ValueError, match="lr"):
        TrainConfig(steps=1, lr=0)
    with pytest.raises(ValueError, match="checkpoint_dir"):
        TrainConfig(steps=1, lr=1e-3, checkpoint_every=1)


def run(seed, steps, checkpoint_dir=None, checkpoint_every=None, evaluate=None):
    model = make_model(seed, dropout=0.3)
    config = TrainConfig(
        steps=steps, lr=0.02, warmup=3, log_every=1, eval_every=4,
        checkpoint_every=checkpoint_every, checkpoint_dir=checkpoint_dir,
    )
    return model, train(model, mse, RegressionStream(seed), config, evaluate=evaluate, progress=False)


def test_resume_reproduces_the_uninterrupted_run(seed, tmp_path):
    """Stop after k steps (a checkpoint every 5 steps, the last at 10), resume to n."""
    evaluate = lambda m: {"w": m[0].weight.sum().item()}  # noqa: E731
    straight_model, straight = run(seed, 16, evaluate=evaluate)

    class Interrupt(Exception):
        pass

    stopping_stream_calls = []

    def interrupted_loss(m, batch):
        if len(stopping_stream_calls) == 12:  # dies inside step 13, after the checkpoint at 10
            raise Interrupt
        stopping_stream_calls.append(1)
        return mse(m, batch)

    model = make_model(seed, dropout=0.3)
    config = TrainConfig(steps=16, lr=0.02, warmup=3, log_every=1, eval_every=4, checkpoint_every=5,
                         checkpoint_dir=str(tmp_path))
    with pytest.raises(Interrupt):
        train(model, interrupted_loss, RegressionStream(seed), config, evaluate=evaluate, progress=False)
    assert latest_checkpoint(tmp_path).name == "step-000000010.pt"

    resumed_model, resumed = run(seed, 16, str(tmp_path), 5, evaluate=evaluate)
    assert resumed.resumed_from == 10
    assert resumed.losses == straight.losses, f"seed={seed}"
    assert resumed.evaluations == straight.evaluations, f"seed={seed}"
    assert resumed.units == straight.units == 16 * GLOBAL_BATCH
    for a, b in zip(resumed_model.parameters(), straight_model.parameters()):
        assert torch.equal(a, b), f"seed={seed}"
    assert [p.name for p in tmp_path.iterdir()] == ["step-000000016.pt"], "older checkpoints are removed"


def test_resume_refuses_another_world_size(tmp_path):
    run(0, 4, str(tmp_path), 2)
    model = make_model(0, 0.0)
    config = TrainConfig(steps=6, lr=0.01, checkpoint_every=2, checkpoint_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"world size 1; .*\(this run has 2\)"):
        train(model, mse, RegressionStream(0), config, dist=Distributed(0, 2, torch.device("cpu")), progress=False)


STEPS = 5


def _ddp_worker(rank: int, world_size: int, port: int, seed: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist = Distributed.from_env("cpu")
    model = make_model(seed, 0.0)
    config = TrainConfig(steps=STEPS, lr=0.05, warmup=1, log_every=1)
    result = train(model, mse, RegressionStream(seed, rank, world_size), config, dist=dist, progress=False)
    torch.save({"params": [p.detach() for p in model.parameters()], "losses": result.losses, "units": result.units},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_process_gloo_run_matches_one_process(seed, tmp_path):
    mp.spawn(_ddp_worker, args=(2, _free_port(), seed, str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(a, b), f"parameters identical across ranks, seed={seed}"
    assert ranks[0]["losses"] == ranks[1]["losses"] and ranks[0]["units"] == STEPS * GLOBAL_BATCH

    single = make_model(seed, 0.0)
    config = TrainConfig(steps=STEPS, lr=0.05, warmup=1, log_every=1)
    result = train(single, mse, RegressionStream(seed), config, progress=False)
    for a, b in zip(ranks[0]["params"], single.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6, msg=f"seed={seed}")
    for (step_a, loss_a), (step_b, loss_b) in zip(ranks[0]["losses"], result.losses, strict=True):
        assert step_a == step_b and loss_a == pytest.approx(loss_b, rel=1e-5), f"seed={seed}"


def test_json_is_written_whole_or_not_at_all(tmp_path):
    path = tmp_path / "metrics.json"
    write_json_atomic(path, {"a": 1})
    write_json_atomic(path, {"a": [1, 2]})
    assert json.loads(path.read_text()) == {"a": [1, 2]}
    with pytest.raises(TypeError):
        write_json_atomic(path, {"a": object()})
    assert json.loads(path.read_text()) == {"a": [1, 2]} and [p.name for p in tmp_path.iterdir()] == ["metrics.json"]

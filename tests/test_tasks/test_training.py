"""The shared training engine: schedule, checkpoint/resume, data-parallel runs."""

from __future__ import annotations

import errno
import json
import math
import os
import socket
import warnings

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from harness.common.files import write_json_atomic
from harness.tasks.distributed import Distributed
from harness.tasks.training import CheckpointError, TrainConfig, latest_checkpoint, train, warmup_cosine

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
        steps=steps,
        lr=0.02,
        warmup=3,
        log_every=1,
        eval_every=4,
        checkpoint_every=checkpoint_every,
        checkpoint_dir=checkpoint_dir,
    )
    return model, train(model, mse, RegressionStream(seed), config, evaluate=evaluate, progress=False)


def test_resume_reproduces_the_uninterrupted_run(seed, tmp_path):
    """Stop after k steps (a checkpoint every 5 steps, the last at 10), resume to n."""
    evaluate = lambda m, _index: {"w": m[0].weight.sum().item()}  # noqa: E731
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
    config = TrainConfig(steps=16, lr=0.02, warmup=3, log_every=1, eval_every=4, checkpoint_every=5, checkpoint_dir=str(tmp_path))
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
    model = make_model(0, 0.3)
    config = TrainConfig(steps=4, lr=0.02, warmup=3, log_every=1, eval_every=4, checkpoint_every=2, checkpoint_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"world size 1; .*\(this run has 2\)"):
        train(model, mse, RegressionStream(0), config, dist=Distributed(0, 2, torch.device("cpu")), progress=False)


STEPS = 5


def _ddp_worker(rank: int, world_size: int, port: int, seed: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist = Distributed.from_env("cpu")
    model = make_model(seed, 0.0)
    config = TrainConfig(steps=STEPS, lr=0.05, warmup=1, log_every=1)
    result = train(model, mse, RegressionStream(seed, rank, world_size), config, dist=dist, progress=False)
    torch.save({"params": [p.detach() for p in model.parameters()], "losses": result.losses, "units": result.units}, os.path.join(out_dir, f"rank{rank}.pt"))
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


# --- mixed precision (harness.tasks.precision) ---------------------------------------------


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_training_steps_on_the_cpu_keep_float32_master_weights(seed, dtype, tmp_path):
    """The forward pass computes in the 16-bit dtype (autocast, on the CPU too), the weights and
    the optimiser's moments stay float32 and move; float16 goes through a gradient scaler, whose
    state is checkpointed and restored."""
    model = make_model(seed, 0.0)
    before = [p.detach().clone() for p in model.parameters()]
    seen = []

    def recording_mse(m, batch):
        seen.append(m(batch[0]).dtype)
        return mse(m, batch)

    config = TrainConfig(steps=4, lr=0.01, log_every=1, dtype=dtype, checkpoint_every=2, checkpoint_dir=str(tmp_path))
    result = train(model, recording_mse, RegressionStream(seed), config, progress=False)
    assert set(seen) == {getattr(torch, dtype)}, f"seed={seed}"
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(math.isfinite(loss) for _, loss in result.losses) and result.steps == 4
    assert not any(torch.equal(a, b) for a, b in zip(before, model.parameters())), f"seed={seed}"
    saved = torch.load(latest_checkpoint(tmp_path), weights_only=True)
    assert ("scale" in saved["scaler"]) == (dtype == "float16")
    assert all(state["exp_avg"].dtype == torch.float32 for state in saved["optimizer"]["state"].values())


def test_a_float16_step_whose_gradients_overflow_is_skipped(seed):
    """An infinite gradient under the scaler leaves the weights as they were and halves the scale."""
    model = make_model(seed, 0.0)
    before = [p.detach().clone() for p in model.parameters()]

    def overflowing(m, batch):
        loss, count = mse(m, batch)
        return loss * torch.tensor(math.inf), count

    config = TrainConfig(steps=1, lr=0.01, dtype="float16", clip=None, log_every=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the schedule's step after a skipped one is no warning
        result = train(model, overflowing, RegressionStream(seed), config, progress=False)
    assert result.stopped == "non-finite loss"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), f"seed={seed}"


def test_a_dtype_outside_the_policy_is_refused_by_name():
    with pytest.raises(ValueError, match=r"TrainConfig\.dtype: a quality task trains in float32, bfloat16, float16 .*not 'float64'"):
        TrainConfig(steps=1, lr=1e-3, dtype="float64")


def test_schedules_and_optimisers_are_configuration():
    assert TrainConfig(steps=10, lr=1, schedule="constant").multiplier()(9) == 1.0
    drop = TrainConfig(steps=10, lr=1, schedule="step_drop", drop_step=4).multiplier()
    assert (drop(3), drop(4)) == (1.0, 0.1)
    with pytest.raises(ValueError, match="drop_step"):
        TrainConfig(steps=10, lr=1, schedule="step_drop")
    with pytest.raises(ValueError, match="optimizer must be one of adamw, adam, radam"):
        TrainConfig(steps=10, lr=1, optimizer="sgd")


# --- checkpoints -------------------------------------------------------------------------------


def test_a_checkpoint_of_another_training_is_refused_naming_what_differs(tmp_path):
    run(0, 4, str(tmp_path), 2)
    config = TrainConfig(steps=4, lr=0.03, warmup=3, log_every=1, eval_every=4, checkpoint_every=2, checkpoint_dir=str(tmp_path))
    with pytest.raises(CheckpointError, match=r"step-000000004\.pt: written by another training \(differs in lr\)"):
        train(make_model(0, 0.3), mse, RegressionStream(0), config, progress=False)


def test_a_full_disk_while_checkpointing_names_the_file_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """ENOSPC in the middle of the second checkpoint's write: one line naming that checkpoint, no
    truncated or temporary file left behind, and a resume continues from the first checkpoint
    to the uninterrupted run's result."""
    _, straight = run(0, 4)
    real_save, calls = torch.save, []

    def disk_full_the_second_time(payload, file):
        calls.append(1)
        if len(calls) == 2:
            file.write(b"PK\x03\x04 half a checkpoint")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_save(payload, file)

    with monkeypatch.context() as patch:
        patch.setattr(torch, "save", disk_full_the_second_time)
        with pytest.raises(CheckpointError) as caught:
            run(0, 4, str(tmp_path), 2)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{tmp_path / 'step-000000004.pt'}: could not write the checkpoint")
    assert "No space left on device" in message
    assert [p.name for p in tmp_path.iterdir()] == ["step-000000002.pt"], "no truncated or temporary file"
    _, resumed = run(0, 4, str(tmp_path), 2)
    assert resumed.resumed_from == 2 and resumed.losses == straight.losses

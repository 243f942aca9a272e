"""Checkpoints of the retrieval and MQAR trainings (the shared trainer, checkpoint after every
evaluation): a run stopped after a checkpoint and started again follows the trajectory of an
uninterrupted run, step for step."""

from __future__ import annotations

import pytest
import torch

from harness.models.mqar import MQARModel
from harness.models.retrieval import RetrievalModel
from harness.tasks import mqar, retrieval
from harness.tasks.training import CheckpointError, latest_checkpoint


class Interrupted(Exception):
    """Raised by the data stream in place of a process dying mid-training."""


def _interrupt_at(monkeypatch, module, call: int) -> None:
    """Make ``module.make_batch`` raise on its ``call``-th call (the training stream only:
    evaluations of both tasks draw through the same function, so count every call)."""
    make_batch, calls = module.make_batch, [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        if calls[0] == call:
            raise Interrupted
        return make_batch(*args, **kwargs)

    monkeypatch.setattr(module, "make_batch", counted)


def _retrieval(seed, checkpoint_dir=None, **changes):
    torch.manual_seed(seed)
    model = RetrievalModel(6, "linear", d_key=8)
    config = retrieval.RetrievalConfig(max_steps=7, eval_every=2, patience=50, target_loss=1e-9, seed=seed, **changes)
    return retrieval.train(model, config, 6, checkpoint_dir=checkpoint_dir)


def _mqar(seed, checkpoint_dir=None):
    torch.manual_seed(seed)
    model = MQARModel(16, 16, "linear", max_len=16)
    config = mqar.MQARConfig(name="mqar", vocab_size=16, steps=7, batch=4, eval_every=2, seed=seed)
    return mqar.train(model, config, 16, checkpoint_dir=checkpoint_dir)


@pytest.mark.parametrize(("module", "run", "interrupt_at"), [(retrieval, _retrieval, 5), (mqar, _mqar, 13)])
def test_a_resumed_run_follows_the_uninterrupted_one(tmp_path, monkeypatch, seed, module, run, interrupt_at):
    """Interrupted on the 5th training step, after the checkpoints of the evaluations at steps 2
    and 4 (each draws its EVAL_BATCHES = 4 evaluation batches through make_batch for MQAR, none
    for retrieval), then started again."""
    whole = run(seed)
    with monkeypatch.context() as patch:
        _interrupt_at(patch, module, interrupt_at)
        with pytest.raises(Interrupted):
            run(seed, tmp_path)
    assert latest_checkpoint(tmp_path).name == "step-000000004.pt"
    resumed = run(seed, tmp_path)
    assert resumed.resumed_from == 4 and whole.resumed_from is None
    assert (resumed.evaluations, resumed.loss) == (whole.evaluations, whole.loss), f"seed={seed}"
    assert (resumed.steps, resumed.tokens) == (whole.steps, whole.tokens)
    assert [step for step, _ in whole.evaluations] == [2, 4, 6, 7]
    assert resumed.train_s > 0 and resumed.wall_s >= resumed.train_s


def test_a_finished_run_restarts_to_its_result_without_training(tmp_path, monkeypatch, seed):
    """A checkpoint written at the stopping evaluation (the process died before its record) gives
    the result again; nothing is trained past it."""
    whole = _retrieval(seed, tmp_path)
    monkeypatch.setattr(retrieval, "make_batch", lambda *args, **kwargs: pytest.fail("trained past the end"))
    again = _retrieval(seed, tmp_path)
    assert (again.loss, again.steps, again.stopped, again.evaluations) == (whole.loss, whole.steps, whole.stopped, whole.evaluations)
    assert again.resumed_from == 7


def test_stop_reasons_follow_the_evaluations():
    """target: the last loss at most target_loss; patience: that many evaluations since the first
    best; max_steps: the last evaluation at the budget (Schlag et al. 2021, §6.1)."""
    stop = retrieval._stop_reason
    assert stop([], 10, 2, 0.1) is None
    assert stop([(1, 0.5), (2, 0.05)], 10, 2, 0.1) == "target"
    assert stop([(1, 0.5), (2, 0.6), (3, 0.5)], 10, 2, 0.1) == "patience"  # a tie is no new best
    assert stop([(1, 0.5), (2, 0.6), (3, 0.4)], 10, 2, 0.1) is None
    assert stop([(1, 0.5), (10, 0.4)], 10, 2, 0.1) == "max_steps"


def test_a_checkpoint_of_another_training_is_refused_by_name(tmp_path, seed):
    _retrieval(seed, tmp_path)
    with pytest.raises(CheckpointError, match=r"step-000000007\.pt: written by another training \(differs in lr, task\.lr\)"):
        _retrieval(seed, tmp_path, lr=0.01)


def test_a_checkpoint_missing_a_field_is_refused_by_name(tmp_path):
    torch.save({"step": 1, "world_size": 1}, tmp_path / "step-000000001.pt")
    with pytest.raises(CheckpointError, match="step-000000001.pt: field 'model': expected dict, got nothing"):
        _retrieval(0, tmp_path)

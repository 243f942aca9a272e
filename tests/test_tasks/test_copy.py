"""The copy task (Katharopoulos et al. 2020, §4.1): data, the loss curve and its threshold, evaluation, the ci preset."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import attnbench
from torch import nn

from harness.scenarios.scenario import load_scenario
from harness.tasks.batches import GeneratorBatches
from harness.tasks.copy import IGNORE, SEPARATOR, CopyConfig, evaluate, make_batch, max_copy, padding, steps_to_threshold
from harness.tasks.training import LR_DROP, TrainConfig, train


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("T, n_symbols", [(12, 10), (32, 10), (7, 3)])
def test_sequences_hold_a_separator_the_symbols_the_separator_and_the_copy(seed, T, n_symbols):
    inputs, targets = make_batch(T, n_symbols, 200, gen(seed))
    assert inputs.shape == targets.shape == (200, T) and inputs.dtype == targets.dtype == torch.long, f"seed={seed}"
    lengths = set()
    for row, target in zip(inputs.tolist(), targets.tolist()):
        assert row[0] == SEPARATOR, f"seed={seed}"
        L = row.index(SEPARATOR, 1) - 1
        lengths.add(L)
        assert 1 <= L <= max_copy(T), f"seed={seed}"
        symbols = row[1 : L + 1]
        assert all(1 <= s <= n_symbols for s in symbols), f"seed={seed}"
        # the targets are the inputs shifted by one, scored exactly on the second copy
        scored = [t for t, value in enumerate(target) if value != IGNORE]
        assert scored == list(range(L + 1, 2 * L + 1)), f"seed={seed}"
        assert [target[t] for t in scored] == symbols, f"the copy repeats the symbols, seed={seed}"
        assert all(row[t + 1] == target[t] for t in scored if t + 1 < T), f"seed={seed}"
        assert all(token == padding(n_symbols) for token in row[2 * L + 2 :]), f"padding after the copy, seed={seed}"
    assert {1, max_copy(T)} <= lengths, f"copy lengths span 1 .. (T - 1) // 2, seed={seed}"


def test_a_copy_task_needs_room_for_two_separators_and_a_symbol():
    with pytest.raises(ValueError, match="seq_len >= 3"):
        make_batch(2, 10, 1, gen(0))


def test_steps_to_threshold_is_the_first_point_at_or_below_it():
    curve = [[10, 2.3], [20, 0.5], [30, 0.1], [40, 0.05], [50, 0.2]]
    assert steps_to_threshold(curve, 0.1) == 30
    assert steps_to_threshold(curve, 0.5) == 20 and steps_to_threshold(curve, 0.3) == 30
    assert steps_to_threshold(curve, 0.01) is None
    assert steps_to_threshold([[5, math.nan], [10, 0.0]], 0.1) == 10
    with pytest.raises(ValueError, match="finite"):
        steps_to_threshold(curve, math.nan)


def _curve_config(**changes) -> TrainConfig:
    task = CopyConfig(name="copy", steps=10000, lr=1e-3, lr_drop_step=3000, log_every=50)
    return TrainConfig.loss_curve(task.model_copy(update=changes))


def test_the_learning_rate_drops_tenfold_after_the_given_updates():
    multiplier = _curve_config().multiplier()
    assert multiplier(0) == multiplier(2999) == 1.0 and multiplier(3000) == multiplier(9999) == LR_DROP == 0.1
    assert _curve_config(lr_drop_step=None).multiplier()(10**6) == 1.0
    assert _curve_config().optimizer == "radam" and _curve_config().clip is None


def test_each_curve_point_is_the_mean_loss_since_the_previous_one():
    weight = nn.Linear(1, 1)
    losses = iter(range(1, 6))
    values = GeneratorBatches(lambda _generator: float(next(losses)), 0)
    config = _curve_config(steps=5, lr_drop_step=2, log_every=2)
    curve = train(weight, lambda model, batch: (model.weight.sum() * 0 + batch, 3), values, config, progress=False)
    assert curve.losses == [(2, 1.5), (4, 3.5), (5, 5.0)] and curve.units == 15


def test_a_non_finite_loss_ends_the_curve_at_its_point():
    weight = nn.Linear(1, 1)
    losses = iter([1.0, 2.0, math.inf, 4.0])
    values = GeneratorBatches(lambda _generator: next(losses), 0)
    curve = train(weight, lambda model, batch: (model.weight.sum() * 0 + batch, 1), values, _curve_config(steps=4, log_every=2), progress=False)
    assert curve.losses[:1] == [(2, 1.5)] and curve.losses[1][0] == 3 and not math.isfinite(curve.losses[1][1])
    assert curve.steps == 3 and curve.stopped == "non-finite loss"


class Oracle(nn.Module):
    """Predicts the next token from the inputs: the second copy repeats the token L + 1 back."""

    def __init__(self, vocab: int, wrong: bool = False):
        super().__init__()
        self.vocab, self.wrong = vocab, wrong

    def forward(self, inputs):
        logits = torch.zeros(*inputs.shape, self.vocab)
        for b, row in enumerate(inputs.tolist()):
            L = row.index(SEPARATOR, 1) - 1
            for t in range(L + 1, min(2 * L + 1, len(row))):
                logits[b, t, 1 if self.wrong else row[t - L]] = 1.0
        return logits


def test_evaluation_scores_the_copied_half(seed):
    right = evaluate(Oracle(12), 16, 10, batch=8, batches=3, seed=seed)
    assert right == {"accuracy": 1.0, "exact": 1.0}, f"seed={seed}"
    wrong = evaluate(Oracle(12, wrong=True), 16, 10, batch=8, batches=3, seed=seed)
    assert wrong["accuracy"] < 0.5 and wrong["exact"] < 1.0, f"seed={seed}"


@pytest.mark.slow
def test_ci_preset_runs_through_attnbench_run(tmp_path):
    from harness.results import load

    done = attnbench("run", "quality/copy", "--preset", "ci", "--out", str(tmp_path / "out"), "--no-progress", "--report", str(tmp_path / "report"))
    assert done.returncode == 0, done.stderr
    table = load([tmp_path / "out"])
    assert sorted(table["variant"]) == ["linear", "lsh", "softmax"] and set(table["status"]) == {"ok"}, table[["variant", "error"]]
    for losses in table["metrics.losses"]:
        assert [step for step, _ in losses] == [2, 4, 6] and all(0 < loss < 10 for _, loss in losses)
    assert table["metrics.accuracy"].between(0, 1).all() and (table["metrics.loss_threshold"] == 0.1).all()
    assert "Copy task" in (tmp_path / "report" / "index.html").read_text()


def test_the_cpu_preset_trains_the_papers_four_kinds_of_attention():
    """A preset's ``variants`` replace the scenario's: the cpu preset must list softmax, linear and delta beside lsh."""
    cells = load_scenario("quality/copy", preset="cpu").cells()
    assert {cell.variant for cell in cells} == {"softmax", "linear", "lsh", "delta"}
    assert sorted(cell.params["n_rounds"] for cell in cells if cell.variant == "lsh") == [1, 4]

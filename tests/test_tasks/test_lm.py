"""The WikiText language-modelling task: batches, the three evaluation protocols, learning, the runner."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import attnbench, make_cell, needs_shared

from harness.models import DecoderConfig
from harness.models.decoder import DecoderLM
from harness.tasks.batches import WindowBatches
from harness.tasks.command_line import parse_command_line
from harness.tasks.lm import LMConfig, evaluate_carry, evaluate_sliding, evaluate_windows, main, run_cell, run_lm

VOCAB = 40


def toy_model(variant: str, seed: int, context: int = 4, **overrides) -> DecoderLM:
    """A float64 two-layer model with weights far from zero (so that context matters)."""
    torch.manual_seed(seed)
    config = DecoderConfig(vocab_size=VOCAB, n_layers=2, d_model=16, n_heads=2, d_ff=32, context=context, variant=variant, **overrides)
    model = DecoderLM(config).double().eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 1 / math.sqrt(param.shape[-1]))
    return model


# --- batches ---------------------------------------------------------------------------


def test_windows_are_contiguous_and_shifted(seed):
    tokens = torch.arange(1000)
    inputs, targets = WindowBatches(tokens, 16, 5, seed=seed).next()
    assert inputs.shape == targets.shape == (5, 16)
    assert torch.equal(targets, inputs + 1) and torch.equal(inputs[:, 1:], inputs[:, :-1] + 1), f"seed={seed}"
    assert int(targets.max()) < 1000


def test_ranks_take_their_shard_of_the_same_global_batch(seed):
    tokens = torch.randint(100, (500,), generator=torch.Generator().manual_seed(seed))
    whole = WindowBatches(tokens, 8, 4, seed=seed)
    shards = [WindowBatches(tokens, 8, 4, seed=seed, rank=r, world_size=2) for r in range(2)]
    for _ in range(3):
        inputs, targets = whole.next()
        parts = [shard.next() for shard in shards]
        assert torch.equal(inputs, torch.cat([p[0] for p in parts])) and torch.equal(targets, torch.cat([p[1] for p in parts]))
    with pytest.raises(ValueError, match="divisible"):
        WindowBatches(tokens, 8, 3, seed=seed, world_size=2)


def test_batch_state_restores_the_position(seed):
    stream = WindowBatches(torch.arange(300), 8, 2, seed=seed)
    stream.next()
    state = stream.state_dict()
    expected = stream.next()
    stream.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(stream.next(), expected))


# --- evaluation protocols --------------------------------------------------------------


def nll(logits_row, target) -> float:
    return -F.log_softmax(logits_row, dim=-1)[target].item()


def test_sliding_window_equals_a_hand_computation(seed):
    """Inputs x_0..x_{L-1}, targets y_i = x_{i+1}, window c: y_i for i < c is scored at position i
    of the first window; y_i for i >= c at the last position of the window x_{i-c+1} .. x_i."""
    context = 4
    model = toy_model("softmax", seed, context)
    tokens = torch.randint(VOCAB, (12,), generator=torch.Generator().manual_seed(seed))
    x, y = tokens[:-1], tokens[1:]
    losses = []
    with torch.no_grad():
        first = model(x[None, :context])[0]
        for i in range(context):
            losses.append(nll(first[i], y[i]))
        for i in range(context, len(x)):
            window = x[i - context + 1 : i + 1]
            losses.append(nll(model(window[None])[0, -1], y[i]))
    hand = sum(losses) / len(losses)
    assert len(losses) == 11
    for batch in (1, 3):
        assert evaluate_sliding(model, tokens, context, batch=batch) == pytest.approx(hand, rel=1e-12), f"seed={seed}"
    # non-overlapping windows: x_0..x_3, x_4..x_7, x_8..x_10
    with torch.no_grad():
        windows = [model(x[None, s : s + context])[0] for s in range(0, len(x), context)]
    hand_windows = sum(nll(w[j], y[s + j]) for s, w in zip(range(0, len(x), context), windows) for j in range(len(w))) / 11
    assert evaluate_windows(model, tokens, context, batch=2) == pytest.approx(hand_windows, rel=1e-12), f"seed={seed}"
    assert evaluate_sliding(model, tokens, context) != pytest.approx(hand_windows), "the two protocols differ"
    # a prefix limit evaluates the first N tokens only
    assert evaluate_sliding(model, tokens, context, limit=7) == pytest.approx(sum(losses[:6]) / 6, rel=1e-12)


@pytest.mark.parametrize("variant, params", [("linear", {}), ("delta", {"chunk_size": 4})])
def test_carried_state_equals_one_parallel_pass(seed, variant, params):
    """Windows of c tokens, each continuing from the previous window's state, with positions
    restarting at 0, are one causal pass over the whole stream with positions i mod c."""
    context = 5
    model = toy_model(variant, seed, context, variant_params=params)
    tokens = torch.randint(VOCAB, (19,), generator=torch.Generator().manual_seed(seed))  # 18 inputs: 3.6 windows
    x, y = tokens[:-1], tokens[1:]
    with torch.no_grad():
        parallel = model(x[None], positions=torch.arange(len(x)) % context, targets=y[None]).mean().item()
    carried = evaluate_carry(model, tokens, context)
    assert carried == pytest.approx(parallel, rel=1e-10, abs=1e-12), f"{variant}, seed={seed}"
    truncated = evaluate_windows(model, tokens, context)
    assert abs(carried - truncated) > 1e-6, f"{variant}: the carried state changes the predictions, seed={seed}"


def test_carry_refuses_softmax(seed):
    model = toy_model("softmax", seed)
    assert not model.linear_time and toy_model("delta", seed).linear_time
    with pytest.raises(ValueError, match="linear-time"):
        evaluate_carry(model, torch.arange(10), 4)


def test_adaptive_softmax_scores_match_its_log_probabilities(seed):
    model = toy_model("linear", seed, adaptive_cutoffs=(10, 25))
    tokens = torch.randint(VOCAB, (2, 5), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        log_probs = model(tokens[:, :-1])
        scored = model(tokens[:, :-1], targets=tokens[:, 1:])
    assert torch.allclose(log_probs.exp().sum(-1), torch.ones(2, 4, dtype=torch.float64))
    expected = -log_probs.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(scored, expected, msg=f"seed={seed}")


# --- training on WikiText-2 ------------------------------------------------------------


@needs_shared
@pytest.mark.slow
def test_loss_falls_below_the_unigram_baseline():
    """A tiny model beats the best context-free model (the unigram entropy of the training
    split, ~7.06 nats) on validation text within seconds of training (measured: 6.89 after 200
    steps, from 7.10 after 50)."""
    config = LMConfig(
        steps=200,
        batch=32,
        lr=3e-3,
        warmup=10,
        dropout=0.0,
        model_overrides={"n_layers": 1, "d_model": 64, "n_heads": 2, "d_ff": 128},
        eval_tokens=4000,
        sliding_tokens=200,
        threads=1,
    )
    metrics = run_lm("linear", {}, config, context=32)
    unigram_nll = math.log(metrics["unigram_ppl"])
    assert 6.9 < unigram_nll < 7.2
    assert math.log(metrics["valid_ppl"]) < unigram_nll - 0.1, metrics["evaluations"]
    assert metrics["losses"][-1][1] < metrics["losses"][0][1]
    assert metrics["words"] == 200 * 32 * 32 and metrics["words_per_s"] > 0
    assert metrics["eval_tokens"] == {"valid": 4000, "test": 4000} and metrics["sliding_tokens"] == 200
    assert {"test_ppl", "valid_ppl_sliding", "valid_ppl_carry", "test_ppl_carry", "peak_mem_bytes"} <= set(metrics)


@needs_shared
@pytest.mark.slow
def test_ci_preset_runs_through_the_runner(tmp_path):
    from harness.results import load

    done = attnbench("run", "quality/lm-wikitext", "--preset", "ci", "--out", str(tmp_path / "out"), "--no-progress")
    assert done.returncode == 0, done.stderr
    table = load([tmp_path / "out"])
    assert sorted(table["variant"]) == ["delta", "softmax"] and set(table["status"]) == {"ok"}, table[["variant", "error"]]
    assert (table["metrics.steps"] == 6).all() and (table["metrics.valid_ppl"] > 1).all()
    assert set(table["axes.seq_len"]) == {16} and (table["metrics.words"] == 6 * 4 * 16).all()
    delta = table[table["variant"] == "delta"].iloc[0]
    assert delta["metrics.valid_ppl_carry"] > 1 and math.isnan(table[table["variant"] == "softmax"].iloc[0].get("metrics.valid_ppl_carry", math.nan))
    # The report of quality results is rendered in a fresh interpreter that never imports torch (issue 45).
    program = (
        "import sys; from harness.report import build_report; build_report([sys.argv[1]], sys.argv[2]); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'variants')))"
    )
    rendered = subprocess.run([sys.executable, "-c", program, str(tmp_path / "out"), str(tmp_path / "report")], capture_output=True, text=True)
    assert rendered.returncode == 0, rendered.stderr
    assert rendered.stdout.splitlines()[-1] == "[]"
    assert "valid_ppl_sliding" in (tmp_path / "report" / "index.html").read_text()


def test_the_gpu_preset_has_a_cpu_twin():
    """lm-wikitext's ``gpu`` preset (the small model for 200 steps on a GPU) and its twin ``gpu-twin`` on
    this CPU: the same settings but the sizes."""
    from harness.scenarios.scenario import load_scenario

    gpu, twin = (load_scenario("quality/lm-wikitext", preset=name).scenario for name in ("gpu", "gpu-twin"))
    sizes = {"model_overrides", "steps", "batch", "warmup", "eval_tokens", "sliding_tokens", "threads", "log_every"}
    assert gpu.task.model_dump(exclude=sizes) == twin.task.model_dump(exclude=sizes)
    assert (gpu.task.preset, gpu.task.steps, gpu.axes.seq_len, gpu.axes.device) == ("small", 200, 256, "cuda")


@needs_shared
@pytest.mark.slow
def test_the_gpu_twin_trains_and_reports_the_step_time(tmp_path):
    """The twin of the ``gpu`` preset runs through the runner and reports ``step_s`` (train_s / steps)."""
    from harness.results import load

    done = attnbench("run", "quality/lm-wikitext", "--preset", "gpu-twin", "--out", str(tmp_path), "--no-progress")
    assert done.returncode == 0, done.stderr
    table = load([tmp_path])
    assert set(table["status"]) == {"ok"}, table[["variant", "error"]]
    assert (table["metrics.step_s"] > 0).all() and (table["metrics.valid_ppl"] > 1).all()
    assert (table["metrics.step_s"] * 4 - table["metrics.train_s"]).abs().max() < 1e-9


@needs_shared
@pytest.mark.slow
def test_command_line_writes_metrics_and_a_rerun_resumes(tmp_path, capsys):
    args = [
        "--variant",
        "linear",
        "--context",
        "16",
        "--steps",
        "4",
        "--batch",
        "4",
        "--warmup",
        "1",
        "--eval-tokens",
        "300",
        "--sliding-tokens",
        "40",
        "--checkpoint-every",
        "2",
        "--threads",
        "1",
        "--out",
        str(tmp_path),
    ]
    assert main(args) == 0
    first = json.loads((tmp_path / "metrics.json").read_text())
    assert first["resumed_from"] is None and first["words"] == 4 * 4 * 16 and first["arguments"]["variant"] == "linear"
    assert first["config"] == LMConfig(steps=4, batch=4, warmup=1, eval_tokens=300, sliding_tokens=40, threads=1).model_dump()
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-000000004.pt"]
    assert main(args) == 0
    again = json.loads((tmp_path / "metrics.json").read_text())
    assert again["resumed_from"] == 4 and again["losses"] == first["losses"]
    assert again["valid_ppl"] == first["valid_ppl"] and again["test_ppl"] == first["test_ppl"]
    assert main(["--variant", "nope", "--out", str(tmp_path / "x")]) == 2
    assert "unknown variant 'nope'" in capsys.readouterr().err


@needs_shared
@pytest.mark.slow
def test_a_harness_cell_checkpoints_at_its_evaluations_and_continues(tmp_path):
    """The runner's ``checkpoint_dir``: a checkpoint at every evaluation; measured again, the cell
    continues from the last one to the same result."""
    task = {"name": "lm", "steps": 4, "batch": 4, "warmup": 1, "eval_every": 2, "eval_tokens": 300, "sliding_tokens": 40, "threads": 1}
    cell = make_cell(mode="quality", target="lm", axes={"seq_len": 16, "device": "cpu", "dtype": "float32"}, task=task, checkpoint_dir=str(tmp_path / "cell"))
    first = run_cell(cell)
    assert first["resumed_from"] is None
    assert [p.name for p in (tmp_path / "cell" / "checkpoints").iterdir()] == ["step-000000004.pt"]
    again = run_cell(cell)
    assert again["resumed_from"] == 4 and again["losses"] == first["losses"] and again["test_ppl"] == first["test_ppl"]


@needs_shared
@pytest.mark.slow
def test_the_command_line_under_torchrun_trains_as_one_process(tmp_path):
    """The documented way to give one LM run several devices (docs/scale-out.md): two gloo ranks
    under torchrun, each on its shard of the same global batch, train and score as one process
    (without dropout, whose masks depend on the rank)."""
    args = [
        "--variant",
        "linear",
        "--context",
        "16",
        "--steps",
        "3",
        "--batch",
        "4",
        "--warmup",
        "1",
        "--eval-tokens",
        "300",
        "--dropout",
        "0",
        "--sliding-tokens",
        "40",
        "--threads",
        "1",
    ]
    runs = {}
    for ranks in (1, 2):
        out = tmp_path / f"ranks{ranks}"
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
        command = [*launcher, "-m", "harness.tasks.lm", *args, "--out", str(out)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[2])
        assert done.returncode == 0, done.stderr[-3000:]
        runs[ranks] = json.loads((out / "metrics.json").read_text())
    one, two = runs[1], runs[2]
    assert two["words"] == one["words"] == 3 * 4 * 16
    for (step_1, loss_1), (step_2, loss_2) in zip(one["losses"], two["losses"], strict=True):
        assert step_1 == step_2 and loss_2 == pytest.approx(loss_1, rel=1e-4)
    assert two["valid_ppl"] == pytest.approx(one["valid_ppl"], rel=1e-4) and two["test_ppl"] == pytest.approx(one["test_ppl"], rel=1e-4)


# --- settings and the command line -----------------------------------------------------


def parse(argv):
    from harness.tasks.lm import _command_line

    return parse_command_line(_command_line(), LMConfig, ["--variant", "linear", "--out", "out", *argv])


def test_command_line_defaults_are_the_configs():
    """Every setting has an option, and an option left out takes the config's own default."""
    args, config = parse([])
    assert config == LMConfig() and config.model_dump()["warmup"] == 50 and config.adaptive_cutoffs == [2000, 10000]
    assert vars(args) == {"variant": "linear", "params": {}, "out": "out", "device": None, "checkpoint_every": 250, "context": None, "dtype": "float32"}
    from harness.tasks.lm import _command_line

    options = {action.dest for action in _command_line()._actions}
    assert set(LMConfig.model_fields) - {"name"} <= options


def test_options_parse_into_the_config():
    _, config = parse(
        [
            "--steps",
            "30",
            "--lr",
            "3e-3",
            "--warmup",
            "0",
            "--adaptive-cutoffs",
            "none",
            "--eval-tokens",
            "all",
            "--sliding-tokens",
            "100",
            "--no-carry",
            "--clip",
            "none",
            "--weight-decay",
            "0.1",
            "--log-every",
            "5",
            "--model-overrides",
            "{n_layers: 1, d_model: 32}",
            "--segment",
            "rmt",
            "--segment",
            "{kind: rmt, memory: 2}",
        ]
    )
    assert config == LMConfig(
        steps=30,
        lr=3e-3,
        warmup=0,
        adaptive_cutoffs=None,
        eval_tokens=None,
        sliding_tokens=100,
        carry=False,
        clip=None,
        weight_decay=0.1,
        log_every=5,
        model_overrides={"n_layers": 1, "d_model": 32},
        segment={"kind": "rmt", "memory": 2},
    )
    assert parse(["--adaptive-cutoffs", "100,500"])[1].adaptive_cutoffs == [100, 500]
    assert parse(["--adaptive-cutoffs", "[100, 500]", "--segment", "xl"])[1].segment == {"kind": "xl"}
    assert parse(["--params", '{"m": 16}'])[0].params == {"m": 16}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "2"], "error: --warmup: must be at most steps = 2, got 50"),
        (["--steps", "0"], "error: --steps: Input should be greater than or equal to 1, got '0'"),
        (["--preset", "huge"], "error: --preset: expected a model preset among small, medium, cpu, got 'huge'"),
        (["--adaptive-cutoffs", "500,100"], "error: --adaptive-cutoffs: expected increasing positive word ranks"),
        (["--model-overrides", "{context: 64}"], "error: --model-overrides: context: expected model fields among"),
        (["--model-overrides", "{n_heads: 3}"], "error: --model-overrides: d_model (128) must be a multiple of n_heads (3)"),
        (["--segment", "{kind: xl, size: 2}"], "error: --segment: unknown segment field"),
        (["--params", "[1]"], "error: --params: expected a mapping"),
        (["--nope", "1"], "error: unrecognized arguments: --nope 1"),
    ],
)
def test_bad_options_end_in_one_line_naming_the_option(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith(message) and err.count("\n") == 1, err


@pytest.mark.slow
def test_too_few_steps_for_the_default_warmup_is_a_clean_error(tmp_path):
    """The case of the issue: no traceback, one line naming the option, exit code 2."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "harness.tasks.lm", "--variant", "linear", "--steps", "2", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2 and done.stderr == "error: --warmup: must be at most steps = 2, got 50\n", done.stderr
    assert not (tmp_path / "metrics.json").exists()

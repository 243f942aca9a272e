"""Translation: cross-attention, the encoder-decoder's step form, search, padding, batching,
BLEU, the WMT layout and the scenario end to end through the runner."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import make_cell, needs_shared
from pydantic import ValidationError

import variants
from harness.models.seq2seq import Seq2Seq, source_lengths
from harness.running import runner
from harness.scenarios.scenario import load_scenario
from harness.tasks.batches import Example, LengthBatches, collate
from harness.tasks.command_line import parse_command_line
from harness.tasks.mt import (
    PRESETS,
    MTConfig,
    _command_line,
    beam_search,
    bleu,
    greedy,
    label_smoothed_loss,
    main,
    mt_config,
    position_variants,
    run_cell,
    run_mt,
)
from harness.tasks.parallel_text import BOS, EOS, PAD, data_root

D_KEY = 16  # the ci preset: d_model 32, 2 heads

#: (variant, params) at every position it can take; the delta rule in decoder self-attention.
MODEL_VARIANTS = [("softmax", {}), ("linear", {}), ("performer", {"m": 8}), ("dpfp", {"nu": 1}), ("delta", {})]


def make_model(variant, params, seed, vocab_size=40, **overrides) -> Seq2Seq:
    torch.manual_seed(seed)
    config = mt_config("ci", vocab_size, **position_variants(variant, params, D_KEY), **overrides)
    return Seq2Seq(config).double().eval()


def tokens(shape, vocab_size, seed):
    return torch.randint(4, vocab_size, shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one thread is fastest (and a second one only contends on a shared machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- cross-attention -------------------------------------------------------------------


def hand_cross(layer, x, memory, variant):
    """Cross-attention written out: per head, softmax(q kᵀ/√d) v or φ(q)φ(k)ᵀ v / Σ φ(q)φ(k)ᵀ."""
    batch, length, _ = x.shape
    split = lambda t: t.view(batch, t.shape[1], layer.n_heads, -1).transpose(1, 2)
    q, k, v = split(x @ layer.query.weight.T), split(memory @ layer.key.weight.T), split(memory @ layer.value.weight.T)
    if variant == "softmax":
        y = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1) @ v
    else:
        scores = (F.elu(q) + 1) @ (F.elu(k) + 1).transpose(-1, -2)
        y = scores @ v / (scores.sum(-1, keepdim=True) + 1e-6)
    return y.transpose(1, 2).reshape(batch, length, -1) @ layer.out.weight.T


@pytest.mark.parametrize("variant", ["softmax", "linear"])
@pytest.mark.parametrize("length", [1, 5, 13])
def test_cross_attention_matches_hand_computation(seed, variant, length):
    torch.manual_seed(seed)
    layer = variants.AttentionLayer(24, 3, variant).double()
    x, memory = torch.randn(2, length, 24, dtype=torch.float64), torch.randn(2, 5, 24, dtype=torch.float64)
    y, projected = layer.cross(x, memory)
    torch.testing.assert_close(y, hand_cross(layer, x, memory, variant), msg=f"seed={seed}")
    again, _ = layer.cross(x, projected)
    torch.testing.assert_close(again, y, rtol=0, atol=0, msg="the projected memory gives the same output")


def test_cross_attention_gradients_match_hand_computation(seed):
    torch.manual_seed(seed)
    layer = variants.AttentionLayer(24, 3, "linear").double()
    x = torch.randn(2, 7, 24, dtype=torch.float64, requires_grad=True)
    memory = torch.randn(2, 3, 24, dtype=torch.float64, requires_grad=True)
    got = torch.autograd.grad(layer.cross(x, memory)[0].square().sum(), (x, memory))
    expected = torch.autograd.grad(hand_cross(layer, x, memory, "linear").square().sum(), (x, memory))
    torch.testing.assert_close(got, expected, msg=f"seed={seed}")


def test_cross_attention_refuses_a_causal_only_core():
    layer = variants.AttentionLayer(16, 2, "delta")
    with pytest.raises(variants.VariantError, match="causal only"):
        layer.cross(torch.randn(1, 3, 16), torch.randn(1, 4, 16))


# --- model: positions, step form, padding --------------------------------------------------


@pytest.mark.parametrize("position", ["encoder", "cross"])
def test_causal_only_variant_refused_at_non_causal_positions(position):
    with pytest.raises(variants.VariantError, match=f"Seq2SeqConfig.{position}: variant 'delta' is causal only"):
        Seq2Seq(mt_config("ci", 20, **{position: "delta"}))
    Seq2Seq(mt_config("ci", 20, decoder="delta"))  # the causal position takes it


def test_position_rule():
    assert position_variants("delta", {"phi": "dpfp", "nu": 1}, D_KEY) == {
        "decoder": "delta",
        "decoder_params": {"phi": "dpfp", "nu": 1},
        "encoder": "linear",
        "encoder_params": {},
        "cross": "linear",
        "cross_params": {},
    }
    fields = position_variants("performer", {"m": 8}, D_KEY, cross="softmax")
    assert (fields["encoder"], fields["encoder_params"], fields["cross"], fields["decoder"]) == ("performer", {"m": 8}, "softmax", "performer")
    assert position_variants("delta", {}, D_KEY, fallback="softmax")["encoder"] == "softmax"


@pytest.mark.parametrize("variant, params", MODEL_VARIANTS, ids=[v for v, _ in MODEL_VARIANTS])
def test_step_logits_equal_parallel_logits(seed, variant, params):
    """Teacher-forced: the recurrent step (KV cache or fast weights, projected memory) gives
    the parallel form's logits at every position."""
    model = make_model(variant, params, seed)
    src, tgt_in = tokens((3, 7), 40, seed), tokens((3, 11), 40, seed + 1)
    tgt_in[:, 0] = BOS
    with torch.no_grad():
        memory = model.encode(src)
        parallel = model.decode(memory, tgt_in)
        state, stepped = model.start(memory), []
        for t in range(tgt_in.shape[1]):
            logits_t, state = model.step(tgt_in[:, t], state)
            stepped.append(logits_t)
    torch.testing.assert_close(torch.stack(stepped, 1), parallel, msg=f"seed={seed}")


def greedy_parallel(model, src, max_length):
    """Greedy decoding with the parallel form only: re-run the decoder on the whole prefix."""
    memory = model.encode(src)
    prefix = torch.full((src.shape[0], 1), BOS, dtype=torch.long)
    for _ in range(max_length):
        prefix = torch.cat([prefix, model.decode(memory, prefix)[:, -1].argmax(-1, keepdim=True)], 1)
    outputs = []
    for row in prefix[:, 1:].tolist():
        outputs.append(row[: row.index(EOS)] if EOS in row else row)
    return outputs


@pytest.mark.parametrize("variant, params", MODEL_VARIANTS, ids=[v for v, _ in MODEL_VARIANTS])
def test_greedy_step_decoding_equals_parallel_decoding(seed, variant, params):
    model = make_model(variant, params, seed, vocab_size=12)
    with torch.no_grad():
        model.head.weight[EOS] *= 0.9  # some sentences end early, some run to max_length
    src = tokens((6, 5), 12, seed)
    with torch.no_grad():
        stepped, parallel = greedy(model, src, max_length=12), greedy_parallel(model, src, max_length=12)
    assert stepped == parallel, f"seed={seed}"


@pytest.mark.parametrize("variant, params", [("softmax", {}), ("delta", {})])
def test_beam_one_is_greedy(seed, variant, params):
    model = make_model(variant, params, seed, vocab_size=12)
    src = tokens((5, 6), 12, seed)
    assert beam_search(model, src, 1, max_length=10) == greedy(model, src, max_length=10), f"seed={seed}"


def sequence_log_probs(model, src, targets: list[list[int]]) -> list[float]:
    """log p(target | src) of each of ``targets`` (all of one length), by the parallel form."""
    target = torch.tensor(targets)
    tgt_in = torch.cat([torch.full((len(targets), 1), BOS), target[:, :-1]], 1)
    log_probs = torch.log_softmax(model.decode(model.encode(src).expand(len(targets), -1, -1), tgt_in), -1)
    return log_probs.gather(2, target[:, :, None]).sum((1, 2)).tolist()


@pytest.mark.parametrize("length_penalty", [0.0, 1.0])
def test_wide_beam_finds_the_exhaustive_optimum(seed, length_penalty):
    """With a beam wider than the number of hypotheses, beam search is exhaustive search:
    it returns the best of every EOS-ended sequence shorter than max_length and every
    unfinished sequence of max_length, under log p / length^α."""
    vocab_size, max_length = 6, 3
    model = make_model("linear", {}, seed, vocab_size=vocab_size)
    src = tokens((1, 4), vocab_size, seed)
    words = [w for w in range(vocab_size) if w != EOS]
    scored = []
    with torch.no_grad():
        for n in range(max_length + 1):
            prefixes = [list(prefix) for prefix in itertools.product(words, repeat=n)]
            finished = n < max_length  # ends in EOS, or is cut at max_length
            targets = [prefix + [EOS] for prefix in prefixes] if finished else prefixes
            for prefix, log_prob in zip(prefixes, sequence_log_probs(model, src, targets)):
                scored.append((log_prob / len(targets[0]) ** length_penalty, prefix))
        best = max(scored)[1]
        assert beam_search(model, src, len(scored), length_penalty=length_penalty, max_length=max_length) == [best], f"seed={seed}"


@pytest.mark.parametrize("variant, params", MODEL_VARIANTS, ids=[v for v, _ in MODEL_VARIANTS])
def test_padded_batch_equals_sentences_one_by_one(seed, variant, params):
    """Source padding reaches no non-causal attention, target padding no real position."""
    model = make_model(variant, params, seed)
    sources = [tokens((n,), 40, seed + n).tolist() + [EOS] for n in (3, 6, 6, 1)]
    targets = [tokens((n,), 40, seed + 10 + n).tolist() for n in (4, 2, 7, 5)]
    src = torch.full((4, 7), PAD)
    for row, source in enumerate(sources):
        src[row, : len(source)] = torch.tensor(source)
    batch = collate([Example([4] * 7, target, 1) for target in targets])
    with torch.no_grad():
        padded = model(src, batch.tgt_in)
        for row, (source, target) in enumerate(zip(sources, targets)):
            alone = model(torch.tensor([source]), batch.tgt_in[row : row + 1, : len(target) + 1])
            torch.testing.assert_close(padded[row, : len(target) + 1], alone[0], msg=f"row {row}, seed={seed}")


def test_source_padding_must_be_at_the_end():
    assert source_lengths(torch.tensor([[5, 6, EOS], [5, EOS, PAD]])).tolist() == [3, 2]
    with pytest.raises(ValueError, match="right-padded"):
        source_lengths(torch.tensor([[5, PAD, EOS]]))


def test_loss_falls_on_a_tiny_budget(seed):
    """A copy task (target = source): 150 AdamW steps take the loss well below that of the
    uniform prediction, log 16 (measured over seeds: 1.2-1.8 nats after 150 steps)."""
    model = make_model("linear", {}, seed % 1000, vocab_size=16).float().train()
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(150):
        words = torch.randint(4, 16, (16, 5), generator=generator)
        examples = [Example(row + [EOS], row, 5) for row in words.tolist()]
        loss, count = label_smoothed_loss(model, collate(examples), smoothing=0.0)
        assert count == 16 * 5
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] > math.log(16) - 0.7, losses[0]
    assert sum(losses[-5:]) / 5 < 0.75 * math.log(16), f"seed={seed % 1000}: {losses[::10]}"


# --- batching, scoring ----------------------------------------------------------------------


def make_examples(count, seed):
    rng = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (count, 2), generator=rng).tolist()
    return [Example([5] * s + [EOS], [6] * t, t) for s, t in lengths]


def test_length_batches(seed):
    examples = make_examples(300, seed)
    stream = LengthBatches(examples, 40, seed=seed)
    seen = []
    for _ in range(len(stream)):
        batch = stream.next()
        assert batch.src.shape[0] * max(batch.src.shape[1], batch.tgt_in.shape[1]) <= 40
        assert (batch.src != PAD).all(), "one source length per batch: no source padding"
        assert (batch.tgt_in[:, 0] == BOS).all() and ((batch.tgt_out == EOS).sum(1) == 1).all()
        seen += [(row.count(5), batch.tgt_in.shape[1]) for row in batch.src.tolist()]
    assert len(seen) == len(examples), "an epoch holds every example once"
    assert sorted(s for s, _ in seen) == sorted(len(e.source) - 1 for e in examples)


def test_length_batches_resume_and_shard(seed):
    examples = make_examples(200, seed)
    stream = LengthBatches(examples, 30, seed=seed)
    for _ in range(len(stream) + 3):  # into the second epoch
        stream.next()
    resumed = LengthBatches(examples, 30, seed=seed)
    resumed.load_state_dict(stream.state_dict())
    for _ in range(5):
        a, b = stream.next(), resumed.next()
        assert torch.equal(a.src, b.src) and torch.equal(a.tgt_out, b.tgt_out)
    ranks = [LengthBatches(examples, 30, seed=seed, rank=r, world_size=2) for r in range(2)]
    sizes = [sum(ranks[r].next().src.shape[0] for _ in range(len(ranks[r]))) for r in range(2)]
    assert sum(sizes) == len(examples), "two ranks share one epoch's batches"
    with pytest.raises(ValueError, match="batch_tokens=3 is below the longest sentence"):
        LengthBatches(examples, 3)


def test_bleu_of_the_reference_is_100():
    references = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee.", "Eine Frau liest ein Buch im Park."]
    score, signature = bleu(references, references)
    assert score == pytest.approx(100.0)
    assert signature.startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:")
    assert bleu(["Ein Hund.", "Katzen.", "Ein Auto."], references)[0] < 10
    with pytest.raises(ValueError, match="2 hypotheses but 3 references"):
        bleu(references[:2], references)


# --- runs -----------------------------------------------------------------------------------


def fake_wmt(directory, rng):
    """A tiny WMT-layout directory: train.en/de and newstest2014.en/de of made-up sentences."""
    lexicon = {"the": "die", "cat": "Katze", "sees": "sieht", "a": "eine", "dog": "Hund", "house": "Haus", "red": "rote"}
    english = list(lexicon)
    for split, count in (("train", 300), ("newstest2014", 12)):
        lines = [[english[i] for i in torch.randint(len(english), (int(n),), generator=rng)] for n in torch.randint(2, 7, (count,), generator=rng)]
        (directory / f"{split}.en").write_text("".join(" ".join(line) + "\n" for line in lines), encoding="utf-8")
        (directory / f"{split}.de").write_text("".join(" ".join(lexicon[w] for w in line) + "\n" for line in lines), encoding="utf-8")


def test_wmt_layout_trains_and_scores_newstest2014(tmp_path, monkeypatch, seed):
    monkeypatch.setenv("ATTNBENCH_CACHE", str(tmp_path / "cache"))
    fake_wmt(tmp_path, torch.Generator().manual_seed(seed))
    config = MTConfig(preset="ci", dataset="wmt14", data=str(tmp_path), steps=30, vocab_size=300, seed=seed % 100)
    metrics = run_mt("linear", {}, config, out_dir=str(tmp_path / "out"))
    assert metrics["test_set"] == f"{tmp_path.name}/newstest2014" and metrics["test_sentences"] == 12
    assert metrics["valid_loss"] is None, "no newstest2013 in the directory: no validation"
    assert 0 <= metrics["bleu"] <= 100 and metrics["bleu_signature"].startswith("nrefs:1")
    assert metrics["losses"][-1][1] < metrics["losses"][0][1]
    assert metrics["config"] == dict(config.model_dump(), batch_tokens=600, lr=3e-3, warmup=10, beam=2, max_sentences=200, test_sentences=16)
    assert len((tmp_path / "out" / "newstest2014.hyp.de").read_text(encoding="utf-8").split("\n")) == 13


def test_command_line_writes_metrics(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ATTNBENCH_CACHE", str(tmp_path / "cache"))
    fake_wmt(tmp_path, torch.Generator().manual_seed(0))
    out = tmp_path / "out"
    argv = [
        "--variant",
        "delta",
        "--preset",
        "ci",
        "--dataset",
        "wmt14",
        "--data",
        str(tmp_path),
        "--steps",
        "12",
        "--warmup",
        "2",
        "--vocab-size",
        "300",
        "--beam",
        "1",
        "--threads",
        "1",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["arguments"] == {"variant": "delta", "params": {}, "out": str(out), "device": None, "checkpoint_every": None}
    assert metrics["config"]["steps"] == 12 and metrics["config"]["beam"] == 1 and metrics["positions"]["encoder"] == ["linear", {}]
    assert "BLEU" in capsys.readouterr().out
    assert sorted(path.name for path in out.iterdir()) == ["metrics.json", "newstest2014.hyp.de"], "no temporary file left"
    assert main([*argv[:-2], "--batch-tokens", "2", "--out", str(tmp_path / "x")]) == 2
    assert "batch_tokens=2 is below the longest sentence" in capsys.readouterr().err


def test_a_harness_cell_checkpoints_at_its_evaluations_and_continues(tmp_path, monkeypatch):
    """The runner's ``checkpoint_dir``: a checkpoint at every evaluation; measured again, the cell
    continues from the last one to the same translations."""
    monkeypatch.setenv("ATTNBENCH_CACHE", str(tmp_path / "cache"))
    fake_wmt(tmp_path, torch.Generator().manual_seed(0))
    task = {
        "name": "mt",
        "preset": "ci",
        "dataset": "wmt14",
        "data": str(tmp_path),
        "steps": 6,
        "warmup": 2,
        "eval_every": 3,
        "vocab_size": 300,
        "beam": 1,
        "threads": 1,
    }
    cell = make_cell(variant="delta", mode="quality", target="mt", task=task, checkpoint_dir=str(tmp_path / "cell"))
    first = run_cell(cell)
    assert first["resumed_from"] is None
    assert [p.name for p in (tmp_path / "cell" / "checkpoints").iterdir()] == ["step-000000006.pt"]
    again = run_cell(cell)
    assert again["resumed_from"] == 6 and again["losses"] == first["losses"] and again["bleu"] == first["bleu"]


@needs_shared
def test_both_tasks_write_metrics_under_the_same_names(tmp_path, monkeypatch):
    """One name per concept in the metrics.json of language modelling and of translation."""
    from harness.tasks import lm

    monkeypatch.setenv("ATTNBENCH_CACHE", str(tmp_path / "cache"))
    fake_wmt(tmp_path, torch.Generator().manual_seed(0))
    assert (
        main(
            [
                "--variant",
                "linear",
                "--preset",
                "ci",
                "--dataset",
                "wmt14",
                "--data",
                str(tmp_path),
                "--steps",
                "4",
                "--warmup",
                "1",
                "--vocab-size",
                "300",
                "--beam",
                "1",
                "--threads",
                "1",
                "--out",
                str(tmp_path / "mt"),
            ]
        )
        == 0
    )
    assert (
        lm.main(
            [
                "--variant",
                "linear",
                "--context",
                "8",
                "--steps",
                "4",
                "--batch",
                "2",
                "--warmup",
                "1",
                "--eval-tokens",
                "50",
                "--sliding-tokens",
                "20",
                "--threads",
                "1",
                "--model-overrides",
                "{n_layers: 1, d_model: 16, n_heads: 2, d_ff: 16}",
                "--out",
                str(tmp_path / "lm"),
            ]
        )
        == 0
    )
    names = [set(json.loads((tmp_path / task / "metrics.json").read_text())) for task in ("mt", "lm")]
    shared = {
        "steps",
        "loss",
        "losses",
        "evaluations",
        "train_s",
        "wall_s",
        "final_eval_s",
        "peak_mem_bytes",
        "memory_kind",
        "resumed_from",
        "world_size",
        "torch_threads",
        "num_parameters",
        "words",
        "words_per_s",
        "vocab_size",
        "data",
        "config",
        "arguments",
    }
    assert all(shared <= keys for keys in names), [shared - keys for keys in names]
    assert not any({"parameters", "processes", "loss_curve", "settings"} & keys for keys in names)


@pytest.mark.slow
def test_ci_preset_end_to_end_through_the_runner(tmp_path, monkeypatch):
    if not (data_root() / "multi30k").is_dir():
        pytest.skip(f"multi30k is not at {data_root() / 'multi30k'}")
    monkeypatch.setenv("ATTNBENCH_CACHE", str(tmp_path / "cache"))
    loaded = load_scenario("quality/mt-multi30k", preset="ci")
    assert [cell.variant for cell in loaded.cells()] == ["delta"]
    summary = runner.run(loaded, tmp_path / "results", progress=False)
    assert summary.statuses == {"ok": 1}, summary
    records = [json.loads(line) for line in summary.path.read_text().splitlines()]
    cells = {record["variant"]: record for record in records if record.get("kind", "cell") != "run" and "metrics" in record}
    metrics = cells["delta"]["metrics"]
    for key in ("bleu", "bleu_signature", "sentences_per_s", "words_per_s", "peak_mem_bytes", "steps", "wall_s", "loss", "valid_loss"):
        assert metrics[key] is not None, key
    assert metrics["steps"] == 40 and metrics["test_set"] == "multi30k/test_2016_flickr" and metrics["test_sentences"] == 16
    assert metrics["sentences_per_s"] > 0 and metrics["words_per_s"] > 0 and metrics["torch_threads"] == 1
    assert metrics["losses"][-1][1] < metrics["losses"][0][1], "the loss falls"
    assert metrics["positions"] == {"encoder": ["linear", {}], "decoder": ["delta", {"backend": "torch"}], "cross": ["linear", {}]}
    from harness.report import build_report

    page = build_report([tmp_path / "results"], tmp_path / "report").read_text()
    quality = page[page.index("<caption>Quality") :]
    quality = quality[: quality.index("</table>")]
    assert all(header in quality for header in ("<th>bleu</th>", "<th>sentences/s</th>", "<th>words/s</th>", "<th>peak memory</th>"))


# --- settings and the command line -----------------------------------------------------


def parse(argv):
    return parse_command_line(_command_line(), MTConfig, ["--variant", "linear", "--out", "out", *argv])


def test_command_line_defaults_are_the_configs():
    """Every setting has an option, and an option left out takes the config's own default."""
    args, config = parse([])
    assert config == MTConfig() and config.resolved().steps == PRESETS["cpu"]["run"]["steps"]
    assert vars(args) == {"variant": "linear", "params": {}, "out": "out", "device": None, "checkpoint_every": None}
    assert set(MTConfig.model_fields) - {"name"} <= {action.dest for action in _command_line()._actions}
    _, config = parse(["--preset", "ci", "--steps", "20", "--lr", "1e-3", "--encoder", "softmax", "--vocab-size", "none"])
    assert config == MTConfig(preset="ci", steps=20, lr=1e-3, encoder="softmax")
    assert config.resolved().model_dump() == dict(config.model_dump(), **{k: v for k, v in PRESETS["ci"]["run"].items() if k not in ("steps", "lr")})


def test_presets_come_from_one_table():
    assert {preset: MTConfig(preset=preset).head_width for preset in PRESETS} == {"ci": 16, "cpu": 32, "gpu": 32, "base": 64}
    assert mt_config("gpu", 100).d_model == PRESETS["gpu"]["model"]["d_model"]
    with pytest.raises(ValidationError, match="expected a preset among ci, cpu, gpu, base"):
        MTConfig(preset="large")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--preset", "large"], "error: --preset: expected a preset among ci, cpu, gpu, base, got 'large'"),
        (["--dataset", "wmt19"], "error: --dataset: expected a data set among multi30k, wmt14, got 'wmt19'"),
        (["--preset", "cpu", "--steps", "30"], "error: --warmup: the preset's warm-up, 70, must be at most steps = 30"),
        (["--preset", "ci", "--warmup", "50"], "error: --warmup: must be at most steps = 40, got '50'"),
        (["--fallback", "nope"], "error: --fallback: unknown variant 'nope'"),
        (["--vocab-size", "100"], "error: --vocab-size: Input should be greater than or equal to 300, got '100'"),
    ],
)
def test_bad_options_end_in_one_line_naming_the_option(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith(message) and err.count("\n") == 1, err

"""The cost model of a sweep (harness.running.estimate) and what it plans (harness.running.planning): estimates that follow the
FLOPs, fixed costs paid once per first use, estimates from the nearest measured cell of a results file, budgets
that keep the cells that fit and list the rest, and bad options refused with one line and exit code 2."""

from __future__ import annotations

import json
import re

import pytest
from helpers import attnbench, attnbench_here

from harness.results import ResultsWriter, read_records
from harness.running.estimate import COSTS, Estimator, gpu_roof, parse_duration, work
from harness.running.planning import fill_order, select
from harness.scenarios.scenario import load_scenario

H100 = {"cuda": gpu_roof("h100")}


def _scenario(tmp_path, variants: str, seq_len: str, *, backends="[torch]", device="cuda", modes="[forward]", batch=2, name="est") -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        f"name: {name}\nvariants: {{{variants}}}\nbackends: {backends}\n"
        f"axes: {{seq_len: {seq_len}, batch: {batch}, heads: 8, d_key: 64, dtype: bfloat16, device: {device}}}\n"
        f"modes: {modes}\nmeasure: {{warmup: 1, repeats: 3, max_time_s: 0.2}}\n"
    )
    return str(path)


def _cells(path: str):
    return load_scenario(path).cells()


def test_the_estimate_grows_with_t_as_the_flops_do(tmp_path):
    """Past the launch floor a call's estimate is its FLOPs at the roof: softmax's grow as T², the sum rule's as T."""
    cells = _cells(_scenario(tmp_path, "softmax: {}, linear: {}", "[16384, 65536]", batch=32))
    estimator = Estimator(H100)
    by = {(cell.variant, cell.axes["seq_len"]): cell for cell in cells}
    for variant, growth in (("softmax", 16), ("linear", 4)):
        short, long = by[(variant, 16384)], by[(variant, 65536)]
        flops_ratio = work(long).flops / work(short).flops
        assert flops_ratio == pytest.approx(growth, rel=0.01)
        assert estimator.call_s(long)[0] / estimator.call_s(short)[0] == pytest.approx(flops_ratio, rel=1e-6)
    done = attnbench_here("run", _scenario(tmp_path, "softmax: {}", "[4096, 16384, 65536]", batch=32), "--dry-run", "--estimate-for", "h100")
    assert done.returncode == 0, done.stderr
    seconds = [float(s) for s in re.findall(r"~([0-9.]+) s", done.stdout)]
    assert len(seconds) == 3 and seconds[0] < seconds[1] < seconds[2]
    assert "roof (cuda): H100 (datasheet peaks)" in done.stdout and "estimated total: " in done.stdout


def test_fixed_costs_are_counted_once_per_first_use(tmp_path):
    """Each (backend, variant, d, dtype, mode) pays its compilations once, however many lengths it runs; the run its start once."""
    two = Estimator(H100).sweep(_cells(_scenario(tmp_path, "linear: {}", "[1024, 4096]", backends="[triton]", modes="[forward, train]")))
    four = Estimator(H100).sweep(_cells(_scenario(tmp_path, "linear: {}", "[1024, 2048, 4096, 8192]", backends="[triton]", modes="[forward, train]")))
    assert len(two.first_uses()) == len(four.first_uses()) == 2
    assert two.fixed_s() == four.fixed_s() == COSTS.run_start_s + 2 * COSTS.first_use_s["cuda"]["triton"]
    assert two.seconds() == pytest.approx(two.fixed_s() + sum(e.seconds for e in two.cells))
    torch_only = Estimator(H100).sweep(_cells(_scenario(tmp_path, "linear: {}", "[1024, 4096]")))
    assert torch_only.first_uses() == {} and torch_only.fixed_s() == COSTS.run_start_s
    # a compile cell has a fresh worker (harness.running.worker.needs_fresh_worker): each compiles again
    compiled = Estimator(H100).sweep(_cells(_scenario(tmp_path, "linear: {}", "[1024, 4096]", backends="[compile]")))
    assert list(compiled.first_uses().values()) == [COSTS.first_use_s["cuda"]["compile"]] * 2


def _measured(tmp_path, cells: list, name: str = "measured.jsonl"):
    """A results file of ``cells`` (``(cell, median_s)``), each with the FLOPs and bytes the model counts for it."""
    path = tmp_path / name
    writer = ResultsWriter(path)
    writer.write_run({"run_id": "r", "started_at": "now", "scenario": "est", "machine": {"machine_id": "m"}})
    for cell, median_s in cells:
        done = work(cell)
        metrics = {"median_s": median_s, "flops": done.flops, "min_bytes": done.bytes}
        writer.write_cell({**cell.record(), "run_id": "r", "status": "ok", "metrics": metrics, "duration_s": 1.0})
    writer.close()
    return path


def test_estimate_from_uses_the_nearest_measured_cell(tmp_path):
    cells = _cells(_scenario(tmp_path, "linear: {}, delta: {}", "[1024, 8192, 16384]"))
    by = {(cell.variant, cell.axes["seq_len"]): cell for cell in cells}
    path = _measured(tmp_path, [(by[("linear", 1024)], 0.002), (by[("linear", 16384)], 0.5)])
    from harness.running.estimate import Measured

    model, measured = Estimator(H100), Estimator(H100, measured=Measured(path))
    assert measured.call_s(by[("linear", 16384)]) == (pytest.approx(0.5), True)  # the same shape: its own median
    assert measured.call_s(by[("linear", 1024)]) == (pytest.approx(0.002), True)
    # T 8192 is nearer 16384 than 1024 in FLOPs: that cell's median, scaled by the model's ratio of the two
    ratio = model.call_s(by[("linear", 8192)])[0] / model.call_s(by[("linear", 16384)])[0]
    assert measured.call_s(by[("linear", 8192)]) == (pytest.approx(0.5 * ratio), True)
    assert measured.call_s(by[("delta", 8192)]) == model.call_s(by[("delta", 8192)])  # no delta cell measured: the roof
    done = attnbench_here("run", str(tmp_path / "est.yaml"), "--dry-run", "--estimate-from", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("(measured)") == 3
    assert f"calls of 3 cells from the nearest measured cells of {tmp_path}" in done.stdout


def test_fill_order_takes_the_ends_then_halves_the_gaps():
    assert fill_order(1) == [0] and fill_order(2) == [0, 1]
    assert fill_order(5) == [0, 4, 2, 1, 3]
    assert sorted(fill_order(8)) == list(range(8)) and fill_order(8)[:3] == [0, 7, 3]


def test_a_budget_takes_every_series_at_its_shortest_first(tmp_path):
    """A budget that fits the run's start and the shortest cell of each series keeps those and no other."""
    cells = _cells(_scenario(tmp_path, "softmax: {}, linear: {}, delta: {}", "[1024, 4096, 16384, 65536]", modes="[forward, train]"))
    sweep = Estimator(H100).sweep(cells)
    shortest = [e for e in sweep.cells if e.cell.axes["seq_len"] == 1024]
    budget = COSTS.run_start_s + sum(e.seconds for e in shortest) + 0.01
    selection = select([sweep], budget)
    (kept,) = selection.kept
    assert {cell.cell_id for cell in kept} == {e.cell.cell_id for e in shortest}
    assert selection.seconds <= budget and len(selection.left_out) == len(cells) - len(shortest)
    lines = selection.left_out_lines()
    assert lines[-1] == f"left out: {len(cells) - len(shortest)} cells in all"
    assert len(lines) == 1 + 6  # one line per variant and mode
    assert lines[0].startswith("left out: est softmax[torch] forward bfloat16 cuda: T=4096 B=2, T=16384 B=2, T=65536 B=2 (3 cells, ~")
    everything = select([sweep], sweep.seconds() + 1)
    assert everything.left_out == [] and everything.seconds == pytest.approx(sweep.seconds())


def test_budget_on_the_command_line_lists_what_it_leaves_out():
    done = attnbench_here("run", "seq-sweep", "--preset", "gpu", "--budget", "3m", "--dry-run", "--estimate-for", "h100")
    assert done.returncode == 0, done.stderr
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("budget ")]
    kept, total, estimated = re.fullmatch(r"budget 3 min 00 s: (\d+) of (\d+) cells kept, estimated (.+)", line).groups()
    assert int(total) == 384 and 0 < int(kept) < 384
    assert f"left out: {384 - int(kept)} cells in all" in done.stdout
    assert f"seq-sweep, preset gpu): {kept} cells, estimated {estimated}" in done.stdout
    listed = re.findall(r"^  [0-9a-f]{16}  (\S+) \S+ T=(\d+)", done.stdout, flags=re.M)
    assert {name for name, _ in listed} >= {"softmax[torch]", "linear[torch]", "rwkv[torch]", "lsh(n_rounds=8)[torch]"}
    assert {int(t) for _, t in listed} >= {512}


@pytest.mark.slow  # measures a few CPU cells
def test_a_run_with_a_budget_measures_the_cells_it_keeps(tmp_path):
    scenario = _scenario(tmp_path, "linear: {}, delta: {}", "[16, 32, 64]", device="cpu", modes="[forward, train]")
    done = attnbench("run", scenario, "--budget", "25s", "--out", str(tmp_path / "out"), "--no-progress")
    assert done.returncode == 0, done.stderr
    kept, total = map(int, re.search(r"budget 25 s: (\d+) of (\d+) cells kept", done.stdout).groups())
    assert total == 12 and 0 < kept < 12
    assert f"left out: {12 - kept} cells in all" in done.stdout
    (path,) = (tmp_path / "out").glob("*.jsonl")
    cells = [record for record in read_records(path) if record["kind"] == "cell"]
    assert len(cells) == kept and all(cell["status"] == "ok" for cell in cells)
    assert min(cell["axes"]["seq_len"] for cell in cells) == 16


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--budget", "abc"], "error: --budget: expected a positive duration such as 90s, 8m or 1.5h, got 'abc'"),
        (["--budget=-1m"], "error: --budget: expected a positive duration such as 90s, 8m or 1.5h, got '-1m'"),
        (["--budget", "0s"], "error: --budget: expected a positive duration such as 90s, 8m or 1.5h, got '0s'"),
        (["--dry-run", "--estimate-for", "tpu"], "error: --estimate-for 'tpu': no datasheet of that GPU; known: H200, "),
        (["--estimate-from", "x.jsonl"], "error: --estimate-for and --estimate-from estimate the cells of --dry-run or --budget"),
    ],
)
def test_bad_options_are_one_line_and_exit_code_2(tmp_path, args, expected):
    done = attnbench_here("run", _scenario(tmp_path, "linear: {}", "[1024]"), *args)
    assert done.returncode == 2
    assert done.stderr.startswith(expected) and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_a_missing_or_wrong_estimate_file_is_one_line_naming_it(tmp_path):
    scenario = _scenario(tmp_path, "linear: {}", "[1024]")
    missing = tmp_path / "none.jsonl"
    done = attnbench_here("run", scenario, "--dry-run", "--estimate-from", str(missing))
    assert done.returncode == 2 and done.stderr == f"error: --estimate-from: results file {missing} does not exist\n"
    wrong = tmp_path / "scenario.jsonl"
    wrong.write_text(json.dumps({"name": "not results"}) + "\n")
    done = attnbench_here("run", scenario, "--budget", "1m", "--estimate-from", str(wrong))
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stderr.startswith(f"error: --estimate-from: {wrong}, line 1 is not a results record")


def test_durations():
    assert [parse_duration(text) for text in ("90s", "8m", "1.5h", "45", " 2 m ")] == [90, 480, 5400, 45, 120]
    for bad in ("", "m", "8x", "-1m", "1e3s", "8 min"):
        with pytest.raises(ValueError, match="expected a positive duration"):
            parse_duration(bad)


def test_the_gpu_present_is_the_default_roof_where_a_datasheet_knows_it(monkeypatch):
    import torch

    from harness.running.estimate import DEFAULT_GPU, default_gpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA A100-SXM4-80GB")
    assert default_gpu() == "NVIDIA A100-SXM4-80GB" and gpu_roof(default_gpu()).name.startswith("A100 (datasheet")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA Unknown 9000")
    assert default_gpu() == DEFAULT_GPU

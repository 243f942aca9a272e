"""How long a sweep will take, before it runs: ``attnbench run --dry-run`` (per cell, group, scenario and in
all), ``--budget`` (the cells that fit) and ``attnbench gpu-check``'s plan share this one cost model.

A cell costs its fixed terms (``Costs``: the run's start, a fresh worker where the executor starts one, the
cell's build, record and accuracy check, the first use of each kernel configuration) and its calls: the NaN
check, ``warmup``, ``repeats`` and, for an unstable cell, adaptive sampling up to ``max_time_s``
(harness.measuring.measure). One call takes the longest of its FLOPs at the roof's matmul rate, its bytes at the roof's
bandwidth (each divided by the fraction of the roof the form reaches) and the form's launch floor. The roof is a
GPU's datasheet (``harness.measuring.roofline.DATASHEETS``) for a CUDA cell, this CPU's matmul and copy rates (measured
now, briefly) for a CPU cell. ``Measured`` replaces the roof's time of a call with the median of the nearest
measured cell of a results file, scaled by the model's ratio between the two shapes, and a quality cell's flat
``quality_cell_s`` with the seconds the same cell took; ``attnbench run`` reads this machine's results in the directory
it writes to (``planning.this_machines_results``) unless ``--estimate-from`` names others.
"""

from __future__ import annotations

import functools
import json
import math
import numbers
import re
from dataclasses import dataclass, field
from typing import NamedTuple

from ..scenarios.cell import Cell

#: The GPU a CUDA cell is estimated for when none is named (``--estimate-for``) and none is present.
DEFAULT_GPU = "H100"
#: The forms whose fraction of the roof and launch floor ``Costs`` gives: a backend, or SDPA (softmax, torch).
SDPA = "sdpa"


@dataclass(frozen=True)
class Costs:
    """The terms of the model, in seconds unless named otherwise. Measured where a comment says so: on an
    H200, 2026-12-04 (torch 2.11, triton 3.6, fla-core 0.6.0; docs/performance.md, "First GPU contact",
    "Second GPU session") and on the 2-core development VM; the rest are design estimates."""

    run_start_s: float = 12.0  # an `attnbench run`: its worker imports torch, starts CUDA, calibrates (measured: 12 s)
    #: a new worker (import torch, start the device) for a cell after a CPU speed or compile cell (harness.running.worker.needs_fresh_worker);
    #: measured on the H200: a cell after a failed one waited 13 s; on the VM a decode cell, its worker's start included, 2.9 s
    worker_start_s: dict = field(default_factory=lambda: {"cuda": 13.0, "cpu": 2.0})
    cell_overhead_s: float = 0.5  # a speed cell's build, NaN check, peak memory and results record
    #: compilations and autotuning the first cell of each (backend, variant, d, dtype, mode) pays. Measured: attnbench's
    #: kernels 3.4-4.8 s a cell; fla's forward 53 s (linear) and 60 s (delta), its training over 120 s; torch.compile
    #: on CUDA 7.1-7.7 s (linear, T 4096), on the CPU 23-100 s (every compile cell has a fresh worker, so pays it again)
    first_use_s: dict = field(default_factory=lambda: {"cuda": {"triton": 5.0, "fla": 60.0, "compile": 10.0}, "cpu": {"compile": 40.0}})
    #: the fraction of the roof a form reaches. CUDA: the geometric means of gpu-check's cells at T 16k on the H200
    #: (second session; bf16, d 128: linear, delta, gated delta), the model's medians against the measured ones there;
    #: compile twice the torch forms (linear, T 4096, bf16 on the H200: 0.51 against 1.03 ms forward); on the CPU (the VM,
    #: seq-sweep's cpu preset) every form reached 0.14-0.33 of its calibrated roof, SDPA 0.24-0.58
    efficiency: dict = field(default_factory=lambda: {
        "cuda": {SDPA: 0.31, "torch": 0.007, "triton": 0.026, "fla": 0.047, "compile": 0.014},
        "cpu": {SDPA: 0.4, "torch": 0.2, "compile": 0.2},
    })  # fmt: skip
    memory_efficiency: float = 0.5  # the fraction of the bandwidth a memory-bound call reaches (design)
    #: the fraction of the roof dense matmuls reach (a layer's projections; a model's feed-forward layers, embedding and
    #: head): design, as SDPA's 0.46 on the H200
    dense_efficiency: float = 0.4
    #: the shortest forward call of a form, launches and Python (measured on the H200 at T 1,024: SDPA 0.12 ms, the
    #: torch forms 0.94-2.8 ms, Triton 0.76-1.0 ms, fla 0.78-1.2 ms; the CPU's: design)
    floor_s: dict = field(default_factory=lambda: {
        "cuda": {SDPA: 1e-4, "torch": 1.5e-3, "triton": 8e-4, "fla": 9e-4, "compile": 5e-4},
        "cpu": {SDPA: 1e-4, "torch": 3e-4, "compile": 3e-4},
    })  # fmt: skip
    train_floor: float = 3.0  # a training call's floor against the forward's (measured on the H200 at T 1,024: 2.1-4.6x)
    #: one decode step of a core, launches and Python (measured on the VM: 0.10-0.23 ms; on CUDA: design)
    step_floor_s: dict = field(default_factory=lambda: {"cuda": 3e-4, "cpu": 1.5e-4})
    unstable_fraction: float = 0.06  # cells that sample on to max_time_s (measured on the H200: 2 of 34)
    accuracy_calls: float = 1.0  # the float64 reference on one row, as calls of the cell (design)
    quality_cell_s: float = 10.0  # a quality cell: one LM ci cell on CUDA, 6 steps and its evaluations (design)

    def first_use(self, cell: Cell) -> float:
        """What the first cell of ``cell``'s kernel configuration pays to compile and autotune them (0: nothing to compile)."""
        return self.first_use_s[cell.device.split(":")[0]].get(cell.backend, 0.0)


COSTS = Costs()


@dataclass(frozen=True)
class Roof:
    """What one call is held to: matmul FLOP/s per dtype and bandwidth, and where they come from."""

    name: str
    flops_per_s: dict
    bandwidth_bytes_per_s: float

    def compute_s(self, flops: float, dtype: str) -> float:
        rates = self.flops_per_s
        peak = rates.get(dtype) or (rates["float32"] / 2 if dtype == "float64" else rates["float32"])
        return flops / peak

    def describe(self) -> str:
        rates = ", ".join(f"{dtype} {rate / 1e12:.3g} TFLOP/s" for dtype, rate in self.flops_per_s.items() if dtype != "tf32")
        return f"{self.name}: {rates}, {self.bandwidth_bytes_per_s / 1e9:.0f} GB/s"


class EstimateError(ValueError):
    """An estimate that cannot be made as asked (an unknown GPU, an unreadable results file)."""


def gpu_roof(name: str) -> Roof:
    """The datasheet roof of the GPU ``name`` (any substring a datasheet matches: h100, a100, ...)."""
    from ..measuring.roofline import DATASHEETS, datasheet

    sheet = datasheet(name)
    if sheet is None:
        known = ", ".join(known for known, _ in DATASHEETS)
        raise EstimateError(f"--estimate-for {name!r}: no datasheet of that GPU; known: {known}")
    rates = {key: value for key, value in sheet.items() if key not in ("name", "bandwidth_bytes_per_s")}
    return Roof(f"{sheet['name']} (datasheet peaks)", rates, sheet["bandwidth_bytes_per_s"])


@functools.cache
def cpu_roof(dtypes: tuple[str, ...] = ("float32",)) -> Roof:
    """This CPU's roof at torch's thread count: the best of its calibrations, as a run's (``harness.measuring.roofline.calibrate``)."""
    from ..measuring import machine
    from ..measuring.roofline import calibrate

    found = calibrate(machine.fingerprint("cpu")["machine_id"], list(dtypes))
    name = f"this CPU (calibrated: the best of this machine's calibrations, {found['torch_threads']} threads)"
    return Roof(name, found["matmul_flops_per_s"], found["bandwidth_bytes_per_s"])


def default_gpu() -> str:
    """The GPU present where a datasheet knows it, else ``DEFAULT_GPU``."""
    import torch

    from ..measuring.roofline import datasheet

    present = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return present if datasheet(present) is not None else DEFAULT_GPU


def roofs_for(cells: list[Cell], gpu: str | None = None) -> dict[str, Roof]:
    """The roof of each device type the cells run on: ``gpu``'s datasheet (default ``default_gpu``) for CUDA."""
    kinds = {cell.device.split(":")[0] for cell in cells}
    roofs = {"cuda": gpu_roof(gpu or default_gpu())} if "cuda" in kinds else {}
    if "cpu" in kinds:
        roofs["cpu"] = cpu_roof(tuple(sorted({cell.axes["dtype"] for cell in cells if cell.device == "cpu"})))
    return roofs


# --- one cell's work ----------------------------------------------------------------------------


def _key(cell: Cell) -> str:
    return json.dumps([cell.variant, cell.backend, cell.backend_options, cell.params, cell.axes["d_key"], cell.model, cell.target], sort_keys=True)


_MODULES: dict[str, tuple] = {}


def _module(cell: Cell) -> tuple:
    """The cell's core (a layer's or a model's, which it is built around) and, for a layer or a model, the
    module and the model's config, built once per configuration on the CPU in float32 (the counts need no device)."""
    import torch

    from ..measuring.builders import build_core, build_layer, build_model

    key, cpu = _key(cell), torch.device("cpu")
    if key not in _MODULES:
        if cell.target == "model":
            model, config = build_model(cell, cpu, torch.float32)
            _MODULES[key] = model.blocks[0].attn.core, model, config
        elif cell.target == "layer":
            layer = build_layer(cell, cpu, torch.float32)
            _MODULES[key] = layer.core, layer, None
        else:
            _MODULES[key] = build_core(cell), None, None
    return _MODULES[key]


class Work(NamedTuple):
    """What one call does: FLOPs, bytes, the share of the FLOPs in dense matmuls (a layer's projections, a model's
    other layers) and how many attention-core calls it makes (a model: one per layer)."""

    flops: float
    bytes: float
    dense_share: float = 0.0
    core_calls: int = 1


def work(cell: Cell) -> Work:
    """One call (a decode cell: its ``new_tokens`` steps), FLOPs as the cell's workload counts them
    (harness.measuring.builders, harness.running.workloads) and the bytes of its inputs and outputs (for a model its weights and logits)."""
    from ..measuring.builders import core_counts, head_arguments, layer_flops, module_bytes

    core, module, config = _module(cell)
    axes, size = cell.axes, {"float64": 8, "float32": 4}.get(cell.axes["dtype"], 2)
    tokens = axes["batch"] * axes["seq_len"]
    io_bytes = tokens * axes["heads"] * (2 * core.d_key + 2 * axes["d_value"]) * size
    if cell.mode == "decode":
        heads, grouped = head_arguments(core, axes)
        new, batch, context = cell.decode["new_tokens"], axes["batch"], axes["seq_len"]
        flops = sum(core.step_flops(batch, heads, axes["d_value"], context + i, **grouped) for i in range(new))
        state = 2 * core.state_numel(batch, heads, axes["d_value"], context + new // 2, **grouped) * size
        return Work(flops, new * (state + io_bytes / axes["seq_len"]))
    layers = 1
    if cell.target == "model":  # as harness.measuring.builders.model_workload counts a model's FLOPs
        layers = config.n_layers
        attention = layers * core.flops(axes["batch"], config.n_heads, axes["seq_len"], config.d_model // config.n_heads)
        flops = 2 * sum(p.numel() for name, p in module.named_parameters() if p.dim() == 2 and "pos" not in name) * tokens + attention
        io_bytes = module_bytes(module) // 4 * size + tokens * config.vocab_size * size
    elif cell.target == "layer":
        flops, attention = layer_flops(module, axes), core.flops(axes["batch"], axes["heads"], axes["seq_len"], axes["d_value"])
        io_bytes += module_bytes(module) // 4 * size
    else:
        flops = attention = core_counts(core, cell)[1]
    share = 1.0 - attention / flops if flops else 0.0
    return Work(3 * flops, 2 * io_bytes, share, layers) if cell.mode == "train" else Work(flops, io_bytes, share, layers)


def _work(cell: Cell) -> Work:
    """``work``, or none (the call's floor only) for a plugin's core that counts no FLOPs or a cell that cannot be built."""
    try:
        return work(cell)
    except (NotImplementedError, ValueError):
        return Work(0.0, 0.0)


def form(cell: Cell) -> str:
    """What the efficiency and floor of ``Costs`` are keyed by: the backend, SDPA for softmax's torch form."""
    return SDPA if (cell.variant, cell.backend) == ("softmax", "torch") else cell.backend


def first_use_group(cell: Cell, costs: Costs = COSTS) -> tuple | None:
    """The cells that share their kernels' compilations and autotuning (the first of them pays): one backend, variant,
    d, dtype, mode and device; a cell measured in a fresh worker (a compile cell) compiles again, a group of its own.
    None for a backend that compiles nothing there."""
    from .worker import needs_fresh_worker

    if not costs.first_use(cell):
        return None
    axes = cell.axes
    group = (cell.backend, cell.variant, axes["d_key"], axes["d_value"], axes["dtype"], cell.mode, axes["device"])
    return (*group, cell.cell_id) if needs_fresh_worker(cell, "ok") else group


# --- the model ------------------------------------------------------------------------------------


@dataclass
class CellEstimate:
    """One cell's estimated seconds (its own: without first uses and worker starts) and where its call time came from."""

    cell: Cell
    seconds: float
    call_s: float
    measured: bool = False


class Estimator:
    """Estimates cells against ``roofs`` (device type -> Roof), with ``costs`` and optionally the
    nearest cells of ``measured`` results."""

    def __init__(self, roofs: dict[str, Roof], costs: Costs = COSTS, measured=None):
        self.roofs, self.costs, self.measured = roofs, costs, measured

    def model_call_s(self, cell: Cell, done: Work) -> float:
        """One call (a decode cell: its steps) by the roof: its attention FLOPs over the form's fraction of the roof
        plus its dense FLOPs over ``dense_efficiency``'s, or its bytes at ``memory_efficiency``, or the form's floor."""
        costs, kind = self.costs, cell.device.split(":")[0]
        roof, name = self.roofs[kind], form(cell)
        efficiency = costs.efficiency[kind].get(name, costs.efficiency[kind]["torch"])
        if cell.mode == "decode":
            floor = cell.decode["new_tokens"] * costs.step_floor_s[kind]
        else:
            floor = costs.floor_s[kind].get(name, costs.floor_s[kind]["torch"]) * (costs.train_floor if cell.mode == "train" else 1.0)
        compute = roof.compute_s(done.flops, cell.axes["dtype"])
        compute = compute * (1 - done.dense_share) / efficiency + compute * done.dense_share / costs.dense_efficiency
        return max(compute, done.bytes / roof.bandwidth_bytes_per_s / costs.memory_efficiency, floor * done.core_calls)

    def call_s(self, cell: Cell) -> tuple[float, bool]:
        """One call's seconds and whether they come from a measured cell (its median, scaled by the model's
        ratio of this cell's call to that cell's, whose FLOPs and bytes are as recorded)."""
        done = _work(cell)
        model = self.model_call_s(cell, done)
        near = self.measured.nearest(cell, done.flops) if self.measured is not None else None
        if near is None:
            return model, False
        return near["median_s"] * model / self.model_call_s(cell, done._replace(flops=near["flops"], bytes=near["min_bytes"])), True

    def cell(self, cell: Cell) -> CellEstimate:
        """A cell's own seconds: overhead, the calls before timing (warm-up build, NaN check, ``warmup``), the
        timed ones, the accuracy check and, for the unstable share, sampling up to ``max_time_s``."""
        costs = self.costs
        if cell.skip:
            return CellEstimate(cell, 0.0, 0.0)
        if cell.quality:
            took = self.measured.durations.get(cell.cell_id) if self.measured is not None else None
            return CellEstimate(cell, costs.quality_cell_s if took is None else took, 0.0, took is not None)
        call, measured = self.call_s(cell)
        if cell.mode == "decode":  # a round: the prefill, then the steps; the warm-up's prefill and two steps, the memory round
            prefill = cell.replace(mode="forward")
            call += self.model_call_s(prefill, _work(prefill))
        measure = cell.measure
        repeats = measure.get("repeats", 7)
        calls = 2 + measure.get("warmup", 2) + repeats + costs.accuracy_calls
        sampling = costs.unstable_fraction * max(0.0, (measure.get("max_time_s") or 0.0) - repeats * call) if measure.get("target_rel_ci", 0.05) else 0.0
        return CellEstimate(cell, costs.cell_overhead_s + calls * call + sampling, call, measured)

    def sweep(self, cells: list[Cell]) -> Sweep:
        """Every cell's estimate and the fixed costs of measuring them in this order in one run."""
        return Sweep([self.cell(cell) for cell in cells], self.costs)


@dataclass
class Sweep:
    """The estimates of one run's cells, with its fixed costs: the run's start, a worker start before each
    cell that follows a fresh-worker cell, each first use."""

    cells: list[CellEstimate]
    costs: Costs = COSTS

    @property
    def measured(self) -> list[CellEstimate]:
        return [estimate for estimate in self.cells if not estimate.cell.skip]

    def first_uses(self) -> dict[tuple, float]:
        groups = {first_use_group(e.cell, self.costs): e.cell for e in self.measured}
        return {group: self.costs.first_use(cell) for group, cell in groups.items() if group is not None}

    def worker_starts_s(self) -> float:
        from .worker import needs_fresh_worker

        cells = [e.cell for e in self.measured]
        return sum(self.costs.worker_start_s[cell.device.split(":")[0]] for cell in cells[:-1] if needs_fresh_worker(cell, "ok"))

    def fixed_s(self) -> float:
        return (self.costs.run_start_s if self.measured else 0.0) + self.worker_starts_s() + sum(self.first_uses().values())

    def seconds(self) -> float:
        return self.fixed_s() + sum(e.seconds for e in self.cells)


# --- durations ----------------------------------------------------------------------------------------

_DURATION = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([smh]?)\s*")


def parse_duration(text: str) -> float:
    """Seconds of ``30s``, ``8m``, ``1.5h`` (a bare number: seconds); a ValueError saying what was expected."""
    match = _DURATION.fullmatch(text or "")
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"expected a positive duration such as 90s, 8m or 1.5h, got {text!r}")
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[match.group(2)]


def format_duration(seconds: float) -> str:
    """``42 s``, ``12 min 05 s``, ``2 h 07 min``."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


# --- measured cells -----------------------------------------------------------------------------------


def _positive(value) -> bool:
    """Whether a recorded time or count is a positive finite number, one an estimate can scale."""
    return isinstance(value, numbers.Real) and math.isfinite(value) and value > 0


class Measured:
    """The ok cells of results files (``--estimate-from``; those of one machine, ``machine_id``): speed cells by what
    a cell must share with the one estimated (variant, backend, mode, target, dtype and device type), quality cells
    by their id with the seconds each took (its last record's ``duration_s``). ``source`` names them in the dry run."""

    def __init__(self, paths, machine_id: str | None = None, source: str | None = None):
        from ..results import ResultsFileError, load

        self.source = source or str(paths)
        try:
            frame = load(paths)
        except (ResultsFileError, ValueError, OSError) as exc:
            raise EstimateError(f"--estimate-from: {exc}") from None
        if machine_id is not None and not frame.empty:
            frame = frame[frame["machine.machine_id"] == machine_id]
        self.cells: dict[tuple, list[dict]] = {}
        quality = frame[(frame["status"] == "ok") & (frame["mode"] == "quality")] if not frame.empty else frame
        self.durations = {row["cell_id"]: float(row["duration_s"]) for row in quality.to_dict("records") if _positive(row["duration_s"])}
        needed = {"metrics.median_s", "metrics.flops", "axes.dtype", "axes.device"}
        if frame.empty or not needed <= set(frame.columns):
            return
        for row in frame[(frame["status"] == "ok") & (frame["mode"] != "quality")].to_dict("records"):
            if not (_positive(row["metrics.flops"]) and _positive(row["metrics.median_s"])):
                continue  # a time or count that is no positive finite number (the reader takes NaN and inf): nothing learned
            key = (row["variant"], row["backend"], row["mode"], row["target"], row["axes.dtype"], str(row["axes.device"]).split(":")[0])
            params = {name[len("params.") :]: value for name, value in row.items() if name.startswith("params.") and value == value}
            self.cells.setdefault(key, []).append({
                "params": params, "flops": float(row["metrics.flops"]), "median_s": float(row["metrics.median_s"]), "cell_id": row["cell_id"],
                "min_bytes": float(row["metrics.min_bytes"]) if _positive(row.get("metrics.min_bytes")) else 0.0,
            })  # fmt: skip

    def __len__(self) -> int:
        return sum(map(len, self.cells.values())) + len(self.durations)

    def nearest(self, cell: Cell, flops: float) -> dict | None:
        """The measured cell nearest ``cell``: of the same parameters where one is, then of the nearest FLOPs (in ratio)."""
        key = (cell.variant, cell.backend, cell.mode, cell.target, cell.axes["dtype"], cell.device.split(":")[0])
        found = self.cells.get(key)
        if not found:
            return None
        distance = lambda row: (row["params"] != cell.params, abs(math.log(row["flops"] / max(flops, 1.0))))  # noqa: E731
        return min(found, key=distance)

"""A sweep planned before it runs: what ``attnbench run --dry-run`` prints beside the cells (each cell's
estimate, each group's, each scenario's, the total; harness.running.estimate) and what ``--budget`` keeps.

A budget keeps the most informative cells first: every series (the cells of one variant, parameters, backend,
mode, dtype and shape but for their length, ``seq_len`` then ``batch``) at its shortest point, then at its
longest, then the points between, halving the widest gap first; within one round the scenarios' order. A cell is
kept when it fits what is left, with the fixed costs it adds (its run's start, its first use, a fresh worker);
one that does not is left out and the next is tried.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from ..common.formatting import counted
from ..scenarios.cell import Cell
from ..scenarios.expansion import describe
from .estimate import CellEstimate, Estimator, Measured, Sweep, first_use_group, format_duration

#: The axes along which a series runs (its points ordered by them), the rest name the series.
LENGTH_AXES = ("seq_len", "batch")
#: The largest results file in --out that estimates learn from (read whole): a run of the most cells a scenario may have
#: (100,000, about 250 MB) fits; a larger file is passed over unread, with a line.
LEARN_MAX_BYTES = 512 * 2**20


def group_label(cell: Cell) -> str:
    """The group of a cell in the listings: variant and parameters, backend, mode, dtype, device."""
    params = ",".join(f"{key}={value}" for key, value in cell.params.items())
    return f"{cell.variant}{'(' + params + ')' if params else ''}[{cell.backend}] {cell.mode} {cell.axes['dtype']} {cell.axes['device']}"


def format_dry_run(loaded, sweeps: list[Sweep], roofs: dict, measured: Measured | None = None) -> list[str]:
    """The lines of ``--dry-run``: per scenario its cells with their estimates, its groups and its total; then the total,
    the roofs and where the estimates came from (with measured cells, each cell estimated by the model is marked so)."""
    lines = []
    for scenario, sweep in zip(loaded, sweeps):
        preset = f", preset {scenario.preset}" if scenario.preset else ""
        lines.append(f"{scenario.path} ({scenario.name}{preset}): {counted(len(sweep.cells), 'cell')}, estimated {format_duration(sweep.seconds())}")
        for estimate in sweep.cells:
            lines.append(f"  {estimate.cell.cell_id}  {describe(estimate.cell)}{_cell_note(estimate, measured is not None)}")
        lines += [f"  group {label}: {text}" for label, text in _groups(sweep.cells)]
        lines.append(f"  {scenario.name}: estimated {format_duration(sweep.seconds())} ({_fixed(sweep)})")
    total = sum(sweep.seconds() for sweep in sweeps)
    count = sum(len(sweep.cells) for sweep in sweeps)
    lines.append(f"estimated total: {format_duration(total)} for {counted(count, 'cell')} in {counted(len(sweeps), 'scenario')}")
    lines += [f"roof ({kind}): {roof.describe()}" for kind, roof in roofs.items()]
    return lines + [_sources(sweeps, measured)]


def _sources(sweeps: list[Sweep], measured: Measured | None) -> str:
    """Which cells were estimated from measured ones (``(measured)``) and which from the model."""
    estimates = [e for sweep in sweeps for e in sweep.measured]
    if measured is None:
        learn = "this machine's results of these scenarios in --out, or --estimate-from"
        return f"{counted(len(estimates), 'cell')} from the model: no measured cells to learn from ({learn})"
    speed = sum(e.measured and not e.cell.quality for e in estimates)
    quality = sum(e.measured and e.cell.quality for e in estimates)
    model = len(estimates) - speed - quality
    parts = [f"calls of {counted(speed, 'cell')} from the nearest measured cells of {measured.source}, scaled by the model"] if speed else []
    parts += [f"{counted(quality, 'quality cell')} from their own durations{'' if speed else f' measured in {measured.source}'}"] if quality else []
    parts += [f"{counted(model, 'cell')} from the model" + (" (marked (model))" if parts else f": none measured in {measured.source}")] if model else []
    return "; ".join(parts)


def _cell_note(estimate: CellEstimate, marked: bool) -> str:
    """``  ~1.2 s``, ``(measured)`` where it came from a measured cell; ``(model)`` beside measured ones (``marked``)."""
    if estimate.cell.skip:
        return ""
    source = " (measured)" if estimate.measured else " (model)" if marked else ""
    return f"  ~{estimate.seconds:.1f} s{source}"


def _groups(estimates: list[CellEstimate]) -> list[tuple[str, str]]:
    grouped = defaultdict(list)
    for estimate in estimates:
        if not estimate.cell.skip:
            grouped[group_label(estimate.cell)].append(estimate)
    return [(label, f"{counted(len(group), 'cell')}, {format_duration(sum(e.seconds for e in group))}") for label, group in grouped.items()]


def _fixed(sweep: Sweep) -> str:
    uses = sweep.first_uses()
    cells = sum(e.seconds for e in sweep.cells)
    skipped = len(sweep.cells) - len(sweep.measured)
    return (f"cells {format_duration(cells)}, run start {format_duration(sweep.costs.run_start_s if sweep.measured else 0)}, "
            f"worker starts {format_duration(sweep.worker_starts_s())}, {len(uses)} first uses {format_duration(sum(uses.values()))}"
            f"{f', {skipped} skipped' if skipped else ''}")  # fmt: skip


# --- budgets ------------------------------------------------------------------------------------------


@dataclass
class Selection:
    """What a budget keeps: the cells of each scenario (in the scenario's order; its skipped cells, which cost nothing, with
    those kept) and those it leaves out, with their estimates."""

    kept: list[list[Cell]]
    left_out: list[CellEstimate]
    seconds: float

    def left_out_lines(self) -> list[str]:
        """One line per group of the cells left out, then their count."""
        grouped = defaultdict(list)
        for estimate in self.left_out:
            grouped[(estimate.cell.scenario, group_label(estimate.cell))].append(estimate)
        lines = []
        for (scenario, label), group in grouped.items():
            points = ", ".join(f"T={e.cell.axes['seq_len']} B={e.cell.axes['batch']}" for e in group)
            lines.append(f"left out: {scenario} {label}: {points} ({counted(len(group), 'cell')}, ~{format_duration(sum(e.seconds for e in group))})")
        return lines + [f"left out: {counted(len(self.left_out), 'cell')} in all"]


def series_key(cell: Cell) -> str:
    axes = {name: value for name, value in cell.axes.items() if name not in LENGTH_AXES}
    return json.dumps([cell.scenario, cell.variant, cell.params, cell.backend, cell.backend_options, cell.mode, cell.target, axes], sort_keys=True, default=str)


def fill_order(count: int) -> list[int]:
    """The order in which a series of ``count`` points is taken: first, last, then halving the widest gap."""
    order, gaps = ([0, count - 1] if count > 1 else [0]), [(0, count - 1)]
    while gaps:
        gaps.sort(key=lambda gap: gap[0] - gap[1])  # the widest first
        low, high = gaps.pop(0)
        if high - low > 1:
            middle = (low + high) // 2
            order.append(middle)
            gaps += [(low, middle), (middle, high)]
    return order[:count]


def priority(sweeps: list[Sweep]) -> list[tuple[int, CellEstimate]]:
    """``(scenario index, estimate)`` of every measured cell, most informative first (the module's docstring)."""
    series = defaultdict(list)
    for index, sweep in enumerate(sweeps):
        for estimate in sweep.measured:
            series[(index, series_key(estimate.cell))].append(estimate)
    ranked = []
    for position, ((index, _), members) in enumerate(series.items()):
        members.sort(key=lambda e: tuple(e.cell.axes.get(name, 0) for name in LENGTH_AXES))
        ranked += [((round_, index, position), index, members[point]) for round_, point in enumerate(fill_order(len(members)))]
    return [(index, estimate) for _, index, estimate in sorted(ranked, key=lambda item: item[0])]


def select(sweeps: list[Sweep], budget_s: float) -> Selection:
    """The cells of ``sweeps`` that fit ``budget_s`` seconds, by ``priority``, with what each adds to the fixed costs."""
    from .worker import needs_fresh_worker

    kept, started, groups, spent = set(), set(), set(), 0.0
    for index, estimate in priority(sweeps):
        cell, costs = estimate.cell, sweeps[index].costs
        group = first_use_group(cell, costs)
        extra = estimate.seconds + (costs.run_start_s if index not in started else 0.0)
        extra += costs.first_use(cell) if group is not None and group not in groups else 0.0
        extra += costs.worker_start_s[cell.device.split(":")[0]] if needs_fresh_worker(cell, "ok") else 0.0
        if spent + extra <= budget_s:
            spent += extra
            kept.add(cell.cell_id)
            started.add(index)
            groups.add(group)
    chosen = [[e.cell for e in sweep.cells if e.cell.skip or e.cell.cell_id in kept] if index in started else [] for index, sweep in enumerate(sweeps)]
    left_out = [e for sweep in sweeps for e in sweep.measured if e.cell.cell_id not in kept]
    return Selection(chosen, left_out, spent)


def this_machines_results(loaded: list, out_dir) -> tuple[Measured | None, str | None]:
    """The cells measured on this machine in ``out_dir`` (the directory the run writes to), in the results files of
    ``loaded``'s scenarios, as ``--estimate-from`` reads them (``learned_from``)."""
    from ..measuring import machine
    from .executors import main_device
    from .runner import _results_file_pattern

    patterns = [_results_file_pattern(scenario.name) for scenario in loaded]
    files = sorted(path for path in Path(out_dir).glob("*.jsonl") if any(pattern.fullmatch(path.name) for pattern in patterns))
    if not files:
        return None, None
    here = machine.fingerprint(main_device([cell for scenario in loaded for cell in scenario.cells()]))["machine_id"]
    return learned_from(files, here, out_dir)


def learned_from(files: list[Path], machine_id: str, out_dir) -> tuple[Measured | None, str | None]:
    """The cells of ``files`` (in ``out_dir``) measured on machine ``machine_id``: ``(Measured or None where there are
    none, a line saying why some were not read)`` (an unreadable file is passed over: the estimates then come from the
    model; one larger than ``LEARN_MAX_BYTES`` is not read)."""
    from .estimate import EstimateError

    large = [path for path in files if path.is_file() and path.stat().st_size > LEARN_MAX_BYTES]
    files = [path for path in files if path not in large]
    unread = (
        f"measured cells in {large[0]} not used: {large[0].stat().st_size} bytes, more than the {LEARN_MAX_BYTES} of a file to learn from" if large else None
    )
    if not files:
        return None, unread
    try:
        found = Measured(files, machine_id=machine_id, source=f"{out_dir} (this machine's results of {counted(len(files), 'file')})")
    except EstimateError as exc:
        return None, "; ".join(filter(None, [unread, f"measured cells in {out_dir} not used: {str(exc).removeprefix('--estimate-from: ')}"]))
    return (found if len(found) else None), unread


def plan(loaded: list, *, gpu: str | None = None, measured_from: str | None = None, budget_s: float | None = None, dry_run: bool = False, out_dir=None):
    """``(scenarios to run, lines to print)`` for ``attnbench run``: with a budget each scenario narrowed to the
    cells it keeps (one it keeps none of dropped) and a line per group left out; with ``dry_run`` the listing. The
    estimates come from the cells measured in ``measured_from`` (``--estimate-from``), else from those measured on this
    machine in ``out_dir`` (``this_machines_results``), and from the model. An EstimateError for an unknown GPU or an
    unreadable ``measured_from``."""
    from .estimate import roofs_for

    roofs = roofs_for([cell for scenario in loaded for cell in scenario.cells()], gpu)
    measured, unread = (Measured(measured_from), None) if measured_from else this_machines_results(loaded, out_dir) if out_dir else (None, None)
    estimator = Estimator(roofs, measured=measured)
    sweeps = [estimator.sweep(scenario.cells()) for scenario in loaded]
    lines = []
    if budget_s is not None:
        selection = select(sweeps, budget_s)
        kept = sum(map(len, selection.kept))
        total = kept + len(selection.left_out)
        lines.append(f"budget {format_duration(budget_s)}: {kept} of {counted(total, 'cell')} kept, estimated {format_duration(selection.seconds)}")
        lines += selection.left_out_lines() if selection.left_out else []
        loaded = [scenario.narrowed(cells) for scenario, cells in zip(loaded, selection.kept) if cells]
        sweeps = [estimator.sweep(scenario.cells()) for scenario in loaded]
    if dry_run:
        lines = format_dry_run(loaded, sweeps, roofs, measured) + lines
    return loaded, lines + ([unread] if unread else [])

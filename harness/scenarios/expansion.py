"""Expanding a validated scenario into cells: every variant configuration at every point of its
axes, per backend and mode (but those ``exclude`` leaves out), each with its stable ``cell_id``; a cell
its backend cannot compute is marked skipped with the reason. ``describe`` names a cell in one line.
Torch is imported where a core is built (``expand``), so ``cell_count`` answers before it loads."""

from __future__ import annotations

import itertools
import math

import variants

from .. import tasks
from ..common.formatting import quote
from . import axes as axis_table
from . import lengths
from .cell import Cell
from .scenario_files import MAX_CELLS, SEED_AXIS, ScenarioError, limit
from .schema import PACKINGS, VARIANT_AXES, Axes, Scenario, axis_names, check_packed_axes, configurations, sweep, variant_axes


def cell_count(scenario: Scenario) -> int:
    """How many cells the scenario sweeps at most (before repeated cells are dropped), from
    the lengths of its lists alone: nothing is expanded."""
    task = tasks.get(scenario.task.name) if scenario.task else None
    count = 0
    for name, spec in scenario.variants.items():
        for field, params in configurations(name, spec):
            axes = variant_axes(scenario, params.get(VARIANT_AXES), f"{field}.{VARIANT_AXES}")
            grid = math.prod(len(sweep(value)) for key, value in params.items() if key != VARIANT_AXES)
            shape = math.prod(len(sweep(getattr(axes, axis))) for axis in axis_names(task, axes))
            count += grid * shape * len(sweep(axes.d_dot))
    return count * len(scenario.backends) * len(scenario.modes)


def check_cell_count(scenario: Scenario, path: str) -> None:
    most, count = limit(MAX_CELLS), cell_count(scenario)
    if count > most:
        raise ScenarioError(f"{path}: sweeps {count} cells, more than the {most} a run may have (${MAX_CELLS[0]} raises it; split the sweep)")


def _param_grid(params: dict) -> list[dict]:
    keys = list(params)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(sweep(params[key]) for key in keys))]


def _variant_configs(scenario: Scenario) -> list[tuple[str, dict, str, Axes]]:
    """(name, params, field path, axes) for every variant configuration the scenario sweeps."""
    configs = []
    for name, spec in scenario.variants.items():
        for field, params in configurations(name, spec):
            axes = variant_axes(scenario, params.get(VARIANT_AXES), f"{field}.{VARIANT_AXES}")
            swept = {key: value for key, value in params.items() if key != VARIANT_AXES}
            configs.extend((name, grid, field, axes) for grid in _param_grid(swept))
    return configs


def expand(scenario: Scenario, path: str = "<scenario>") -> list[Cell]:
    """Every cell of the sweep, in a deterministic order. Each variant configuration is checked
    here (``variants.supports``, which builds its torch core), so an impossible parameter (a ν or
    m that cannot give the asked d_dot) fails before anything is measured, and a cell whose
    backend does not compute it is marked skipped with the reason."""
    task = tasks.get(scenario.task.name) if scenario.task else None
    cells, seen = [], set()
    for name, params, field, axes in _variant_configs(scenario):
        names = axis_names(task, axes)
        axis_values = {axis: sweep(getattr(axes, axis)) for axis in names}
        if "lengths" in names:
            axis_values.update(lengths=check_packed_axes(scenario, axes, f"{field}.{VARIANT_AXES}"), packing=sweep(axes.packing or PACKINGS[0]))
        d_dots = sweep(axes.d_dot)
        # A variant's own d_key (Based's and ReBased's 16-dimensional keys) replaces the d_key
        # axis where there is one (values keep the axis width); a task's model gives it to the layer.
        own_d_key = params.get("d_key")
        core_params = {key: value for key, value in params.items() if key != "d_key"}
        for d_dot in d_dots:
            core_params_at = dict(core_params, **({"d_dot": d_dot} if d_dot is not None else {}))
            full_params = core_params_at if "d_key" in names else dict(params, **core_params_at)
            d_keys = task.d_keys(scenario.task, axis_values) if task else axis_values["d_key"]
            places = list(itertools.product(axis_values["dtype"], axis_values["device"]))
            unsupported = _unsupported_backends(name, [own_d_key] if own_d_key is not None else d_keys, places, core_params_at, scenario, field, path)
            shapes = _ShapeSupport(name, core_params_at)
            for backend, mode in itertools.product(scenario.backends, scenario.modes):
                if any(exclusion.matches(name, backend, mode) for exclusion in scenario.exclude):
                    continue
                for combo in itertools.product(*(axis_values[axis] for axis in names)):
                    cell_axes = dict(zip(names, combo))
                    packed = _packed_batch(cell_axes)
                    if "d_value" in cell_axes and cell_axes["d_value"] is None:
                        cell_axes["d_value"] = cell_axes["d_key"]
                    if own_d_key is not None and "d_key" in cell_axes:
                        cell_axes["d_key"] = own_d_key
                    if scenario.rules.tokens_per_batch is not None:
                        cell_axes["batch"] = max(1, scenario.rules.tokens_per_batch // cell_axes["seq_len"])
                    if mode == "decode":
                        cell_axes["new_tokens"] = scenario.decode.new_tokens
                    if scenario.target == "model":
                        cell_axes["model"] = scenario.model.preset
                    cell = Cell(
                        scenario=scenario.name,
                        variant=name,
                        backend=backend,
                        backend_options=_options_of(scenario, backend, name),
                        params=full_params,
                        axes=cell_axes,
                        mode=mode,
                        target=scenario.target,
                        decode=scenario.decode.model_dump(),
                        model=scenario.model.model_dump() if scenario.target == "model" else None,
                        task=_task_section(scenario.task, cell_axes),
                        measure=scenario.measure.model_dump(),
                        skip=unsupported.get((backend, cell_axes["dtype"], cell_axes["device"])) or shapes(backend, mode, cell_axes),
                        lengths=list(packed.lengths) if packed else None,
                    )
                    if cell.cell_id not in seen:
                        seen.add(cell.cell_id)
                        cells.append(cell)
    return cells


def _packed_batch(cell_axes: dict) -> lengths.Batch | None:
    """A packed cell's batch, its ``axes.lengths`` then its label, ``seq_len`` its longest
    sequence and ``batch`` how many it holds (what a padded batch's shape is); None for others."""
    packed = cell_axes.get("lengths")
    if packed is None:
        return None
    cell_axes.update(lengths=packed.label, seq_len=max(packed.lengths), batch=len(packed.lengths))
    return packed


class _ShapeSupport:
    """Why a backend cannot run a cell's packed sequences or grouped heads (None: it can), asked once
    per backend, mode and shape: the variant's own refusal (its torch forms run on a tiny input of
    the shape: the parallel form, and for a decode cell a packed or padded prefill), else the backend's
    (``variants.supports(..., packed=, heads=)``)."""

    def __init__(self, name: str, params: dict):
        self.name, self.params, self.known = name, params, {}

    def __call__(self, backend: str, mode: str, cell_axes: dict) -> str | None:
        packing, ratio = cell_axes.get("packing"), cell_axes.get("head_ratio", 1)
        if packing is None and ratio == 1:
            return None
        key = (backend, mode == "decode", packing, ratio, cell_axes["heads"], cell_axes["d_key"], cell_axes["d_value"], cell_axes["dtype"], cell_axes["device"])
        if key not in self.known:
            self.known[key] = self._refusal(backend, mode == "decode", packing == "packed", cell_axes)
        return self.known[key]

    def _refusal(self, backend: str, decode: bool, packed: bool, cell_axes: dict) -> str | None:
        import torch

        from ..measuring.builders import head_counts, shaped_inputs

        core = variants.create(self.name, cell_axes["d_key"], **self.params)
        axes = dict(cell_axes, batch=1, seq_len=2)
        inputs = shaped_inputs(core, axes, [1, 1] if packed else None, "cpu", torch.float32, False)
        padded = {"lengths": [1]} if decode and not packed and "packing" in cell_axes else {}
        try:
            with torch.no_grad():
                core(**inputs)
                if decode:
                    core.prefill(**inputs, **padded)
        except variants.VariantError as exc:
            return str(exc)
        heads = head_counts(core, cell_axes)
        place = {"dtype": cell_axes["dtype"], "device": cell_axes["device"]}
        packs = packed or (bool(padded) and _packs_padded(core, inputs))
        return variants.supports(self.name, cell_axes["d_key"], [backend], packed=packs, heads=heads, **place, **self.params)[backend]


def _packs_padded(core, inputs: dict) -> bool:
    """Whether ``core``'s padded prefill (``prefill(lengths=)``) runs its rows packed: it refuses on a backend
    that takes no ``cu_seqlens`` (as the sum and delta rules' does; softmax's runs the padded batch densely)."""
    import torch

    core.shapes = tuple(shape for shape in core.shapes if shape != "packed")
    try:
        with torch.no_grad():
            core.prefill(**inputs, lengths=[1])
    except variants.UnsupportedBackend:
        return True
    return False


def _task_section(task_config, cell_axes: dict) -> dict | None:
    """The cell's ``task`` section: the scenario's, with the cell's seed where seeds are swept."""
    if task_config is None:
        return None
    section = task_config.model_dump()
    if SEED_AXIS in cell_axes:
        section["seed"] = cell_axes[SEED_AXIS]
    return section


def _options_of(scenario: Scenario, backend: str, name: str) -> dict:
    """The scenario's ``backend_options`` that variant ``name`` takes on ``backend``."""
    return variants.backend_options_for(name, backend, scenario.backend_options)


def _unsupported_backends(name: str, d_keys: list, places: list, params: dict, scenario: Scenario, field: str, path: str) -> dict:
    """``{(backend, dtype, device): reason}`` for the scenario's backends that do not compute the
    variant at some d_key for inputs of that dtype on that device (``variants.supports``; their
    cells are recorded as skipped); a parameter no backend takes is an error."""
    unsupported = {}
    for d_key, (dtype, device) in itertools.product(d_keys, places):
        try:
            reasons = variants.supports(name, d_key, scenario.backends, dtype=dtype, device=device, **params)
        except variants.VariantError as exc:
            raise ScenarioError(f"{path}: {field}: parameters {quote(params)} at d_key={d_key}: {exc}") from None
        unsupported.update({(backend, dtype, device): reason for backend, reason in reasons.items() if reason is not None})
    return unsupported


def describe(cell: Cell) -> str:
    """A one-line name of a cell, for progress bars and listings."""
    params = ",".join(f"{key}={value}" for key, value in cell.params.items())
    axes = cell.axes
    skipped = " (skipped)" if cell.skip else ""
    shape = " ".join(f"{axis_table.SHORT.get(name, name)}={value}" for name, value in axes.items() if name not in axis_table.UNSHAPED)
    return f"{cell.variant}{'(' + params + ')' if params else ''}[{cell.backend}]{skipped} {cell.mode}/{cell.target} {shape} {axes['dtype']} {axes['device']}"

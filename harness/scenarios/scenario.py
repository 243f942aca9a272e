"""Scenarios: a YAML file read and merged with its preset and ``--set`` overrides
(``harness.scenarios.scenario_files``), validated (``harness.scenarios.schema``) and expanded into cells
(``harness.scenarios.expansion``). The public face: ``load_scenario``, ``check_scenario`` (all but the expansion,
torch-free), ``LoadedScenario``, ``ScenarioError``,
``resolve_path``, ``shipped``. README.md ("Scenario format") describes the file.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from pydantic import ValidationError

from . import scenario_files, validation
from .cell import Cell
from .expansion import check_cell_count
from .scenario_files import ScenarioError, resolve_path, shipped  # noqa: F401 (the public face)
from .schema import Scenario, scenario_model


def load_scenario(spec: str, *, preset: str | None = None, overrides: list[str] = ()) -> LoadedScenario:
    """Read, merge the preset and ``--set`` overrides, validate and expand a scenario."""
    loaded = check_scenario(spec, preset=preset, overrides=overrides)
    loaded.cells()
    return loaded


def check_scenario(spec: str, *, preset: str | None = None, overrides: list[str] = ()) -> LoadedScenario:
    """Read, merge the preset and ``--set`` overrides and validate a scenario, without loading torch (but for
    the checks of ``schema.Scenario._torch_checks``): every mistake of a name, field or value is a ScenarioError
    before torch loads. Its cells are expanded on the first ``cells()``."""
    path, data, raw = scenario_files.read(spec, preset, overrides)
    model = scenario_model(raw)
    try:
        scenario = model.model_validate(raw, context={"folder": path.parent})
    except ValidationError as exc:
        raise ScenarioError(validation.format_validation(str(path), exc, overrides, model)) from None
    check_cell_count(scenario, str(path))
    return LoadedScenario(scenario, None, path, hashlib.sha256(data).hexdigest(), preset, list(overrides))


class LoadedScenario:
    """A validated scenario, its cells (None: expanded on the first ``cells()``) and where it came from."""

    def __init__(self, scenario: Scenario, cells: list[Cell] | None, path: Path, sha256: str, preset: str | None, overrides: list[str]):
        self.scenario, self._cells, self.path, self.sha256 = scenario, cells, path, sha256
        self.preset, self.overrides = preset, overrides

    @property
    def name(self) -> str:
        return self.scenario.name

    def cells(self) -> list[Cell]:
        """Every cell (``expansion.expand``, which builds each configuration's torch core: a parameter that
        builds none, a d_dot a variant cannot reach, is a ScenarioError here)."""
        if self._cells is None:
            from .expansion import expand

            self._cells = expand(self.scenario, str(self.path))
        return self._cells

    def narrowed(self, cells: list[Cell]) -> LoadedScenario:
        """The same scenario, measuring only ``cells`` (some of its own: a budget's, a commit's cells left)."""
        return LoadedScenario(self.scenario, cells, self.path, self.sha256, self.preset, self.overrides)

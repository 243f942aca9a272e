"""Scenarios: a YAML file read and merged with its preset and ``--set`` overrides
(``harness.scenarios.scenario_files``), validated (``harness.scenarios.schema``) and expanded into cells
(``harness.scenarios.expansion``). The public face: ``load_scenario``, ``LoadedScenario``, ``ScenarioError``,
``resolve_path``, ``shipped``. README.md ("Scenario format") describes the file.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from pydantic import ValidationError

from . import scenario_files
from .cell import Cell
from .expansion import check_cell_count, expand
from .scenario_files import ScenarioError, resolve_path, shipped  # noqa: F401 (the public face)
from .schema import Scenario, scenario_model


def load_scenario(spec: str, *, preset: str | None = None, overrides: list[str] = ()) -> LoadedScenario:
    """Read, merge the preset and ``--set`` overrides, validate and expand a scenario."""
    path, data, raw = scenario_files.read(spec, preset, overrides)
    try:
        scenario = scenario_model().model_validate(raw, context={"folder": path.parent})
    except ValidationError as exc:
        raise ScenarioError(scenario_files.format_validation(str(path), exc)) from None
    check_cell_count(scenario, str(path))
    sha256 = hashlib.sha256(data).hexdigest()
    return LoadedScenario(scenario, expand(scenario, str(path)), path, sha256, preset, list(overrides))


class LoadedScenario:
    """A validated scenario, its expanded cells and where it came from."""

    def __init__(self, scenario: Scenario, cells: list[Cell], path: Path, sha256: str, preset: str | None, overrides: list[str]):
        self.scenario, self._cells, self.path, self.sha256 = scenario, cells, path, sha256
        self.preset, self.overrides = preset, overrides

    @property
    def name(self) -> str:
        return self.scenario.name

    def cells(self) -> list[Cell]:
        return self._cells

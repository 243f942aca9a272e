"""A cell: one variant configuration at one point of its axes, on one backend, in one mode;
what ``harness.scenarios.expansion.expand`` makes and every executor, worker and workload reads. Its
sections (``measure``, ``decode``, ``model``, ``task``) are the scenario's, validated by
``harness.scenarios.schema`` and carried as plain mappings, which is what its id hashes. Plain Python:
the report may import it without torch."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

#: The fields that always name what a cell measures (its id; ``backend_options`` and ``task`` too when set).
IDENTITY = ("scenario", "variant", "backend", "params", "axes", "mode", "target", "model")


@dataclasses.dataclass(frozen=True)
class Cell:
    scenario: str
    variant: str
    backend: str
    #: the scenario's ``backend_options`` this variant takes on this backend
    backend_options: dict[str, Any]
    #: the variant's parameters (``variants.create``'s keywords)
    params: dict[str, Any]
    #: axis name (harness.scenarios.axes) -> value
    axes: dict[str, Any]
    mode: str
    target: str
    decode: dict[str, Any]
    model: dict[str, Any] | None
    #: a quality cell's task config (its ``model_dump()``), with the cell's seed; None for a speed cell
    task: dict[str, Any] | None
    measure: dict[str, Any]
    #: why the cell is not measured (its backend cannot compute it); None: it is
    skip: str | None
    #: a packed batch's sequence lengths (None: every sequence is ``seq_len`` long)
    lengths: list[int] | None = None
    #: where a quality cell keeps its checkpoints (the runner's, beside the results file)
    checkpoint_dir: str | None = None
    #: the profile asked for (harness.measuring.profiling.request)
    profile: dict[str, Any] | None = None
    #: computed from the identity fields when not given (``cell_id``)
    cell_id: str = ""

    def __post_init__(self):
        if not self.cell_id:
            object.__setattr__(self, "cell_id", cell_id(self))

    @property
    def device(self) -> str:
        return str(self.axes["device"])

    @property
    def quality(self) -> bool:
        return self.mode == "quality"

    def replace(self, **changes) -> Cell:
        """This cell with ``changes`` (its id kept)."""
        return dataclasses.replace(self, **changes)

    def record(self) -> dict:
        """The cell's part of its results record (harness.results.cell_record)."""
        task = {"task": self.task} if self.task else {}
        names = ("cell_id", "scenario", "variant", "backend", "params", "axes")
        return {**{name: getattr(self, name) for name in names}, **task, "mode": self.mode, "target": self.target}


def cell_id(cell: Cell) -> str:
    """A stable id of what a cell measures (not how often): used to resume."""
    identity = {key: getattr(cell, key) for key in IDENTITY}
    if cell.backend_options:
        identity["backend_options"] = cell.backend_options
    if cell.task:
        identity["task"] = cell.task
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]

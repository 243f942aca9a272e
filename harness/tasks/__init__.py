"""Quality tasks: small models built on attnbench variants, trained and evaluated as one cell.

Every task registers itself once with ``register(Task(...))``: the model of a scenario's
``task:`` section, the axes of its cells, how one cell runs, and its own plots and tables in
the report. ``harness.scenarios.scenario``, ``harness.running.workloads`` and ``harness.report`` read this
registry and name no task; a plugin (``--plugin``) registers a task exactly as the shipped ones
do. docs/extending.md has the recipe.

A shipped task lives in three modules: ``<task>_report.py`` registers it and holds how its results
read (metrics, score, report sections), and names its config and run as ``"module:attribute"``
(``resolve``): the config in ``<task>_config.py``, torch-free, and the run in ``<task>.py``, which
trains. So the report, which reads results files only, never imports a model, a variant or the
training, and a scenario's ``task:`` section is checked before torch loads.

May import: common, measuring, models, report (a task's sections: ``figures``, ``seeds``), variants;
the typed cell (``scenarios.cell``) for its type only.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

#: The shipped tasks' registering modules, imported the first time the registry is read.
BUILTIN = tuple(f"harness.tasks.{task}_report" for task in ("retrieval", "mqar", "lm", "mt", "copy", "image_gen"))
_TASKS: dict[str, Task] = {}
_builtin_loaded = False

# Upper bounds of the sizes in a task's config: a value past one would take the machine's memory
# (or longer than anyone waits) and is refused when the scenario loads, naming the field.
MAX_VOCAB = 1 << 20  # tokens of a vocabulary (symbols, pairs of keys)
MAX_WIDTH = 1 << 16  # a model's width (d_model, d_ff)
MAX_LAYERS = 1 << 10  # layers, heads
MAX_BATCH = 1 << 16  # sequences or images per batch
MAX_LENGTH = 1 << 20  # tokens or pixels of one sequence
MAX_STEPS = 10**9  # steps, and step counts (eval_every, patience, ...)
MAX_SEED = 2**32 - 1

Steps = Annotated[int, Field(ge=1, le=MAX_STEPS)]
Seed = Annotated[int, Field(ge=0, le=MAX_SEED, description="seed of the initialisation and the data")]


def one_of(table, what: str) -> AfterValidator:
    """A config field's check that its value names an entry of ``table`` (a preset, a data set): "expected WHAT among ..."."""

    def check(value):
        if value not in table:
            raise ValueError(f"expected {what} among {', '.join(table)}")
        return value

    return AfterValidator(check)


class TaskConfig(BaseModel):
    """The base of every task's config (a scenario's ``task:`` section): unknown keys are
    refused, numbers must be numbers (``steps: true`` or ``lr: "1e-3"`` is refused, not taken
    as 1 or 0.001; the command line of a task converts its options' text itself), and no number
    is infinite or NaN. Bounded fields use the ``MAX_*`` limits above."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def _d_key_axis(config, axes: dict) -> list[int]:
    return axes["d_key"]


@dataclass(frozen=True)
class Score:
    """A task's headline quality metric: which way is better and, optionally, the value a cell
    must reach to count as having learnt the task (MQAR: accuracy ≥ 0.9). The report aggregates
    it over seeds (seeds that passed) and puts it against speed (the quality–speed frontier).

    ``stop_field`` names a field of the task's config at which training stops (retrieval:
    ``target_loss``). It is then each cell's threshold, and values past it tie: how far past
    the target the last evaluation landed is chance, not quality, so the frontier compares
    such cells by speed alone."""

    metric: str
    higher_is_better: bool
    threshold: float | None = None
    stop_field: str | None = None

    def values(self, cells):
        """Each cell's metric (``metrics.<metric>``) as floats, NaN where missing."""
        import pandas as pd

        return pd.to_numeric(cells[f"metrics.{self.metric}"], errors="coerce")

    def thresholds(self, cells):
        """Each cell's threshold: ``task.<stop_field>``, else ``threshold``; NaN where there is none."""
        import pandas as pd

        column = f"task.{self.stop_field}"
        if self.stop_field is not None and column in cells:
            return pd.to_numeric(cells[column], errors="coerce")
        return pd.Series(float("nan") if self.threshold is None else self.threshold, index=cells.index, dtype=float)

    def passed(self, cells):
        """Whether each cell's metric reaches its threshold (never, without one)."""
        values, thresholds = self.values(cells), self.thresholds(cells)
        return values >= thresholds if self.higher_is_better else values <= thresholds

    def compared(self, cells):
        """Each cell's metric as the frontier compares it: past a ``stop_field`` threshold, the
        threshold itself (a tie); everywhere else the metric unchanged."""
        values = self.values(cells)
        if self.stop_field is None:
            return values
        past = self.passed(cells)
        return values.where(~past, self.thresholds(cells))

    def has_threshold(self) -> bool:
        """Whether a cell can pass: a fixed ``threshold`` or a ``stop_field``."""
        return self.threshold is not None or self.stop_field is not None

    def describe(self) -> str:
        """``accuracy ≥ 0.9``, ``valid_ppl ≤ 100``, ``loss ≤ target_loss``."""
        bound = self.stop_field if self.stop_field is not None else f"{self.threshold:g}"
        return f"{self.metric} {'≥' if self.higher_is_better else '≤'} {bound}"


@dataclass(frozen=True)
class Task:
    """One kind of quality cell.

    - ``name``: the scenario's ``task.name``, and its cells' ``target``.
    - ``config``: a pydantic model of the ``task:`` section (a ``TaskConfig``) whose first field
      is ``name: Literal[name]``; a cell carries its ``model_dump()`` as ``cell.task``. It and
      ``run`` may be given as ``"module:attribute"``, imported when first needed (``resolve``).
    - ``axes``: the axes of its cells (``dtype`` and ``device`` come with every task); the
      first is what its results are plotted against. An axis that is not one of the speed
      axes (``harness.scenarios.schema.AXES``) takes positive integers.
    - ``run(cell) -> metrics``: train and evaluate one cell (a ``harness.scenarios.cell.Cell``: its variant,
      params, backend, axes and task); a ``loss`` metric that is not finite marks
      the cell ``nan``.
    - ``d_keys(config, axes) -> [d_key, ...]``: the head widths its variants are built with,
      from the config and the swept axis values (lists); every variant configuration is built at
      each when the scenario is loaded, so an impossible one fails before anything runs.
    - ``any_device``: runs on a GPU too (else on the CPU only); every task trains in each dtype of
      ``harness.tasks.precision`` (``axes.dtype``: float32, bfloat16, float16).
    - ``metrics``: the columns it fills in the report's quality table, in order.
    - ``report(cells, figures, name) -> [Plot | Table]``: its own plots and tables, given the
      report's cells of this task (``harness.report.figures``); ``name`` prefixes plot file names.
    - ``score``: its headline metric (``Score``), aggregated over seeds and set against speed
      in the report; none: the report shows no seed summary or frontier for it.

    Every task whose config has a ``seed`` field can sweep it: ``axes: {seed: [0, 1, 2]}``.
    """

    name: str
    config: type | str
    axes: tuple[str, ...]
    run: Callable[[dict], dict] | str
    d_keys: Callable[[Any, dict], list[int]] = _d_key_axis
    any_device: bool = False
    metrics: tuple[str, ...] = ()
    report: Callable[..., list] | None = None
    score: Score | None = None


def resolve(reference):
    """``reference`` itself, or the attribute a ``"module:attribute"`` text names, imported now."""
    if not isinstance(reference, str):
        return reference
    module, _, attribute = reference.partition(":")
    return getattr(importlib.import_module(module), attribute)


def register(task: Task) -> Task:
    """Make ``task`` known to scenarios, the runner and the report."""
    if task.name in _TASKS:
        raise ValueError(f"task {task.name!r} is registered twice")
    _TASKS[task.name] = task
    return task


def _load_builtin() -> None:
    global _builtin_loaded
    if not _builtin_loaded:
        _builtin_loaded = True
        for module in BUILTIN:
            importlib.import_module(module)


def names() -> list[str]:
    """The registered task names, the shipped ones first."""
    _load_builtin()
    return list(_TASKS)


def get(name: str) -> Task:
    """The task registered as ``name``; KeyError naming the known ones otherwise."""
    _load_builtin()
    if name not in _TASKS:
        raise KeyError(f"unknown task {name!r}; known tasks: {', '.join(_TASKS)} (a plugin registers more with harness.tasks.register)")
    return _TASKS[name]


def tasks() -> list[Task]:
    """Every registered task, the shipped ones first."""
    _load_builtin()
    return list(_TASKS.values())

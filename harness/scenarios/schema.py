"""The scenario schema: a YAML file's fields as pydantic models, and every check of them (each
error names the file, the field path, the value and what was expected). ``harness.scenarios.scenario_files``
reads the file, ``harness.scenarios.expansion`` expands a validated scenario into cells, ``harness.scenarios.scenario``
loads one (all three). The axes are listed in ``harness.scenarios.axes``; ``harness.scenarios.lengths`` draws packed
batches. See README.md ("Scenario format") for the full format.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, ValidationInfo, create_model, field_validator, model_validator
from pydantic import Strict as PydanticStrict

from variants.errors import did_you_mean
from variants.params import BACKENDS, refusal, variant_names

from .. import tasks
from ..common.formatting import quote
from ..measuring.timings import CPU_TIMINGS, DECODE_TIMINGS, MAX_SAMPLES, TIMINGS
from ..models import LM_PRESETS, lm_config
from ..tasks import precision
from . import axes as axis_table
from . import lengths, scenario_files, validation
from .scenario_files import SEED_AXIS

DTYPES = ("float32", "float16", "bfloat16", "float64")
MODES = ("forward", "train", "decode")
AXES = axis_table.SPEED
#: The targets every scenario can measure; each registered task (harness.tasks) adds its name.
SPEED_TARGETS = ("core", "layer", "model")
#: How a packed batch (axes.lengths) runs: one row with cu_seqlens, or a dense batch padded to the longest.
PACKINGS = ("packed", "padded")
#: The key of a variant configuration that holds its own axes (``variants.linear.axes.S``).
VARIANT_AXES = "axes"


Scalar = Union[int, float, str, bool, None]
Sweep = Union[Scalar, list[Scalar]]
#: An axis value: an integer, never a bool or a float that YAML or --set turned into one.
AxisInt = Annotated[int, PydanticStrict()]
#: A scenario's name becomes a file name (``results/<name>-<time>.jsonl``).
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
#: The longest scenario name: ``<name>-<time>.jsonl`` must fit a file name (255 bytes on most file systems).
NAME_MAX_BYTES = 200
#: What a cell does: time a call (forward), a training step (train), decoding steps (decode), or train a task (quality).
MODES = ("forward", "train", "decode", "quality")
#: The longest time a setting may give in seconds (a week): longer ones overflow timers and alarms.
MAX_SECONDS = 7 * 24 * 3600.0
#: The most tokens a decode cell generates (its steps' latencies are kept one by one).
MAX_NEW_TOKENS = 1 << 16


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StrictSettings(Strict):
    """Settings whose numbers are numbers: ``repeats: true`` or ``timeout_s: "60"`` is refused, not taken as 1 or 60."""

    model_config = ConfigDict(extra="forbid", strict=True)


def _positive_ints(value):
    """A positive integer or a non-empty list of them (None passes: an axis left out)."""
    for item in value if isinstance(value, list) else [value]:
        if item is not None and item < 1:
            raise ValueError(f"expected positive integers, got {item}")
    if isinstance(value, list) and not value:
        raise ValueError("expected at least one value")
    return value


class Axes(BaseModel):
    """The speed axes; a task's own axes (``harness.tasks.Task.axes``) come as extra fields of
    positive integers, checked against the scenario's task (``Scenario._task_axes``)."""

    model_config = ConfigDict(extra="allow")

    seq_len: AxisInt | list[AxisInt] | None = None
    batch: AxisInt | list[AxisInt] = 1
    heads: AxisInt | list[AxisInt] = 8
    d_key: AxisInt | list[AxisInt] = 64
    d_value: AxisInt | list[AxisInt] | None = None
    dtype: str | list[str] = "float32"
    device: str | list[str] = "cpu"
    d_dot: AxisInt | list[AxisInt] | None = None
    lengths: Any = None
    packing: str | list[str] | None = None
    head_ratio: AxisInt | list[AxisInt] | None = None

    @field_validator("seq_len", "batch", "heads", "d_key", "d_value", "d_dot", "head_ratio")
    @classmethod
    def _positive(cls, value):
        return _positive_ints(value)

    @field_validator("packing")
    @classmethod
    def _packing(cls, value):
        for item in value if isinstance(value, list) else [value]:
            if item is not None and item not in PACKINGS:
                raise ValueError(f"expected {' or '.join(PACKINGS)}, got {quote(item)}")
        return value

    @field_validator("dtype", "device", "packing")
    @classmethod
    def _not_empty(cls, value):
        if value == []:
            raise ValueError("expected at least one value")
        return value

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, value):
        for item in value if isinstance(value, list) else [value]:
            if item not in DTYPES:
                raise ValueError(f"expected one of {', '.join(DTYPES)}, got {quote(item)}")
        return value

    @field_validator("device")
    @classmethod
    def _device(cls, value):
        for item in value if isinstance(value, list) else [value]:
            kind, _, index = item.partition(":")
            if kind not in ("cpu", "cuda") or (index and not index.isdigit()) or (kind == "cpu" and index):
                raise ValueError(f"expected 'cpu', 'cuda' or 'cuda:N', got {quote(item)}")
        return value


class Measure(StrictSettings):
    warmup: int = Field(2, ge=0, le=MAX_SAMPLES)
    repeats: int = Field(7, ge=1, le=MAX_SAMPLES, description="the fewest timed samples; sampling goes on until target_rel_ci or max_time_s")
    target_rel_ci: float | None = Field(
        0.05, gt=0, description="sample until the 95 % bootstrap interval of the median is within ± this fraction of it; null: exactly repeats"
    )
    max_time_s: float = Field(
        2.0, ge=0, le=MAX_SECONDS, description="seconds of sampling per cell after which a cell that has not reached target_rel_ci stops (unstable)"
    )
    cpus: list[Annotated[int, Field(ge=0)]] | None = Field(None, min_length=1, description="pin the worker to these CPUs (os.sched_setaffinity)")
    timeout_s: float = Field(900.0, gt=0, le=MAX_SECONDS, description="a cell running longer is stopped and recorded as an error")
    flush_l2: bool = True
    fresh_worker: bool | None = Field(
        None, description="a new worker process for each cell; default: CPU speed cells (exact peak RSS), compile cells (compile_s from nothing compiled)"
    )
    max_memory: int | None = Field(None, ge=1 << 20, description="bytes of host memory a worker may take (a cell over it: oom); null: 80 % of RAM on the CPU")
    timing: Literal[TIMINGS] = Field("events", description="what one sample times: events, cudagraph, profiler or wall (docs/profiling.md)")


class Decode(StrictSettings):
    new_tokens: int = Field(64, ge=1, le=MAX_NEW_TOKENS, description="steps timed after the prefill (each a Python call; the state or cache grows with them)")


class Rules(StrictSettings):
    tokens_per_batch: int | None = Field(None, ge=1, description="batch = max(1, tokens_per_batch // seq_len)")


class Exclusion(StrictSettings):
    """Cells the sweep leaves out: those matching every field given (each a name or a list of names), e.g.
    ``{backend: fla, mode: train}`` keeps fla's forward cells only."""

    variant: str | list[str] | None = None
    backend: str | list[str] | None = None
    mode: str | list[str] | None = None

    @model_validator(mode="after")
    def _names_a_field(self):
        if not self.fields():
            raise ValueError("expected at least one of variant, backend, mode")
        return self

    def fields(self) -> dict[str, list[str]]:
        """The given fields, each as a list of names."""
        return {key: sweep(value) for key, value in self.model_dump().items() if value is not None}

    def matches(self, variant: str, backend: str, mode: str) -> bool:
        cell = {"variant": variant, "backend": backend, "mode": mode}
        return all(cell[key] in names for key, names in self.fields().items())


class ReportSpec(StrictSettings):
    baseline_backend: str | None = Field(None, description="the report shows each backend's time as a ratio to this backend's, per variant")


class ModelSpec(StrictSettings):
    preset: str = "small"
    vocab_size: int = Field(32000, ge=2)
    overrides: dict[str, Any] = {}

    @model_validator(mode="after")
    def _cell_fields(self):
        """The cell sets variant and variant_params (the preset and the other overrides: ``Scenario._torch_checks``)."""
        taken = [key for key in ("variant", "variant_params") if key in self.overrides]
        if taken:
            raise ValueError(f"model.overrides.{taken[0]}: set by each cell (its variant and parameters), not by an override")
        return self

    def check_config(self) -> None:
        """The preset and override fields are the LM config's (``harness.models``)."""
        if self.preset not in LM_PRESETS:
            raise ValueError(f"model.preset: expected one of {', '.join(LM_PRESETS)}, got {quote(self.preset)}{did_you_mean(self.preset, LM_PRESETS)}")
        try:
            lm_config(self.preset, self.vocab_size, **self.overrides)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"model.overrides: {exc}") from None


class Scenario(Strict):
    """A scenario file. ``task`` is validated against the registered tasks' configs
    (``scenario_model`` builds the model that knows them)."""

    name: str
    description: str = ""
    variants: dict[str, dict[str, Sweep | dict[str, Any]] | list[dict[str, Sweep | dict[str, Any]]] | None]
    backends: list[str] = Field(["torch"], min_length=1)
    backend_options: dict[str, Any] = Field({}, description="backend options: compile's mode and dynamic, softmax's sdpa (torch, compile)")
    axes: Axes
    modes: list[Literal[MODES]] = Field(["forward"], min_length=1)
    target: str = "core"
    task: Any = None
    decode: Decode = Decode()
    measure: Measure = Measure()
    rules: Rules = Rules()
    model: ModelSpec | None = None
    exclude: list[Exclusion] = Field([], description="cells left out of the sweep: those matching every field of an entry")
    presets: dict[str, dict[str, Any]] = {}
    report: ReportSpec = ReportSpec()
    _folder: Path | None = PrivateAttr(None)

    @model_validator(mode="before")
    @classmethod
    def _finite_numbers(cls, raw):
        """Every number in the file is finite: a NaN or infinite parameter, axis or setting
        would otherwise reach a measurement (or the results file) before it failed."""
        for path, value in scenario_files.numbers(raw):
            if not math.isfinite(value):
                raise ValueError(f"{path}: expected a finite number, got {value}")
        return raw

    @field_validator("name")
    @classmethod
    def _file_name(cls, value):
        if not re.match(NAME_PATTERN, value):
            raise ValueError("expected letters, digits, '.', '_' and '-', starting with a letter or digit (it names the results file)")
        if len(value.encode()) > NAME_MAX_BYTES:
            raise ValueError(f"expected at most {NAME_MAX_BYTES} characters, got {len(value.encode())} (it names the results file, <name>-<time>.jsonl)")
        return value

    @field_validator("variants")
    @classmethod
    def _known_variants(cls, value):
        """Registered names (``variants.params``: the shipped ones without loading torch, a plugin's once it registered)."""
        known = variant_names()
        unknown = [name for name in value if name not in known]
        if unknown:
            raise ValueError(f"variants.{unknown[0]}: unknown variant{did_you_mean(unknown[0], known)}; known: {', '.join(known)}")
        if not value:
            raise ValueError("expected at least one variant")
        return value

    @field_validator("backends")
    @classmethod
    def _known_backends(cls, value):
        for backend in value:
            if backend not in BACKENDS:
                raise ValueError(f"expected backends among {', '.join(BACKENDS)}, got {quote(backend)}")
        return value

    @model_validator(mode="after")
    def _exclusions(self):
        """Each exclusion names known variants, backends and modes (a typo would leave nothing out); a preset may
        drop what one names (the ci preset of a GPU scenario: its torch cells only)."""
        known = {"variant": variant_names(), "backend": BACKENDS, "mode": MODES}
        for i, exclusion in enumerate(self.exclude):
            for key, names in exclusion.fields().items():
                unknown = [name for name in names if name not in known[key]]
                if unknown:
                    close = did_you_mean(unknown[0], known[key])
                    raise ValueError(f"exclude.{i}.{key}: expected one of {', '.join(known[key])}, got {quote(unknown[0])}{close}")
        return self

    @model_validator(mode="after")
    def _baseline_backend(self):
        baseline = self.report.baseline_backend
        if baseline is not None and baseline not in self.backends:
            raise ValueError(f"report.baseline_backend: expected one of the scenario's backends ({', '.join(self.backends)}), got {quote(baseline)}")
        return self

    @model_validator(mode="after")
    def _timing(self):
        """``measure.timing`` fits the cells: a speed scenario's; ``cudagraph`` and ``profiler`` time one
        call (not decode's steps); ``cudagraph`` replays a CUDA graph (no CPU device, a variant's own axes included)."""
        timing = self.measure.timing
        if timing == "events":
            return self
        if self.task is not None:
            raise ValueError(f"measure.timing: a quality task times its own training (words/s), not {timing!r}; leave it at 'events'")
        if timing not in DECODE_TIMINGS and "decode" in self.modes:
            raise ValueError(f"measure.timing: {timing!r} times one call; decode cells (modes) time each step with {' or '.join(DECODE_TIMINGS)}")
        configs = [(field, params) for name, spec in self.variants.items() for field, params in configurations(name, spec)]
        devices = {device for field, params in configs for device in sweep(variant_axes(self, params.get(VARIANT_AXES), f"{field}.{VARIANT_AXES}").device)}
        if timing == "cudagraph" and "cpu" in devices:
            raise ValueError(f"measure.timing: 'cudagraph' replays a CUDA graph and needs a CUDA device; axes.device has 'cpu' ({CPU_TIMINGS})")
        return self

    @field_validator("target")
    @classmethod
    def _known_target(cls, value):
        known = SPEED_TARGETS + tuple(tasks.names())
        if value not in known:
            raise ValueError(f"expected one of {', '.join(known)}, got {quote(value)}")
        return value

    @model_validator(mode="after")
    def _model_target(self):
        if self.target == "model" and self.model is None:
            raise ValueError("target 'model' needs a 'model' section (preset, vocab_size)")
        return self

    @model_validator(mode="after")
    def _task_or_sequence(self):
        if self.task is None:
            if self.axes.seq_len is None and self.axes.lengths is None:
                raise ValueError("axes.seq_len (or axes.lengths) is required (or a 'task' section)")
            if "quality" in self.modes or self.target not in SPEED_TARGETS:
                raise ValueError(f"mode 'quality' and the task targets ({', '.join(tasks.names())}) need a 'task' section")
            return self
        task = tasks.get(self.task.name)
        needed = [axis for axis in task.axes if getattr(self.axes, axis, None) is None]
        if needed or self.modes != ["quality"] or self.target != task.name:
            axes = "".join(f"axes.{axis}, " for axis in task.axes)
            raise ValueError(f"a {task.name} task scenario needs {axes}modes: [quality] and target: {task.name}")
        return self

    @model_validator(mode="after")
    def _packed_axes(self, info: ValidationInfo):
        """``axes.lengths``, ``packing`` and ``head_ratio`` (``check_packed_axes``); histogram files
        relative to the scenario's folder (the validation context's ``folder``)."""
        self._folder = (info.context or {}).get("folder")
        check_packed_axes(self, self.axes, "axes")
        return self

    @model_validator(mode="after")
    def _task_axes(self):
        """Extra axes are a task's own: only those its task declares, each positive integers, and
        ``seed`` (integers ≥ 0) for a task whose config has a seed."""
        _check_extra_axes(self.task, self.axes.model_extra or {}, "axes")
        return self

    @model_validator(mode="after")
    def _variant_axes(self):
        """A variant configuration's own ``axes`` replace those of the scenario for its cells
        (a task's axis placed around each variant's capacity); each is an axis the scenario
        has, valid as the scenario's own would be."""
        for name, spec in self.variants.items():
            if spec == []:
                raise ValueError(f"variants.{name}: expected at least one configuration, got an empty list")
            for field, params in configurations(name, spec):
                for key, value in params.items():
                    if value == []:
                        raise ValueError(f"{field}.{key}: expected at least one value, got an empty list")
                    if isinstance(value, dict) and key != VARIANT_AXES:
                        raise ValueError(f"{field}.{key}: expected a value or a list of values, got a mapping (only '{VARIANT_AXES}' holds one)")
                if VARIANT_AXES in params:
                    variant_axes(self, params[VARIANT_AXES], f"{field}.{VARIANT_AXES}")
        return self

    @model_validator(mode="after")
    def _variant_parameters(self):
        """Each configuration's parameters are its variant's, each value one it accepts (``variants.params``,
        without torch: a value that builds no core, a d_dot it cannot reach, is found at expansion)."""
        for name, spec in self.variants.items():
            for field, params in configurations(name, spec):
                for key, value in params.items():
                    if key in (VARIANT_AXES, "d_key"):  # the configuration's axes; its own d_key (expansion)
                        continue
                    for item in sweep(value):
                        if (problem := refusal(name, {key: item})) is not None:
                            raise ValueError(f"{field}: {problem}")
        return self

    @model_validator(mode="after")
    def _torch_checks(self):
        """The checks that need the fields checked before them (a validator runs only when those before it passed):
        the LM config of ``model``, a quality task's training dtypes (``harness.tasks.precision``), and, last, the
        backend options (the variants' own), which load torch, so that every other mistake is answered before."""
        if self.model is not None:
            self.model.check_config()
        if self.task is not None:
            for field, axes in [("axes", self.axes), *_own_axes(self)]:
                _training_dtypes(axes, field)
        _check_backend_options(self.backend_options)
        return self


def _check_extra_axes(task_config, extra: dict, prefix: str) -> None:
    """A scenario's extra axes (at ``prefix``) are its task's own, positive integers, or ``seed``."""
    declared = tasks.get(task_config.name).axes if task_config is not None else ()
    for axis, value in extra.items():
        if axis == SEED_AXIS:
            _check_seeds(task_config, value, f"{prefix}.{axis}")
            continue
        if axis not in declared:
            own = ", ".join(f"{task.name}: {', '.join(a for a in task.axes if a not in Axes.model_fields) or '-'}" for task in tasks.tasks())
            speed = ", ".join(Axes.model_fields)
            raise ValueError(f"{prefix}.{axis}: not an axis of this scenario (got {quote(value)}; speed axes: {speed}; task axes: {own})")
        items = value if isinstance(value, list) else [value]
        if not items or not all(isinstance(item, int) and not isinstance(item, bool) and item >= 1 for item in items):
            raise ValueError(f"{prefix}.{axis}: expected positive integers, got {quote(value)}")


def variant_axes(scenario: Scenario, override: dict | None, field: str) -> Axes:
    """The axes of one variant configuration: the scenario's, with the configuration's own
    ``axes`` (at ``field``) in place of those it names."""
    if not override:
        return scenario.axes
    if not isinstance(override, dict):
        raise ValueError(f"{field}: expected a mapping of axis names to values, got {quote(override)}")
    current = scenario.axes.model_dump(exclude_unset=True)  # unset: still unset (axes.batch beside axes.lengths)
    task = tasks.get(scenario.task.name) if scenario.task else None
    own = axis_names(task, scenario.axes) + (() if task else ("d_dot", *axis_table.OPTIONAL))
    unknown = [axis for axis in override if axis not in own]
    if unknown:
        raise ValueError(f"{field}.{unknown[0]}: the scenario has no such axis to replace (its axes: {', '.join(own)})")
    try:
        merged = Axes.model_validate({**current, **override})
    except ValidationError as exc:
        raise ValueError(f"{field}.{validation.plain_errors(exc, Axes)[0]}") from None
    _check_extra_axes(scenario.task, {axis: value for axis, value in override.items() if axis not in Axes.model_fields}, field)
    check_packed_axes(scenario, merged, field)
    return merged


def _own_axes(scenario: Scenario) -> list[tuple[str, Axes]]:
    """(field, axes) of each variant configuration that has its own ``axes``."""
    return [
        (f"{field}.{VARIANT_AXES}", variant_axes(scenario, params[VARIANT_AXES], f"{field}.{VARIANT_AXES}"))
        for name, spec in scenario.variants.items()
        for field, params in configurations(name, spec)
        if params.get(VARIANT_AXES)
    ]


def _check_backend_options(options: dict) -> None:
    """``backend_options``: each an option of a backend (``compile``'s) or of the cores it runs (softmax's ``sdpa``)."""
    if not options:
        return
    import variants

    owners = variants.backend_option_owners()
    for option, setting in options.items():
        if option not in owners:
            known = ", ".join(f"{name} ({'/'.join(backends)})" for name, backends in owners.items())
            raise ValueError(f"backend_options.{option}: unknown option{did_you_mean(option, owners)}; backend options: {known}")
        try:
            variants.check_backend_options(owners[option][0], {option: setting})
        except variants.VariantError as exc:
            raise ValueError(f"backend_options.{option}: {exc}") from None


def check_packed_axes(scenario: Scenario, axes: Axes, field: str) -> list[lengths.Batch] | None:
    """The packed batches of ``axes.lengths`` (None without), checked with ``packing`` and
    ``head_ratio`` (at ``field``): attention cores only, in place of seq_len and batch; a
    ``head_ratio`` divides every ``heads``. Histogram files are read from the scenario's folder."""
    given = [axis for axis in axis_table.OPTIONAL if getattr(axes, axis) is not None]
    if given and (scenario.task is not None or scenario.target != "core"):
        raise ValueError(f"{field}.{given[0]}: measured on attention cores only (target: core), not {quote(scenario.target)}")
    for ratio in sweep(axes.head_ratio):
        for heads in sweep(axes.heads) if ratio is not None else ():
            if heads % ratio:
                raise ValueError(f"{field}.head_ratio: expected a divisor of every heads, got {ratio} for heads={heads}")
    if axes.lengths is None:
        if axes.packing is not None:
            raise ValueError(f"{field}.packing: packs the sequences of axes.lengths, which is not set")
        return None
    taken = [axis for axis in ("seq_len", "batch") if axis in axes.model_fields_set] + (["rules.tokens_per_batch"] if scenario.rules.tokens_per_batch else [])
    if taken:
        raise ValueError(f"{field}.lengths: gives each cell's sequences, so {taken[0]} must not be set (got {quote(getattr(axes, taken[0], None))})")
    return lengths.parse(axes.lengths, f"{field}.lengths", scenario._folder)


def _training_dtypes(axes: Axes, field: str) -> None:
    """A quality cell trains in one of the dtypes of the policy (``harness.tasks.precision``)."""
    for dtype in sweep(axes.dtype):
        try:
            precision.check(dtype)
        except ValueError as exc:
            raise ValueError(f"{field}.dtype: {exc}") from None


def _check_seeds(task_config, value, field: str = f"axes.{SEED_AXIS}") -> None:
    """``axes.seed``: integers ≥ 0, in a scenario whose task config has a ``seed`` field."""
    if task_config is None or "seed" not in type(task_config).model_fields:
        where = "a speed scenario" if task_config is None else f"the {task_config.name} task, whose config has no seed field"
        raise ValueError(f"{field}: seeds sweep a quality task's seed; {where} has none")
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(item, int) and not isinstance(item, bool) and item >= 0 for item in items):
        raise ValueError(f"{field}: expected integers >= 0, got {quote(value)}")
    if len(set(items)) != len(items):
        raise ValueError(f"{field}: a seed is listed twice in {quote(value)}")


def sweep(value) -> list:
    return value if isinstance(value, list) else [value]


def configurations(name: str, spec) -> list[tuple[str, dict]]:
    """(field path, parameters) of each configuration written under ``variants.<name>``."""
    specs = spec if isinstance(spec, list) else [spec or {}]
    return [(f"variants.{name}" + (f"[{index}]" if isinstance(spec, list) else ""), params or {}) for index, params in enumerate(specs)]


def axis_names(task, axes: Axes) -> tuple[str, ...]:
    """The axes a scenario's cells carry: a task's own (with dtype, device and any seeds), or the speed
    axes with those of ``axis_table.OPTIONAL`` it sets (``packing`` wherever ``lengths`` is)."""
    if task is None:
        return AXES + tuple(axis for axis in axis_table.OPTIONAL if getattr(axes, axis) is not None or (axis == "packing" and axes.lengths is not None))
    return (*task.axes, "dtype", "device", *([SEED_AXIS] if (axes.model_extra or {}).get(SEED_AXIS) is not None else []))


_MODELS: dict[tuple, type[Scenario]] = {}


def scenario_model(raw: dict | None = None) -> type[Scenario]:
    """The model of a scenario ``raw``: ``Scenario`` itself where it has no ``task`` section (a speed scenario), else
    ``Scenario`` whose ``task`` is one of the registered tasks' configs, told apart by ``task.name`` (errors read
    ``task.<name>.<field>``); the shipped ones are torch-free (``harness.tasks.<task>_config``)."""
    if raw is not None and raw.get("task") is None:
        return Scenario
    configs = tuple(tasks.resolve(task.config) for task in tasks.tasks())
    if configs not in _MODELS:
        union = Annotated[Union[configs], Field(discriminator="name")] if len(configs) > 1 else configs[0]
        _MODELS[configs] = create_model("Scenario", __base__=Scenario, task=(union | None, None))
    return _MODELS[configs]

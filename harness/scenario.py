"""Scenarios: YAML files validated with pydantic and expanded into cells.

A scenario names variants (with parameters; a list value sweeps), backends, axes (each a
value or a list to sweep), modes, measurement settings, optional rules and presets. See
README.md ("Scenario format") for the full format. Every error names the file, the field
path, the value and what was expected.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import math
import os
import re
import stat
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator
from pydantic import Strict as PydanticStrict

import variants

from . import tasks
from .formatting import quote
from .measure import CPU_TIMINGS, DECODE_TIMINGS, MAX_SAMPLES, TIMINGS
from .models import LM_PRESETS, lm_config
from .tasks import precision

SCENARIO_DIR = Path(__file__).resolve().parent.parent / "scenarios"
DTYPES = ("float32", "float16", "bfloat16", "float64")
MODES = ("forward", "train", "decode")
BACKENDS = variants.BACKENDS
AXES = ("seq_len", "batch", "heads", "d_key", "d_value", "dtype", "device")
#: The targets every scenario can measure; each registered task (harness.tasks) adds its name.
SPEED_TARGETS = ("core", "layer", "model")
#: The axis that sweeps a quality task's ``seed`` (its cells then carry it in ``axes`` and ``task``).
SEED_AXIS = "seed"
#: The key of a variant configuration that holds its own axes (``variants.linear.axes.S``).
VARIANT_AXES = "axes"


class ScenarioError(ValueError):
    """A scenario that cannot be run: the message names the file, field, value and expectation."""


Scalar = Union[int, float, str, bool, None]
Sweep = Union[Scalar, list[Scalar]]
#: An axis value: an integer, never a bool or a float that YAML or --set turned into one.
AxisInt = Annotated[int, PydanticStrict()]
#: A scenario's name becomes a file name (``results/<name>-<time>.jsonl``).
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
#: The longest scenario name: ``<name>-<time>.jsonl`` must fit a file name (255 bytes on most file systems).
NAME_MAX_BYTES = 200
#: The longest time a setting may give in seconds (a week): longer ones overflow timers and alarms.
MAX_SECONDS = 7 * 24 * 3600.0
#: How deep a scenario's mappings and lists may nest.
MAX_DEPTH = 64
#: Limits on the work a scenario may ask for: (environment variable, default). The variable raises or lowers a limit.
MAX_FILE_BYTES = ("ATTNBENCH_MAX_SCENARIO_BYTES", 1_000_000)
MAX_NODES = ("ATTNBENCH_MAX_SCENARIO_NODES", 100_000)
MAX_CELLS = ("ATTNBENCH_MAX_CELLS", 100_000)
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

    @field_validator("seq_len", "batch", "heads", "d_key", "d_value", "d_dot")
    @classmethod
    def _positive(cls, value):
        return _positive_ints(value)

    @field_validator("dtype", "device")
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
    fresh_worker: bool | None = Field(None, description="a new worker process for each cell; default: for CPU speed cells (exact peak RSS), not on a GPU")
    max_memory: int | None = Field(None, ge=1 << 20, description="bytes of host memory a worker may take (a cell over it: oom); null: 80 % of RAM on the CPU")
    timing: Literal[TIMINGS] = Field("events", description="what one sample times: events, cudagraph, profiler or wall (docs/profiling.md)")


class Decode(StrictSettings):
    new_tokens: int = Field(64, ge=1, le=MAX_NEW_TOKENS, description="steps timed after the prefill (each a Python call; the state or cache grows with them)")


class Rules(StrictSettings):
    tokens_per_batch: int | None = Field(None, ge=1, description="batch = max(1, tokens_per_batch // seq_len)")


class ReportSpec(StrictSettings):
    baseline_backend: str | None = Field(None, description="the report shows each backend's time as a ratio to this backend's, per variant")


class ModelSpec(StrictSettings):
    preset: str = "small"
    vocab_size: int = Field(32000, ge=2)
    overrides: dict[str, Any] = {}

    @model_validator(mode="after")
    def _known_model(self):
        """The preset and override fields are the LM config's (``harness.models``); the cell sets variant and variant_params."""
        if self.preset not in LM_PRESETS:
            raise ValueError(f"model.preset: expected one of {', '.join(LM_PRESETS)}, got {quote(self.preset)}")
        taken = [key for key in ("variant", "variant_params") if key in self.overrides]
        if taken:
            raise ValueError(f"model.overrides.{taken[0]}: set by each cell (its variant and parameters), not by an override")
        try:
            lm_config(self.preset, self.vocab_size, **self.overrides)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"model.overrides: {exc}") from None
        return self


class Scenario(Strict):
    """A scenario file. ``task`` is validated against the registered tasks' configs
    (``scenario_model`` builds the model that knows them)."""

    name: str
    description: str = ""
    variants: dict[str, dict[str, Sweep | dict[str, Any]] | list[dict[str, Sweep | dict[str, Any]]] | None]
    backends: list[str] = Field(["torch"], min_length=1)
    backend_options: dict[str, Any] = Field({}, description="backend options: compile's mode and dynamic, softmax's sdpa (torch, compile)")
    axes: Axes
    modes: list[Literal["forward", "train", "decode", "quality"]] = Field(["forward"], min_length=1)
    target: str = "core"
    task: Any = None
    decode: Decode = Decode()
    measure: Measure = Measure()
    rules: Rules = Rules()
    model: ModelSpec | None = None
    presets: dict[str, dict[str, Any]] = {}
    report: ReportSpec = ReportSpec()

    @model_validator(mode="before")
    @classmethod
    def _finite_numbers(cls, raw):
        """Every number in the file is finite: a NaN or infinite parameter, axis or setting
        would otherwise reach a measurement (or the results file) before it failed."""
        for path, value in _numbers(raw):
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
        unknown = [name for name in value if name not in variants.names()]
        if unknown:
            raise ValueError(f"unknown variant {quote(unknown[0])}; known: {', '.join(variants.names())}")
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

    @field_validator("backend_options")
    @classmethod
    def _backend_options(cls, value):
        owners = variants.backend_option_owners()
        for option, setting in value.items():
            if option not in owners:
                known = ", ".join(f"{name} ({'/'.join(backends)})" for name, backends in owners.items())
                raise ValueError(f"unknown option {quote(option)}; backend options: {known}")
            try:
                variants.check_backend_options(owners[option][0], {option: setting})
            except variants.VariantError as exc:
                raise ValueError(str(exc)) from None
        return value

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
        devices = {device for _, _, _, axes in _variant_configs(self) for device in _sweep(axes.device)}
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
            if self.axes.seq_len is None:
                raise ValueError("axes.seq_len is required (or a 'task' section)")
            if "quality" in self.modes or self.target not in SPEED_TARGETS:
                raise ValueError(f"mode 'quality' and the task targets ({', '.join(tasks.names())}) need a 'task' section")
            return self
        task = tasks.get(self.task.name)
        needed = [axis for axis in task.axes if getattr(self.axes, axis, None) is None]
        if needed or self.modes != ["quality"] or self.target != task.name:
            axes = "".join(f"axes.{axis}, " for axis in task.axes)
            raise ValueError(f"a {task.name} task scenario needs {axes}modes: [quality] and target: {task.name}")
        _training_dtypes(self.axes, "axes")
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
            for field, params in _configurations(name, spec):
                for key, value in params.items():
                    if value == []:
                        raise ValueError(f"{field}.{key}: expected at least one value, got an empty list")
                    if isinstance(value, dict) and key != VARIANT_AXES:
                        raise ValueError(f"{field}.{key}: expected a value or a list of values, got a mapping (only '{VARIANT_AXES}' holds one)")
                if VARIANT_AXES in params:
                    variant_axes(self, params[VARIANT_AXES], f"{field}.{VARIANT_AXES}")
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
    current = scenario.axes.model_dump()
    task = tasks.get(scenario.task.name) if scenario.task else None
    own = _axis_names(task, scenario.axes) + (() if task else ("d_dot",))
    unknown = [axis for axis in override if axis not in own]
    if unknown:
        raise ValueError(f"{field}.{unknown[0]}: the scenario has no such axis to replace (its axes: {', '.join(own)})")
    try:
        merged = Axes.model_validate({**current, **override})
    except ValidationError as exc:
        error = exc.errors()[0]
        message = error["msg"].removeprefix("Value error, ")
        shown = "" if "got" in message else f" (got {quote(error.get('input'))})"
        raise ValueError(f"{field}.{'.'.join(str(part) for part in error['loc'])}: {message}{shown}") from None
    _check_extra_axes(scenario.task, {axis: value for axis, value in override.items() if axis not in Axes.model_fields}, field)
    if task is not None:
        _training_dtypes(merged, field)
    return merged


def _training_dtypes(axes: Axes, field: str) -> None:
    """A quality cell trains in one of the dtypes of the policy (``harness.tasks.precision``)."""
    for dtype in _sweep(axes.dtype):
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


_MODELS: dict[tuple, type[Scenario]] = {}


def scenario_model() -> type[Scenario]:
    """``Scenario`` whose ``task`` is one of the registered tasks' configs, told apart by
    ``task.name`` (errors read ``task.<name>.<field>``)."""
    configs = tuple(tasks.resolve(task.config) for task in tasks.tasks())
    if configs not in _MODELS:
        union = Annotated[Union[configs], Field(discriminator="name")] if len(configs) > 1 else configs[0]
        _MODELS[configs] = create_model("Scenario", __base__=Scenario, task=(union | None, None))
    return _MODELS[configs]


def _numbers(value, path: str = ""):
    """(dotted path, value) of every float inside ``value`` (dicts and lists, at any depth)."""
    if isinstance(value, float):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _numbers(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _numbers(item, f"{path}[{index}]")


def _format_validation(path: str, exc: ValidationError) -> str:
    lines = [f"{path}: invalid scenario"]
    for error in exc.errors():
        message = error["msg"].removeprefix("Value error, ")
        field = ".".join(str(part) for part in error["loc"])
        if re.match(rf"^{re.escape(field)}[\w.\[\]]*: ", message):  # a check that names its field itself
            lines.append(f"  {message}")
            continue
        value = error.get("input")
        shown = quote(value) if not isinstance(value, dict) else "{...}"
        lines.append(f"  {field or '(top level)'}: {message} (got {shown})")
    return "\n".join(lines)


def deep_merge(base: dict, override: dict) -> dict:
    """``override`` on top of ``base``, recursively for dicts (lists and scalars replace)."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _apply_set(raw: dict, assignment: str, path: str) -> dict:
    """``--set key=value``: a bare axis name means ``axes.<name>``; the value is YAML."""
    key, sep, text = assignment.partition("=")
    if not sep or not key:
        raise ScenarioError(f"{path}: --set {quote(assignment)}: expected KEY=VALUE, e.g. seq_len=1024 or measure.repeats=3")
    parts = key.split(".")
    if len(parts) == 1 and parts[0] in AXES + ("d_dot", SEED_AXIS) + tuple(axis for task in tasks.tasks() for axis in task.axes):
        parts = ["axes", parts[0]]
    where = f"{path}: --set {quote(assignment)}"
    override = _parse_yaml(text, where)
    _check_size(override, where)
    for part in reversed(parts):
        override = {part: override}
    return deep_merge(raw, override)


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def limit(setting: tuple[str, int]) -> int:
    """The value of one of the limits (``MAX_CELLS`` ...): its environment variable's, else its default."""
    variable, default = setting
    text = os.environ.get(variable)
    if text is None:
        return default
    if not text.strip().isdigit() or int(text) < 1:
        raise ScenarioError(f"${variable}: expected a positive integer, got {quote(text)}")
    return int(text)


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses a key written twice in one mapping (the later would silently win)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) or key is None:
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"duplicate key {quote(key)}", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep)


def _parse_yaml(text: str, where: str):
    """``text`` as YAML (safe, no duplicate keys); an error names ``where`` and the line."""
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ScenarioError(f"{where}: not valid YAML: {at}{exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise ScenarioError(f"{where}: not valid YAML: {_first_line(exc)}") from None
    except RecursionError:
        raise ScenarioError(f"{where}: nested too deeply to read (at most {MAX_DEPTH} levels)") from None


def _read_bytes(path: Path) -> bytes:
    """A scenario file's bytes: a regular file (a FIFO or device is refused without reading it), at most ``MAX_FILE_BYTES``."""
    most = limit(MAX_FILE_BYTES)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot be read ({exc.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "directory" if stat.S_ISDIR(mode) else "special file (FIFO, device or socket)"
        raise ScenarioError(f"{path}: expected a scenario file (YAML), got a {kind}")
    with os.fdopen(fd, "rb") as file:
        data = file.read(most + 1)
    if len(data) > most:
        raise ScenarioError(f"{path}: larger than {most} bytes, the most a scenario file may have (${MAX_FILE_BYTES[0]} raises it)")
    return data


def _read_yaml(path: Path, data: bytes) -> dict:
    """The scenario file's ``data`` as a dict; a file that is not a UTF-8 YAML mapping is a ScenarioError."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ScenarioError(f"{path}: not a UTF-8 text file (byte {exc.start}: {exc.reason})") from None
    raw = _parse_yaml(text, str(path))
    if not isinstance(raw, dict):
        raise ScenarioError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    _check_size(raw, str(path))
    return raw


def _check_size(value, where: str) -> None:
    """Refuse a YAML value whose aliases make it contain itself, nest deeper than ``MAX_DEPTH``
    or expand to more than ``MAX_NODES`` values (a "billion laughs"). Linear in the
    value as written: each shared mapping or list is counted once, memoised by identity."""
    most, sizes, open_ = limit(MAX_NODES), {}, set()

    def size(item, depth: int) -> int:
        if not isinstance(item, (dict, list)):
            return 1
        if id(item) in open_:
            raise ScenarioError(f"{where}: a YAML alias refers to itself (a structure that contains itself); write the values out")
        if id(item) not in sizes:
            if depth > MAX_DEPTH:
                raise ScenarioError(f"{where}: nested deeper than {MAX_DEPTH} levels")
            open_.add(id(item))
            children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
            sizes[id(item)] = 1 + sum(size(child, depth + 1) for child in children)
            open_.discard(id(item))
        if sizes[id(item)] > most:
            raise ScenarioError(f"{where}: expands (through YAML aliases) to more than {most} values, the most a scenario may have (${MAX_NODES[0]} raises it)")
        return sizes[id(item)]

    size(value, 0)


def resolve_path(spec: str) -> Path:
    """A scenario file path, or the name of a shipped scenario (``smoke-cpu``)."""
    path = Path(spec)
    if path.exists():
        return path
    for candidate in (SCENARIO_DIR / spec, SCENARIO_DIR / f"{spec}.yaml"):
        if candidate.exists():
            return candidate
    raise ScenarioError(f"{spec}: no such scenario file (shipped scenarios: {', '.join(shipped())})")


def shipped() -> list[str]:
    return sorted(str(p.relative_to(SCENARIO_DIR).with_suffix("")) for p in SCENARIO_DIR.rglob("*.yaml"))


def load_scenario(spec: str, *, preset: str | None = None, overrides: list[str] = ()) -> LoadedScenario:
    """Read, merge the preset and ``--set`` overrides, and validate a scenario."""
    path = resolve_path(spec)
    data = _read_bytes(path)
    raw = _read_yaml(path, data)
    raw.setdefault("name", path.stem)
    if preset is not None:
        presets = raw.get("presets") or {}
        if not isinstance(presets, dict):
            raise ScenarioError(f"{path}: presets: expected a mapping of preset names to settings, got {quote(presets)}")
        if preset not in presets:
            raise ScenarioError(f"{path}: presets.{preset}: no such preset (this file has: {', '.join(map(str, presets)) or 'none'})")
        if not isinstance(presets[preset], dict):
            raise ScenarioError(f"{path}: presets.{preset}: expected a mapping of settings, got {quote(presets[preset])}")
        chosen = dict(presets[preset])
        if "variants" in chosen:  # a preset's variants replace the scenario's, they do not add to them
            raw["variants"] = chosen.pop("variants")
        raw = deep_merge(raw, chosen)
    for assignment in overrides:
        raw = _apply_set(raw, assignment, str(path))
    try:
        scenario = scenario_model().model_validate(raw)
    except ValidationError as exc:
        raise ScenarioError(_format_validation(str(path), exc)) from None
    _check_cell_count(scenario, str(path))
    sha256 = hashlib.sha256(data).hexdigest()
    return LoadedScenario(scenario, expand(scenario, str(path)), path, sha256, preset, list(overrides))


def cell_count(scenario: Scenario) -> int:
    """How many cells the scenario sweeps at most (before repeated cells are dropped), from
    the lengths of its lists alone: nothing is expanded."""
    task = tasks.get(scenario.task.name) if scenario.task else None
    configurations = 0
    for name, spec in scenario.variants.items():
        for field, params in _configurations(name, spec):
            axes = variant_axes(scenario, params.get(VARIANT_AXES), f"{field}.{VARIANT_AXES}")
            grid = math.prod(len(_sweep(value)) for key, value in params.items() if key != VARIANT_AXES)
            shape = math.prod(len(_sweep(getattr(axes, axis))) for axis in _axis_names(task, axes))
            configurations += grid * shape * len(_sweep(axes.d_dot))
    return configurations * len(scenario.backends) * len(scenario.modes)


def _check_cell_count(scenario: Scenario, path: str) -> None:
    most, count = limit(MAX_CELLS), cell_count(scenario)
    if count > most:
        raise ScenarioError(f"{path}: sweeps {count} cells, more than the {most} a run may have (${MAX_CELLS[0]} raises it; split the sweep)")


class LoadedScenario:
    """A validated scenario, its expanded cells and where it came from."""

    def __init__(self, scenario: Scenario, cells: list[dict], path: Path, sha256: str, preset: str | None, overrides: list[str]):
        self.scenario, self._cells, self.path, self.sha256 = scenario, cells, path, sha256
        self.preset, self.overrides = preset, overrides

    @property
    def name(self) -> str:
        return self.scenario.name

    def cells(self) -> list[dict]:
        return self._cells


def _sweep(value) -> list:
    return value if isinstance(value, list) else [value]


def _param_grid(params: dict) -> list[dict]:
    keys = list(params)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(_sweep(params[key]) for key in keys))]


def _configurations(name: str, spec) -> list[tuple[str, dict]]:
    """(field path, parameters) of each configuration written under ``variants.<name>``."""
    specs = spec if isinstance(spec, list) else [spec or {}]
    return [(f"variants.{name}" + (f"[{index}]" if isinstance(spec, list) else ""), params or {}) for index, params in enumerate(specs)]


def _variant_configs(scenario: Scenario) -> list[tuple[str, dict, str, Axes]]:
    """(name, params, field path, axes) for every variant configuration the scenario sweeps."""
    configs = []
    for name, spec in scenario.variants.items():
        for field, params in _configurations(name, spec):
            axes = variant_axes(scenario, params.get(VARIANT_AXES), f"{field}.{VARIANT_AXES}")
            swept = {key: value for key, value in params.items() if key != VARIANT_AXES}
            configs.extend((name, grid, field, axes) for grid in _param_grid(swept))
    return configs


def _axis_names(task, axes: Axes) -> tuple[str, ...]:
    """The axes a scenario's cells carry: a task's own (with dtype, device and any seeds), or the speed axes."""
    if task is None:
        return AXES
    return (*task.axes, "dtype", "device", *([SEED_AXIS] if (axes.model_extra or {}).get(SEED_AXIS) is not None else []))


def cell_id(cell: dict) -> str:
    """A stable id of what a cell measures (not how often): used to resume."""
    identity = {key: cell[key] for key in ("scenario", "variant", "backend", "params", "axes", "mode", "target", "model")}
    if cell.get("backend_options"):
        identity["backend_options"] = cell["backend_options"]
    if cell["task"]:
        identity["task"] = cell["task"]
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]


def expand(scenario: Scenario, path: str = "<scenario>") -> list[dict]:
    """Every cell of the sweep, in a deterministic order. Each variant configuration is checked
    here (``variants.supports``, which builds its torch core), so an impossible parameter (a ν or
    m that cannot give the asked d_dot) fails before anything is measured, and a cell whose
    backend does not compute it is marked skipped with the reason."""
    task = tasks.get(scenario.task.name) if scenario.task else None
    cells, seen = [], set()
    for name, params, field, axes in _variant_configs(scenario):
        names = _axis_names(task, axes)
        axis_values = {axis: _sweep(getattr(axes, axis)) for axis in names}
        d_dots = _sweep(axes.d_dot)
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
            for backend, mode in itertools.product(scenario.backends, scenario.modes):
                for combo in itertools.product(*(axis_values[axis] for axis in names)):
                    cell_axes = dict(zip(names, combo))
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
                    cell = {
                        "scenario": scenario.name,
                        "variant": name,
                        "backend": backend,
                        "backend_options": _options_of(scenario, backend, name),
                        "params": full_params,
                        "axes": cell_axes,
                        "mode": mode,
                        "target": scenario.target,
                        "decode": scenario.decode.model_dump(),
                        "model": scenario.model.model_dump() if scenario.target == "model" else None,
                        "task": _task_section(scenario.task, cell_axes),
                        "measure": scenario.measure.model_dump(),
                        "skip": unsupported.get((backend, cell_axes["dtype"], cell_axes["device"])),
                    }
                    cell["cell_id"] = cell_id(cell)
                    if cell["cell_id"] not in seen:
                        seen.add(cell["cell_id"])
                        cells.append(cell)
    return cells


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


#: How ``describe`` names each axis.
SHORT_AXES = {"seq_len": "T", "batch": "B", "heads": "H", "d_key": "Dk", "d_value": "Dv"}
#: Axes ``describe`` leaves out of the shape (shown elsewhere in the line, or settings of the mode).
UNSHAPED_AXES = ("dtype", "device", "new_tokens", "model")


def describe(cell: dict) -> str:
    """A one-line name of a cell, for progress bars and listings."""
    params = ",".join(f"{key}={value}" for key, value in cell["params"].items())
    axes = cell["axes"]
    skipped = " (skipped: no such backend)" if cell["skip"] else ""
    shape = " ".join(f"{SHORT_AXES.get(name, name)}={value}" for name, value in axes.items() if name not in UNSHAPED_AXES)
    return (
        f"{cell['variant']}{'(' + params + ')' if params else ''}[{cell['backend']}]{skipped} {cell['mode']}/{cell['target']} "
        f"{shape} {axes['dtype']} {axes['device']}"
    )

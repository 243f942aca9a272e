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
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

import variants

SCENARIO_DIR = Path(__file__).resolve().parent.parent / "scenarios"
DTYPES = ("float32", "float16", "bfloat16", "float64")
MODES = ("forward", "train", "decode")
BACKENDS = ("torch", "triton")
AXES = ("seq_len", "batch", "heads", "d_key", "d_value", "dtype", "device")
#: The axes of a quality task's cells (retrieval: S, the number of keys; MQAR: the model width).
TASK_AXES = {"retrieval": ("S", "d_key", "dtype", "device"), "mqar": ("seq_len", "d_model", "dtype", "device")}
TASK_AXES["mt"] = ("dtype", "device")  # translation: the model's sizes come from task.preset
TASK_AXES["lm"] = ("seq_len", "dtype", "device")  # language modelling: seq_len is the model's context


class ScenarioError(ValueError):
    """A scenario that cannot be run: the message names the file, field, value and expectation."""


Scalar = Union[int, float, str, bool, None]
Sweep = Union[Scalar, list[Scalar]]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Axes(Strict):
    seq_len: int | list[int] | None = None
    S: int | list[int] | None = None
    d_model: int | list[int] | None = None
    batch: int | list[int] = 1
    heads: int | list[int] = 8
    d_key: int | list[int] = 64
    d_value: int | list[int] | None = None
    dtype: str | list[str] = "float32"
    device: str | list[str] = "cpu"
    d_dot: int | list[int] | None = None

    @field_validator("seq_len", "S", "d_model", "batch", "heads", "d_key", "d_value", "d_dot")
    @classmethod
    def _positive(cls, value):
        for item in value if isinstance(value, list) else [value]:
            if item is not None and item < 1:
                raise ValueError(f"expected positive integers, got {item}")
        if isinstance(value, list) and not value:
            raise ValueError("expected at least one value")
        return value

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, value):
        for item in value if isinstance(value, list) else [value]:
            if item not in DTYPES:
                raise ValueError(f"expected one of {', '.join(DTYPES)}, got {item!r}")
        return value

    @field_validator("device")
    @classmethod
    def _device(cls, value):
        for item in value if isinstance(value, list) else [value]:
            kind, _, index = item.partition(":")
            if kind not in ("cpu", "cuda") or (index and not index.isdigit()) or (kind == "cpu" and index):
                raise ValueError(f"expected 'cpu', 'cuda' or 'cuda:N', got {item!r}")
        return value


class Measure(Strict):
    warmup: int = Field(2, ge=0)
    repeats: int = Field(7, ge=1)
    timeout_s: float = Field(900.0, gt=0, description="a cell running longer is stopped and recorded as an error")
    flush_l2: bool = True
    fresh_worker: bool | None = Field(
        None, description="a new worker process for each cell; default: for CPU speed cells (exact peak RSS), not on a GPU"
    )


class Decode(Strict):
    new_tokens: int = Field(64, ge=1)


class Rules(Strict):
    tokens_per_batch: int | None = Field(None, ge=1, description="batch = max(1, tokens_per_batch // seq_len)")


class RetrievalTask(Strict):
    """Associative retrieval (Schlag et al. 2021, §6.1), trained and evaluated per cell."""

    name: Literal["retrieval"] = "retrieval"
    setting: Literal[1, 2] = 1
    max_steps: int = Field(20000, ge=1)
    eval_every: int = Field(100, ge=1)
    patience: int = Field(10, ge=1)
    target_loss: float = Field(1e-3, gt=0)
    lr: float = Field(1e-3, gt=0)
    batch: int = Field(32, ge=1)
    seed: int = 0


class MQARTask(Strict):
    """Multi-query associative recall (Arora et al. 2023, Zoology), trained and evaluated per cell."""

    name: Literal["mqar"]
    steps: int = Field(2000, ge=1)
    batch: int = Field(64, ge=1)
    lr: float = Field(1e-3, gt=0)
    eval_every: int = Field(100, ge=1)
    num_pairs: int | None = Field(None, ge=1)
    vocab_size: int = Field(256, ge=4)
    seed: int = 0


class MTTask(Strict):
    """Translation (harness.tasks.mt): train an encoder-decoder on parallel text, score BLEU.
    Every None setting takes the preset's value (``harness.tasks.mt.RUN_PRESETS``); the cell's
    variant goes to every attention position it can (see ``position_variants``)."""

    name: Literal["mt"]
    preset: Literal["ci", "cpu", "gpu", "base"] = "cpu"
    dataset: Literal["multi30k", "wmt14"] = "multi30k"
    data: str | None = Field(None, description="the data set's directory (default: the shared data or $ATTNBENCH_DATA)")
    steps: int | None = Field(None, ge=1)
    batch_tokens: int | None = Field(None, ge=1)
    lr: float | None = Field(None, gt=0)
    warmup: int | None = Field(None, ge=0)
    beam: int | None = Field(None, ge=1)
    length_penalty: float = Field(1.0, ge=0)
    vocab_size: int | None = Field(None, ge=300)
    encoder: str | None = Field(None, description="variant of encoder self-attention (default: the cell's, or fallback)")
    cross: str | None = Field(None, description="variant of cross-attention (default: the cell's, or fallback)")
    fallback: str = Field("linear", description="encoder and cross variant when the cell's variant is causal only")
    threads: int | None = Field(None, ge=1, description="torch CPU threads (default: torch's)")
    seed: int = 0

    @field_validator("encoder", "cross", "fallback")
    @classmethod
    def _known_variant(cls, value):
        if value is not None and value not in variants.names():
            raise ValueError(f"unknown variant {value!r}; known: {', '.join(variants.names())}")
        return value

    @property
    def head_width(self) -> int:
        """d_key of the preset's model (d_model / n_heads), to check the variants against."""
        from .tasks.mt_model import MT_PRESETS

        return MT_PRESETS[self.preset]["d_model"] // MT_PRESETS[self.preset]["n_heads"]


class LMTask(Strict):
    """WikiText language modelling (harness.tasks.lm): train a DecoderLM of ``preset`` with the
    cell's variant at context ``axes.seq_len``, report perplexities, words/s and memory."""

    name: Literal["lm"]
    preset: str = Field("cpu", description="a model preset of harness.models.LM_PRESETS")
    steps: int = Field(700, ge=1)
    batch: int = Field(16, ge=1, description="windows per step (the global batch)")
    lr: float = Field(2e-3, gt=0)
    warmup: int = Field(50, ge=0)
    dropout: float = Field(0.1, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    clip: float | None = Field(1.0, gt=0)
    adaptive_cutoffs: list[int] | None = Field([2000, 10000], description="adaptive softmax cutoffs (None: tied full softmax)")
    eval_tokens: int | None = Field(None, ge=2, description="evaluate on the first N tokens of valid/test (None: all)")
    sliding_tokens: int | None = Field(2048, ge=2, description="sliding-window evaluation on the first N valid tokens")
    carry: bool = Field(True, description="also evaluate linear-time variants carrying their state across windows")
    eval_every: int | None = Field(None, ge=1)
    log_every: int = Field(25, ge=1)
    data: str | None = Field(None, description="a WikiText directory (default: $ATTNBENCH_DATA/wikitext-2 or the shared data)")
    threads: int | None = Field(None, ge=1, description="torch CPU threads (default: torch's)")
    model_overrides: dict[str, Any] = {}
    segment: dict[str, Any] | None = Field(
        None, description="segment-level recurrence: {kind: xl | rmt | carry_state, length, segments, memory, bptt} "
        "(harness.models.SegmentConfig; length defaults to axes.seq_len)")
    seed: int = 0

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, value):
        from .models import LM_PRESETS

        if value not in LM_PRESETS:
            raise ValueError(f"expected a model preset among {', '.join(LM_PRESETS)}, got {value!r}")
        return value

    @field_validator("segment")
    @classmethod
    def _valid_segment(cls, value):
        from .models import SegmentConfig

        if value is not None:
            try:
                SegmentConfig(**value)
            except TypeError as exc:
                raise ValueError(f"unknown segment field ({exc}); expected kind, length, segments, memory, bptt") from None
        return value

    @property
    def head_width(self) -> int:
        """d_key of the model (d_model / n_heads), to check the variants against."""
        from .models import LM_PRESETS

        sizes = {**LM_PRESETS[self.preset], **self.model_overrides}
        return sizes["d_model"] // sizes["n_heads"]


Task = Annotated[Union[RetrievalTask, MQARTask, MTTask, LMTask], Field(discriminator="name")]


class ModelSpec(Strict):
    preset: str = "small"
    vocab_size: int = Field(32000, ge=2)
    overrides: dict[str, Any] = {}


class Scenario(Strict):
    name: str
    description: str = ""
    variants: dict[str, dict[str, Sweep] | list[dict[str, Sweep]] | None]
    backends: list[str] = ["torch"]
    axes: Axes
    modes: list[Literal["forward", "train", "decode", "quality"]] = ["forward"]
    target: Literal["core", "layer", "model", "retrieval", "mqar", "mt", "lm"] = "core"
    task: Task | None = None
    decode: Decode = Decode()
    measure: Measure = Measure()
    rules: Rules = Rules()
    model: ModelSpec | None = None
    presets: dict[str, dict[str, Any]] = {}

    @field_validator("variants")
    @classmethod
    def _known_variants(cls, value):
        unknown = [name for name in value if name not in variants.names()]
        if unknown:
            raise ValueError(f"unknown variant {unknown[0]!r}; known: {', '.join(variants.names())}")
        if not value:
            raise ValueError("expected at least one variant")
        return value

    @field_validator("backends")
    @classmethod
    def _known_backends(cls, value):
        for backend in value:
            if backend not in BACKENDS:
                raise ValueError(f"expected backends among {', '.join(BACKENDS)}, got {backend!r}")
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
            if "quality" in self.modes or self.target in TASK_AXES:
                raise ValueError(f"mode 'quality' and targets {', '.join(TASK_AXES)} need a 'task' section")
            return self
        needed = [axis for axis in TASK_AXES[self.task.name] if getattr(self.axes, axis) is None and axis not in ("dtype", "device")]
        if needed or self.modes != ["quality"] or self.target != self.task.name:
            axes = ", ".join(f"axes.{axis}" for axis in TASK_AXES[self.task.name][:2])
            raise ValueError(f"a {self.task.name} task scenario needs {axes}, modes: [quality] and target: {self.task.name}")
        return self


def _format_validation(path: str, exc: ValidationError) -> str:
    lines = [f"{path}: invalid scenario"]
    for error in exc.errors():
        field = ".".join(str(part) for part in error["loc"]) or "(top level)"
        value = error.get("input")
        shown = json.dumps(value, default=str) if not isinstance(value, dict) else "{...}"
        lines.append(f"  {field}: {error['msg'].removeprefix('Value error, ')} (got {shown})")
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
        raise ScenarioError(f"{path}: --set {assignment!r}: expected KEY=VALUE, e.g. seq_len=1024 or measure.repeats=3")
    parts = key.split(".")
    if len(parts) == 1 and parts[0] in AXES + ("d_dot", "S"):
        parts = ["axes", parts[0]]
    override: dict = yaml.safe_load(text)
    for part in reversed(parts):
        override = {part: override}
    return deep_merge(raw, override)


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
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ScenarioError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ScenarioError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    raw.setdefault("name", path.stem)
    if preset is not None:
        presets = raw.get("presets") or {}
        if preset not in presets:
            raise ScenarioError(f"{path}: presets.{preset}: no such preset (this file has: {', '.join(presets) or 'none'})")
        chosen = dict(presets[preset])
        if "variants" in chosen:  # a preset's variants replace the scenario's, they do not add to them
            raw["variants"] = chosen.pop("variants")
        raw = deep_merge(raw, chosen)
    for assignment in overrides:
        raw = _apply_set(raw, assignment, str(path))
    try:
        scenario = Scenario.model_validate(raw)
    except ValidationError as exc:
        raise ScenarioError(_format_validation(str(path), exc)) from None
    sha256 = hashlib.sha256(path.read_bytes()).hexdigest()
    return LoadedScenario(scenario, expand(scenario, str(path)), path, sha256, preset, list(overrides))


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


def _variant_configs(scenario: Scenario) -> list[tuple[str, dict, str]]:
    """(name, params, field path) for every variant configuration the scenario sweeps."""
    configs = []
    for name, spec in scenario.variants.items():
        specs = spec if isinstance(spec, list) else [spec or {}]
        for index, params in enumerate(specs):
            field = f"variants.{name}" + (f"[{index}]" if isinstance(spec, list) else "")
            configs.extend((name, grid, field) for grid in _param_grid(params or {}))
    return configs


def cell_id(cell: dict) -> str:
    """A stable id of what a cell measures (not how often): used to resume."""
    identity = {key: cell[key] for key in ("scenario", "variant", "backend", "params", "axes", "mode", "target", "model")}
    if cell["task"]:
        identity["task"] = cell["task"]
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]


def expand(scenario: Scenario, path: str = "<scenario>") -> list[dict]:
    """Every cell of the sweep, in a deterministic order. Each variant configuration is built
    once here, so an impossible parameter (a ν or m that cannot give the asked d_dot) fails
    before anything is measured."""
    axes = scenario.axes
    names = TASK_AXES[scenario.task.name] if scenario.task else AXES
    axis_values = {name: _sweep(getattr(axes, name)) for name in names}
    d_dots = _sweep(axes.d_dot)
    cells, seen = [], set()
    for name, params, field in _variant_configs(scenario):
        # A variant's own d_key (Based's and ReBased's 16-dimensional keys) replaces the d_key
        # axis where there is one (values keep the axis width); a task's model gives it to the layer.
        own_d_key = params.get("d_key")
        core_params = {key: value for key, value in params.items() if key != "d_key"}
        for d_dot in d_dots:
            core_params_at = dict(core_params, **({"d_dot": d_dot} if d_dot is not None else {}))
            full_params = core_params_at if "d_key" in names else dict(params, **core_params_at)
            unsupported = {}
            # MQAR cells have one head of width d_model; MT cells the preset's heads.
            d_keys = axis_values.get("d_key") or axis_values.get("d_model") or [scenario.task.head_width]
            for d_key in [own_d_key] if own_d_key is not None else d_keys:
                unsupported.update(_unsupported_backends(name, d_key, core_params_at, scenario.backends, field, path))
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
                        "params": full_params,
                        "axes": cell_axes,
                        "mode": mode,
                        "target": scenario.target,
                        "decode": scenario.decode.model_dump(),
                        "model": scenario.model.model_dump() if scenario.target == "model" else None,
                        "task": scenario.task.model_dump() if scenario.task else None,
                        "measure": scenario.measure.model_dump(),
                        "skip": unsupported.get(backend),
                    }
                    cell["cell_id"] = cell_id(cell)
                    if cell["cell_id"] not in seen:
                        seen.add(cell["cell_id"])
                        cells.append(cell)
    return cells


def _unsupported_backends(name: str, d_key: int, params: dict, backends: list[str], field: str, path: str) -> dict:
    """Build the variant once per backend: ``{backend: reason}`` for the backends it has no
    implementation for (their cells are recorded as skipped); any other problem is an error."""
    unsupported = {}
    for backend in backends:
        try:
            variants.create(name, d_key, backend=backend, **params)
        except variants.UnsupportedBackend as exc:
            unsupported[backend] = str(exc)
        except variants.VariantError as exc:
            raise ScenarioError(f"{path}: {field}: parameters {json.dumps(params)} at d_key={d_key}: {exc}") from None
    return unsupported


#: How ``describe`` names each axis.
SHORT_AXES = {"seq_len": "T", "S": "S", "batch": "B", "heads": "H", "d_key": "Dk", "d_value": "Dv", "d_model": "D"}


def describe(cell: dict) -> str:
    """A one-line name of a cell, for progress bars and listings."""
    params = ",".join(f"{key}={value}" for key, value in cell["params"].items())
    axes = cell["axes"]
    skipped = " (skipped: no such backend)" if cell["skip"] else ""
    shape = " ".join(f"{short}={axes[name]}" for name, short in SHORT_AXES.items() if name in axes)
    return (
        f"{cell['variant']}{'(' + params + ')' if params else ''}[{cell['backend']}]{skipped} {cell['mode']}/{cell['target']} "
        f"{shape} {axes['dtype']} {axes['device']}"
    )

"""Reading a scenario file and merging into it: its bytes (a regular file, bounded), YAML (no
duplicate keys, bounded size and depth, aliases counted out), the chosen preset and ``--set``
overrides; the limits every input answers within. ``harness.scenarios.scenario`` validates what this reads
(``harness.scenarios.validation`` words what does not validate)."""

from __future__ import annotations

import copy
import os
import stat
from pathlib import Path

import yaml

from variants.errors import did_you_mean

from .. import tasks
from ..common.formatting import one_line, quote
from . import axes as axis_table

SCENARIO_DIR = Path(__file__).resolve().parents[2] / "scenarios"
#: The section of a quality task (its config, one of the registered tasks' by its ``name``).
TASK = "task"
#: The axis that sweeps a quality task's ``seed`` (its cells then carry it in ``axes`` and ``task``).
SEED_AXIS = "seed"
#: How deep a scenario's mappings and lists may nest.
MAX_DEPTH = 64
#: Limits on the work a scenario may ask for: (environment variable, default). The variable raises or lowers a limit.
MAX_FILE_BYTES = ("ATTNBENCH_MAX_SCENARIO_BYTES", 1_000_000)
MAX_NODES = ("ATTNBENCH_MAX_SCENARIO_NODES", 100_000)
MAX_CELLS = ("ATTNBENCH_MAX_CELLS", 100_000)


class ScenarioError(ValueError):
    """A scenario that cannot be run: the message names the file, field, value and expectation."""


def read(spec: str, preset: str | None, overrides) -> tuple[Path, bytes, dict]:
    """The scenario file ``spec`` (a path or a shipped name): its path, bytes and mapping with
    ``name`` defaulted, the ``preset`` merged in and the ``--set`` ``overrides`` applied."""
    path = resolve_path(spec)
    data = _read_bytes(path)
    raw = _read_yaml(path, data)
    raw.setdefault("name", path.stem)
    if preset is not None:
        raw = _with_preset(raw, preset, path)
    for assignment in overrides:
        raw = _apply_set(raw, assignment, str(path))
    return path, data, raw


def _with_preset(raw: dict, preset: str, path: Path) -> dict:
    """``raw`` with its preset ``preset`` merged in (a preset's ``variants`` replace the scenario's)."""
    presets = raw.get("presets") or {}
    if not isinstance(presets, dict):
        raise ScenarioError(f"{path}: presets: expected a mapping of preset names to settings, got {quote(presets)}")
    if preset not in presets:
        has = ", ".join(map(str, presets)) or "none"
        raise ScenarioError(f"{path}: presets.{preset}: no such preset{did_you_mean(preset, presets)} (this file has: {has})")
    if not isinstance(presets[preset], dict):
        raise ScenarioError(f"{path}: presets.{preset}: expected a mapping of settings, got {quote(presets[preset])}")
    chosen = dict(presets[preset])
    if "variants" in chosen:  # a preset's variants replace the scenario's, they do not add to them
        raw["variants"] = chosen.pop("variants")
    return deep_merge(raw, chosen)


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
    parts, text = set_target(assignment, path), assignment.partition("=")[2]
    where = f"{path}: --set {quote(assignment)}"
    override = _parse_yaml(text, where)
    _check_size(override, where)
    for part in reversed(parts):
        override = {part: override}
    return deep_merge(raw, override)


def set_target(assignment: str, path: str = "") -> list[str]:
    """The field ``--set KEY=VALUE`` sets, as its dotted names (a bare axis name means ``axes.<name>``)."""
    key, sep, _ = assignment.partition("=")
    if not sep or not key:
        raise ScenarioError(f"{path}: --set {quote(assignment)}: expected KEY=VALUE, e.g. seq_len=1024 or measure.repeats=3")
    parts = key.split(".", MAX_DEPTH)
    if len(parts) > MAX_DEPTH or not all(parts):
        raise ScenarioError(f"{path}: --set {quote(assignment)}: expected a KEY of at most {MAX_DEPTH} dotted names, none empty (measure.repeats=3)")
    axes = axis_table.SPEED + axis_table.OPTIONAL + ("d_dot", SEED_AXIS) + tuple(axis for task in tasks.tasks() for axis in task.axes)
    return ["axes", parts[0]] if len(parts) == 1 and parts[0] in axes else parts


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
    name = Path(spec).with_suffix("").as_posix().removeprefix(f"{SCENARIO_DIR.name}/")  # scenarios/x.yaml: x
    raise ScenarioError(f"{one_line(spec)}: no such scenario file{did_you_mean(name, shipped())} (shipped scenarios: {', '.join(shipped())})")


def shipped() -> list[str]:
    return sorted(str(p.relative_to(SCENARIO_DIR).with_suffix("")) for p in SCENARIO_DIR.rglob("*.yaml"))


def numbers(value, path: str = ""):
    """(dotted path, value) of every float inside ``value`` (dicts and lists, at any depth)."""
    if isinstance(value, float):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from numbers(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from numbers(item, f"{path}[{index}]")

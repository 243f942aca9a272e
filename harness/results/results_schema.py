"""The types of a results file's fields (docs/results.md), checked as each line is read: a string where a
number belongs, a list where a mapping belongs, or an integer too large for a float is one error naming the
line's field and what was expected. Fields the format does not name (a task's own metrics) pass as JSON; every
integer anywhere in a line must fit a float, since every reader (pandas, the statistics) takes numbers as floats.
``harness.results`` reads the files; this module only says whether a decoded line is well typed."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..common.formatting import quote

#: A JSON integer of more digits than this is too large for a float whatever its digits (10^309 > max float).
FLOAT_DIGITS = 309

#: A number: an integer or a float (strict: never a string or a bool); NaN and ±inf are allowed (metrics store them).
Number = float
#: A count or a time that cannot be negative.
Amount = Annotated[float, Field(ge=0)]
Mapping = dict[str, Any]


@dataclass(frozen=True)
class TooLarge:
    """A JSON integer too large for a float, as read (``integer``), so that the check can name its field."""

    text: str


def integer(text: str) -> int | TooLarge:
    """A JSON integer (``json.loads``'s ``parse_int``): an ``int``, or ``TooLarge`` where no float holds it
    (without converting the digits of one longer than Python converts)."""
    if len(text.lstrip("-")) <= FLOAT_DIGITS:
        value = int(text)
        if abs(value) <= sys.float_info.max:
            return value
    return TooLarge(text)


def _too_large(value, path: str) -> tuple[str, TooLarge] | None:
    """The dotted path (lists by index) and value of the first ``TooLarge`` in ``value``, or None."""
    if isinstance(value, TooLarge):
        return path, value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    return next((found for key, item in items if (found := _too_large(item, f"{path}.{key}" if path else str(key))) is not None), None)


class _Fields(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class Cpu(_Fields):
    usable_cores: int | None = None
    logical_cores: int | None = None
    torch_threads: int | None = None


class Gpu(_Fields):
    memory_bytes: Amount | None = None


class Datasheet(_Fields):
    name: str
    bandwidth_bytes_per_s: Amount
    __pydantic_extra__: dict[str, Amount]  # the peaks, FLOP/s by dtype


class Calibration(_Fields):
    """A run's calibrated limits (docs/results.md, "Roofline"), as the report's header reads them."""

    matmul_flops_per_s: dict[str, Amount]
    bandwidth_bytes_per_s: Amount
    torch_threads: int
    datasheet: Datasheet | None = None
    sm_clock_mhz: Number | None = None


class Machine(_Fields):
    machine_id: str
    hostname: str | None = None
    memory_bytes: Amount | None = None
    calibration: Calibration | None = None
    gpu: Gpu | None = None
    cpu: Cpu | None = None
    git: Mapping | None = None
    versions: Mapping | None = None


class RunLine(_Fields):
    run_id: str
    started_at: str
    scenario: str
    machine: Machine
    scenario_file: str | None = None
    scenario_sha256: str | None = None
    preset: str | None = None
    overrides: list[str] | None = None
    report: Mapping | None = None
    command: str | None = None
    commit: str | None = None
    dirty: bool | None = None
    resumed_from: str | None = None
    executor: str | None = None
    node_id: str | None = None
    torch_threads: int | None = None


class Load(_Fields):
    """``metrics.load`` and ``metrics.timed_load`` (docs/results.md)."""

    wall_s: Amount | None = None
    cores: Amount | None = None
    other_cpu_s: Number | None = None
    other_cores: Number | None = None
    own_cpu_s: Amount | None = None
    threads: int | None = None
    loadavg_before: list[Number] | None = None
    loadavg_after: list[Number] | None = None
    gpu_before: Mapping | None = None
    gpu_after: Mapping | None = None


class Axes(_Fields):
    """A cell's axes: the text ones (those of ``harness.scenarios.axes`` no plot puts on an x axis) strings,
    every other (``seq_len``, ``batch``, a task's ``S`` or ``d_model``, ``seed``, ...) a number."""

    __pydantic_extra__: dict[str, Number]
    dtype: str | None = None
    device: str | None = None
    model: str | None = None
    lengths: str | None = None
    packing: str | None = None


class Metrics(_Fields):
    """The metrics docs/results.md names; a task's own pass as JSON (``_too_large`` still checks them)."""

    median_s: Number | None = None
    p20_s: Number | None = None
    p80_s: Number | None = None
    iqr_s: Number | None = None
    samples_s: list[Number] | None = None
    tokens: Amount | None = None
    lengths: list[int] | None = None
    tokens_per_s: Number | None = None
    words_per_s: Number | None = None
    peak_mem_bytes: Number | None = None
    memory_kind: str | None = None
    flops: Number | None = None
    flops_per_s: Number | None = None
    torch_threads: int | None = None
    step_latency_s: list[Number] | None = None
    prefill_median_s: Number | None = None
    compile_s: Number | None = None
    backend_options: Mapping | None = None
    sdpa_backend: str | None = None
    scan: str | None = None
    triton_kernels: list[Mapping] | None = None
    state_numel: Number | None = None
    rel_error: Number | None = None
    rel_error_reference: str | None = None
    rel_error_tolerance: Number | None = None
    rel_error_floor: Number | None = None
    inaccurate: bool | None = None
    rel_ci: Number | None = None
    target_rel_ci: Number | None = None
    unstable: bool | None = None
    disturbed: bool | None = None
    load: Load | None = None
    timed_load: Load | None = None
    timing: str | None = None
    clock: str | None = None
    profile: Mapping | None = None
    min_bytes: Number | None = None
    roofline_s: Number | None = None
    roofline_fraction: Number | None = None
    bound: str | None = None
    throttled: bool | None = None
    throttle_before: Mapping | None = None
    throttle_after: Mapping | None = None
    loss: Number | None = None
    accuracy: Number | None = None
    steps: int | None = None
    wall_s: Number | None = None
    seed: int | None = None


class CellLine(_Fields):
    run_id: str
    cell_id: str
    scenario: str
    variant: str
    mode: str
    status: str
    backend: str | None = None
    params: Mapping | None = None
    axes: Axes | None = None
    task: Mapping | None = None
    target: str | None = None
    error: str | None = None
    metrics: Metrics | None = None
    machine_id: str | None = None
    node_id: str | None = None
    commit: str | None = None
    started_at: str | None = None
    duration_s: Amount | None = None
    concurrent_runs: list[Mapping] | None = None


LINES = {"run": RunLine, "cell": CellLine}
#: What each pydantic error type expected, in a results file's words.
EXPECTED = {
    "dict_type": "a JSON object", "model_type": "a JSON object", "float_type": "a number", "int_type": "an integer",
    "string_type": "a string", "bool_type": "true or false", "list_type": "a list", "greater_than_equal": "a number >= 0",
    "missing": "a value (required)",
}  # fmt: skip


#: A run of digits as long as an integer must be for ``integer`` to find no float that holds it: a line without one
#: holds no ``TooLarge`` (``type_error(..., long_digits=False)`` then skips looking for one).
LONG_DIGITS = re.compile(rb"[0-9]{%d}" % FLOAT_DIGITS)


def type_error(record: dict, long_digits: bool = True) -> str | None:
    """What is wrong with the types of ``record`` (a decoded run or cell line, its metrics' NaN strings
    decoded): ``metrics.tokens: expected a number, got "many"``; None when every field is well typed. ``long_digits``:
    whether its line held ``LONG_DIGITS`` (where it did not, no integer in it is too large for a float)."""
    found = _too_large(record, "") if long_digits else None
    if found is not None:
        path, value = found
        return f"{path}: expected a number a float can hold, got an integer of {len(value.text.lstrip('-'))} digits"
    try:
        LINES[record["kind"]].model_validate(record)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        field = _in_record(record, error["loc"])
        expected = EXPECTED.get(error["type"], error["msg"])
        if error["type"] == "missing":  # the field is not in the record: named by pydantic's last part
            return f"{'.'.join([*field, str(error['loc'][-1])])}: expected {expected}, got nothing"
        return f"{'.'.join(field)}: expected {expected}, got {quote(error['input'])}"
    return None


def _in_record(record, loc: tuple) -> list[str]:
    """The parts of pydantic's error location that are keys of ``record`` (not the names of a union's members)."""
    parts = []
    for part in loc:
        if isinstance(record, dict) and part in record or isinstance(record, list) and isinstance(part, int) and part < len(record):
            parts.append(str(part))
            record = record[part]
        else:
            break
    return parts

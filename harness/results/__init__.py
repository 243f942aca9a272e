"""Results files: append one JSON line per run or cell, atomically; load them into pandas.

A results file is JSON Lines (schema ``SCHEMA_VERSION``): a ``run`` line first, then one
``cell`` line per measured cell, and another ``run`` line for each ``--resume``. Lines of an
older schema are upgraded as they are read (``_upgrade``). The format, field by field, is in
docs/results.md.

The results group owns the records (here), their field types (``results_schema``), which
records are the same cell (``identity``), comparing two sets (``compare``) and the results directory's
lock (``locking``). May import: common, measuring, scenarios.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

from ..common.files import open_regular
from ..measuring.stats import median_rel_ci
from ..scenarios.cell import Cell
from .locking import LockedError
from .results_schema import LONG_DIGITS, integer, type_error

if TYPE_CHECKING:
    from ..scenarios.scenario import LoadedScenario

SCHEMA_VERSION = 2
#: The oldest schema the reader upgrades.
OLDEST_SCHEMA = 1
STATUSES = ("ok", "oom", "error", "crashed", "nan", "skipped")
#: The statuses of a cell that ran and failed; ``attnbench run --resume --retry-failed`` runs them again.
FAILED = ("oom", "error", "crashed", "nan")
#: The statuses of a cell that make a run fail (exit code 1, ``RunSummary.failures``): every
#: failed status but ``oom``, which a sweep to the memory limit expects.
FAILING = tuple(status for status in FAILED if status != "oom")
#: The timing metrics of an ``ok`` cell: when present, finite numbers >= 0 (``samples_s`` a list of them).
TIMINGS = ("median_s", "p20_s", "p80_s", "iqr_s", "samples_s")

#: Keys a record must carry (before ``kind`` and ``schema`` are added).
REQUIRED = {
    "run": ("run_id", "started_at", "scenario", "machine"),
    "cell": ("run_id", "cell_id", "scenario", "variant", "mode", "status"),
}

#: The columns ``load`` always returns first, even when there are no cells.
COLUMNS = [
    "file",
    "run_id",
    "cell_id",
    "scenario",
    "variant",
    "backend",
    "mode",
    "target",
    "status",
    "error",
    "machine_id",
    "commit",
    "started_at",
    "duration_s",
]

#: JSON has no NaN or infinities; metrics store them as these strings.
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


class ResultsFileError(ValueError):
    """A results file is missing or malformed; the message names the file (and line)."""


class ResultsWriteError(OSError):
    """A line could not be appended (full disk, file-size limit, I/O error); the file was cut
    back to its last complete line, so it still loads and resumes."""


def _encode(value):
    """``value`` with every NaN/±inf float (also inside lists and dicts) as its string."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {key: _encode(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(item) for item in value]
    return value


def _decode(value):
    """The inverse of ``_encode``: the strings "NaN", "Infinity", "-Infinity" become floats."""
    if isinstance(value, str):
        return _NONFINITE.get(value, value)
    if isinstance(value, dict):
        return {key: _decode(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_decode(item) for item in value]
    return value


def _missing_key(record: dict, kind: str) -> str | None:
    """The first required key ``record`` lacks, or None."""
    for key in REQUIRED[kind]:
        if key not in record:
            return key
    if kind == "run" and isinstance(record["machine"], dict) and "machine_id" not in record["machine"]:
        return "machine.machine_id"  # a machine that is not a mapping is a type error (``results_schema``)
    return None


class ResultsChangedError(ResultsFileError):
    """The results file being written was deleted, replaced or cut by someone else; the run stops."""


class ResultsWriter:
    """Appends run and cell records to one results file, one whole line per ``os.write``.

    The writer holds the file open from the start of the run to its end, with an exclusive
    ``flock`` on the file itself (its inode), so a second run cannot write into it by any name
    (a symbolic or a hard link in another directory); ``LockedError`` says so. ``create``: the
    file is opened at the first line (created if missing); otherwise at once, and it must exist
    (``--resume``). A link at ``path``
    is refused (``open_regular``). Before each line it checks that ``path`` is still the file
    opened and holds exactly what was written (``ResultsChangedError`` otherwise)."""

    def __init__(self, path, *, create: bool = True):
        self.path, self.create, self.fd, self.size = Path(path), create, None, 0
        if not create:
            self._open()

    def _open(self) -> None:
        """Open (``create``: creating it if missing) and lock the file, or ``LockedError``."""
        if self.create:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = open_regular(self.path, os.O_WRONLY | os.O_APPEND | (os.O_CREAT if self.create else 0))
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.close()
            raise LockedError(f"{self.path} is being written by another attnbench run (it holds the file's lock); wait for it to finish") from None
        self.size = os.fstat(self.fd).st_size

    def close(self) -> None:
        """Close the file (and drop its lock); the writer writes nothing more."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    __del__ = close

    def repair_tail(self) -> bool:
        """``repair_tail`` of the file this writer holds locked; True if anything was cut."""
        cut = repair_tail(self.path)
        self.size = os.fstat(self.fd).st_size
        return cut

    def write_run(self, record: dict) -> None:
        """Append a ``run`` line (the fingerprint of this run: machine, commit, scenario)."""
        self._write("run", record)

    def write_cell(self, record: dict) -> None:
        """Append a ``cell`` line (one measured cell); NaN/±inf metrics are stored as strings."""
        if "status" in record and record["status"] not in STATUSES:
            raise ValueError(f"cell status {record['status']!r} is not one of {', '.join(STATUSES)}")
        self._write("cell", {**record, "metrics": _encode(record.get("metrics", {}))})

    def _write(self, kind: str, record: dict) -> None:
        missing = _missing_key(record, kind)
        if missing is not None:
            raise ValueError(f"{kind} record for {self.path} is missing the required key {missing!r}")
        line = {"kind": kind, "schema": SCHEMA_VERSION, **record}
        line.update(kind=kind, schema=SCHEMA_VERSION)  # first in the line, and never the caller's
        data = (json.dumps(line, allow_nan=False, ensure_ascii=False) + "\n").encode("utf-8")
        self._append(data)

    def _check_unchanged(self) -> None:
        """``ResultsChangedError`` unless ``path`` is still the file opened, as long as written."""
        try:
            named = os.stat(self.path)
        except FileNotFoundError:
            named = None
        opened = os.fstat(self.fd)
        if named is None or (named.st_dev, named.st_ino) != (opened.st_dev, opened.st_ino):
            how = "deleted" if named is None else "replaced by another file"
        elif opened.st_size != self.size:
            how = f"changed by someone else ({opened.st_size} bytes where this run wrote {self.size})"
        else:
            return
        raise ResultsChangedError(
            f"{self.path} was {how} while this run wrote it; the run stopped and writes nothing more into it "
            "(start a new run, or restore the file and continue it with --resume)"
        )

    def _append(self, data: bytes) -> None:
        """One ``os.write`` of the whole line on the O_APPEND descriptor, then fsync. A write
        that fails or falls short (a full disk) is undone: the file is cut back to its size
        before it, and ``ResultsWriteError`` says so."""
        if self.fd is None:
            self._open()
        self._check_unchanged()
        try:
            written = os.write(self.fd, data)
            if written != len(data):
                raise OSError(f"wrote {written} of {len(data)} bytes")
            os.fsync(self.fd)
        except OSError as exc:
            os.ftruncate(self.fd, self.size)
            reason = exc.strerror or str(exc)
            raise ResultsWriteError(f"cannot append to {self.path} ({reason}); it still holds every line written before") from None
        self.size += written


# --- the records ---------------------------------------------------------------------------


def utc_now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def run_header(loaded: LoadedScenario, run_id: str, command: str, fingerprint: dict, *, commit=None, dirty=None, resumed_from=None, **extra) -> dict:
    """The ``run`` line of a results file: the scenario as loaded, the command, the machine and
    the commit measured (the fingerprint's, unless ``commit``/``dirty`` say otherwise)."""
    return {
        "run_id": run_id,
        "started_at": utc_now(),
        "scenario": loaded.name,
        "scenario_file": str(loaded.path),
        "scenario_sha256": loaded.sha256,
        "preset": loaded.preset,
        "overrides": loaded.overrides,
        "report": loaded.scenario.report.model_dump(),
        "command": command,
        "machine": fingerprint,
        "commit": fingerprint["git"]["commit"] if commit is None else commit,
        "dirty": fingerprint["git"]["dirty"] if dirty is None else dirty,
        "resumed_from": resumed_from,
        **extra,
    }


def cell_record(cell: Cell, observation: dict, run_id: str, fingerprint: dict) -> dict:
    """The results record of ``cell`` from its ``observe``-ation: with the GPU's throttle state,
    the roofline fraction and the machine and the commit of ``fingerprint`` (the machine that
    measured it) and, for a Ray executor's cell, the ``node_id`` of the Ray node."""
    from ..measuring.roofline import roofline  # torch: not for the readers of results files

    result, before, after = observation["result"], observation["throttle_before"], observation["throttle_after"]
    metrics = dict(result["metrics"])
    if not cell.quality:
        metrics.update(roofline(metrics, fingerprint.get("calibration"), cell.axes["dtype"]))
    if before is not None or after is not None:
        metrics.update(
            throttle_before=before,
            throttle_after=after,
            throttled=bool((before or {}).get("throttled") or (after or {}).get("throttled")),
        )
    node = {"node_id": observation["node_id"]} if observation.get("node_id") else {}
    return {
        "run_id": run_id,
        **cell.record(),
        "status": result["status"],
        "error": result["error"],
        "metrics": metrics,
        "machine_id": fingerprint["machine_id"],
        **node,
        "commit": fingerprint["git"]["commit"],
        "started_at": observation["started_at"],
        "duration_s": observation["duration_s"],
    }


def repair_tail(path) -> bool:
    """Repair the last line of an interrupted write: one that is not whole JSON is cut (True); a whole
    record that lacks only its newline gets it, so no finished cell is lost (False: nothing was cut)."""
    data = Path(path).read_bytes()
    if not data or data.endswith(b"\n"):
        return False
    start = data.rfind(b"\n") + 1
    try:
        json.loads(data[start:].decode("utf-8"), parse_int=integer)
    except (UnicodeDecodeError, ValueError, RecursionError):
        os.truncate(path, start)
        return True
    fd = open_regular(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    return False


def parse_line(raw: bytes, path: Path, where: str) -> dict:
    """One line as a dict with ``kind`` and the current ``schema``, or ResultsFileError."""
    try:
        record = json.loads(raw.decode("utf-8"), parse_int=integer)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ResultsFileError(f"{where} is not valid JSON ({exc})") from None
    except RecursionError:
        raise ResultsFileError(f"{where} is nested too deeply to be a results record") from None
    if not isinstance(record, dict) or "kind" not in record or "schema" not in record:
        raise ResultsFileError(f"{where} is not a results record (a JSON object with 'kind' and 'schema')")
    if record["schema"] not in range(OLDEST_SCHEMA, SCHEMA_VERSION + 1):
        raise ResultsFileError(
            f"file {path} was written with results schema {record['schema']}; this attnbench reads schemas {OLDEST_SCHEMA} to {SCHEMA_VERSION} ({where})"
        )
    if record["kind"] not in REQUIRED:
        raise ResultsFileError(f"{where} has unknown kind {record['kind']!r} (expected 'run' or 'cell')")
    missing = _missing_key(record, record["kind"])
    if missing is not None:
        raise ResultsFileError(f"{where} ({record['kind']} line) is missing the required key {missing!r}")
    if record["kind"] == "cell":
        record["metrics"] = _decode(record.get("metrics", {}))
    if (wrong := type_error(record, LONG_DIGITS.search(raw) is not None)) is not None:
        raise ResultsFileError(f"{where} ({record['kind']} line): {wrong}")
    return record


def _check_cell(record: dict, run_ids: set, where: str) -> None:
    """A cell must follow the run line it belongs to and carry a known status."""
    if not run_ids:
        raise ResultsFileError(f"{where} is a cell before any run line")
    if record["run_id"] not in run_ids:
        raise ResultsFileError(f"{where} belongs to run {record['run_id']!r}, which no run line above declares")
    if record["status"] not in STATUSES:
        raise ResultsFileError(f"{where} has status {record['status']!r}, not one of {', '.join(STATUSES)}")
    if record["status"] == "ok":
        metrics = record.get("metrics") or {}
        for name in TIMINGS:
            values = metrics.get(name)
            for value in values if isinstance(values, list) else [] if values is None else [values]:
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                    raise ResultsFileError(f"{where}: an ok cell's metrics.{name} must hold finite numbers >= 0, got {value!r}")


def read_records(path) -> list[dict]:
    """Every record of one results file, in order, metrics decoded; strict about every line."""
    path = Path(path)
    if not path.exists():
        raise ResultsFileError(f"results file {path} does not exist")
    if not path.is_file():
        raise ResultsFileError(f"results file {path} is not a file")
    lines = path.read_bytes().split(b"\n")
    if lines == [b""]:
        raise ResultsFileError(f"results file {path} is empty")
    if lines[-1] != b"":
        raise ResultsFileError(
            f"{path}, line {len(lines)}: the last line is incomplete (no trailing newline), so the "
            "run was interrupted while writing it; `attnbench run --resume` repairs the file"
        )
    records, run_ids = [], set()
    for number, raw in enumerate(lines[:-1], start=1):
        where = f"{path}, line {number}"
        record = parse_line(raw, path, where)
        if record["kind"] == "run":
            run_ids.add(record["run_id"])
        else:
            _check_cell(record, run_ids, where)
        records.append(_upgrade(record))
    return records


def _upgrade(record: dict) -> dict:
    """A record of an older schema as the current schema writes it. 1 -> 2: schema 1 took a fixed
    number of samples, so its cells get the ``rel_ci`` of their samples and no ``unstable`` verdict
    (as a cell sampled with ``target_rel_ci: null``); its runs were not calibrated
    (``machine.calibration`` null), so no cell has a roofline fraction."""
    if record["schema"] == 1:
        if record["kind"] == "run":
            record["machine"] = {**record["machine"], "calibration": None}
        elif record["status"] in ("ok", "nan") and record["metrics"].get("samples_s"):
            record["metrics"]["rel_ci"] = median_rel_ci(record["metrics"]["samples_s"])
        record["schema"] = 2
    return record


def completed_cell_ids(path, *, retry_failed: bool = False) -> set[str]:
    """The cell_ids already recorded in ``path`` (for ``--resume``): whatever their status, or
    with ``retry_failed`` only those whose latest record did not fail (``FAILED``)."""
    latest = {record["cell_id"]: record["status"] for record in read_records(path) if record["kind"] == "cell"}
    return {cell_id for cell_id, status in latest.items() if not (retry_failed and status in FAILED)}


def _expand(paths) -> list[Path]:
    """Results files named by ``paths``: files as given, directories as their sorted *.jsonl."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files = []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(path.glob("*.jsonl"))
            if not found:
                raise ResultsFileError(f"results directory {path} holds no *.jsonl files")
            files.extend(found)
        else:
            files.append(path)
    if not files:
        raise ValueError("load() needs at least one results file or directory")
    return files


def _cell_rows(path: Path, runs: list | None = None) -> list[dict]:
    """The cell records of one file, each with its file name and its run's machine fingerprint (its run lines,
    each with its file, appended to ``runs`` when given)."""
    records = read_records(path)
    if runs is not None:
        runs += [dict(record, file=str(path)) for record in records if record["kind"] == "run"]
    machines = {record["run_id"]: record["machine"] for record in records if record["kind"] == "run"}
    return [{"file": str(path), **record, "machine": machines[record["run_id"]]} for record in records if record["kind"] == "cell"]


def load(paths: str | os.PathLike | Iterable[str | os.PathLike], *, runs: list | None = None) -> pd.DataFrame:
    """One row per cell across all files; nested fields become dotted columns (``axes.seq_len``,
    ``metrics.median_s``, ``machine.gpu.name``); lists stay whole. Any bad file raises. ``runs``, a list,
    receives every run line (with its file) as well: each file is read once."""
    rows = [row for path in _expand(paths) for row in _cell_rows(path, runs)]
    if not rows:
        return pd.DataFrame(columns=COLUMNS)
    machines = [row.pop("machine") for row in rows]  # one fingerprint a run, the same dict in each of its cells: flattened once
    flat = {key: pd.json_normalize({"machine": machine}, sep=".").iloc[0].to_dict() for key, machine in {id(m): m for m in machines}.items()}
    frame = pd.concat([pd.json_normalize(rows, sep="."), pd.DataFrame([flat[id(machine)] for machine in machines])], axis=1)
    frame = frame.drop(columns=["kind", "schema"])
    return frame.reindex(columns=COLUMNS + [c for c in frame.columns if c not in COLUMNS])

"""The run loop: measure a scenario's cells, resumably, into one results file.

An executor (harness.running.executors: a local worker process, or Ray) measures the cells; the run
loop (``measure_cells``) hands each finished cell to a journal, which writes its record at once:
for ``attnbench run`` the results file (``ResultsJournal``), for ``attnbench regress`` each
revision's rounds. So Ctrl-C or a crash of the runner itself keeps every finished cell, and
``--resume`` measures only what is missing.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import re
import shutil
import stat
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from ..common.files import open_regular
from ..measuring import machine, profiling
from ..measuring.busyness import busy_warning, other_cores_now, run_threads, timed_on_cpu
from ..results import FAILING, ResultsWriteError, ResultsWriter, cell_record, completed_cell_ids, parse_line, read_records, run_header, utc_now
from ..results.locking import MachineRuns, ResultsDirectoryLock, describe_runs
from ..scenarios.cell import Cell
from ..scenarios.expansion import describe
from ..scenarios.scenario import LoadedScenario
from .executors import main_device
from .executors.local import LocalExecutor
from .progress import progress_bar

#: The most of a results file ``--resume`` reads before taking its lock: its first line (a run line).
FIRST_LINE_BYTES = 1 << 20


class RunError(RuntimeError):
    """A run that cannot start or go on (an unwritable directory, a file that is not this
    scenario's to resume, another run in the directory); the message says what to do."""


@dataclass
class RunSummary:
    path: Path
    total: int
    skipped_as_done: int
    statuses: dict = field(default_factory=dict)
    seconds: float = 0.0
    interrupted: bool = False
    write_error: str | None = None
    timed: int = 0  #: cells with a stability verdict (metrics.unstable)
    unstable: list = field(default_factory=list)  #: describe() of each unstable cell
    other_cpu_s: float = 0.0  #: CPU seconds other processes used during the cells
    load_wall_s: float = 0.0  #: wall seconds of the cells those were counted over
    cores: int | None = None
    failures: list = field(default_factory=list)  #: (describe(cell), status, message) of each cell measured FAILING or inaccurate (``problem``)
    earlier_failures: list = field(default_factory=list)  #: the same of the cells a resumed file holds so and this run left alone

    def count(self, cell: Cell, record: dict) -> None:
        """Add a finished cell: its status, whether it was unstable, the load it saw."""
        self.statuses[record["status"]] = self.statuses.get(record["status"], 0) + 1
        if (found := problem(record)) is not None:
            self.failures.append((describe(cell), *found))
        metrics = record["metrics"]
        if metrics.get("unstable") is not None:
            self.timed += 1
            if metrics["unstable"]:
                self.unstable.append(describe(cell))
        load = metrics.get("load") or {}
        if load.get("other_cpu_s") is not None:
            self.other_cpu_s += load["other_cpu_s"]
            self.load_wall_s += load["wall_s"]
            self.cores = load["cores"]

    def headline(self) -> str:
        """ "36 cells (34 ok, 2 oom, 4 already done) in 81.2 s -> results/x.jsonl": what ``attnbench run`` says of a run."""
        counts = ", ".join(f"{count} {status}" for status, count in sorted(self.statuses.items())) or "nothing new"
        done = f", {self.skipped_as_done} already done" if self.skipped_as_done else ""
        return f"{self.total} cells ({counts}{done}) in {self.seconds:.1f} s -> {self.path}"

    def stability(self, names: int = 5) -> str:
        """ "3 of 36 timed cells unstable (...); other processes used 1.7 of 2 cores during the run"."""
        listed = "; ".join(self.unstable[:names]) + (f"; and {len(self.unstable) - names} more" if len(self.unstable) > names else "")
        text = f"{len(self.unstable)} of {self.timed} timed cells unstable" + (f" ({listed})" if listed else "") if self.timed else "no timed cells"
        if self.load_wall_s > 0:
            text += f"; other processes used {self.other_cpu_s / self.load_wall_s:.1f} of {self.cores} cores during the run"
        return text

    @property
    def failed(self) -> bool:
        """Whether a cell of the file ends this run ``FAILING`` or inaccurate: measured so now, or earlier and not retried."""
        return bool(self.failures or self.earlier_failures)

    def failure_lines(self, names: int = 3) -> list[str]:
        """ "2 cells failed: fault_error[torch] forward/core ... (error: RuntimeError: injected failure); ...",
        "1 cell inaccurate: ... (inaccurate: rel_error 1.0e-02 > 0.0001 against reference)" and, after a resume,
        the same of the cells so earlier; empty when none failed."""
        lines = []
        for failures, earlier in ((self.failures, False), (self.earlier_failures, True)):
            for inaccurate in (False, True):
                chosen = [failure for failure in failures if (failure[1] == "inaccurate") == inaccurate]
                if not chosen:
                    continue
                what = "inaccurate" if inaccurate else "failed"
                what += (" in an earlier run" + ("" if inaccurate else " (--retry-failed runs them again)")) if earlier else ""
                listed = "; ".join(f"{name} ({status}: {_first_line(message)})" for name, status, message in chosen[:names])
                more = f"; and {len(chosen) - names} more" if len(chosen) > names else ""
                lines.append(f"{len(chosen)} {'cell' if len(chosen) == 1 else 'cells'} {what}: {listed}{more}")
        return lines


def problem(record: dict) -> tuple[str, str] | None:
    """``(status, message)`` of a cell record that makes a run exit 1: a ``FAILING`` status, or an ok
    cell whose output is beyond its dtype's tolerance of the float64 reference (``metrics.inaccurate``,
    ``harness.measuring.accuracy``); None otherwise."""
    if record["status"] in FAILING:
        return record["status"], record["error"]
    metrics = record.get("metrics") or {}
    if record["status"] == "ok" and metrics.get("inaccurate"):
        return "inaccurate", f"rel_error {metrics['rel_error']:.1e} > {metrics['rel_error_tolerance']:g} against {metrics['rel_error_reference']}"
    return None


def _first_line(text: str | None) -> str:
    lines = (text or "").strip().splitlines()
    return lines[0] if lines else "no message"


def _results_file_pattern(name: str) -> re.Pattern:
    """The name of a results file of scenario ``name`` and no other: ``NAME-YYYYMMDDTHHMMSSZ.jsonl``."""
    return re.compile(re.escape(name) + r"-\d{8}T\d{6}Z\.jsonl")


def results_path(out_dir: Path, name: str, resume) -> Path:
    """The file to write: a new timestamped one, or with ``resume`` the given file or the
    latest one of this scenario in ``out_dir``."""
    if resume is True:
        pattern = _results_file_pattern(name)
        candidates = sorted(path for path in out_dir.glob("*.jsonl") if pattern.fullmatch(path.name))
        if not candidates:
            raise RunError(f"--resume: no results of scenario {name!r} in {out_dir} to resume")
        return candidates[-1]
    if resume:
        return Path(resume)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return out_dir / f"{name}-{stamp}.jsonl"


def scenario_identity(loaded: LoadedScenario) -> dict:
    """What a resumed file must have been measured for: the scenario's name, the hash of its
    file and the preset (the run line records all three)."""
    return {"scenario": loaded.name, "scenario_sha256": loaded.sha256, "preset": loaded.preset}


def resumable_file(resume, loaded: LoadedScenario) -> Path:
    """The real path of the file ``--resume FILE`` names, checked before anything is created
    beside it: a regular file whose first line is a run line of this scenario (else ``RunError``)."""
    given = Path(resume)
    path = given.resolve()
    if not path.exists():
        raise RunError(f"--resume: {given} does not exist")
    if not stat.S_ISREG(path.stat().st_mode):
        raise RunError(f"--resume: {given} is not a regular file (a results file to continue)")
    with open(open_regular(path, os.O_RDONLY), "rb") as file:
        first = file.readline(FIRST_LINE_BYTES)
    if not first:
        raise RunError(f"--resume: results file {given} is empty")
    if not first.endswith(b"\n"):
        raise RunError(f"--resume: {given} is not a results file (its first line is not a whole run line)")
    record = parse_line(first, given, f"{given}, line 1")
    if record["kind"] != "run":
        raise RunError(f"--resume: {given}, line 1 is a {record['kind']} line; a results file starts with its run line")
    if record["scenario"] != loaded.name:
        raise RunError(f"--resume: {given} was measured for another scenario, {record['scenario']!r} (this run: {loaded.name!r})")
    return path


def append_writer(path: Path) -> ResultsWriter:
    """The writer of a run into results file ``path``: a new file created at its first line, or an existing one (run
    --commits --force, a commit that cannot run) held at once, an incomplete last line an interrupted write left cut first."""
    if not path.exists():
        return ResultsWriter(path)
    writer = ResultsWriter(path, create=False)
    _repair(writer)
    return writer


def _repair(writer: ResultsWriter) -> None:
    """Cut an incomplete last line of the file ``writer`` holds (an interrupted write), saying so, before lines follow it."""
    if writer.repair_tail():
        print(f"warning: {writer.path}: dropped an incomplete last line left by an interrupted write", file=sys.stderr)


def _resume_state(writer: ResultsWriter, loaded: LoadedScenario, fingerprint: dict, retry_failed: bool, *, same_machine: bool = True) -> tuple[str, set]:
    """(the run_id resumed, the cell_ids not to measure again) of the results file ``writer``
    holds, when this run may continue it: the same scenario, file, preset and ``--set``
    overrides, measured on this machine (``same_machine``: one of its run lines has this
    machine's id; a run on several devices writes one per device, and a Ray run's cells record
    each its own machine, so any machine may continue it)."""
    path = writer.path
    _repair(writer)
    runs = [record for record in read_records(path) if record["kind"] == "run"]
    wanted = scenario_identity(loaded)
    differ = [f"{key} {runs[0].get(key)!r} (this run: {value!r})" for key, value in wanted.items() if runs[0].get(key) != value]
    if differ:
        raise RunError(
            f"--resume: {path} was measured for another scenario: {'; '.join(differ)}. Results of two scenarios (or two "
            "versions of one scenario file) do not mix in one file: start a new run (a report reads several files)"
        )
    recorded = list(runs[0].get("overrides") or [])
    if recorded != list(loaded.overrides):
        gone = [f"--set {o}" for o in recorded if o not in loaded.overrides]
        new = [f"--set {o}" for o in loaded.overrides if o not in recorded]
        difference = "; ".join([*(f"without {o} (the file's run had it)" for o in gone), *(f"with {o} (the file's run had not)" for o in new)])
        raise RunError(
            f"--resume: {path} was measured with other overrides: this run is {difference or 'in another order of --set'}. "
            "Cells of two configurations do not mix in one file: repeat the file's --set options, or start a new run"
        )
    if same_machine and fingerprint["machine_id"] not in {run["machine"]["machine_id"] for run in runs}:
        raise RunError(
            f"--resume: {path} was measured on machine {runs[-1]['machine']['machine_id']} "
            f"({runs[-1]['machine'].get('hostname')}); this is {fingerprint['machine_id']}. "
            "Results of two machines do not mix in one run: start a new run instead."
        )
    return runs[-1]["run_id"], completed_cell_ids(path, retry_failed=retry_failed)


def _failures_in(path: Path, cells: list[Cell], cell_ids: set) -> list[tuple]:
    """(describe(cell), status, message) of each of ``cells`` in ``cell_ids`` whose latest record in ``path`` is a ``problem``."""
    latest = {record["cell_id"]: record for record in read_records(path) if record["kind"] == "cell"}
    found = [(cell, problem(latest[cell.cell_id])) for cell in cells if cell.cell_id in cell_ids]
    return [(describe(cell), *problem_found) for cell, problem_found in found if problem_found is not None]


def measure_cells(executor, todo: list[Cell], fingerprint: dict, journal, bar: tqdm, label=describe) -> None:
    """The run loop: ``executor`` measures ``todo`` (``fingerprint``: the main device's machine);
    ``journal`` gets a ``run_line(fingerprint, node_id)`` for each run line the executor asks for
    at its start, ``starting(cell)`` before each cell and ``cell_line(cell, observation)`` as each
    finishes; ``bar`` shows ``label(cell)`` and counts the cells. The executor is closed however
    the loop ends (Ctrl-C, a full disk)."""

    def starting(cell: Cell) -> None:
        bar.set_description(label(cell))
        journal.starting(cell)

    try:
        for fp in executor.start(todo, fingerprint):
            journal.run_line(fp, None)
        for cell, observation in executor.measure(todo, starting):
            journal.cell_line(cell, observation)
            bar.update()
    finally:
        executor.close()


class ResultsJournal:
    """What ``attnbench run`` keeps of each cell: its record, appended to the results file at once
    under the run line of the machine (and Ray node) that measured it, written before that
    machine's first cell (``header(run_id, fingerprint, node_id)``), with the other attnbench runs
    that measured on this machine meanwhile (``concurrent_runs``); counted in ``summary``."""

    def __init__(self, writer: ResultsWriter, header, summary: RunSummary, machine_runs: MachineRuns, machine_id: str):
        self.writer, self.header, self.summary, self.machine_runs, self.machine_id = writer, header, summary, machine_runs, machine_id
        self.run_ids, self.overlapping, self.warned = {}, {}, set()

    def run_line(self, fp: dict, node_id) -> str:
        """The run_id of the run line of ``fp``'s machine and ``node_id``, written now if it is new."""
        key = (node_id, fp["machine_id"])
        if key not in self.run_ids:
            self.run_ids[key] = uuid.uuid4().hex
            self.writer.write_run(self.header(self.run_ids[key], fp, node_id))
        return self.run_ids[key]

    def starting(self, cell: Cell) -> None:
        others = self.machine_runs.others()
        if others and not self.warned.issuperset(o.get("pid") for o in others):
            self.warned.update(o.get("pid") for o in others)
            tqdm.write(
                f"warning: other attnbench runs are measuring on this machine ({describe_runs(others)}); "
                "cells measured meanwhile record them in concurrent_runs",
                file=sys.stderr,
            )
        self.overlapping[cell.cell_id] = others

    def cell_line(self, cell: Cell, observation: dict) -> None:
        node_fp = observation["machine"]
        trace = observation["result"].pop("trace", None)
        record = cell_record(cell, observation, self.run_line(node_fp, observation["node_id"]), node_fp)
        if trace is not None:  # --profile: the trace goes beside the results file, its name into the record
            record["metrics"]["profile"]["trace"] = profiling.write_trace(self.writer.path, cell.cell_id, trace)
        others = self.overlapping.pop(cell.cell_id, None)
        if others and node_fp["machine_id"] == self.machine_id:
            record["concurrent_runs"] = others
        self.writer.write_cell(record)
        if record["status"] == "ok" and cell.checkpoint_dir:
            remove_checkpoints(Path(cell.checkpoint_dir))
        self.summary.count(cell, record)


def run(
    loaded: LoadedScenario,
    out_dir,
    *,
    resume=False,
    retry_failed: bool = False,
    plugins=(),
    command: str = "",
    progress: bool = True,
    executor=None,
    profile: str | None = None,
    path: Path | None = None,
) -> RunSummary:
    """Measure every cell of ``loaded`` not yet in the results file; return a summary. One run
    at a time writes into a directory (``ResultsDirectoryLock``); other runs measuring on the
    machine meanwhile are warned about and recorded with each cell they overlap. ``executor``
    measures the cells (default: a ``LocalExecutor``; harness.running.executors.ray spreads them over a
    Ray cluster). ``profile`` (``--profile``: torch, ncu or nsys) profiles each cell once more
    after its timing (``harness.measuring.profiling``). ``path``: the new results file (default: ``NAME-TIME.jsonl`` in ``out_dir``)."""
    out_dir = Path(out_dir)
    if resume not in (False, True, None):
        resume = resumable_file(resume, loaded)
    directory = resume.parent if isinstance(resume, Path) else out_dir
    holder = {"pid": os.getpid(), "scenario": loaded.name, "started_at": utc_now(), "out": str(directory)}
    executor = executor or LocalExecutor(plugins)
    with ResultsDirectoryLock(directory, holder), MachineRuns(holder) as machine_runs:
        return _run_locked(loaded, out_dir, resume, retry_failed, executor, command, progress, machine_runs, profile, path)


def _run_locked(loaded, out_dir, resume, retry_failed, executor, command, progress, machine_runs, profile=None, path=None) -> RunSummary:
    cells = loaded.cells()
    path = results_path(out_dir, loaded.name, resume) if resume or path is None else path
    fingerprint = machine.fingerprint(main_device(cells))
    resumed_from, done = None, set()
    writer = ResultsWriter(path, create=False) if resume else append_writer(path)
    if resume:
        try:
            resumed_from, done = _resume_state(writer, loaded, fingerprint, retry_failed, same_machine=executor.same_machine)
        except BaseException:
            writer.close()
            raise
    todo = [profiling.request(with_checkpoint_dir(cell, path), profile, path) for cell in cells if cell.cell_id not in done]
    summary = RunSummary(path=path, total=len(cells), skipped_as_done=len(cells) - len(todo))
    if done:
        summary.earlier_failures = _failures_in(path, cells, done)

    threads = None  # a Ray executor's nodes choose their own (executors.ray)
    if executor.same_machine:
        other_cores = other_cores_now()
        earlier = earlier_threads(path) if resumed_from else None
        threads = earlier or run_threads(todo, fingerprint.get("cpu") or {}, other_cores)
        if busy := busy_warning(todo, other_cores, os.cpu_count(), threads):
            print(busy, file=sys.stderr)
    todo = [with_threads(cell, threads) for cell in todo]

    def header(run_id: str, fp: dict, node_id) -> dict:
        return run_header(loaded, run_id, command, fp, resumed_from=resumed_from, **{"torch_threads": threads, **executor.run_fields(node_id)})

    journal = ResultsJournal(writer, header, summary, machine_runs, fingerprint["machine_id"])
    start = time.perf_counter()
    try:
        with progress_bar(len(cells), initial=summary.skipped_as_done, shown=progress) as bar:
            measure_cells(executor, todo, fingerprint, journal, bar)
    except KeyboardInterrupt:
        summary.interrupted = True
    except ResultsWriteError as exc:
        summary.write_error = str(exc)
    finally:
        writer.close()
        summary.seconds = time.perf_counter() - start
    return summary


def earlier_threads(path: Path) -> int | None:
    """The threads the latest run line of a resumed file chose for its CPU cells (None: none): a resumed
    run keeps them, so that every CPU cell of the file is timed on the same terms."""
    return next((run.get("torch_threads") for run in reversed(read_records(path)) if run["kind"] == "run"), None)


def with_threads(cell: Cell, threads: int | None) -> Cell:
    """A timed CPU cell with its run's torch threads (``measure.threads``, chosen once per run:
    ``busyness.run_threads``), which its worker runs it on; any other cell as it is."""
    if threads is None or not timed_on_cpu(cell):
        return cell
    return cell.replace(measure={**cell.measure, "threads": threads})


def with_checkpoint_dir(cell: Cell, results: Path) -> Cell:
    """A quality cell with its own ``checkpoint_dir`` beside the results file
    (``<results>.checkpoints/<cell_id>``): its training saves its state there and continues
    from it when the cell is measured again (``--resume``); the runner removes it once the cell
    is recorded as ok. A speed cell as it is."""
    if not cell.quality:
        return cell
    return cell.replace(checkpoint_dir=str(results.with_suffix(".checkpoints") / cell.cell_id))


def remove_checkpoints(directory: Path) -> None:
    """Remove a recorded cell's checkpoint directory, and the results file's once it is empty."""
    shutil.rmtree(directory, ignore_errors=True)
    with contextlib.suppress(OSError):
        directory.parent.rmdir()

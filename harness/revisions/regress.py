"""``attnbench regress``: benchmark two git revisions of attnbench in one interleaved run.

1. Both revisions are checked out into temporary git worktrees (``harness.common.checkouts``; the head
   defaults to the working tree: HEAD plus a copy of every uncommitted change), removed afterwards.
2. In each revision's own fresh process (harness/revisions/regress_check.py, run in its worktree),
   every variant configuration of the scenario is checked against the float64 reference,
   on each backend whose forms are the project's own (``variants.backends.OWN_FORMS``: torch, triton),
   and the files its forms run are recorded.
3. The configurations whose files the diff changes are measured (all with ``all_variants``).
4. Their cells are measured in rounds, base and head alternating (base head, head base, ...),
   each side in a fresh worker process running its own revision's ``harness`` and
   ``variants`` (``worker.Worker(code_root=...)``), with its own Triton cache, through the
   run loop of ``attnbench run`` (``runner.measure_cells``).
5. Each cell's rounds are pooled into one record, one results file per side is written and
   the two are compared (``harness.results.compare``).

When the diff touches ``variants/kernels/``, the rows of ``attnbench kernels`` that compile
differently are compiled for both revisions and compared (``kernel_diff.for_regress``); a row
that got worse makes the exit code 1.

docs/regress.md explains the output and the exit codes.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from variants.backends import OWN_FORMS

from ..common.checkouts import SIDES, RegressError, Revision, changed_files, repository, worktrees
from ..measuring import machine
from ..measuring.measure import Timing
from ..results import ResultsWriter, cell_record, run_header
from ..results.compare import EXIT_OK, EXIT_REGRESSION, CompareResult, compare
from ..running import runner
from ..running.executors import main_device, unmeasured
from ..running.executors.local import LocalExecutor
from ..running.progress import progress_bar
from ..scenarios.cell import Cell
from ..scenarios.expansion import describe
from ..scenarios.scenario import LoadedScenario

CHECK_SCRIPT = Path(__file__).with_name("regress_check.py")
#: Runs a script by path without putting its directory on sys.path (this one's is harness/).
RUN_SCRIPT = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"


# --- correctness and what each configuration runs -----------------------------------------


def _config_key(variant: str, backend: str, params: dict) -> str:
    return json.dumps([variant, backend, params], sort_keys=True)


def _config_name(config: dict) -> str:
    params = ",".join(f"{key}={value}" for key, value in sorted(config["params"].items()))
    return f"{config['variant']}{'(' + params + ')' if params else ''}[{config['backend']}]"


def scenario_cells(loaded: LoadedScenario, only: set[str] | None = None) -> list[Cell]:
    """The scenario's cells, only those whose ``cell_id`` is in ``only`` when given."""
    return [cell for cell in loaded.cells() if only is None or cell.cell_id in only]


def configurations(loaded: LoadedScenario, only: set[str] | None = None) -> dict[str, dict]:
    """What to check: each variant configuration of the scenario's cells (``only``: of these cell ids),
    on each backend of ``OWN_FORMS``, at the smallest d_key of its cells; ``decode`` when the scenario measures decoding."""
    configs = {}
    for cell in scenario_cells(loaded, only):
        for backend in OWN_FORMS:
            config = configs.setdefault(
                _config_key(cell.variant, backend, cell.params),
                {"variant": cell.variant, "backend": backend, "params": cell.params, "d_key": cell.axes["d_key"]},
            )
            config["d_key"] = min(config["d_key"], cell.axes["d_key"])
            config["decode"] = "decode" in loaded.scenario.modes
    return configs


def check_revision(revision: Revision, configs: dict[str, dict]) -> dict[str, dict]:
    """Run harness/revisions/regress_check.py in ``revision``'s checkout: per configuration ``ok``,
    ``problems``, ``files`` (what ran) and ``unsupported`` (the backend does not exist there).
    A revision whose check cannot run at all (its variants do not import) fails every one."""
    env = {**os.environ, **revision.env, "PYTHONPATH": str(revision.root)}
    command = [sys.executable, "-c", RUN_SCRIPT, str(CHECK_SCRIPT)]
    done = subprocess.run(command, input=json.dumps(list(configs.values())), capture_output=True, text=True, cwd=revision.root, env=env)
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        return {key: {**config, "ok": False, "problems": [f"the check could not run: {reason}"], "files": []} for key, config in configs.items()}
    return dict(zip(configs, json.loads(done.stdout.splitlines()[-1])))  # the last line: a variant may print


def touched(changed: list[str], checks: dict[str, dict[str, dict]]) -> dict[str, list[str]]:
    """Per configuration, the changed files its forms run on either revision (only those that run any)."""
    found = {}
    for key in checks["base"]:
        ran = set(checks["base"][key].get("files", [])) | set(checks["head"][key].get("files", []))
        hit = sorted(ran.intersection(changed))
        if hit:
            found[key] = hit
    return found


# --- measuring in rounds ------------------------------------------------------------------


def pool(records: list[dict]) -> dict:
    """One record from a cell's measurements in several rounds: every round's raw samples
    together, the order statistics, interval and rates of them all, the largest peak memory,
    the load over all rounds; the other metrics are the first round's. A round that failed
    makes the cell fail."""
    failed = [record for record in records if record["status"] != "ok"]
    if failed:
        return failed[0]
    first = records[0]
    timing = Timing(tuple(sample for record in records for sample in record["metrics"]["samples_s"]), first["metrics"].get("target_rel_ci"))
    metrics = {
        **first["metrics"],
        **timing.summary(),
        "round_medians_s": [record["metrics"]["median_s"] for record in records],
        "round_samples_s": [record["metrics"]["samples_s"] for record in records],
    }
    loads = [record["metrics"].get("load") or {} for record in records]
    if all(load.get("other_cpu_s") is not None for load in loads):
        wall, other = sum(load["wall_s"] for load in loads), sum(load["other_cpu_s"] for load in loads)
        metrics["load"] = {
            **loads[0],
            "wall_s": wall,
            "other_cpu_s": other,
            "other_cores": other / wall if wall > 0 else None,
            "loadavg_after": loads[-1].get("loadavg_after"),
        }
    for rate, amount in (("tokens_per_s", "tokens"), ("flops_per_s", "flops"), ("words_per_s", "tokens")):
        if rate in metrics:
            metrics[rate] = metrics[amount] / timing.median_s
    memory = [record["metrics"].get("peak_mem_bytes") for record in records]
    if all(value is not None for value in memory):
        metrics["peak_mem_bytes"] = max(memory)
    return {**first, "metrics": metrics, "duration_s": sum(record["duration_s"] for record in records)}


class _Rounds:
    """The run loop's journal of one revision's round: each cell's record kept with its earlier rounds' (``pool`` makes one of them)."""

    def __init__(self, measured: dict, run_id: str):
        self.measured, self.run_id = measured, run_id

    def run_line(self, fingerprint: dict, node_id) -> None:
        """Nothing yet: each side's file gets its run line with the pooled records."""

    def starting(self, cell: Cell) -> None:
        pass

    def cell_line(self, cell: Cell, observation: dict) -> None:
        self.measured[cell.cell_id].append(cell_record(cell, observation, self.run_id, observation["machine"]))


def measure_rounds(revisions, cells: dict[str, list[Cell]], rounds: int, fingerprints: dict, run_ids: dict, progress: bool) -> dict:
    """``{side: {cell_id: [record per round]}}``: each side's ``cells[side]`` measured ``rounds``
    times by the run loop (``runner.measure_cells``), the sides alternating (base head, head
    base, ...) so that drift hits both alike; each side's round in a fresh worker of its own
    checkout, kept from cell to cell (regress compares time, not peak memory) unless a cell
    failed or asks for a fresh one (``measure.fresh_worker``)."""
    measured = {side: {cell.cell_id: [] for cell in side_cells} for side, side_cells in cells.items()}
    with progress_bar(rounds * sum(map(len, cells.values())), shown=progress) as bar:
        for number in range(rounds):
            for revision in revisions if number % 2 == 0 else revisions[::-1]:
                if not cells[revision.side]:
                    continue
                side = revision.side
                executor = LocalExecutor(code_root=revision.root, env=revision.env, shared=True, fingerprint=fingerprints[side])
                journal = _Rounds(measured[side], run_ids[side])
                label = lambda cell, number=number, side=side: f"round {number + 1}/{rounds} {side}: {describe(cell)}"
                runner.measure_cells(executor, cells[side], fingerprints[side], journal, bar, label)
    return measured


def _incorrect_record(cell: Cell, check: dict, run_id: str, fingerprint: dict) -> dict:
    """The record of a cell that is not timed because its revision computes the wrong thing."""
    return cell_record(cell, unmeasured("error", "incorrect, not timed: " + "; ".join(check["problems"])), run_id, fingerprint)


# --- the whole run ------------------------------------------------------------------------


@dataclass
class RegressResult:
    """What ``regress`` found: the correctness checks, the touched configurations, the
    comparison (None when nothing was measured) and the results files."""

    revisions: tuple[Revision, Revision]
    changed: list[str]
    checks: dict
    touched: dict
    comparison: CompareResult | None = None
    paths: dict = field(default_factory=dict)
    kernel_changes: list | None = None  #: the static kernel diff's changed rows (None: not run)

    def incorrect(self, side: str) -> list[dict]:
        return [check for check in self.checks[side].values() if not check["ok"]]

    @property
    def kernels_worse(self) -> list:
        """The rows of the static kernel diff that got worse."""
        return [change for change in self.kernel_changes or () if change.regressions]

    @property
    def exit_code(self) -> int:
        """1 when the head computes a wrong result anywhere or a kernel row got worse; otherwise
        compare's exit code (0 when nothing needed measuring)."""
        if self.incorrect("head") or self.kernels_worse:
            return EXIT_REGRESSION
        return EXIT_OK if self.comparison is None else self.comparison.exit_code


def regress(
    repo,
    loaded: LoadedScenario,
    *,
    base: str,
    head: str | None = None,
    all_variants: bool = False,
    rounds: int = 3,
    threads: int | None = 1,
    out_dir=Path("results"),
    factor: float = 1.1,
    alpha: float = 0.05,
    command: str = "",
    progress: bool = True,
    say=print,
    cells: set[str] | None = None,
    kernel_diff: bool = True,
) -> RegressResult:
    """Check, then measure ``loaded``'s cells on revisions ``base`` and ``head`` (None: the
    working tree) of the repository at ``repo``, with ``threads`` CPU threads per process
    (None: PyTorch's default); ``say`` prints each step's outcome. ``cells``: only the cells of
    these ids are checked and measured (``attnbench bisect``'s probes), still only where touched
    unless ``all_variants``. ``kernel_diff``: compare the compiled kernels when the diff touches them."""
    if rounds < 1:
        raise RegressError(f"--rounds must be at least 1, got {rounds}")
    if threads is not None and threads < 1:
        raise RegressError(f"--threads must be at least 1 (or 0 for PyTorch's default), got {threads}")
    if loaded.scenario.task is not None:
        raise RegressError(f"{loaded.path}: regress measures speed scenarios (modes forward, train, decode), not quality tasks")
    repo = repository(repo)
    with worktrees(repo, base, head) as revisions:
        for revision in revisions:
            revision.threads = threads
            say(f"{revision.side} = {revision.describe()}")
        changed = changed_files(*revisions)
        say("changed files: " + (", ".join(changed) or "none"))
        if not all_variants and not any(path.endswith(".py") for path in changed):
            say("nothing to check or measure: the diff changes no Python file")
            return RegressResult(revisions, changed, {side: {} for side in SIDES}, {})
        configs = configurations(loaded, cells)
        say(f"checking {len(configs)} configurations against the float64 reference in each revision ...")
        with ThreadPoolExecutor(len(revisions)) as threads:
            checks = dict(zip(SIDES, threads.map(lambda revision: check_revision(revision, configs), revisions)))
        result = RegressResult(revisions, changed, checks, touched(changed, checks))
        _say_checks(result, say)
        if kernel_diff:
            result.kernel_changes = _kernel_diff(revisions, changed, say)
        chosen = _cells_to_measure(scenario_cells(loaded, cells), result, all_variants)
        if not chosen:
            say("nothing to measure: the diff touches no variant configuration of the scenario")
            return result
        result.comparison, result.paths = _measure_and_compare(revisions, chosen, checks, loaded, rounds, Path(out_dir), factor, alpha, command, progress, say)
    return result


def _cells_to_measure(cells: list[Cell], result: RegressResult, all_variants: bool) -> list[Cell]:
    """Every one of ``cells`` with ``all_variants``; otherwise those of the touched configurations and
    of any configuration that is incorrect on either side (so that compare marks it)."""
    if all_variants:
        return cells
    chosen = set(result.touched) | {key for side in SIDES for key, check in result.checks[side].items() if not check["ok"]}
    return [cell for cell in cells if _config_key(cell.variant, cell.backend, cell.params) in chosen]


def _kernel_diff(revisions, changed: list[str], say) -> list | None:
    """The static kernel diff (``kernel_diff.for_regress``); None, said, when the kernels cannot be tabled (no Triton, ...)."""
    from ..kernels.kernel_diff import for_regress
    from ..kernels.kernel_table import KernelTableError

    try:
        return for_regress(*revisions, changed, say)
    except KernelTableError as exc:
        say(f"kernels: not compared: {exc}")
        return None


def _check_of(checks: dict, cell: Cell) -> dict:
    return checks[_config_key(cell.variant, cell.backend, cell.params)]


def _say_checks(result: RegressResult, say) -> None:
    for side in SIDES:
        checks = result.checks[side].values()
        correct = [check for check in checks if check["ok"] and not check.get("unsupported")]
        unsupported = sum(bool(check.get("unsupported")) for check in checks)
        say(f"{side}: {len(correct)} configurations correct, {len(result.incorrect(side))} incorrect, {unsupported} without such a backend")
        for check in result.incorrect(side):
            say(f"  INCORRECT on {side}: {_config_name(check)} at d_key={check['d_key']}: " + "; ".join(check["problems"]))
    if result.touched:
        say("touched: " + "; ".join(f"{_config_name(result.checks['head'][key])} <- {', '.join(files)}" for key, files in result.touched.items()))


def _measure_and_compare(revisions, cells, checks, loaded, rounds, out_dir, factor, alpha, command, progress, say):
    """Measure the correct sides of ``cells`` in rounds, write base.jsonl and head.jsonl, compare."""
    common = machine.fingerprint(main_device(cells))
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    folder = out_dir / f"regress-{loaded.name}-{stamp}"
    fingerprints, run_ids, paths, timed = {}, {}, {}, {}
    for revision in revisions:
        fingerprints[revision.side] = {
            **common,
            "git": {"commit": revision.commit, "dirty": bool(revision.dirty_files), "describe": revision.commit[:10]},
        }
        run_ids[revision.side] = uuid.uuid4().hex
        timed[revision.side] = [cell for cell in cells if _check_of(checks[revision.side], cell)["ok"]]
    say(
        f"measuring {len(cells)} cells ({', '.join(f'{len(timed[side])} timed on {side}' for side in SIDES)}), "
        f"{rounds} rounds, base and head alternating, fresh processes"
        + ("" if revisions[0].threads is None else f" of {revisions[0].threads} CPU thread(s)")
        + f" -> {folder}/"
    )
    measured = measure_rounds(revisions, timed, rounds, fingerprints, run_ids, progress)
    for revision in revisions:
        side = revision.side
        paths[side] = folder / f"{side}.jsonl"
        writer = ResultsWriter(paths[side])
        writer.write_run(
            run_header(
                loaded,
                run_ids[side],
                command,
                fingerprints[side],
                commit=revision.commit,
                dirty=bool(revision.dirty_files),
                revision={"side": side, "label": revision.label, "commit": revision.commit, "dirty_files": revision.dirty_files},
                rounds=rounds,
            )
        )
        for cell in cells:
            check = _check_of(checks[side], cell)
            if check["ok"]:
                record = pool(measured[side][cell.cell_id])
            else:
                record = _incorrect_record(cell, check, run_ids[side], fingerprints[side])
            writer.write_cell({**record, "revision": side})
    return compare([paths["base"]], [paths["head"]], factor=factor, alpha=alpha), paths

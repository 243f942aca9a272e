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
   the two are compared (``harness.results.compare``). Touched cells too noisy to judge get more rounds
   (``next_steps.MAX_DOUBLINGS``); measured cells whose code did not change are controls (``next_steps``).
6. The ending (``RegressResult.ending``) says what the controls allow and the command to run next.

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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from variants.backends import OWN_FORMS

from ..common.checkouts import SIDES, RegressError, Revision, changed_files, git, repository, worktrees
from ..measuring import machine
from ..measuring.measure import Timing
from ..results import ResultsWriter, cell_record, load, run_header
from ..results.compare import EXIT_INCOMPARABLE, EXIT_OK, EXIT_REGRESSION, CompareResult, compare
from ..results.identity import identify, params_text
from ..running import runner
from ..running.executors import main_device, unmeasured
from ..running.executors.local import LocalExecutor
from ..running.progress import progress_bar
from ..scenarios.cell import Cell
from ..scenarios.expansion import describe
from ..scenarios.scenario import LoadedScenario
from ..scenarios.scenario_files import SCENARIO_DIR
from .next_steps import MAX_DOUBLINGS, Invocation, mark_controls, next_steps, noisy_rows, trusted, verdict_lines

CHECK_SCRIPT = Path(__file__).with_name("regress_check.py")
#: Runs a script by path without putting its directory on sys.path (this one's is harness/).
RUN_SCRIPT = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
#: The longest a revision's correctness check may take (its import and every form of the touched variants in float64 on
#: the CPU: well under a minute for all eleven on the 2-core development VM); a check that hangs fails the revision.
CHECK_TIMEOUT_S = 600
#: The columns that name a cell in compare's table and in the identified results frame.
ROW_KEY = ("scenario", "variant", "backend", "params", "axes", "mode", "target")


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
    A revision whose check cannot run at all (its variants do not import) or does not end within ``CHECK_TIMEOUT_S``
    fails every one."""
    env = {**os.environ, **revision.env, "PYTHONPATH": str(revision.root)}
    command = [sys.executable, "-c", RUN_SCRIPT, str(CHECK_SCRIPT)]
    try:
        done = subprocess.run(
            command, input=json.dumps(list(configs.values())), capture_output=True, text=True, cwd=revision.root, env=env, timeout=CHECK_TIMEOUT_S
        )
        reason = None if done.returncode == 0 else (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
    except subprocess.TimeoutExpired:
        reason = f"it did not end within {CHECK_TIMEOUT_S:g} s (regress.CHECK_TIMEOUT_S): does the revision's import hang?"
    if reason is not None:
        return {key: {**config, "ok": False, "problems": [f"the check could not run: {reason}"], "files": []} for key, config in configs.items()}
    return dict(zip(configs, json.loads(done.stdout.splitlines()[-1])))  # the last line: a variant may print


def first_parent_commits(repo: Path, base_commit: str, head_commit: str) -> list[tuple[str, str]] | None:
    """(commit, subject) of ``git log --first-parent --reverse base..head``; None when base is not an ancestor of head
    (or the two share no history)."""
    try:
        if git(repo, "merge-base", base_commit, head_commit) != base_commit:
            return None
    except RegressError:  # no merge base
        return None
    lines = git(repo, "log", "--first-parent", "--reverse", "--format=%H %s", f"{base_commit}..{head_commit}").splitlines()
    return [tuple(line.split(" ", 1)) if " " in line else (line, "") for line in lines]


def row_key(row: dict) -> tuple:
    return tuple(row[column] for column in ROW_KEY)


def row_cell_ids(comparison: CompareResult, path: Path) -> list[str]:
    """The cell id of each row of ``comparison``'s table, from the records of ``path`` (a side's results file), matched
    by the identity columns compare's table is made of."""
    frame = identify(load([path])).rename(columns={"params_text": "params", "axes_text": "axes"})
    ids = {row_key(record): record["cell_id"] for record in frame.to_dict("records")}
    return [ids[row_key(row)] for row in comparison.table.to_dict("records")]


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
    the load over all rounds, disturbed when any round was (and so unstable); the other metrics are the first round's.
    A round that failed makes the cell fail."""
    failed = [record for record in records if record["status"] != "ok"]
    if failed:
        return failed[0]
    first = records[0]
    judged = [record["metrics"]["disturbed"] for record in records if record["metrics"].get("disturbed") is not None]
    samples = tuple(sample for record in records for sample in record["metrics"]["samples_s"])
    timing = Timing(samples, first["metrics"].get("target_rel_ci"), any(judged) if judged else None)
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
    failed or asks for a fresh one (``measure.fresh_worker``). The bar (``progress``) only where stderr is a terminal."""
    measured = {side: {cell.cell_id: [] for cell in side_cells} for side, side_cells in cells.items()}
    with progress_bar(rounds * sum(map(len, cells.values())), shown=progress and sys.stderr.isatty()) as bar:  # no bar in a CI log
        for number in range(rounds):
            for revision in revisions if number % 2 == 0 else revisions[::-1]:
                if not cells[revision.side]:
                    continue
                side = revision.side
                executor = LocalExecutor(revision.plugins, code_root=revision.root, env=revision.env, shared=True, fingerprint=fingerprints[side])
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
    invocation: Invocation | None = None  #: what was run, for the command to run next
    rounds: int = 3  #: the rounds of every measured cell
    rounds_noisy: int = 3  #: the rounds of the cells measured again because they were noisy (``rounds`` when none were)

    def incorrect(self, side: str) -> list[dict]:
        return [check for check in self.checks[side].values() if not check["ok"]]

    @property
    def kernels_worse(self) -> list:
        """The rows of the static kernel diff that got worse."""
        return [change for change in self.kernel_changes or () if change.regressions]

    @property
    def exit_code(self) -> int:
        """1 when the head computes a wrong result anywhere or a kernel row got worse; 2 when a control moved (the
        timings are not trusted); otherwise compare's exit code (0 when nothing needed measuring)."""
        if self.incorrect("head") or self.kernels_worse:
            return EXIT_REGRESSION
        if self.comparison is None:
            return EXIT_OK
        return self.comparison.exit_code if trusted(self.comparison) else EXIT_INCOMPARABLE

    def ending(self) -> str:
        """What ``attnbench regress`` prints once done: the table, the touched cells and the controls, the results
        files, the exit code and why, then the command to run next."""
        lines = []
        if self.comparison is not None:
            lines += [self.comparison.format_table(summary=False), *verdict_lines(self.comparison)]
            lines.append(f"results: {self.paths['base']} and {self.paths['head']}")
        why = [what for what, true in (("the head is incorrect", self.incorrect("head")), ("a kernel row got worse", self.kernels_worse)) if true]
        if self.comparison is not None and not trusted(self.comparison):
            why.append("not trusted: the controls moved")
        lines.append(f"attnbench regress: exit code {self.exit_code}" + (f" ({'; '.join(why)})" if why else ""))
        if self.invocation is not None:
            lines += next_steps(self.comparison, self.invocation, self.rounds, self.rounds_noisy)
        return "\n".join(lines)


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
    plugins: tuple[str, ...] = (),
) -> RegressResult:
    """Check, then measure ``loaded``'s cells on revisions ``base`` and ``head`` (None: the
    working tree) of the repository at ``repo``, with ``threads`` CPU threads per process
    (None: PyTorch's default); ``say`` prints each step's outcome. ``cells``: only the cells of
    these ids are checked and measured (``attnbench bisect``'s probes), still only where touched
    unless ``all_variants``. ``kernel_diff``: compare the compiled kernels when the diff touches them. ``plugins``
    (absolute paths or module names): imported by each revision's check and workers."""
    if rounds < 1:
        raise RegressError(f"--rounds must be at least 1, got {rounds}")
    if threads is not None and threads < 1:
        raise RegressError(f"--threads must be at least 1 (or 0 for PyTorch's default), got {threads}")
    if loaded.scenario.task is not None:
        raise RegressError(f"{loaded.path}: regress measures speed scenarios (modes forward, train, decode), not quality tasks")
    given_repo, repo = repo, repository(repo)
    with worktrees(repo, base, head) as revisions:
        for revision in revisions:
            revision.threads, revision.plugins = threads, tuple(plugins)
            say(f"{revision.side} = {revision.describe()}")
        options = dict(all_variants=all_variants, threads=threads, factor=factor, alpha=alpha, out_dir=out_dir, repo=given_repo, plugins=tuple(plugins))
        invocation = Invocation(
            base, head, scenario_spec(loaded), loaded.preset, list(loaded.overrides), shared_flags(**options),
            first_parent_commits(repo, revisions[0].commit, revisions[1].commit), revisions[1].dirty_files,
        )  # fmt: skip
        changed = changed_files(*revisions)
        say("changed files: " + (", ".join(changed) or "none"))
        if not all_variants and not any(path.endswith(".py") for path in changed):
            say("nothing to check or measure: the diff changes no Python file")
            return RegressResult(revisions, changed, {side: {} for side in SIDES}, {}, invocation=invocation)
        configs = configurations(loaded, cells)
        say(f"checking {len(configs)} configurations against the float64 reference in each revision ...")
        with ThreadPoolExecutor(len(revisions)) as checking:
            checks = dict(zip(SIDES, checking.map(lambda revision: check_revision(revision, configs), revisions)))
        result = RegressResult(revisions, changed, checks, touched(changed, checks), invocation=invocation, rounds=rounds, rounds_noisy=rounds)
        _say_checks(result, say)
        if kernel_diff:
            result.kernel_changes = _kernel_diff(revisions, changed, say)
        scenario = scenario_cells(loaded, cells)
        chosen = _cells_to_measure(scenario, result, all_variants)
        untimed = _say_untimed(result, scenario, loaded, bool(chosen), say)
        if not chosen:
            if not untimed:
                say("nothing to measure: the diff touches no variant configuration of the scenario")
            return result
        measuring = Measuring(revisions, checks, loaded, Path(out_dir), command, progress, say, options, _touched_rows(result))
        result.comparison, result.paths, result.rounds_noisy = measuring.run(chosen, rounds, factor, alpha)
    return result


def scenario_spec(loaded: LoadedScenario) -> str:
    """The scenario as a command names it: a shipped scenario by its name, any other by its path."""
    path = Path(loaded.path).resolve()
    return path.relative_to(SCENARIO_DIR).with_suffix("").as_posix() if path.is_relative_to(SCENARIO_DIR) else str(loaded.path)


def shared_flags(*, all_variants: bool, threads: int | None, factor: float, alpha: float, out_dir, repo, plugins=()) -> list[str]:
    """The options of regress and bisect that differ from their defaults, as argv words (for a command to run next)."""
    flags = [word for plugin in plugins for word in ("--plugin", plugin)]
    flags += ["--all-variants"] if all_variants else []
    flags += [] if threads == 1 else ["--threads", str(threads or 0)]
    flags += [] if factor == 1.1 else ["--factor", f"{factor:g}"]
    flags += [] if alpha == 0.05 else ["--alpha", f"{alpha:g}"]
    flags += [] if Path(out_dir) == Path("results") else ["--out", str(out_dir)]
    return flags + ([] if Path(repo).resolve() == Path.cwd().resolve() else ["--repo", str(repo)])


def _touched_rows(result: RegressResult) -> set[tuple[str, str, str]]:
    """The touched configurations as compare's table names them: (variant, backend, params text)."""
    return {(variant, backend, params_text(params)) for variant, backend, params in map(json.loads, result.touched)}


def _say_untimed(result: RegressResult, cells: list[Cell], loaded: LoadedScenario, measuring: bool, say) -> list[str]:
    """Say which touched configurations the scenario does not time (a Triton kernel under a CPU preset), and where
    they are timed; their names."""
    timed = {_config_key(cell.variant, cell.backend, cell.params) for cell in cells}
    untimed = [_config_name(result.checks["head"][key]) for key in result.touched if key not in timed]
    if not untimed:
        return []
    where = loaded.name + (f" (preset {loaded.preset})" if loaded.preset else "")
    triton = any(name.endswith("[triton]") for name in untimed)
    hint = "; use --preset gpu on a GPU" if triton and "gpu" in loaded.scenario.presets and loaded.preset != "gpu" else ""
    say(f"{'not timed here' if measuring else 'nothing to measure'}: the diff touches {', '.join(untimed)}, which {where} does not time{hint}")
    return untimed


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


@dataclass
class Measuring:
    """One regress measurement: the correct sides of the chosen cells in rounds, written to base.jsonl and head.jsonl
    (their run lines record ``regress``: rounds, threads, all_variants, touched, which bisect reads to reuse them), compared;
    the touched cells too noisy to judge measured again (``run``)."""

    revisions: tuple
    checks: dict
    loaded: LoadedScenario
    out_dir: Path
    command: str
    progress: bool
    say: Callable[[str], None]
    options: dict
    touched: set
    folder: Path = field(init=False)  #: regress-SCENARIO-TIME/, set by ``run``
    fingerprints: dict = field(init=False)
    run_ids: dict = field(init=False)

    def run(self, cells: list[Cell], rounds: int, factor: float, alpha: float) -> tuple[CompareResult, dict, int]:
        """(comparison, paths, the rounds of the noisy cells): ``rounds`` of every cell, then up to ``MAX_DOUBLINGS``
        times as many rounds again as they have for the touched cells still undecided or unstable."""
        common = machine.fingerprint(main_device(cells))
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        self.folder = self.out_dir / f"regress-{self.loaded.name}-{stamp}"
        self.fingerprints, self.run_ids, timed = {}, {}, {}
        for revision in self.revisions:
            self.fingerprints[revision.side] = {
                **common,
                "git": {"commit": revision.commit, "dirty": bool(revision.dirty_files), "describe": revision.commit[:10]},
            }
            self.run_ids[revision.side] = uuid.uuid4().hex
            timed[revision.side] = [cell for cell in cells if _check_of(self.checks[revision.side], cell)["ok"]]
        threads = self.revisions[0].threads
        self.say(
            f"measuring {len(cells)} cells ({', '.join(f'{len(timed[side])} timed on {side}' for side in SIDES)}), "
            f"{rounds} rounds, base and head alternating, fresh processes" + ("" if threads is None else f" of {threads} CPU thread(s)") + f" -> {self.folder}/"
        )
        measured = measure_rounds(self.revisions, timed, rounds, self.fingerprints, self.run_ids, self.progress)
        comparison, paths = self._compare(cells, measured, rounds, factor, alpha)
        done = rounds
        for _ in range(MAX_DOUBLINGS):
            noisy = noisy_rows(comparison)
            if noisy.empty:
                break
            ids = {cell_id for cell_id, is_noisy in zip(row_cell_ids(comparison, paths["head"]), comparison.table.index.isin(noisy.index)) if is_noisy}
            self.say(f"{len(noisy)} touched cells undecided or unstable after {done} rounds: measuring them {done} rounds more")
            again = {side: [cell for cell in side_cells if cell.cell_id in ids] for side, side_cells in timed.items()}
            more = measure_rounds(self.revisions, again, done, self.fingerprints, self.run_ids, self.progress)
            for side, found in more.items():
                for cell_id, records in found.items():
                    measured[side][cell_id] += records
            done *= 2
            comparison, paths = self._compare(cells, measured, rounds, factor, alpha)
        return comparison, paths, done

    def _compare(self, cells, measured, rounds, factor, alpha) -> tuple[CompareResult, dict]:
        """Write (again) each side's results file from ``measured``, compare them, mark the controls."""
        paths = {revision.side: self._write(revision, cells, measured[revision.side], rounds) for revision in self.revisions}
        comparison = compare([paths["base"]], [paths["head"]], factor=factor, alpha=alpha)
        mark_controls(comparison, self.touched)
        return comparison, paths

    def _write(self, revision: Revision, cells: list[Cell], measured: dict, rounds: int) -> Path:
        side, path = revision.side, self.folder / f"{revision.side}.jsonl"
        path.unlink(missing_ok=True)
        regress_options = {"rounds": rounds, "threads": revision.threads, "all_variants": self.options["all_variants"], "touched": sorted(self.touched)}
        with ResultsWriter(path) as writer:
            writer.write_run(
                run_header(
                    self.loaded,
                    self.run_ids[side],
                    self.command,
                    self.fingerprints[side],
                    commit=revision.commit,
                    dirty=bool(revision.dirty_files),
                    revision={"side": side, "label": revision.label, "commit": revision.commit, "dirty_files": revision.dirty_files},
                    rounds=rounds,
                    regress=regress_options,
                )
            )
            for cell in cells:
                check = _check_of(self.checks[side], cell)
                record = pool(measured[cell.cell_id]) if check["ok"] else _incorrect_record(cell, check, self.run_ids[side], self.fingerprints[side])
                writer.write_cell({**record, "revision": side})
        return path

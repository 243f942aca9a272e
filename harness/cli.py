"""The ``attnbench`` command line: run, report, compare, regress, bisect, history, list, check, env, demo, data."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from . import options

#: What ``attnbench run`` measures when no scenario is named.
CPU_DEFAULT = [("smoke-cpu", None)]
GPU_DEFAULT = [("seq-sweep", "gpu"), ("d-dot-sweep", "gpu"), ("decode", "gpu"), ("paper-small-lm", "gpu")]
#: Exit codes of ``attnbench run``, as pytest's: every cell ok, skipped or oom; a cell error,
#: crashed or nan; bad usage or input; interrupted.
EXIT_OK = 0
EXIT_CELLS_FAILED = 1
EXIT_ERROR = 2
EXIT_INTERRUPTED = 130


def _plugins(args) -> list[str]:
    """The plugins of a command: ``$ATTNBENCH_PLUGINS`` (comma-separated), then each ``--plugin``."""
    from_env = [p for p in os.environ.get("ATTNBENCH_PLUGINS", "").split(",") if p]
    return from_env + list(args.plugin or [])


def _in_worktrees(plugins: list[str]) -> tuple[str, ...]:
    """The plugins as processes in another directory (a revision's worktree) name them: a file by its absolute path."""
    return tuple(str(Path(plugin).resolve()) if plugin.endswith(".py") else plugin for plugin in plugins)


def _load_plugins(args) -> list[str]:
    """Import the command's plugins (their variants and tasks registered); the list, for worker processes."""
    from .scenarios.plugins import load_plugins

    plugins = _plugins(args)
    load_plugins(plugins)
    return plugins


def _default_scenarios() -> list[tuple[str, str | None]]:
    import torch

    return GPU_DEFAULT if torch.cuda.is_available() else CPU_DEFAULT


def _option_error(args) -> str | None:
    """What is wrong with ``attnbench run``'s options taken together, found before anything is imported or loaded."""
    if args.commits is None and (args.every != 1 or args.force):
        return "--every and --force choose the commits of --commits: use them with --commits"
    if args.commits is not None and (len(args.scenarios) != 1 or args.resume or args.budget or args.executor != "local"):
        return "--commits measures one named scenario at each commit, with the local executor (no --resume or --budget)"
    if args.retry_failed and not (args.resume or args.commits is not None):
        return "--retry-failed re-runs the failed cells of a results file or of a range: use it with --resume or --commits"
    if args.profile in ("ncu", "nsys") and args.executor != "local":
        return f"--profile {args.profile} wraps the local worker; with --executor {args.executor} use --profile (torch.profiler)"
    if args.executor == "local" and (args.address or args.cells_per_node != 1):
        return "--address and --cells-per-node are options of --executor ray"
    if args.cells_per_node < 1:
        return f"--cells-per-node must be at least 1, got {args.cells_per_node}"
    if (args.estimate_for or args.estimate_from) and not (args.dry_run or args.budget):
        return "--estimate-for and --estimate-from estimate the cells of --dry-run or --budget: use them with one of those"
    if args.budget is not None:
        from .running.estimate import parse_duration

        try:
            parse_duration(args.budget)
        except ValueError as exc:
            return f"--budget: {exc}"
    return None


def _run(args) -> int:
    if error := _option_error(args):
        print(f"error: {error}", file=sys.stderr)
        return EXIT_ERROR
    from .scenarios.scenario import ScenarioError, check_scenario

    plugins = _load_plugins(args)
    if args.commits is not None:
        return _run_commits(args, list(_in_worktrees(plugins)))
    if args.scenarios:
        chosen = [(spec, args.preset) for spec in args.scenarios]
    else:
        chosen = [(spec, args.preset or preset) for spec, preset in _default_scenarios()]
        print("attnbench run: no scenario named; measuring the default set: " + ", ".join(spec for spec, _ in chosen))
    try:  # every scenario checked (without torch: a mistake is answered at once), then each expanded
        loaded = [check_scenario(spec, preset=preset, overrides=args.set or []) for spec, preset in chosen]
        for scenario in loaded:
            scenario.cells()
    except ScenarioError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from .measuring.profiling import missing_tool
    from .running import runner

    if args.dry_run or args.budget:
        from .running.estimate import EstimateError, parse_duration
        from .running.planning import plan

        try:
            loaded, lines = plan(
                loaded,
                gpu=args.estimate_for,
                measured_from=args.estimate_from,
                budget_s=parse_duration(args.budget) if args.budget else None,
                dry_run=args.dry_run,
                out_dir=args.out,
            )
        except EstimateError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_ERROR
        print("\n".join(lines))
        if args.dry_run:
            return 0
    if args.profile and (reason := missing_tool(args.profile)):
        print(f"--profile {args.profile}: skipped, {reason}; the cells are measured without it (metrics.profile.skipped)", file=sys.stderr)
    command = "attnbench " + " ".join(shlex.quote(arg) for arg in sys.argv[1:])
    written, failed = [], False
    for scenario in loaded:
        summary = runner.run(
            scenario,
            args.out,
            resume=args.resume or False,
            retry_failed=args.retry_failed,
            plugins=plugins,
            command=command,
            progress=not args.no_progress,
            executor=_executor(args, plugins),
            profile=args.profile,
        )
        print(f"{scenario.name}: {summary.headline()}")
        print(f"{scenario.name}: {summary.stability()}")
        for line in summary.failure_lines():
            print(f"{scenario.name}: {line}", file=sys.stderr)
        written.append(summary.path)
        failed = failed or summary.failed
        if summary.interrupted:
            print(f"interrupted: every finished cell is in {summary.path}; continue with the same command and --resume", file=sys.stderr)
            return EXIT_INTERRUPTED
        if summary.write_error:
            print(f"error: {summary.write_error}; the run stopped. Free space, then continue with the same command and --resume", file=sys.stderr)
            return EXIT_ERROR
    outcome = EXIT_CELLS_FAILED if failed else EXIT_OK
    if args.report and _report_of_run(written, args.report) != 0:
        return EXIT_ERROR
    return outcome


def _run_commits(args, plugins: list[str]) -> int:
    """``attnbench run SCENARIO --commits RANGE``: the scenario at each commit of the range (docs/history.md)."""
    from .common.checkouts import RegressError
    from .revisions.commits import commit_range, dry_run, exit_code, measure_commits
    from .running.estimate import EstimateError
    from .scenarios.scenario import ScenarioError

    command = "attnbench " + " ".join(shlex.quote(arg) for arg in sys.argv[1:])
    chosen_by = {"preset": args.preset, "overrides": args.set or [], "every": args.every, "force": args.force, "retry_failed": args.retry_failed}
    try:
        if args.dry_run:  # the commits, those measured on this machine, the estimated duration; nothing measured
            chosen = commit_range(args.repo, args.scenarios[0], args.commits, args.out, **chosen_by)
            print("\n".join(dry_run(chosen, gpu=args.estimate_for, measured_from=args.estimate_from)))
            return EXIT_OK
        finished = measure_commits(
            args.repo,
            args.scenarios[0],
            args.commits,
            args.out,
            plugins=plugins,
            command=command,
            progress=not args.no_progress,
            **chosen_by,
        )
    except (RegressError, ScenarioError, EstimateError) as exc:
        shown = args.commits if args.commits.isprintable() else repr(args.commits)  # one line, whatever the range holds
        print(f"error: --commits {shown}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if (code := exit_code(finished)) == EXIT_INTERRUPTED:
        print(f"interrupted: every finished cell is in its commit's results file in {args.out}; the same command measures the rest", file=sys.stderr)
    return code


def _executor(args, plugins: list[str]):
    """The executor ``--executor`` names: the local worker, or Ray (harness.running.executors.ray)."""
    from .running.executors.local import LocalExecutor

    if args.executor == "local":
        return LocalExecutor(plugins)
    from .running.executors.ray import RayExecutor

    return RayExecutor(plugins, address=args.address, cells_per_node=args.cells_per_node)


def _report_of_run(paths: list[Path], out: Path) -> int:
    """The HTML report of the results files a run wrote (``attnbench run --report DIR``)."""
    from .report import build_report

    try:
        index = build_report(paths, out)
    except ValueError as exc:
        print(f"error: no report: {exc}", file=sys.stderr)
        return 2
    print(f"report: {index.resolve()}")
    return 0


def _report(args) -> int:
    from .report import build_report
    from .results import ResultsFileError
    from .results.compare import CompareError, compare

    _load_plugins(args)
    try:
        baseline = compare(args.compare_base, args.results, factor=args.factor, alpha=args.alpha) if args.compare_base else None
        index = build_report(args.results, args.out, title=args.title, compare_base=baseline)
    except (CompareError, ResultsFileError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"report: {index} (plots in {index.parent / 'plots'}, every cell in {index.parent / 'cells.csv'})")
    return 0


def _compare(args) -> int:
    from .report import build_report
    from .results import ResultsFileError
    from .results.compare import EXIT_INCOMPARABLE, CompareError, compare

    try:
        result = compare(args.base, args.head, factor=args.factor, alpha=args.alpha, seed=args.seed, allow_different_machines=args.allow_different_machines)
    except (CompareError, ResultsFileError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INCOMPARABLE
    print(result.format_table())
    if args.report:
        index = build_report([*args.base, *args.head], args.report, compare_base=result)
        print(f"report: {index}")
    return result.exit_code


def _regress_scenario(args):
    """The scenario of ``regress`` and ``bisect``: the one named, else regress-cpu (its gpu preset where CUDA is present),
    read once the plugins are imported (a plugin's variant may be in it)."""
    from .scenarios.scenario import load_scenario

    _load_plugins(args)
    spec, preset = args.scenario or "regress-cpu", args.preset
    if args.scenario is None and preset is None and _default_scenarios() is GPU_DEFAULT:
        preset = "gpu"
    return load_scenario(spec, preset=preset, overrides=args.set or [])


def _regress_options(args) -> dict:
    """The options ``regress`` and ``bisect`` pass to ``harness.revisions.regress.regress``: the plugins (already
    imported here, for the scenario) as absolute paths, since each revision's processes run in its worktree."""
    return dict(
        plugins=_in_worktrees(_plugins(args)),
        all_variants=args.all_variants, rounds=args.rounds, threads=args.threads or None, out_dir=args.out, factor=args.factor, alpha=args.alpha,
        command="attnbench " + " ".join(shlex.quote(arg) for arg in sys.argv[1:]), progress=not args.no_progress,
    )  # fmt: skip


def _bisect(args) -> int:
    from .common.checkouts import RegressError
    from .scenarios.scenario import ScenarioError

    try:
        scenario = _regress_scenario(args)  # first: a mistake in it is answered before the imports below load torch
        from .revisions.bisect import bisect

        result = bisect(args.repo, scenario, good=args.good, bad=args.bad, **_regress_options(args))
    except (ScenarioError, RegressError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("interrupted: the worktrees were removed", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(f"attnbench bisect: exit code {result.exit_code}")
    return result.exit_code


def _regress(args) -> int:
    from .common.checkouts import RegressError
    from .results.compare import EXIT_INCOMPARABLE
    from .scenarios.scenario import ScenarioError

    try:
        scenario = _regress_scenario(args)  # first: a mistake in it is answered before the imports below load torch
        from .revisions.regress import regress

        result = regress(args.repo, scenario, base=args.base, head=args.head, kernel_diff=not args.no_kernel_diff, **_regress_options(args))
    except (ScenarioError, RegressError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INCOMPARABLE
    except KeyboardInterrupt:
        print("interrupted: the worktrees were removed; nothing was written", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(result.ending())
    return result.exit_code


def _history(args) -> int:
    from .history import EXIT_BAD_INPUT, HistoryError, history
    from .results import ResultsFileError

    try:
        result = history(args.results, args.out, repo=args.repo, factor=args.factor, since=args.since, fail_unconfirmed=args.fail_unconfirmed)
    except (HistoryError, ResultsFileError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    print("\n".join(result.lines(args.factor)))
    return result.exit_code


def _list(args) -> int:
    from variants.params import variant_names

    from .scenarios.plugins import plugin_variants
    from .scenarios.scenario import shipped

    _load_plugins(args)
    print("variants: " + ", ".join(variant_names()))
    for line in plugin_variants():
        print(f"  {line}")
    print("scenarios: " + ", ".join(shipped()))
    return 0


def _check(args) -> int:
    """``attnbench check VARIANT``: variants.checking.check_variant, one line per check (exit 1: one failed)."""
    from variants import params
    from variants.errors import VariantError

    _load_plugins(args)
    try:
        chosen = dict(_variant_param(assignment) for assignment in args.set or [])
        params.check(args.variant, chosen)
    except (ValueError, VariantError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    import torch

    from variants.checking import BATCH, D_VALUE, HEADS, check_variant

    shown = ", ".join(f"{key}={value!r}" for key, value in chosen.items()) or "its defaults"
    print(f"attnbench check {args.variant} ({shown}): B={BATCH} H={HEADS} d_key={args.d_key} d_value={D_VALUE} on the CPU, torch {torch.__version__}")
    report = check_variant(args.variant, chosen, d_key=args.d_key, seed=args.seed)
    print("\n".join(report.lines()))
    print(report.summary())
    return EXIT_CELLS_FAILED if report.failures else EXIT_OK


def _variant_param(assignment: str) -> tuple[str, object]:
    """``--set KEY=VALUE`` of ``check``: a parameter of the variant, its value YAML (16, true, dpfp)."""
    import yaml

    key, sep, text = assignment.partition("=")
    if not sep or not key.isidentifier():
        raise ValueError(f"--set {assignment!r}: expected KEY=VALUE with a parameter name, e.g. chunk_size=16 or phi=dpfp")
    try:
        return key, yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"--set {assignment!r}: the value is not YAML ({str(exc).splitlines()[0]})") from exc


def _env(args) -> int:
    from .measuring import machine

    print(machine.format_fingerprint(machine.fingerprint(args.device)))
    return 0


def _demo(args) -> int:
    if error := options.demo_error(args.batch, args.heads, args.seq_len):
        print(f"error: {error}", file=sys.stderr)
        return EXIT_ERROR
    _load_plugins(args)
    import torch

    from .demo import DemoShape, format_table, run_demo

    shape = DemoShape(batch=args.batch, heads=args.heads, length=args.seq_len, d_key=args.d_key, d_value=args.d_key)
    print(
        f"attnbench demo: B={shape.batch} H={shape.heads} T={shape.length} D={shape.d_key}, float32 on the CPU, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}; median of {args.repeats} runs after a warm-up"
    )
    table = run_demo(shape, repeats=args.repeats)
    print(format_table(table))
    print("max_abs_err: largest |form - float64 reference|; tokens_per_s = B*T / median time of the whole form.")
    return EXIT_CELLS_FAILED if "failed" in table and table["failed"].notna().any() else EXIT_OK


def _data_download(args) -> int:
    from .tasks.download import DataError, download

    try:
        directory = download(args.name, args.to)
    except (DataError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.name}: {directory} (checksums verified)")
    return 0


def _kernels(args) -> int:
    from .kernels import kernel_diff, kernel_table

    selection = dict(rules=args.rule, dtypes=args.dtype, head_dims=args.d, workers=args.jobs, chunks=args.chunk, kernels=args.kernel)
    if args.compare:
        return kernel_diff.command(args.compare, args.json, arch=args.arch, **selection)
    return kernel_table.command(args.arch, args.json, **selection)


def _gpu_check(args) -> int:
    from .gpu import gpu_check

    if args.dry_run:
        print(gpu_check.format_plan(gpu_check.plan(kernel_tests=not args.no_kernel_tests)))
        return 0
    return gpu_check.run_check(
        args.dir or gpu_check.default_dir(), kernel_tests=not args.no_kernel_tests, progress=not args.no_progress, keep_going=args.keep_going
    )


def _kit(args) -> int:
    from .gpu.kit import DEFAULT_PLATFORMS, KitError, gather

    try:
        readme = gather(args.dir, python=args.python, platforms=args.platform or DEFAULT_PLATFORMS)
    except KitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    print(f"kit: {args.dir.resolve()} (wheels/, data/); how to carry and install it: {readme.resolve()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = options.Parser(prog="attnbench", description="Benchmark attention variants across hardware.")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="measure scenarios (default: smoke-cpu, or the GPU set where CUDA is present)")
    run.add_argument("scenarios", nargs="*", help="scenario files or names of shipped scenarios (attnbench list)")
    run.add_argument("--out", type=Path, default=Path("results"), help="directory of the results files (default: results/)")
    run.add_argument("--preset", help="apply the scenario's named preset, e.g. ci or full")
    run.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a field: seq_len=1024, measure.repeats=3")
    run.add_argument("--dry-run", action="store_true", help="list the expanded cells with their estimated durations and measure nothing")
    run.add_argument("--budget", metavar="DURATION", help="measure the most informative cells whose estimates fit DURATION (90s, 8m, 1.5h); list the rest")
    run.add_argument(
        "--estimate-for",
        metavar="GPU",
        help="estimate CUDA cells on this GPU's datasheet peaks: h100, h200, a100, v100, ... (default: the GPU present, else H100)",
    )
    run.add_argument("--estimate-from", metavar="FILE", help="estimate each cell from the nearest measured cell of these results (a JSONL file or a directory)")
    run.add_argument("--resume", nargs="?", const=True, metavar="FILE", help="continue the latest (or the given) results file")
    run.add_argument("--retry-failed", action="store_true", help="with --resume or --commits: also run again the cells that failed (oom, error, crashed, nan)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument("--report", type=Path, metavar="DIR", help="then write the HTML report of the results files of this run into DIR")
    run.add_argument(
        "--executor",
        choices=["local", "ray"],
        default="local",
        help="local: one worker on this machine (default); ray: each cell a Ray task on a Ray cluster (docs/scale-out.md)",
    )
    run.add_argument("--address", help="with --executor ray: the cluster (auto, HOST:PORT or ray://HOST:PORT; default: start Ray on this machine)")
    run.add_argument(
        "--cells-per-node",
        type=int,
        default=1,
        metavar="N",
        help="with --executor ray: CPU speed cells run side by side on one node, each on 1/N of its CPUs (default 1)",
    )
    run.add_argument(
        "--profile",
        nargs="?",
        const="torch",
        choices=["torch", "ncu", "nsys"],
        help="after timing, profile one more call of each cell: torch (default) writes a trace per cell beside the results file; "
        "ncu, nsys wrap the worker of each CUDA cell (docs/profiling.md)",
    )
    run.add_argument("--commits", metavar="A..B", help="measure the scenario at each first-parent commit of the range, each in a worktree (docs/history.md)")
    run.add_argument("--every", type=options.int_in(1, 10_000), default=1, metavar="N", help="with --commits: every Nth commit from the root, and the newest")
    run.add_argument("--force", action="store_true", help="with --commits: measure again the cells already measured on this machine")
    run.add_argument("--repo", type=Path, default=Path("."), help="with --commits: the git repository (default: the one holding the current directory)")
    run.set_defaults(handler=_run)

    report = commands.add_parser("report", help="write an HTML report (plots, tables, machines) from results files")
    report.add_argument("results", nargs="+", help="results files or directories (several machines, several runs)")
    report.add_argument("-o", "--out", type=Path, required=True, help="directory for index.html, cells.csv and plots/")
    report.add_argument("--title")
    report.add_argument("--compare-base", nargs="+", metavar="BASE", help="also compare RESULTS against these results")
    report.add_argument("--factor", type=options.factor, default=1.1)
    report.add_argument("--alpha", type=options.alpha, default=0.05)
    report.set_defaults(handler=_report)

    compare = commands.add_parser("compare", help="compare two runs cell by cell (exit 0: no regression, 1: regression, 2: not comparable)")
    compare.add_argument("base", nargs=1, help="results file or directory of the base")
    compare.add_argument("head", nargs=1, help="results file or directory of the head")
    compare.add_argument("--factor", type=options.factor, default=1.1, help="a regression must be slower by more than this ratio (default: 1.1)")
    compare.add_argument("--alpha", type=options.alpha, default=0.05, help="significance level of the bootstrap interval (default: 0.05)")
    compare.add_argument("--seed", type=options.seed, default=0, help="seed of the bootstrap resampling (default: 0)")
    compare.add_argument("--allow-different-machines", action="store_true", help="mark cells of different machines as not comparable")
    compare.add_argument("--report", type=Path, help="also write an HTML report with the comparison into this directory")
    compare.set_defaults(handler=_compare)

    regress = commands.add_parser(
        "regress", help="check and benchmark two git revisions in one interleaved run (exit 0: ok, 1: regression or incorrect, 2: not comparable)"
    )
    regress.add_argument("--base", required=True, metavar="REV", help="the revision to compare against (a commit, branch or tag)")
    regress.add_argument("--head", metavar="REV", help="the revision to check (default: the working tree, uncommitted changes included)")
    regress.add_argument("--no-kernel-diff", action="store_true", help="do not compile and compare the kernels when the diff touches variants/kernels/")
    regress.set_defaults(handler=_regress)
    bisect = commands.add_parser(
        "bisect", help="the first commit of GOOD..BAD at which regress's worse cells became worse (0: found, 1: undecided, 2: cannot bisect, 3: none worse)"
    )
    bisect.add_argument("--good", required=True, metavar="REV", help="a revision where the cells are fast (an ancestor of --bad)")
    bisect.add_argument("--bad", required=True, metavar="REV", help="a revision where regress --base GOOD marks cells worse")
    bisect.set_defaults(handler=_bisect)
    for shared in (regress, bisect):
        shared.add_argument("scenario", nargs="?", help="scenario file or shipped name (default: regress-cpu; its gpu preset where CUDA is present)")
        shared.add_argument("--all-variants", action="store_true", help="measure every cell, not only those of the variants the diff touches")
        shared.add_argument(
            "--rounds",
            type=options.rounds,
            default=3,
            help="rounds of base and head, alternating, each in fresh processes (default: 3; a touched cell too noisy to judge: up to 4x as many)",
        )
        shared.add_argument(
            "--threads", type=options.threads, default=1, help="CPU threads of each measuring process (OMP_NUM_THREADS; default 1, 0: PyTorch's default)"
        )
        shared.add_argument("--out", type=Path, default=Path("results"), help="directory of the regress- or bisect-SCENARIO-TIME/ folder (default: results/)")
        shared.add_argument("--preset", help="apply the scenario's named preset")
        shared.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a field of the scenario, as for run")
        shared.add_argument("--factor", type=options.factor, default=1.1, help="a regression must be slower by more than this ratio (default: 1.1)")
        shared.add_argument("--alpha", type=options.alpha, default=0.05, help="significance level of the bootstrap interval (default: 0.05)")
        shared.add_argument("--repo", type=Path, default=Path("."), help="the git repository (default: the one holding the current directory)")
        shared.add_argument("--no-progress", action="store_true", help="no progress bar")

    history = commands.add_parser(
        "history", help="each cell's time over commits and machines, its steps found (exit 0: none slower, 1: a slower step, 2: bad input)"
    )
    history.add_argument("results", nargs="+", help="results files or directories (any number of commits and machines)")
    history.add_argument("-o", "--out", type=Path, required=True, help="directory for index.html, steps.csv and plots/")
    history.add_argument("--repo", type=Path, default=Path("."), help="the git repository whose first-parent history orders the commits (default: here)")
    history.add_argument("--factor", type=options.factor, default=1.1, help="a slower step beyond this ratio fails (exit code 1)")
    history.add_argument("--since", metavar="REV", help="only steps after this revision fail")
    history.add_argument("--fail-unconfirmed", action="store_true", help="a slower jump at the newest commit (not yet confirmed) fails too")
    history.set_defaults(handler=_history)

    listing = commands.add_parser("list", help="list the variants (a plugin's with its file and parameters) and the shipped scenarios")
    listing.set_defaults(handler=_list)

    checking = commands.add_parser(
        "check", help="check a variant's forms and gradients against its float64 reference, one line per check (exit 0: all ok, 1: one failed)"
    )
    checking.add_argument("variant", help="a variant's name (attnbench list), a plugin's too")
    checking.add_argument("--set", action="append", metavar="KEY=VALUE", help="a parameter of the variant, e.g. chunk_size=16 or phi=dpfp (the value is YAML)")
    checking.add_argument("--d-key", type=options.DEMO["d_key"], default=8, help="the query/key width (default 8)")
    checking.add_argument("--seed", type=options.seed, default=0, help="the seed of the inputs (default 0)")
    checking.set_defaults(handler=_check)

    env = commands.add_parser("env", help="print this machine's fingerprint")
    env.add_argument("--device", type=options.device, default="cpu", help="cpu or cuda[:N]")
    env.set_defaults(handler=_env)

    demo = commands.add_parser("demo", help="run every variant's forms on a small CPU input and print a table")
    demo.add_argument("--batch", type=options.DEMO["batch"], default=2)
    demo.add_argument("--heads", type=options.DEMO["heads"], default=4)
    demo.add_argument("--seq-len", type=options.DEMO["seq_len"], default=256)
    demo.add_argument("--d-key", type=options.DEMO["d_key"], default=64)
    demo.add_argument("--repeats", type=options.DEMO["repeats"], default=5)
    demo.set_defaults(handler=_demo)

    data = commands.add_parser("data", help="data sets of the quality tasks").add_subparsers(dest="data_command", required=True)
    fetch = data.add_parser("download", help="fetch a data set and verify its checksums (needs internet)")
    fetch.add_argument("name", help="wikitext-2, wikitext-103, multi30k (wmt14-newstest2014: prints the sacrebleu command)")
    fetch.add_argument("--to", required=True, help="the data root; files land in TO/NAME/ (point $ATTNBENCH_DATA at TO)")
    fetch.set_defaults(handler=_data_download)

    kernels = commands.add_parser("kernels", help="compile every Triton kernel for GPU targets (no GPU needed): registers, spills, occupancy, MMA")
    kernels.add_argument("--arch", default="sm_70,sm_80,sm_90", help="comma-separated targets among sm_70, sm_80, sm_90 (default: all three)")
    kernels.add_argument("--json", type=Path, help="also write the rows (with --compare: the changed rows, old and new) to this JSON file")
    kernels.add_argument("--rule", help="only these kernel files, e.g. sum_rule,delta_rule (default: all)")
    kernels.add_argument("--dtype", help="only these input dtypes, e.g. bf16,fp32 (default: fp32, fp16, bf16)")
    kernels.add_argument("--d", help="only d_dot = d_value in this list, e.g. 64,256 (default: every shipped shape)")
    kernels.add_argument("--chunk", help="only these chunk sizes, e.g. 64,128 (default: every one the kernels take)")
    kernels.add_argument("--kernel", help="only these kernels, e.g. forward_scan,state_pass (an autotuned one: each candidate; default: all)")
    kernels.add_argument("--jobs", type=options.jobs, help="compiler processes (default: one per CPU)")
    kernels.add_argument("--compare", metavar="REV", help="compile REV's kernels and the working tree's, print the rows that changed (exit 1: a row got worse)")
    kernels.set_defaults(handler=_kernels)

    check = commands.add_parser(
        "gpu-check", help="the first command on a GPU machine, offline: kernel tests on CUDA, kernels timed, an LM cell, report (exit 0: all passed)"
    )
    check.add_argument("dir", nargs="?", type=Path, help="where results, report and summary.json go (default: results/gpu-check-TIME)")
    check.add_argument("--dry-run", action="store_true", help="print the plan (cells and estimated seconds per phase) and run nothing")
    check.add_argument("--no-kernel-tests", action="store_true", help="skip the kernel tests (where attnbench is installed without its tests)")
    check.add_argument("--keep-going", action="store_true", help="run every check even when the kernel tests fail (a GPU lent for minutes: what else fails)")
    check.add_argument("--no-progress", action="store_true", help="no progress bars")
    check.set_defaults(handler=_gpu_check)

    kit = commands.add_parser("kit", help="gather the wheels and data an offline GPU machine needs for gpu-check (needs internet)")
    kit.add_argument("dir", type=Path, help="the kit's directory: wheels/, data/, README.txt")
    kit.add_argument("--python", default="3.12", help="the offline machine's Python version (default 3.12)")
    kit.add_argument(
        "--platform",
        action="append",
        metavar="TAG",
        help="a wheel platform tag of the offline machine, repeatable (default: manylinux glibc 2.28 x86-64 and older tags)",
    )
    kit.set_defaults(handler=_kit)
    for leaf in (*commands.choices.values(), fetch):
        leaf.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of an error")
    for leaf in (run, report, regress, bisect, listing, demo, checking):
        leaf.add_argument("--plugin", action="append", metavar="FILE", help="module or .py file registering extra variants or tasks (also ATTNBENCH_PLUGINS)")
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that mean bad input or an unusable environment, not a bug of attnbench."""
    from .results import ResultsFileError
    from .results.locking import LockedError
    from .running.runner import RunError
    from .scenarios.plugins import PluginError
    from .scenarios.scenario import ScenarioError

    return ScenarioError, PluginError, ResultsFileError, RunError, LockedError, OSError


def main(argv: list[str] | None = None) -> int:
    """Run one command. An error is one line on stderr and exit code 2 (``--debug``: the
    traceback too); SIGINT (Ctrl-C), SIGTERM and SIGHUP end it as Ctrl-C does (``common.signals``), exit code
    128 + the signal's number (130, 143, 129), without a traceback."""
    from .common.signals import stopping

    args = build_parser().parse_args(argv)
    with stopping() as stop:
        code = _handled(args)
    return stop.exit_code(code)


def _handled(args) -> int:
    """The exit code of the command ``args`` names; an interruption or an error as ``main`` says."""
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        if args.debug:
            raise
        known = isinstance(exc, _user_errors())
        message = str(exc) if known else f"{type(exc).__name__}: {exc} (an attnbench bug? --debug shows the traceback)"
        print(f"error: {message}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())

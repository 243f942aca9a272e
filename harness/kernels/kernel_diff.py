"""``attnbench kernels --compare REV``: the compiled figures of REV's kernels beside the working tree's.

Both sides are checked out by ``harness.common.checkouts.worktrees`` (REV at its commit, the working tree with its
uncommitted changes) and each is compiled in its own child process: this attnbench's ``harness`` (the table
code, the same for both: a symlink to it on ``PYTHONPATH``) over that checkout's ``variants.kernels``, with its
own Triton cache (``TRITON_CACHE_DIR``, as ``regress`` gives each revision) and its own figures cache
(``ATTNBENCH_KERNEL_CACHE``), both temporary: nothing compiled for one side is reused for the other.

Rows are matched by (kernel, configuration, arch). A row changed when its registers, spill bytes, shared
memory, warps, occupancy (warps per SM), MMA kind or limits (problem, pruned) differ, or it exists on one side
only. It regressed (:func:`regressions`) when it spills more, keeps fewer warps per SM, lost a 16-bit MMA, or is
newly over a limit of its arch (a problem, or an autotuning candidate newly pruned).

``regress`` runs the same comparison when its diff touches ``variants/kernels/`` (:func:`for_regress`), compiling
only the rows that can differ: each side first records its launches (nothing compiled) and keys each row by what
decides its compilation (:func:`row_keys`); only the rows whose keys differ, or that one side lacks, are compiled.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..common.checkouts import WORKING_TREE
from .kernel_table import KernelTableError, Row, problems

#: What a change is judged on, beside the row's limits (``problem``, ``pruned``), in the order of the printed columns.
COMPARED = ("registers", "spill_bytes", "shared_bytes", "num_warps", "occupancy_warps", "mma")
#: The operand types of a 16-bit MMA in ``kernel_table.mma_kind``'s names ("mma bf16", "wgmma f16").
SIXTEEN_BIT = ("bf16", "f16")
#: The child: this harness's table over the checkout on PYTHONPATH (``_child``).
CHILD = "import sys; from harness.kernels.kernel_diff import _child; sys.exit(_child())"
#: The targets ``regress`` compiles a kernel change for: those of ``attnbench kernels``.
REGRESS_ARCH = "sm_70,sm_80,sm_90"
KERNEL_DIR = "variants/kernels/"


@dataclasses.dataclass(frozen=True)
class Change:
    """One row of either side that differs: ``old`` (REV's, None when only the working tree has it), ``new``
    (None when only REV has it) and why it is worse (empty when it is not)."""

    old: Row | None
    new: Row | None
    regressions: tuple[str, ...]

    @property
    def row(self) -> Row:
        return self.new or self.old

    def as_dict(self) -> dict:
        return {"kernel": self.row.kernel, "config": self.row.config, "arch": self.row.arch, "old": self.old and self.old.as_dict(),
                "new": self.new and self.new.as_dict(), "regressions": list(self.regressions)}  # fmt: skip


def _sixteen_bit(mma: str | None) -> set[str]:
    return {kind for kind in (mma or "").split("+") if kind.split(" ")[-1] in SIXTEEN_BIT}


def _over(row: Row | None) -> str | None:
    return row and (row.problem or row.pruned)


def regressions(old: Row | None, new: Row | None) -> tuple[str, ...]:
    """Why ``new`` is worse than ``old`` (None: the row is new, judged on its limits only): more spill, fewer warps
    per SM, a 16-bit MMA kind lost, or over a limit of the arch where it was not (a problem, or a pruned candidate)."""
    found = []
    if new is None:
        return ()
    if _over(new) and not _over(old):
        found.append(f"newly over a limit: {_over(new)}")
    if old is None or None in (old.registers, new.registers):
        return tuple(found)
    if new.spill_bytes > old.spill_bytes:
        found.append(f"more spill ({old.spill_bytes} -> {new.spill_bytes} B a thread)")
    if new.occupancy_warps < old.occupancy_warps:
        found.append(f"fewer warps per SM ({old.occupancy_warps} -> {new.occupancy_warps})")
    if lost := _sixteen_bit(old.mma) - _sixteen_bit(new.mma):
        found.append(f"16-bit MMA lost ({', '.join(sorted(lost))}; now {new.mma})")
    return tuple(found)


def diff(old_rows: list[Row], new_rows: list[Row]) -> list[Change]:
    """The rows that differ between two tables (``COMPARED`` fields, limits, presence), in the new table's order,
    then the rows only the old one has."""
    key = lambda row: (row.kernel, row.config, row.arch)  # noqa: E731
    old, new = {key(row): row for row in old_rows}, {key(row): row for row in new_rows}
    changes = []
    for name in [*new, *(name for name in old if name not in new)]:
        before, after = old.get(name), new.get(name)
        fields = ("problem", "pruned", *COMPARED)
        if before is None or after is None or any(getattr(before, f) != getattr(after, f) for f in fields):
            changes.append(Change(before, after, regressions(before, after)))
    return changes


def severity(change: Change) -> int:
    """0 worse, 1 only in the old table, 2 only in the new one, 3 changed: the order of the rows within a group."""
    return 0 if change.regressions else 1 if change.new is None else 2 if change.old is None else 3


def group(change: Change) -> tuple[str, str]:
    """(arch, dtype): the dtype is the first word of the configuration's label (``fp32 F64 Dv64 C64 norm``)."""
    return change.row.arch, change.row.config.split(" ")[0]


def format_changes(changes: list[Change], old_label: str, new_label: str = "the working tree") -> str:
    """The changed rows as a table, each figure "old -> new" where it changed; a last column says whether the row
    got worse (and why) or only changed, or that it exists on one side only. Grouped by arch and dtype (a heading line
    each, with its counts), the worse rows first in each group."""
    header = ["kernel", "config", "arch", "regs", "spill B", "smem B", "warps", "occ warps/SM", "mma", "verdict"]
    changes = sorted(changes, key=lambda change: (*group(change), severity(change), change.row.kernel, change.row.config))
    lines, headings = [], {}
    for change in changes:
        old, new = change.old, change.new
        figures = []
        for field in COMPARED:
            before, after = (("-" if row is None or getattr(row, field) is None else str(getattr(row, field))) for row in (old, new))
            figures.append(before if before == after else f"{before} -> {after}")
        if change.regressions:
            verdict = "WORSE: " + "; ".join(change.regressions)
        elif new is None:
            verdict = f"only in {old_label}"
        elif old is None:
            verdict = f"only in {new_label}"
        else:
            verdict = "changed" + (f" (limits: {_over(old)} -> {_over(new)})" if _over(old) or _over(new) else "")
        lines.append([change.row.kernel, change.row.config, change.row.arch, *figures, verdict])
        headings.setdefault(group(change), len(lines) - 1)
    widths = [max(len(x) for x in column) for column in zip(header, *lines)]
    text = lambda line: "  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip()  # noqa: E731
    out = [text(header)]
    for index, line in enumerate(lines):
        if index in headings.values():
            arch, dtype = group(changes[index])
            members = [change for change in changes if group(change) == (arch, dtype)]
            out.append(f"-- {arch} {dtype}: {len(members)} rows changed, {sum(bool(change.regressions) for change in members)} worse")
        out.append(text(line))
    return "\n".join(out)


def gpu_timing_command(base: str, head: str | None = None) -> str:
    """How to time the kernels of ``base`` against ``head`` (None: the working tree) on a GPU: regress's scenario with
    its ``gpu`` preset, which times the Triton backend of both revisions (the variants whose kernels the diff touches)."""
    revisions = ["--base", base, *(["--head", head] if head else [])]
    return "to time the worse kernels on a GPU, run there: " + shlex.join(["attnbench", "regress", *revisions, "regress-cpu", "--preset", "gpu"])


def _tool_directory(scratch: Path) -> Path:
    """``scratch/tool``, holding a link to this harness: the children's working directory and first import path.
    Both sides' threads may make it at once (``for_regress``), so each tolerates the other having made it."""
    tool = scratch / "tool"
    tool.mkdir(exist_ok=True)
    try:
        (tool / "harness").symlink_to(Path(__file__).resolve().parents[1], target_is_directory=True)
    except FileExistsError:
        pass
    return tool


def revision_rows(revision, request: dict, scratch: Path):
    """The table of ``revision``'s kernels (``kernel_table.table(**request)``; with ``request["action"]`` "keys" or
    "rows", :func:`row_keys` or :func:`keyed_rows`), made in a child process of its own (module docstring); its
    progress lines are passed on to stderr. A KernelTableError with the child's last line."""
    tool = _tool_directory(scratch)
    out = scratch / f"{request.get('action', 'rows')}-{revision.side}.json"
    env = {
        **os.environ, **revision.env, "TRITON_INTERPRET": "0", "ATTNBENCH_KERNEL_CACHE": str(scratch / f"figures-{revision.side}"),
        "PYTHONPATH": os.pathsep.join([str(tool), str(revision.root)]),
    }  # fmt: skip
    print(f"attnbench kernels: compiling the kernels of {revision.describe()}", file=sys.stderr)
    command = [sys.executable, "-c", CHILD, json.dumps(request), str(out)]
    last = None
    with subprocess.Popen(command, cwd=tool, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as child:
        for line in child.stderr:
            print(f"  {revision.side}: {line.rstrip()}", file=sys.stderr)
            last = line.strip() or last
    if child.returncode != 0:
        reason = (last or f"exit code {child.returncode}").removeprefix("error: ")
        raise KernelTableError(f"the kernels of {revision.describe()} could not be tabled: {reason}")
    found = json.loads(out.read_text())
    return found if request.get("action") == "keys" else [Row(**fields) for fields in found]


def _row_id(kernel: str, config: str, arch: str) -> str:
    return f"{kernel}|{config}|{arch}"


def row_keys(arch: str, rules: list[str] | None) -> dict[str, list]:
    """In a child: ``{"kernel|config|arch": [coarse, fine]}`` for every launch of ``rules``' configurations on
    ``arch``, recorded, nothing compiled. Both keys hash the signature, constexprs, attrs, options and target;
    ``coarse`` (``kernel_table.compile_key``) every @triton.jit source of the kernel's module and ``_common``,
    ``fine`` only the kernel's and the helpers it calls (``variants.kernels.identity.source_hash``; None in a
    revision without it)."""
    import hashlib

    from variants import UnsupportedBackend

    from .kernel_table import _recorded, _signature, compile_key, jobs, parse_archs

    try:
        from variants.kernels.identity import python_function, source_hash
    except ImportError:
        source_hash = None
    keys = {}
    for rule, index in jobs(rules):
        for target in parse_archs(arch):
            try:
                label, launches = _recorded(rule, index, target.capability)
            except UnsupportedBackend:
                continue
            for launch in launches:
                signature, constexprs, attrs = _signature(launch)
                parts = [target.capability, source_hash and source_hash(python_function(launch.kernel)), sorted(signature.items()),
                         sorted(map(str, constexprs.items())), sorted(map(str, attrs.items())), sorted(launch.options.items())]  # fmt: skip
                fine = source_hash and hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()
                keys[_row_id(launch.name, label, target.name)] = [compile_key(launch, target.capability), fine]
    return keys


def keyed_rows(wanted: list[str], rules: list[str] | None) -> list[Row]:
    """In a child: the rows named ``wanted`` ("kernel|config|arch"), compiled: only their configurations, kernels
    and arches (``kernel_table.build_table``)."""
    from variants import kernels

    from .kernel_table import _progress, build_table, jobs, parse_archs

    names = [name.split("|") for name in wanted]
    labels, arches = {config for _, config, _ in names}, ",".join(sorted({arch for _, _, arch in names}))
    configs = {rule: kernels.load(rule).compile_configs() for rule in rules or kernels.RULES}
    selected = [(rule, index) for rule, index in jobs(rules) if kernels.load(rule).config_label(configs[rule][index]) in labels]
    start = time.perf_counter()
    kernel_names = {kernel.split("[")[0] for kernel, _, _ in names}
    rows = build_table(parse_archs(arches), selected, kernels=kernel_names, progress=lambda done, total: _progress(done, total, start))
    return [row for row in rows if _row_id(row.kernel, row.config, row.arch) in set(wanted)]


def _child() -> int:
    """In the child (``argv``: REQUEST as JSON, OUT): ``kernel_table.table(**REQUEST)``, or with REQUEST's ``action``
    "keys" or "rows" :func:`row_keys` or :func:`keyed_rows`, into OUT; 2 on a KernelTableError."""
    from .kernel_table import table

    request, out = json.loads(sys.argv[1]), Path(sys.argv[2])
    action = request.pop("action", "table")
    try:
        found = {"table": table, "keys": row_keys, "rows": keyed_rows}[action](**request)
    except KernelTableError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out.write_text(json.dumps(found if action == "keys" else [row.as_dict() for row in found]))
    return 0


def changed_rules(changed: list[str]) -> list[str] | None:
    """The kernel rules a diff can change: those of the changed ``variants/kernels/RULE.py``; None (every rule) when
    another file of ``variants/kernels/`` changed (shared helpers, limits, tile sizes); [] when none did."""
    from variants.kernels import RULES

    files = [path for path in changed if path.startswith(KERNEL_DIR) and path.endswith(".py")]
    stems = [path[len(KERNEL_DIR) : -len(".py")] for path in files]
    return stems if all(stem in RULES for stem in stems) else None


def for_regress(base, head, changed: list[str], say, arch: str = REGRESS_ARCH) -> list[Change] | None:
    """``regress``'s static kernel diff of ``base`` and ``head`` (checked out; ``changed``: the diff's files) for
    ``arch``: None when no kernel file changed; else the changed rows among those whose compilation differs
    (module docstring), printed through ``say``. A KernelTableError when either side cannot be tabled."""
    rules = changed_rules(changed)
    if rules == []:
        return None
    scratch = base.root.parent
    request = {"action": "keys", "arch": arch, "rules": rules}
    with ThreadPoolExecutor(2) as pool:  # recording only: one process a side at once
        keys = dict(zip(("base", "head"), pool.map(lambda revision: revision_rows(revision, request, scratch), (base, head))))
    both = [*keys["base"].values(), *keys["head"].values()]
    which = 1 if all(fine for _, fine in both) else 0  # the fine keys where both sides have them
    key = lambda side, name: (keys[side].get(name) or [None, None])[which]  # noqa: E731
    differing = sorted(name for name in {*keys["base"], *keys["head"]} if key("base", name) != key("head", name))
    scope = f"{'every rule' if rules is None else ', '.join(rules)} on {arch}"
    if not differing:
        say(f"kernels ({scope}): the diff changes no compilation of the {len(keys['head'])} rows")
        return []
    say(f"kernels ({scope}): {len(differing)} of {len(keys['head'])} rows compile differently; compiling them in each revision ...")
    rows = {}
    for revision in (base, head):
        wanted = [name for name in differing if name in keys[revision.side]]
        rows[revision.side] = revision_rows(revision, {"action": "rows", "wanted": wanted, "rules": rules}, scratch) if wanted else []
    changes = diff(rows["base"], rows["head"])
    worse = [change for change in changes if change.regressions]
    say(format_changes(changes, "base", "head") if changes else "kernels: no compiled figure changed")
    say(f"kernels: {len(changes)} rows changed, {len(worse)} worse")
    if worse:
        say(gpu_timing_command(base.label, None if head.label == WORKING_TREE else head.label))
    return changes


def command(rev: str, json_path: Path | None = None, repo: Path = Path("."), **request) -> int:
    """``attnbench kernels --compare REV``: print the rows that changed between REV's kernels and the working
    tree's (``request``: the arguments of ``kernel_table.table``), write them to ``json_path``; 1 when a row
    regressed, 0 otherwise, 2 when either table cannot be made."""
    from ..common.checkouts import RegressError, commit_of, worktrees
    from ..common.checkouts import repository as git_repository

    try:
        top = git_repository(repo)
        commit_of(top, rev, "--compare")  # a bad REV named as the user wrote it, before a worktree is made
        with worktrees(top, rev, None) as (base, head):
            scratch = base.root.parent
            old_rows, new_rows = (revision_rows(revision, request, scratch) for revision in (base, head))
            old_label = base.describe()
    except (KernelTableError, RegressError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    changes = diff(old_rows, new_rows)
    if json_path is not None:
        json_path.write_text(json.dumps([change.as_dict() for change in changes], indent=1) + "\n")
    print(ending(changes, rev, old_label, old_rows, new_rows))
    return 1 if any(change.regressions for change in changes) else 0


def ending(changes: list[Change], rev: str, old_label: str, old_rows: list[Row], new_rows: list[Row]) -> str:
    """What ``kernels --compare`` prints on stdout once both sides are tabled: the changed rows (each once), the summary
    line after them, then, when a row got worse, how to time it on a GPU."""
    worse = [change for change in changes if change.regressions]
    lines = [format_changes(changes, rev) if changes else f"no row changed between {old_label} and the working tree"]
    lines.append(
        f"attnbench kernels --compare {rev}: {len(old_rows)} rows of {old_label}, {len(new_rows)} of the working tree; "
        f"{len(changes)} changed, {len(worse)} worse; {len(problems(new_rows))} over a limit in the working tree"
    )
    return "\n".join(lines + ([gpu_timing_command(rev)] if worse else []))

"""``attnbench kernels``: compile every Triton kernel for named GPU targets, on a machine without a GPU.

Which kernels and configurations exist is the kernel modules' knowledge (``variants.kernels.RULES``,
each with ``compile_configs()``, ``config_label(config)`` and ``record_launches(config, capability)``:
the launches of one training step at the reference shape, recorded on "meta" tensors, with every
autotuning candidate). This module compiles each launch with Triton's compiler for a ``GPUTarget``
(ptxas ships with Triton), reads the cubin's resources with the ``cuobjdump`` beside it, and makes one
:class:`Row` per (kernel, configuration, arch). Launches that compile alike (the same kernel source,
signature, constexprs and options for one target: many configurations share tiles) are compiled once,
by one process per core, and their figures kept in a cache keyed by that (its source with every helper it calls) and the
Triton version (``cache_dir``). A row over its target's limits (``_common.over_limits``, the test the
launch applies on a GPU) is a problem, except an autotuning candidate, which the launch prunes: it is
marked ``pruned`` instead, and a problem only when every candidate of its kernel is.

Figures: ``registers`` per thread and ``spill_bytes`` (the per-thread stack frame, where spilled
registers and local arrays live) from ``cuobjdump -res-usage``; ``shared_bytes`` Triton's dynamic
shared memory per program; ``occupancy_warps`` the resident warps per SM that registers, shared
memory and the arch's limits allow; ``programs`` the grid size at the reference shape (B=1, H=8,
T=16384, the configuration's d_dot and d_value); ``mma`` the matrix instructions in the PTX
(``wgmma bf16``, ``mma tf32``, ...; ``fma`` when there are none).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import math
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

#: Where compiled figures are kept between runs (``ATTNBENCH_KERNEL_CACHE`` overrides; "" turns the cache off).
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "attnbench" / "kernels"


@dataclasses.dataclass(frozen=True)
class Arch:
    """An NVIDIA GPU generation's per-SM and per-block limits (CUDA occupancy calculator figures)."""

    name: str
    gpu: str
    capability: int
    shared_per_sm: int  # bytes
    max_shared_per_block: int  # bytes, opt-in maximum
    reserved_shared_per_block: int  # bytes the driver keeps per resident block
    registers_per_sm: int = 65536
    max_registers_per_thread: int = 255
    max_warps_per_sm: int = 64
    max_blocks_per_sm: int = 32
    register_unit: int = 256  # registers are allocated per warp in units of this many

    @property
    def limits(self):
        """What one block may hold, as the launch checks it (``variants.kernels._common.Limits``)."""
        from variants.kernels._common import Limits

        return Limits(shared=self.max_shared_per_block, registers=self.registers_per_sm)


KIB = 1024
ARCHS = {
    "sm_70": Arch("sm_70", "V100", 70, 96 * KIB, 96 * KIB, 0),
    "sm_80": Arch("sm_80", "A100", 80, 164 * KIB, 163 * KIB, KIB),
    "sm_90": Arch("sm_90", "H100", 90, 228 * KIB, 227 * KIB, KIB),
}
FIELDS = ("kernel", "config", "arch", "registers", "spill_bytes", "shared_bytes", "num_warps", "occupancy_warps", "programs", "mma")


class KernelTableError(RuntimeError):
    """The table cannot be made (no triton, the kernels run under the interpreter, an unknown arch)."""


@dataclasses.dataclass(frozen=True)
class Row:
    kernel: str
    config: str
    arch: str
    registers: int | None = None
    spill_bytes: int | None = None
    shared_bytes: int | None = None
    num_warps: int | None = None
    occupancy_warps: int | None = None
    programs: int | None = None
    mma: str | None = None
    problem: str | None = None  # why it failed: no compile, or a limit of the arch exceeded
    pruned: str | None = None  # an autotuning candidate over the arch's limits: the launch never runs it

    def as_dict(self) -> dict:
        """The JSON fields, then ``problem`` and ``pruned`` (null when the row is fine)."""
        return {name: getattr(self, name) for name in (*FIELDS, "problem", "pruned")}


def parse_archs(text: str) -> list[Arch]:
    """``"sm_70,sm_80"`` -> the Arch entries; an unknown name is an error naming the known ones."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in ARCHS]
    if unknown or not names:
        raise KernelTableError(f"unknown arch {', '.join(unknown) or repr(text)}: choose among {', '.join(ARCHS)}")
    return [ARCHS[name] for name in names]


def occupancy_warps(arch: Arch, registers: int, shared_bytes: int, num_warps: int) -> int:
    """Resident warps per SM: whole blocks of ``num_warps`` warps, limited by registers (allocated per
    warp in ``register_unit``s), shared memory (plus the per-block reserve), warps and blocks per SM."""
    registers_per_warp = math.ceil(max(registers, 1) * 32 / arch.register_unit) * arch.register_unit
    blocks = min(
        arch.registers_per_sm // registers_per_warp // num_warps,
        arch.max_warps_per_sm // num_warps,
        arch.max_blocks_per_sm,
        arch.shared_per_sm // (shared_bytes + arch.reserved_shared_per_block) if shared_bytes else arch.max_blocks_per_sm,
    )
    return blocks * num_warps


def mma_kind(ptx: str) -> str:
    """The matrix instructions in ``ptx`` as "wgmma bf16", "mma f16", "mma tf32", ... (several joined
    by "+"), named by the operand type; "fma" when there are none."""
    kinds = set()
    for instruction, types in re.findall(r"\b(wgmma\.mma_async|mma\.sync)((?:\.\w+)+)", ptx):
        operand = next((t for t in types.split(".")[1:] if t in ("bf16", "f16", "tf32", "e4m3", "e5m2", "s8", "u8", "f64")), "?")
        kinds.add(f"{instruction.split('.')[0]} {operand}")
    return "+".join(sorted(kinds)) or "fma"


def triton_tool(name: str) -> Path:
    """A CUDA tool Triton ships (ptxas, cuobjdump, nvdisasm) in ``triton/backends/nvidia/bin``."""
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.is_file():
        raise KernelTableError(f"{path} is missing: this triton package does not ship {name}")
    return path


def resource_usage(cubin: bytes) -> dict[str, int]:
    """``cuobjdump -res-usage`` of one kernel's cubin: REG, STACK, SHARED, LOCAL, ... as ints."""
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "kernel.cubin"
        path.write_bytes(cubin)
        out = subprocess.run([triton_tool("cuobjdump"), "-res-usage", path], capture_output=True, text=True, check=True).stdout
    return {key: int(value) for key, value in re.findall(r"\b([A-Z]+(?:\[\d+\])?):(\d+)", out)}


def _signature(launch) -> tuple[dict, dict, dict]:
    """Signature, constexprs and attrs of a recorded launch, specialised as Triton's launcher does for
    contiguous tensors: pointers 16-byte aligned, ints equal to 1 constant, ints divisible by 16 hinted."""
    import torch

    names = launch.kernel.arg_names
    signature, constexprs, attrs = {}, {}, {}
    for index, name in enumerate(names):
        if index >= len(launch.args):
            signature[name], constexprs[name] = "constexpr", launch.constexprs[name]
            continue
        arg = launch.args[index]
        if isinstance(arg, torch.Tensor):
            signature[name] = "*" + {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32"}[arg.dtype]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif arg == 1:
            signature[name], constexprs[name] = "constexpr", 1
        else:
            signature[name] = "i32" if -(2**31) <= arg < 2**31 else "i64"
            if arg % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (ptxas, cuobjdump)."""
    import resource

    return sum(usage.ru_utime + usage.ru_stime for usage in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))


def compile_figures(launch, capability: int) -> dict:
    """Compile one recorded launch for compute capability ``capability``: its ``registers``, ``spill_bytes``,
    ``shared_bytes``, ``mma`` and ``cpu_s`` (the CPU seconds it took), or ``{"error": ...}`` when it does not compile."""
    import triton
    from triton.backends.compiler import GPUTarget

    start = _cpu_seconds()
    signature, constexprs, attrs = _signature(launch)
    try:
        source = triton.compiler.ASTSource(fn=launch.kernel, signature=signature, constexprs=constexprs, attrs=attrs)
        compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=launch.options)
    except Exception as exc:  # noqa: BLE001 - any compiler failure is this row's finding
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return {"error": f"does not compile: {type(exc).__name__}: {first_line}"}
    usage = resource_usage(compiled.asm["cubin"])
    figures = dict(registers=usage["REG"], spill_bytes=usage["STACK"], shared_bytes=compiled.metadata.shared, mma=mma_kind(compiled.asm["ptx"]))
    return {**figures, "cpu_s": round(_cpu_seconds() - start, 2)}


def make_row(launch, label: str, arch: Arch, figures: dict) -> Row:
    """The row of ``launch`` on ``arch`` from its compiled ``figures``: a problem when it did not compile or
    needs more than ``arch`` has (``_common.over_limits``); an autotuning candidate over them is ``pruned``."""
    from variants.kernels._common import over_limits

    row = Row(kernel=launch.name, config=label, arch=arch.name, num_warps=launch.options["num_warps"], programs=launch.programs)
    if "error" in figures:
        return dataclasses.replace(row, problem=figures["error"])
    registers, shared = figures["registers"], figures["shared_bytes"]
    row = dataclasses.replace(
        row, registers=registers, spill_bytes=figures["spill_bytes"], shared_bytes=shared,
        occupancy_warps=occupancy_warps(arch, registers, shared, row.num_warps), mma=figures["mma"],
    )  # fmt: skip
    over = "; ".join(over_limits(shared, registers, row.num_warps, arch.limits)) or None
    return dataclasses.replace(row, pruned=over) if "[" in launch.name else dataclasses.replace(row, problem=over)


def _candidates_all_pruned(rows: list[Row]) -> list[Row]:
    """A kernel whose every autotuning candidate is pruned on an arch cannot launch there: those rows become problems."""
    groups: dict[tuple, list[int]] = {}
    for index, row in enumerate(rows):
        if "[" in row.kernel:
            groups.setdefault((row.kernel.split("[")[0], row.config, row.arch), []).append(index)
    rows = list(rows)
    for indices in groups.values():
        if all(rows[i].pruned for i in indices):
            for i in indices:
                rows[i] = dataclasses.replace(rows[i], problem=f"every autotuning candidate is over the limits: {rows[i].pruned}")
    return rows


def compile_key(launch, capability: int) -> str:
    """What decides a compilation: the kernel's source and that of every @triton.jit helper it calls, wherever it
    lives (``identity.source_hash``), its name, signature, constexprs, attrs and options, the target and the Triton
    version. Equal keys compile alike."""
    import triton

    from variants.kernels import identity

    function = identity.python_function(launch.kernel)
    signature, constexprs, attrs = _signature(launch)
    parts = [
        triton.__version__, capability, function.__module__, function.__name__, identity.source_hash(function),
        sorted(signature.items()), sorted(map(str, constexprs.items())), sorted(map(str, attrs.items())), sorted(launch.options.items()),
    ]  # fmt: skip
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()


def _split(text: str | None, kind=str) -> list | None:
    if not text:
        return None
    try:
        return [kind(item.strip()) for item in text.split(",") if item.strip()]
    except ValueError as exc:
        raise KernelTableError(f"not a comma-separated list of {kind.__name__}: {text!r}") from exc


def jobs(rules=None, dtypes=None, head_dims=None, chunks=None) -> list[tuple[str, int]]:
    """(rule, index into its ``compile_configs()``) of every configuration, optionally only those of
    the given rules, dtype names ("fp32", ...), head dims (d_dot = d_value = d) and chunk sizes."""
    from variants import kernels
    from variants.kernels import _common

    unknown = [rule for rule in rules or () if rule not in kernels.RULES] + [name for name in dtypes or () if name not in _common.DTYPE_NAMES.values()]
    if unknown:
        raise KernelTableError(f"unknown {', '.join(unknown)}: rules are {', '.join(kernels.RULES)}, dtypes {', '.join(_common.DTYPE_NAMES.values())}")
    chosen = []
    for rule in rules or kernels.RULES:
        for index, config in enumerate(kernels.load(rule).compile_configs()):
            if dtypes is not None and _common.DTYPE_NAMES[config["dtype"]] not in dtypes:
                continue
            if head_dims is not None and not config["d_dot"] == config["d_value"] in head_dims:
                continue
            if chunks is not None and config["chunk_size"] not in chunks:
                continue
            chosen.append((rule, index))
    return chosen


def _recorded(rule: str, index: int, capability: int) -> tuple[str, list]:
    """The label and the recorded launches of configuration ``index`` of ``rule`` on ``capability``."""
    from variants import kernels

    module = kernels.load(rule)
    config = module.compile_configs()[index]
    return module.config_label(config), module.record_launches(config, capability)


def launched_kernels(archs: list[Arch], selected: list[tuple[str, int]]) -> set[str]:
    """The kernels (without autotuning candidates) the ``selected`` jobs launch on ``archs``: recorded, nothing compiled."""
    from variants import UnsupportedBackend

    names = set()
    for rule, index in selected:
        for arch in archs:
            try:
                names.update(launch.name.split("[")[0] for launch in _recorded(rule, index, arch.capability)[1])
            except UnsupportedBackend:
                continue
    return names


def _compile_task(rule: str, index: int, capability: int, launch_index: int) -> dict:
    """In a worker: the figures of one launch (recorded again there, where the kernels are real @triton.jit functions)."""
    return compile_figures(_recorded(rule, index, capability)[1][launch_index], capability)


def _worker_init() -> None:
    """Compile workers import the kernels as real @triton.jit functions, whatever the parent's TRITON_INTERPRET."""
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated to silence its warning


def cache_dir() -> Path | None:
    """The figures cache: ``ATTNBENCH_KERNEL_CACHE`` ("" for none), else ``DEFAULT_CACHE_DIR``."""
    value = os.environ.get("ATTNBENCH_KERNEL_CACHE")
    return DEFAULT_CACHE_DIR if value is None else (Path(value) if value else None)


def _read_cache(directory: Path | None, key: str) -> dict | None:
    path = directory / f"{key}.json" if directory else None
    try:
        return json.loads(path.read_text()) if path else None
    except (OSError, ValueError):
        return None


def _write_cache(directory: Path | None, key: str, figures: dict) -> None:
    """Keep figures that compiled (a failure may be this machine's, e.g. a missing tool: not kept)."""
    if directory is None or "error" in figures:
        return
    directory.mkdir(parents=True, exist_ok=True)
    temporary = directory / f".{key}.{os.getpid()}.tmp"
    temporary.write_text(json.dumps(figures))
    temporary.replace(directory / f"{key}.json")


def _cost(task: tuple) -> tuple:
    """Longest compilations first (sm_70's FMA code, the big backward kernels), so the workers end together."""
    name, capability = task[0], task[1][2]
    return (capability == 70, name.startswith("backward_chunk") or name.startswith("backward_dqk"), "[" not in name)


def build_table(
    archs: list[Arch],
    selected: list[tuple[str, int]] | None = None,
    workers: int | None = None,
    progress=None,
    cache: Path | None | bool = True,
    kernels: set[str] | None = None,
) -> list[Row]:
    """Compile ``selected`` jobs (default: every configuration) for ``archs``: each distinct compilation
    (``compile_key``) once, in ``workers`` fresh processes (default one per CPU), its figures from and into
    ``cache`` (True: ``cache_dir()``; None or False: no cache), only the launches of ``kernels`` when given
    (names without the autotuning candidate: "state_pass" is each of its candidates). Rows in the order of the
    jobs, then arch, then launch; ``progress(done, total)`` after each compilation."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        raise KernelTableError("attnbench kernels needs the triton package: pip install 'attnbench[triton]'") from exc
    directory = cache_dir() if cache is True else cache or None
    selected = jobs() if selected is None else selected
    planned, tasks, figures = [], {}, {}  # (launch, label, arch, key); key -> (name, worker arguments); key -> figures
    from variants import UnsupportedBackend

    for rule, index in selected:
        for arch in archs:
            try:
                label, launches = _recorded(rule, index, arch.capability)
            except UnsupportedBackend:  # a configuration the kernels refuse on this arch (16-bit inputs below sm_80): nothing launches
                continue
            for launch_index, launch in enumerate(launches):
                if kernels is not None and launch.name.split("[")[0] not in kernels:
                    continue
                key = compile_key(launch, arch.capability)
                planned.append((launch, label, arch, key))
                if key not in tasks and key not in figures:
                    cached = _read_cache(directory, key)
                    if cached is not None:
                        figures[key] = cached
                    else:
                        tasks[key] = (launch.name, (rule, index, arch.capability, launch_index))
    if tasks:
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(workers or os.cpu_count(), mp_context=context, initializer=_worker_init) as pool:
            ordered = sorted(tasks.items(), key=lambda item: _cost(item[1]), reverse=True)
            futures = {pool.submit(_compile_task, *arguments): key for key, (_, arguments) in ordered}
            for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
                key = futures[future]
                figures[key] = future.result()
                _write_cache(directory, key, figures[key])
                if progress:
                    progress(done, len(futures))
    return _candidates_all_pruned([make_row(launch, label, arch, figures[key]) for launch, label, arch, key in planned])


def problems(rows: list[Row]) -> list[str]:
    """One line per failed row: kernel, configuration, arch and what is wrong."""
    return [f"{row.kernel} [{row.config}] on {row.arch} ({ARCHS[row.arch].gpu if row.arch in ARCHS else '?'}): {row.problem}" for row in rows if row.problem]


def format_table(rows: list[Row]) -> str:
    """A plain-text table, one line per row (problems at the end of their line)."""
    header = ["kernel", "config", "arch", "regs", "spill B", "smem B", "warps", "occ warps/SM", "programs", "mma"]
    lines = [[r.kernel, r.config, r.arch, *("-" if getattr(r, f) is None else str(getattr(r, f)) for f in FIELDS[3:])] for r in rows]
    widths = [max(len(x) for x in column) for column in zip(header, *lines)]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    for row, line in zip(rows, lines):
        text = "  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip()
        out.append(text + (f"  !! {row.problem}" if row.problem else f"  (pruned: {row.pruned})" if row.pruned else ""))
    return "\n".join(out)


def write_json(rows: list[Row], path: Path) -> None:
    path.write_text(json.dumps([row.as_dict() for row in rows], indent=1) + "\n")


def _progress(done: int, total: int, start: float) -> None:
    """Done, total and the seconds since ``start``, on stderr: a line per 1 % of the total on a terminal, per 10 % where
    stderr is not one (a CI log, a file, the pipe of ``kernels --compare``'s children)."""
    import time

    lines = 100 if sys.stderr.isatty() else 10
    if done == total or done % max(1, math.ceil(total / lines)) == 0:
        print(f"  {done}/{total} compilations, {time.perf_counter() - start:.0f} s", file=sys.stderr)


def summary(rows: list[Row]) -> str:
    """Rows, problems, pruned candidates and rows that spill, in one line."""
    spilling, pruned = sum(1 for row in rows if row.spill_bytes and not row.pruned), sum(1 for row in rows if row.pruned)
    return f"{len(rows)} rows: {len(problems(rows))} over a limit or not compiled, {pruned} autotuning candidates pruned, {spilling} spill"


def table(
    arch: str,
    rules: str | None = None,
    dtypes: str | None = None,
    head_dims: str | None = None,
    workers: int | None = None,
    chunks: str | None = None,
    kernels: str | None = None,
) -> list[Row]:
    """The rows of ``attnbench kernels`` for ``arch`` and the comma-separated filters ``rules``, ``dtypes``,
    ``head_dims``, ``chunks`` and ``kernels`` (as typed), with progress on stderr; a KernelTableError for a bad
    filter, or a kernel name that no selected configuration launches."""
    import time

    archs = parse_archs(arch)
    selected = jobs(_split(rules), _split(dtypes), _split(head_dims, int), _split(chunks, int))
    names = set(_split(kernels) or ()) or None
    if names and not names <= (launched := launched_kernels(archs, selected)):
        unknown, known = ", ".join(sorted(names - launched)), ", ".join(sorted(launched)) or "nothing"
        raise KernelTableError(f"unknown kernel {unknown}: the selected configurations launch {known}")
    print(f"attnbench kernels: {len(selected)} configurations x {len(archs)} arches ({', '.join(a.name for a in archs)})", file=sys.stderr)
    start = time.perf_counter()
    rows = build_table(archs, selected, workers, progress=lambda done, total: _progress(done, total, start), kernels=names)
    print(f"attnbench kernels: {summary(rows)}, in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return rows


def command(
    arch: str,
    json_path: Path | None = None,
    rules: str | None = None,
    dtypes: str | None = None,
    head_dims: str | None = None,
    workers: int | None = None,
    chunks: str | None = None,
    kernels: str | None = None,
) -> int:
    """``attnbench kernels``: print the table (and write ``json_path``); 1 when a row failed, 2 when
    the table cannot be made. ``rules``, ``dtypes``, ``head_dims``, ``chunks``, ``kernels``: comma-separated filters, as typed."""
    try:
        rows = table(arch, rules, dtypes, head_dims, workers, chunks, kernels)
    except KernelTableError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_table(rows))
    if json_path is not None:
        write_json(rows, json_path)
    failed = problems(rows)
    for line in failed:
        print(f"error: {line}", file=sys.stderr)
    return 1 if failed else 0

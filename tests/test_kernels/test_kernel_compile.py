"""``attnbench kernels``: every Triton kernel compiled for sm_70, sm_80 and sm_90 on a machine
without a GPU (Triton's compiler and the ptxas / cuobjdump it ships), read back as registers,
spills, shared memory, occupancy, programs and MMA kind.

Compiling is ``slow`` (a few seconds a kernel on two cores, cold cache). ``test_full_table`` compiles every
reachable configuration (each chunk size, d_dot, d_value, dtype, gate, normaliser and autotuning candidate) for
the three arches and checks the limits and spills; the other slow tests look closer at d = 64 and 256 at chunk 64
(their compilations come from the same cache). The launch plans (grids, precisions, tiles), the deduplication,
the cache and the pruning of candidates over a target's limits are checked without compiling, in the fast tests.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton", reason="attnbench kernels compiles with triton's compiler: pip install 'attnbench[triton]'")

from harness.kernels import kernel_table as kt  # noqa: E402
from variants import UnsupportedBackend, kernels  # noqa: E402
from variants.kernels import _common, delta_rule, sum_rule  # noqa: E402

ARCHS = list(kt.ARCHS.values())


@pytest.fixture(scope="module", autouse=True)
def _kernel_cache(tmp_path_factory):
    """One figures cache for this module's tables (and the commands it starts): ``ATTNBENCH_KERNEL_CACHE`` when
    set, else a fresh one for each run (so CI compiles everything, once), one for all of the run's pytest-xdist workers
    (``kernel_table`` writes each figure whole, then renames it into place)."""
    if os.environ.get("ATTNBENCH_KERNEL_CACHE"):
        yield
        return
    run = tmp_path_factory.getbasetemp()
    os.environ["ATTNBENCH_KERNEL_CACHE"] = str((run.parent if os.environ.get("PYTEST_XDIST_WORKER") else run) / "kernel-cache")
    yield
    del os.environ["ATTNBENCH_KERNEL_CACHE"]


SUM_RULE_KERNELS = {
    "forward_scan", "forward_output", "recompute_scan", "recompute_dy_dot_y", "backward_scan", "backward_dqk", "backward_dv",
}  # fmt: skip
#: The sum rule's scans: one program per (sequence, b·h, state tile), walking the chunks.
SUM_RULE_SCANS = {"forward_scan", "recompute_scan", "backward_scan"}
DELTA_RULE_KERNELS = {"ut_transform", "state_pass", "output", "backward_local", "backward_pass", "backward_chunk"}
FORWARD_KERNELS = {"forward_scan", "forward_output", "ut_transform", "state_pass", "output"}
#: The matrix instruction of bf16 inputs: 16-bit dots from sm_80 on (wgmma on sm_90 where a dot has 64 rows; the
#: delta rule's passes and chunk kernels mix it with mma); the kernels refuse 16-bit inputs on sm_70.
MMA_BF16 = {"sm_80": {"mma bf16"}, "sm_90": {"wgmma bf16", "mma bf16", "mma bf16+wgmma bf16"}}


def _table(dtype: str, d: int, archs=ARCHS, rules=None, heaviest=False, chunk=64) -> list[kt.Row]:
    """Rows of every kernel of ``rules`` at d_dot = d_value = d and ``chunk`` (None: the limit-critical ones) in ``dtype``;
    with ``heaviest`` only the normalised sum rule and the gated delta rule (their kernels run every code path of the
    plain and ungated ones and more)."""
    selected = kt.jobs(rules, [dtype], [d], None if chunk is None else [chunk])
    if chunk is None:
        selected = [(rule, i) for rule, i in selected if _limit_critical(rule, kernels.load(rule).compile_configs()[i])]
    if heaviest:
        selected = [(rule, i) for rule, i in selected if any(kernels.load(rule).compile_configs()[i].get(flag) for flag in ("normalize", "gated"))]
    return kt.build_table(archs, selected, workers=2)


def _kernel(row: kt.Row) -> str:
    """The kernel of a row without its autotuning candidate ("state_pass[BLOCK_V=32,w=8]" -> "state_pass")."""
    return row.kernel.split("[")[0]


def _check_rows(rows: list[kt.Row], dtype: str, archs=ARCHS) -> None:
    """No row fails, every kernel is there for every arch (none for 16-bit inputs on sm_70, which the kernels
    refuse), and the figures are plausible."""
    assert not kt.problems(rows), kt.problems(rows)
    for arch in archs:
        names = {_kernel(row) for row in rows if row.arch == arch.name}
        if dtype != "fp32" and arch.capability < 80:
            assert not names, arch.name
            continue
        expected = SUM_RULE_KERNELS | DELTA_RULE_KERNELS
        assert names == (expected if dtype != "fp32" else expected - {"recompute_dy_dot_y"}), arch.name
    for row in rows:
        assert 0 < row.registers <= 255 and row.spill_bytes >= 0 and row.shared_bytes >= 0, row
        assert 0 < row.occupancy_warps <= 64 and row.occupancy_warps % row.num_warps == 0, row


def _rule(row: kt.Row) -> str:
    return "sum_rule" if _kernel(row) in SUM_RULE_KERNELS else "delta_rule"


def _expected_mma(row: kt.Row, dtype: str) -> set[str]:
    if dtype == "fp32":
        return {"fma"}
    return {kind.replace("bf16", dtype.replace("fp16", "f16")) for kind in MMA_BF16[row.arch]}


@pytest.mark.slow
def test_bf16_every_kernel_every_arch_at_d64():
    """bf16 on sm_80 / sm_90: every dot takes bf16 operands (mma / wgmma bf16), and the forward kernels spill
    nothing; sm_70 (no bf16 tensor cores) has no rows: the kernels refuse 16-bit inputs there."""
    rows = _table("bf16", 64)
    _check_rows(rows, "bf16")
    bounds = _common.PACKED_BOUNDS  # a packed row: each sequence in chunks of its own, its passes from its own state
    packed_chunks = sum(-(-(stop - start) // 64) for start, stop in zip(bounds, bounds[1:]))
    for row in rows:
        assert row.mma in _expected_mma(row, "bf16"), row
        if _kernel(row) in FORWARD_KERNELS:
            assert row.spill_bytes == 0, row
        packed = row.config.endswith(" packed")
        chunks = 8 * (packed_chunks if packed else 16384 // 64)  # (chunk, b·h) pairs at the reference shape
        sequences = 8 * (len(bounds) - 1 if packed else 1)  # (sequence, b·h) pairs
        if _kernel(row) in ("state_pass", "backward_pass"):  # (sequence, b·h) × Dv blocks of the candidate
            block = int(row.kernel.split("BLOCK_V=")[1].split(",")[0])
            assert row.programs == sequences * 64 // block, row
        elif row.kernel in SUM_RULE_SCANS:  # (sequence, b·h) × one 64×64 state tile
            assert row.programs == sequences, row
        else:  # (chunk, b·h) and, where tiled, one 64×64 state tile
            assert row.programs == chunks, row


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_other_dtypes_every_kernel_every_arch_at_d64(dtype):
    rows = _table(dtype, 64, heaviest=True)
    _check_rows(rows, dtype)
    for row in rows:
        assert row.mma in _expected_mma(row, dtype), row


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_largest_d_fits_every_arch(dtype):
    """d = 256, the largest, at its limit-critical chunks (the sum rule's 64 and 128, the delta rule's largest there,
    32): every kernel within every arch's limits (the old delta-rule backward was over a V100's shared memory at
    every d); in bf16 the delta rule's forward spills nothing on sm_80 / sm_90."""
    rows = _table(dtype, 256, heaviest=True, chunk=None)
    _check_rows(rows, dtype)
    if dtype == "bf16":
        assert not [row for row in rows if row.arch != "sm_70" and _kernel(row) in FORWARD_KERNELS and _rule(row) == "delta_rule" and row.spill_bytes], rows


def test_16_bit_is_refused_below_sm80():
    """bf16 and fp16 on a V100: refused (UnsupportedBackend), not multiplied in fp32 under a 16-bit label; from
    sm_80 on 16-bit operands (the interpreter emulates them). TF32, asked for float32, falls back to IEEE on sm_70."""
    for dtype in (torch.bfloat16, torch.float16):
        with pytest.raises(UnsupportedBackend, match=f"take {dtype} inputs from sm_80 on .* sm_70: use float32"):
            _common.operand_precision(dtype, 70)
    assert _common.operand_precision(torch.bfloat16, 80) == _common.operand_precision(torch.float16, 90) == "input"
    assert _common.operand_precision(torch.bfloat16, None) == "input_emulated"
    assert _common.operand_precision(torch.float32, 90) == _common.FP32_DOT_PRECISION == "ieee"
    assert _common.operand_precision(torch.float32, 90, "tf32") == "tf32" and _common.operand_precision(torch.float32, 70, "tf32") == "ieee"
    config = dict(dtype=torch.bfloat16, d_dot=64, d_value=64, chunk_size=64)
    with pytest.raises(UnsupportedBackend):
        delta_rule.record_launches({**config, "gated": True}, 70)
    assert {launch.constexprs["PRECISION"] for launch in delta_rule.record_launches({**config, "gated": True}, 80)} == {"input"}
    launches = sum_rule.record_launches({**config, "normalize": True}, 80)
    assert {launch.constexprs.get("PRECISION") for launch in launches} == {"input"}


def test_recorded_launches_are_a_training_step():
    """Forward and every backward kernel, at the reference shape, with the tiles the wrapper chooses."""
    launches = sum_rule.record_launches(dict(dtype=torch.float16, d_dot=256, d_value=64, chunk_size=None, normalize=True), 80)
    assert [(launch.name, launch.grid) for launch in launches] == [
        ("forward_scan", (8, 4)), ("forward_output", (256, 8, 1)),
        ("recompute_scan", (8, 4)), ("recompute_dy_dot_y", (256, 8, 1)),
        ("backward_scan", (8, 4)), ("backward_dqk", (256, 8, 4)), ("backward_dv", (256, 8, 1)),
    ]  # fmt: skip  # 256 chunks of 64, d_dot 256 in tiles of 64 (the scans: 8 b·h × 4 state tiles)
    assert launches[0].constexprs["BLOCK_C"] == 64 and launches[0].args[0].dtype == torch.float16
    assert {launch.options["num_warps"] for launch in launches if launch.name != "backward_dqk"} == {4}
    launches = delta_rule.record_launches(dict(dtype=torch.float32, d_dot=64, d_value=64, chunk_size=32, gated=True), 90)
    assert [(launch.name, launch.grid, launch.options["num_warps"]) for launch in launches] == [
        ("ut_transform", (512, 8), 8), ("state_pass[BLOCK_V=16,w=4]", (4, 8), 4), ("state_pass[BLOCK_V=16,w=8]", (4, 8), 8), ("output", (512, 8, 2), 8),
        ("backward_local", (512, 8, 2), 8), ("backward_pass[BLOCK_V=16,w=4]", (4, 8), 4), ("backward_pass[BLOCK_V=16,w=8]", (4, 8), 8),
        ("backward_chunk", (512, 8), 8),
    ]  # fmt: skip  # 512 chunks of 32; fp32 tiles of 32 columns, 8 warps; the passes' autotuning candidates, 16 columns each in fp32
    assert {launch.constexprs["GATED"] for launch in launches} == {True}
    assert launches[1].kernel is delta_rule._state_pass_kernel.fn and launches[1].constexprs["BLOCK_V"] == 16
    names = [launch.name for launch in delta_rule.record_launches(dict(dtype=torch.bfloat16, d_dot=64, d_value=64, chunk_size=None), 80)]
    assert [name for name in names if name.startswith("state_pass")] == [f"state_pass[BLOCK_V={b},w={w}]" for b in (16, 32) for w in (4, 8)]


def test_sum_rule_chunk_states_in_16_bits_from_sm90():
    """The sum rule's chunk states S_c (the scans' sixth argument) are stored in bf16 for bf16 inputs from sm_90 on,
    in fp32 on sm_80 (``HALF_STATES_FROM``) and for fp32 inputs; z_c (the seventh) always in fp32."""
    config = dict(dtype=torch.bfloat16, d_dot=64, d_value=64, chunk_size=64, normalize=True)
    for capability, dtype, expected in ((80, torch.bfloat16, torch.float32), (90, torch.bfloat16, torch.bfloat16), (90, torch.float32, torch.float32)):
        scans = [launch for launch in sum_rule.record_launches({**config, "dtype": dtype}, capability) if launch.name.endswith("_scan")]
        assert [scan.name for scan in scans] == ["forward_scan", "recompute_scan", "backward_scan"]
        assert {scan.args[5].dtype for scan in scans} == {expected} and {scan.args[6].dtype for scan in scans} == {torch.float32}, capability


@pytest.mark.parametrize("capability", [70, 80, 90])
@pytest.mark.parametrize("module", [sum_rule, delta_rule], ids=["sum_rule", "delta_rule"])
def test_forward_fills_an_h100(module, capability):
    """Every shipped configuration: the heaviest forward kernel launches at least 132 programs (H100's SMs) at
    the reference shape, and every chunk kernel one program per (chunk, b·h) at least (all but the passes and the sum rule's scans)."""
    forward_names = FORWARD_KERNELS
    for config in module.compile_configs():
        if config["dtype"] != torch.float32 and capability < 80:
            continue  # refused there
        launches = module.record_launches(config, capability)
        assert max(launch.programs for launch in launches if launch.name in forward_names) >= 132, config
        chunk = config["chunk_size"]
        assert all(launch.programs >= 8 * -(-16384 // chunk) for launch in launches if "pass" not in launch.name and "scan" not in launch.name), config


def test_signature_specialised_as_triton_launches():
    """Ints are typed and hinted as Triton's launcher does (1 is a constant, multiples of 16 divisible)."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    launches = delta_rule.record_launches(dict(dtype=torch.bfloat16, d_dot=16, d_value=16, chunk_size=None), 80)
    launch = next(launch for launch in launches if launch.name == "output")
    signature, constexprs, attrs = kt._signature(launch)
    assert signature["q_ptr"] == "*bf16" and signature["states_ptr"] == "*fp32" and constexprs["BLOCK_F"] == 16
    for index, (name, arg) in enumerate(zip(launch.kernel.arg_names, launch.args)):
        if isinstance(arg, int):
            kind, hint = native_specialize_impl(BaseBackend, arg, False, True, True)
            assert (signature[name], constexprs.get(name, hint if hint != "D" else None)) == (kind, 1 if kind == "constexpr" else None), name
            assert ((index,) in attrs) == (hint == "D"), name


def test_occupancy():
    sm_70, sm_80 = kt.ARCHS["sm_70"], kt.ARCHS["sm_80"]
    assert kt.occupancy_warps(sm_80, 32, 0, 4) == 64  # 1024 registers a warp: the 64-warp limit binds
    assert kt.occupancy_warps(sm_80, 128, 0, 4) == 16  # 4096 a warp: 16 warps
    assert kt.occupancy_warps(sm_80, 255, 0, 8) == 8  # rounded up to 8192 a warp: one block of 8
    assert kt.occupancy_warps(sm_80, 32, 80 * 1024, 4) == 8  # 164 KiB / (80 + 1 KiB): two blocks
    assert kt.occupancy_warps(sm_70, 32, 100 * 1024, 4) == 0  # more than a V100 SM has


def test_mma_kind():
    assert kt.mma_kind("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%f1}") == "mma tf32"
    assert kt.mma_kind("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%r1}") == "wgmma bf16"
    assert kt.mma_kind("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32\nmma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32") == "mma f16+mma tf32"
    assert kt.mma_kind("fma.rn.f32 %f1, %f2, %f3, %f4;") == "fma"


@pytest.mark.slow
def test_limit_exceeded_names_kernel_config_and_arch():
    """A configuration over the arch's shared memory per block is a problem row naming all three."""
    small = dataclasses.replace(kt.ARCHS["sm_80"], max_shared_per_block=1024)
    rows = _table("bf16", 64, [small], ["delta_rule"])
    lines = kt.problems(rows)  # 12 rows for each of ungated, gated, ungated packed, gated packed
    assert len(lines) == 4 * 12 and all("F64 Dv64 C64" in line and "on sm_80 (A100): " in line and "> 1024 B per block" in line for line in lines)
    assert {line.split(" ")[0].split("[")[0] for line in lines} == DELTA_RULE_KERNELS  # the passes: 4 candidates each, all pruned
    assert all("every autotuning candidate is over the limits: shared memory" in line for line in lines if "[" in line.split(" ")[0])


def _attnbench(*args):
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    return subprocess.run([sys.executable, "-m", "harness.cli", "kernels", *args], capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.slow
def test_command_writes_the_json_fields(tmp_path):
    out = tmp_path / "kernels.json"
    done = _attnbench("--arch", "sm_90", "--rule", "delta_rule", "--dtype", "bf16", "--d", "64", "--chunk", "64", "--json", str(out), "--jobs", "1")
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())
    candidates = [f"[BLOCK_V={b},w={w}]" for b in (16, 32) for w in (4, 8)]
    kernels = [
        "ut_transform",
        *("state_pass" + c for c in candidates),
        "output",
        "backward_local",
        *("backward_pass" + c for c in candidates),
        "backward_chunk",
    ]
    assert [row["kernel"] for row in rows] == kernels * 4  # ungated, gated, and both over packed sequences
    assert [row["config"].endswith(" packed") for row in rows[:: len(kernels)]] == [False, False, True, True]
    assert list(rows[0]) == [*kt.FIELDS, "problem", "pruned"] and rows[0]["arch"] == "sm_90" and rows[0]["problem"] is None
    assert "backward_chunk" in done.stdout and {row["mma"] for row in rows} <= MMA_BF16["sm_90"]


@pytest.mark.parametrize(
    ("args", "message"), [(["--arch", "sm_75"], "unknown arch sm_75"), (["--dtype", "fp8"], "unknown fp8"), (["--d", "x"], "comma-separated")]
)
@pytest.mark.slow
def test_command_refuses_bad_arguments(args, message):
    done = _attnbench(*args)
    assert done.returncode == 2 and message in done.stderr


def _label_dims(label: str) -> tuple[str, int, int, int]:
    """The dtype, d_dot, d_value and chunk of a label: "bf16 F64 Dv64 C128 norm" -> ("bf16", 64, 64, 128)."""
    dtype, f, dv, c = label.split()[:4]
    return dtype, int(f[1:]), int(dv[2:]), int(c[1:])


def _limit_critical(rule: str, config: dict) -> bool:
    """The configurations whose tiles bound every other's: d_dot ≥ 64 (the widest chunk-kernel tiles; the passes'
    [C, d_dot] tiles grow with d_dot), at chunk 64 (the largest with 4 warps and [C, 64] tiles) and at the largest
    chunk the rule takes there (128 for the sum rule, narrower tiles with 8 warps). Smaller d_dot and chunks
    hold smaller tiles of the same kernels with the same warps."""
    largest = max(kernels.chunk_sizes(rule, config["d_dot"]))
    return config["d_dot"] >= 64 and config["chunk_size"] in (min(64, largest), largest)


#: A spill this small is one stack slot, not a tile: the packed, gated state pass at F 128 with 16 columns and 4
#: warps keeps one on sm_80 (168 registers; its unpacked twin holds 168 with none). The spills the check below is
#: for were tiles, 0.4-7 KB a thread (docs/performance.md).
STACK_SLOT_BYTES = 8


def _check_table(rows: list[kt.Row], selected: list[tuple[str, int]]) -> None:
    """No row over a limit or failing to compile, every selected configuration on every arch (16-bit ones on
    sm_80 and sm_90 only), the expected MMA in every row, and no 16-bit forward kernel at d_dot, d_value ≤ 128
    that spills more than a stack slot on sm_80 / sm_90 (pruned candidates never launch)."""
    assert not kt.problems(rows), kt.problems(rows)[:20]
    present = {(row.config, row.arch) for row in rows}
    for rule, index in selected:
        config = kernels.load(rule).compile_configs()[index]
        label = kernels.load(rule).config_label(config)
        assert {arch for label_, arch in present if label_ == label} == {a.name for a in ARCHS if config["dtype"] == torch.float32 or a.capability >= 80}, label
    spilling = []
    for row in rows:
        dtype, d_dot, d_value, _ = _label_dims(row.config)
        assert row.mma in _expected_mma(row, dtype), row
        if dtype != "fp32" and not row.pruned and _kernel(row) in FORWARD_KERNELS and max(d_dot, d_value) <= 128 and row.spill_bytes > STACK_SLOT_BYTES:
            spilling.append(row)
    assert not spilling, spilling


@pytest.mark.slow
def test_full_table():
    """Every reachable configuration (``compile_configs``: each chunk size the rule takes, head dims, wide keys,
    dtypes, gate, normaliser, autotuning candidates, five packed ones) for sm_70, sm_80 and sm_90: ``_check_table``.
    2,284 distinct compilations since issue 48 (2,302 before; about 1,900 CPU-seconds cold: docs/performance.md, "Every reachable configuration"),
    less what this module's other tables compiled before it."""
    selected = kt.jobs()
    _check_table(kt.build_table(ARCHS, selected), selected)


def _fake_figures(shared_bytes: int) -> dict:
    return dict(registers=96, spill_bytes=0, shared_bytes=shared_bytes, mma="mma bf16", cpu_s=0.0)


def test_identical_compilations_share_a_key():
    """Launches that compile alike share a ``compile_key`` (compiled once): the chunk kernels at d = 128 and 256
    (tiles of 64 either way; the sizes are runtime ints). Another target, chunk or padded d_dot (the passes) does not."""

    def keys(capability=80, **changes):
        config = {**dict(dtype=torch.bfloat16, d_dot=128, d_value=128, chunk_size=32, gated=True), **changes}
        return {launch.name: kt.compile_key(launch, capability) for launch in delta_rule.record_launches(config, capability)}

    base, wider = keys(), keys(d_dot=256, d_value=256)
    assert [base[name] == wider[name] for name in ("ut_transform", "output", "backward_chunk", "state_pass[BLOCK_V=16,w=4]")] == [True] * 3 + [False]
    assert keys(90)["output"] != base["output"] and keys(chunk_size=64)["output"] != base["output"]


def test_table_from_the_cache_prunes_candidates(tmp_path, monkeypatch):
    """With every compilation's figures in the cache nothing compiles (no worker starts). An autotuning candidate
    over the target's limits is pruned, not a problem; a kernel whose every candidate is over them is a problem;
    a plain kernel over them is a problem."""
    sm_80 = kt.ARCHS["sm_80"]
    selected = kt.jobs(["delta_rule"], ["bf16"], [64], [64])[:1]  # ungated
    launches = delta_rule.record_launches(delta_rule.compile_configs()[selected[0][1]], 80)
    over = sm_80.max_shared_per_block + 1
    shared = {"state_pass[BLOCK_V=32,w=4]": over, "output": over, **{f"backward_pass[BLOCK_V={b},w={w}]": over for b in (16, 32) for w in (4, 8)}}
    for launch in launches:
        kt._write_cache(tmp_path, kt.compile_key(launch, 80), _fake_figures(shared.get(launch.name, 1024)))
    monkeypatch.setattr(kt.concurrent.futures, "ProcessPoolExecutor", None)  # compiling would fail
    rows = {row.kernel: row for row in kt.build_table([sm_80], selected, cache=tmp_path)}
    assert list(rows) == [launch.name for launch in launches]
    assert rows["state_pass[BLOCK_V=32,w=4]"].pruned and not rows["state_pass[BLOCK_V=32,w=4]"].problem
    assert not rows["state_pass[BLOCK_V=16,w=4]"].pruned and rows["ut_transform"].shared_bytes == 1024
    assert rows["output"].problem == f"shared memory {over} B > {sm_80.max_shared_per_block} B per block"
    assert all(row.problem.startswith("every autotuning candidate is over the limits") for name, row in rows.items() if name.startswith("backward_pass"))
    assert {row.kernel.split("[")[0] for row in rows.values() if row.problem} == {"output", "backward_pass"}


def test_the_pass_pruner_compiles_each_candidate_with_the_kernels_own_arguments(monkeypatch):
    """Triton's autotuner calls a pass's pruner with its launch keywords beside the constexprs (grid, warmup,
    as ``Autotuner.prune_configs`` does); on a GPU the pruner compiles each candidate (``_common.fitting``) and
    must hand the kernel its own arguments only (the first GPU run failed: warmup() got grid twice)."""
    from unittest import mock

    from variants.kernels import delta_rule_forward

    tuner = delta_rule_forward._state_pass_kernel
    cuda_tensor = mock.Mock(spec=torch.Tensor, device=torch.device("cuda", 0))
    constexprs = {"HAS_S0": False, "GATED": False, "VARLEN": False, "BLOCK_C": 64, "PAD_F": 64, "PRECISION": "input_bf16"}
    positional = [name for name in tuner.arg_names if name not in constexprs and name != "BLOCK_V"]
    nargs = {name: cuda_tensor if name.endswith("_ptr") else 64 for name in positional}
    launch_keywords = {"grid": (1, 1), "warmup": False}
    compiled = []

    def warmup(*args, grid, **kwargs):
        compiled.append(sorted(kwargs))
        return mock.Mock(metadata=mock.Mock(shared=1024), n_regs=64)

    monkeypatch.setattr(tuner.fn, "warmup", warmup)
    monkeypatch.setattr(_common, "device_limits", lambda device: _common.Limits(shared=228 * 1024))
    kept = tuner.early_config_prune(tuner.configs, nargs, **constexprs, **launch_keywords)
    assert kept and len(compiled) == len(kept)
    assert all("grid" not in names and "warmup" not in names and set(constexprs) <= set(names) for names in compiled)

"""``attnbench kernels``: every Triton kernel compiled for sm_70, sm_80 and sm_90 on a machine
without a GPU (Triton's compiler and the ptxas / cuobjdump it ships), read back as registers,
spills, shared memory, occupancy, programs and MMA kind.

Compiling is ``slow``: every kernel in bf16 at d = 64 for the three arches (about a minute on two
cores, cold cache), fp32 and fp16 at d = 64 and the largest d in fp32; the launch plans (grids,
precisions, tiles) are recorded without compiling, in the fast tests.
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

from harness import kernel_table as kt  # noqa: E402
from variants.kernels import _common, delta_rule, sum_rule  # noqa: E402

ARCHS = list(kt.ARCHS.values())
#: (kernel, arch) over a limit today: the delta rule's backward_chunk keeps seven fp32 [C, C] / [C, F] tiles
#: (104-112 KiB of shared memory at d = 64, C = 64) where a V100 block has 96 KiB (issue 14's kernels must fix it).
KNOWN_OVER_LIMIT = {("backward_chunk", "sm_70")}
SUM_RULE_KERNELS = {
    "forward_states", "forward_prefix", "forward_output",
    "recompute_states", "recompute_prefix", "recompute_dy_dot_y", "backward_states", "backward_prefix", "backward_dqk", "backward_dv",
}  # fmt: skip
#: The sum rule's prefix passes add chunk states: no dot, no MMA.
SUM_RULE_PREFIX = {"forward_prefix", "recompute_prefix", "backward_prefix"}
DELTA_RULE_KERNELS = {"ut_transform", "forward_scan", "backward_scan", "backward_chunk"}
#: The matrix instruction of 16-bit inputs: the sum rule's 16-bit dots (IEEE fp32 FMAs on sm_70, which has no
#: bf16 tensor cores); the delta rule still upcasts to fp32 and takes TF32 dots.
MMA_16_BIT = {
    "sum_rule": {"sm_70": "fma", "sm_80": "mma bf16", "sm_90": "wgmma bf16"},
    "delta_rule": {"sm_70": "fma", "sm_80": "mma tf32", "sm_90": "wgmma tf32"},
}


def _table(dtype: str, d: int, archs=ARCHS, rules=None) -> list[kt.Row]:
    return kt.build_table(archs, kt.jobs(rules, [dtype], [d]), workers=2)


def _check_rows(rows: list[kt.Row], dtype: str) -> None:
    """Only the known rows fail, every kernel is there for every arch, and the figures are plausible."""
    failed = {(row.kernel, row.arch) for row in rows if row.problem}
    assert failed == KNOWN_OVER_LIMIT, kt.problems(rows)
    assert all("shared memory" in row.problem for row in rows if row.problem)
    for arch in ARCHS:
        kernels = {row.kernel for row in rows if row.arch == arch.name}
        expected = SUM_RULE_KERNELS | DELTA_RULE_KERNELS
        assert kernels == (expected if dtype != "fp32" else expected - {"recompute_dy_dot_y"}), arch.name
    for row in rows:
        assert 0 < row.registers <= 255 and row.spill_bytes >= 0 and row.shared_bytes >= 0, row
        assert row.occupancy_warps <= 64 and row.occupancy_warps % row.num_warps == 0 and (row.occupancy_warps > 0) == (row.problem is None), row


def _rule(row: kt.Row) -> str:
    return "sum_rule" if row.kernel in SUM_RULE_KERNELS else "delta_rule"


def _expected_mma(row: kt.Row, dtype: str) -> str:
    if dtype == "fp32" or row.kernel in SUM_RULE_PREFIX:
        return "fma"
    return MMA_16_BIT[_rule(row)][row.arch].replace("bf16", dtype.replace("fp16", "f16"))


@pytest.mark.slow
def test_bf16_every_kernel_every_arch_at_d64():
    """bf16 on sm_80 / sm_90: the sum rule's dots take bf16 operands (mma / wgmma bf16) and spill nothing;
    the delta rule upcasts to fp32 and uses TF32 MMA. On sm_70 (no bf16 or TF32 tensor cores) the documented
    fp32 path: IEEE fp32 FMAs, no MMA instruction at all."""
    rows = _table("bf16", 64)
    _check_rows(rows, "bf16")
    chunks = 16384 // 64 * 8  # (chunk, b·h) pairs at the reference shape
    for row in rows:
        assert row.mma == _expected_mma(row, "bf16"), row
        if _rule(row) == "delta_rule":  # one program per (chunk, b·h) for the chunk-local kernels, else one per b·h
            assert row.programs == (chunks if row.kernel in ("ut_transform", "backward_chunk") else 8), row
        elif row.kernel in SUM_RULE_PREFIX:  # b·h × blocks of 256 state entries (S: 64·64, and z: 64 when normalised)
            assert row.programs == 8 * (17 if row.config.endswith("norm") else 16), row
        else:  # (chunk, b·h, state tile): one 64×64 tile on sm_80 and sm_90, fp32 tiles of 32 on sm_70
            tiles = {"sm_70": 4 if row.kernel.endswith("_states") else 2}.get(row.arch, 1)
            assert row.programs == chunks * tiles, row
            if row.arch != "sm_70":
                assert row.spill_bytes == 0, row


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.slow
def test_other_dtypes_every_kernel_every_arch_at_d64(dtype):
    rows = _table(dtype, 64)
    _check_rows(rows, dtype)
    for row in rows:
        assert row.mma == _expected_mma(row, dtype), row


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS, ids=lambda arch: arch.name)
@pytest.mark.slow
def test_largest_d_in_fp32(arch):
    """d = 256 in fp32: the over-limit rows measured 2026-12-01 (docs/performance.md), no more, no fewer: the
    chunk-parallel sum rule keeps [C, 32] tiles whatever d and fits everywhere; the delta rule does not on sm_70."""
    rows = _table("fp32", 256, [arch])
    over = {"sm_70": {"backward_chunk"}, "sm_80": set(), "sm_90": set()}
    assert {row.kernel for row in rows if row.problem} == over[arch.name], kt.problems(rows)


def test_bf16_on_sm70_takes_the_fp32_path():
    """The decision for bf16 (and fp16) on a V100: IEEE fp32 dots on the upcast inputs; from sm_80 on the sum
    rule multiplies 16-bit operands (the interpreter emulates that), the delta rule TF32 on upcast ones."""
    assert _common.dot_precision(torch.bfloat16, 70) == _common.dot_precision(torch.float16, 70) == "ieee"
    assert _common.dot_precision(torch.bfloat16, 80) == _common.dot_precision(torch.bfloat16, 90) == "tf32"
    assert _common.dot_precision(torch.float32, 90) == _common.FP32_DOT_PRECISION
    assert _common.operand_precision(torch.bfloat16, 70) == _common.operand_precision(torch.float16, 70) == "ieee"
    assert _common.operand_precision(torch.bfloat16, 80) == _common.operand_precision(torch.float16, 90) == "input"
    assert _common.operand_precision(torch.bfloat16, None) == "input_emulated"
    assert _common.operand_precision(torch.float32, 90) == _common.FP32_DOT_PRECISION
    config = dict(dtype=torch.bfloat16, d_dot=64, d_value=64, chunk_size=None)
    for capability, delta_precision, sum_precision in ((70, "ieee", "ieee"), (80, "tf32", "input")):
        assert {launch.constexprs["PRECISION"] for launch in delta_rule.record_launches(config, capability)} == {delta_precision}
        launches = sum_rule.record_launches({**config, "normalize": True}, capability)
        assert {launch.constexprs.get("PRECISION") for launch in launches} == {sum_precision, None}  # None: the prefix passes


def test_recorded_launches_are_a_training_step():
    """Forward and every backward kernel, at the reference shape, with the tiles the wrapper chooses."""
    launches = sum_rule.record_launches(dict(dtype=torch.float16, d_dot=256, d_value=64, chunk_size=None, normalize=True), 80)
    assert [(launch.name, launch.grid) for launch in launches] == [
        ("forward_states", (256, 8, 4)), ("forward_prefix", (8, 65)), ("forward_output", (256, 8, 1)),
        ("recompute_states", (256, 8, 4)), ("recompute_prefix", (8, 65)), ("recompute_dy_dot_y", (256, 8, 1)),
        ("backward_states", (256, 8, 4)), ("backward_prefix", (8, 65)), ("backward_dqk", (256, 8, 4)), ("backward_dv", (256, 8, 1)),
    ]  # fmt: skip  # 256 chunks of 64, d_dot 256 in tiles of 64, a state row of 256·64 + 256 in blocks of 256
    assert launches[0].constexprs["BLOCK_C"] == 64 and launches[0].args[0].dtype == torch.float16
    assert {launch.options["num_warps"] for launch in launches if "prefix" not in launch.name and launch.name != "backward_dqk"} == {4}
    launches = delta_rule.record_launches(dict(dtype=torch.float32, d_dot=64, d_value=64, chunk_size=32), 90)
    assert [(launch.name, launch.grid) for launch in launches] == [
        ("ut_transform", (512, 8)), ("forward_scan", (1, 8)), ("backward_scan", (1, 8)), ("backward_chunk", (512, 8))
    ]  # fmt: skip


@pytest.mark.parametrize("capability", [70, 80, 90])
def test_sum_rule_forward_fills_an_h100(capability):
    """Every shipped configuration: the heaviest forward kernel launches at least 132 programs (H100's SMs) at
    the reference shape, and every chunk kernel one program per (chunk, b·h) at least."""
    for config in sum_rule.compile_configs():
        launches = sum_rule.record_launches(config, capability)
        forward = [launch.programs for launch in launches if launch.name.startswith("forward")]
        assert max(forward) >= 132, (config, forward)
        per_chunk = 8 * (16384 // (config["chunk_size"] or 64))
        assert all(launch.programs >= per_chunk for launch in launches if "prefix" not in launch.name), config


def test_signature_specialised_as_triton_launches():
    """Ints are typed and hinted as Triton's launcher does (1 is a constant, multiples of 16 divisible)."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    launch = delta_rule.record_launches(dict(dtype=torch.bfloat16, d_dot=16, d_value=16, chunk_size=None), 80)[1]
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
    lines = kt.problems(rows)
    assert len(lines) == 4 and all("[bf16 F64 Dv64 C64] on sm_80 (A100): shared memory" in line and "> 1024 B per block" in line for line in lines)
    assert {line.split(" ")[0] for line in lines} == DELTA_RULE_KERNELS


def _attnbench(*args):
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    return subprocess.run([sys.executable, "-m", "harness.cli", "kernels", *args], capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.slow
def test_command_writes_the_json_fields(tmp_path):
    out = tmp_path / "kernels.json"
    done = _attnbench("--arch", "sm_90", "--rule", "delta_rule", "--dtype", "bf16", "--d", "64", "--json", str(out), "--jobs", "1")
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())
    assert [row["kernel"] for row in rows] == ["ut_transform", "forward_scan", "backward_scan", "backward_chunk"]
    assert list(rows[0]) == [*kt.FIELDS, "problem"] and rows[0]["arch"] == "sm_90" and rows[0]["problem"] is None
    assert "backward_chunk" in done.stdout and {row["mma"] for row in rows} == {"wgmma tf32"}


@pytest.mark.parametrize(
    ("args", "message"), [(["--arch", "sm_75"], "unknown arch sm_75"), (["--dtype", "fp8"], "unknown fp8"), (["--d", "x"], "comma-separated")]
)
@pytest.mark.slow
def test_command_refuses_bad_arguments(args, message):
    done = _attnbench(*args)
    assert done.returncode == 2 and message in done.stderr

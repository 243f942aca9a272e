"""``attnbench kernels --compare`` as a CI log reads it (issue 57, items 5 and 6): rows grouped by arch and dtype, the
worse first, each row once, the summary after them, then how to time the worse kernels on a GPU; progress lines per
10 % where stderr is not a terminal. Made-up rows: nothing compiles."""

from __future__ import annotations

import dataclasses
import io
import re

from harness.kernels import kernel_diff as kd
from harness.kernels import kernel_table as kt

ROW = kt.Row("output", "bf16 F64 Dv64 C64 norm", "sm_80", 128, spill_bytes=0, shared_bytes=32768, num_warps=4, occupancy_warps=16, mma="mma bf16")


def _with(**changes) -> kt.Row:
    return dataclasses.replace(ROW, **changes)


def _changes() -> list[kd.Change]:
    """Over two arches and two dtypes, changed rows before worse ones in the input."""
    old, new = [], []
    for arch in ("sm_90", "sm_80"):
        for dtype in ("fp32", "bf16"):
            config = f"{dtype} F64 Dv64 C64 norm"
            old += [_with(kernel="a_changed", arch=arch, config=config), _with(kernel="z_worse", arch=arch, config=config)]
            new += [_with(kernel="a_changed", arch=arch, config=config, registers=120), _with(kernel="z_worse", arch=arch, config=config, spill_bytes=8)]
    return kd.diff(old, new)


def test_rows_are_grouped_by_arch_and_dtype_the_worse_first_each_group_headed_with_its_counts():
    lines = kd.format_changes(_changes(), "HEAD~1").splitlines()
    headings = [line for line in lines if line.startswith("-- ")]
    assert headings == [f"-- {arch} {dtype}: 2 rows changed, 1 worse" for arch in ("sm_80", "sm_90") for dtype in ("bf16", "fp32")]
    rows = [line for line in lines[1:] if not line.startswith("-- ")]
    assert [row.split()[0] for row in rows] == ["z_worse", "a_changed"] * 4, "worse before changed within each group"
    assert all(f" {arch} " in row for row, arch in zip(rows, ["sm_80"] * 4 + ["sm_90"] * 4))


def test_the_ending_prints_each_row_once_the_summary_after_the_rows_then_the_gpu_command():
    changes = _changes()
    text = kd.ending(changes, "HEAD~1", "HEAD~1 (abc)", [ROW] * 8, [ROW] * 8).splitlines()
    assert sum("z_worse" in line for line in text) == 4 and sum("a_changed" in line for line in text) == 4, "no row printed twice"
    assert re.fullmatch(r"attnbench kernels --compare HEAD~1: 8 rows of HEAD~1 \(abc\), 8 of the working tree; 8 changed, 4 worse; .*", text[-2])
    assert text[-1] == "to time the worse kernels on a GPU, run there: attnbench regress --base 'HEAD~1' regress-cpu --preset gpu"
    quiet = kd.ending([change for change in changes if not change.regressions], "main", "main (abc)", [ROW], [ROW]).splitlines()
    assert quiet[-1].startswith("attnbench kernels --compare main:") and "0 worse" in quiet[-1], "no GPU line without a worse row"


def test_progress_is_a_line_per_10_percent_where_stderr_is_not_a_terminal(monkeypatch):
    for terminal, most in ((False, 10), (True, 100)):
        stream = io.StringIO()
        stream.isatty = lambda terminal=terminal: terminal
        monkeypatch.setattr("sys.stderr", stream)
        for done in range(1, 135):
            kt._progress(done, 134, 0.0)
        lines = stream.getvalue().splitlines()
        assert len(lines) <= most + 1 and lines[-1].startswith("  134/134 compilations"), (terminal, len(lines))
        assert len(lines) > (most // 2), "and still a line per step"

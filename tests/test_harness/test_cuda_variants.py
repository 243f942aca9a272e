"""scenarios/cuda-variants.yaml (issue 44): every core variant on CUDA in every mode, dtype and backend, its
presets parts of that sweep, and its cpu preset the PyTorch forms as a GPU runs them."""

from __future__ import annotations

import variants
from harness.scenarios.scenario import load_scenario
from harness.scenarios.schema import MODES

SWEEP = load_scenario("cuda-variants").cells()


def test_every_core_variant_mode_dtype_and_backend_is_a_cell():
    assert {cell.variant for cell in SWEEP} == set(variants.names())
    assert {(cell.mode, cell.axes["dtype"], cell.backend, cell.device) for cell in SWEEP} == {
        (mode, dtype, backend, "cuda") for mode in MODES if mode != "quality" for dtype in ("float32", "bfloat16") for backend in variants.BACKENDS
    }
    # a backend a variant lacks is a skipped cell with its reason
    assert all(cell.skip for cell in SWEEP if cell.backend == "triton" and cell.variant in ("softmax", "rwkv", "lsh"))


def test_the_gpu_presets_split_the_sweep():
    ids = {cell.cell_id for cell in SWEEP}
    parts = {name: load_scenario("cuda-variants", preset=name).cells() for name in ("quick", "compile", "fla")}
    assert all({cell.cell_id for cell in cells} <= ids for cells in parts.values())
    assert {cell.backend for cell in parts["quick"]} == {"torch", "triton"} and len(parts["quick"]) == len(SWEEP) // 2


def test_the_cpu_preset_runs_the_scan_a_gpu_runs():
    """A fast-weight rule's scan 'auto' is the token loop on a CPU and the chunk-parallel scan on a GPU: the cpu
    preset names the GPU's, for every variant that has the choice."""
    for preset in ("cpu", "ci"):
        cells = load_scenario("cuda-variants", preset=preset).cells()
        assert {cell.variant for cell in cells} == set(variants.names()) and {cell.device for cell in cells} == {"cpu"}
        for cell in cells:
            core = variants.create(cell.variant, cell.axes["d_key"], **cell.params)
            assert getattr(core, "scan", "parallel") == "parallel", (preset, cell.variant)

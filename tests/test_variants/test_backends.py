"""The Triton backend through the variant interface: ``create(..., backend='triton')``
computes the same function as the float64 torch reference, forward and backward, and its
prefill state continues into the recurrent step. Runs through Triton's interpreter on a CPU
(tests/conftest.py sets TRITON_INTERPRET=1 there) and natively on a GPU.

Softmax's SDPA kernel: the backend option ``sdpa`` pins it (the pinned kernel is the one that
runs), cells record it (``metrics.sdpa_backend``), bad values and other variants are refused."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close, config_id, make_inputs, slow_interpreted, to
from torch.utils._python_dispatch import TorchDispatchMode

import variants
from harness.running import workloads
from harness.scenarios.scenario import ScenarioError, load_scenario

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CONFIGS = [
    ("linear", {}),
    ("linear", {"phi": "identity", "normalize": False}),
    slow_interpreted(("performer", {"m": 8})),
    slow_interpreted(("dpfp", {"nu": 2})),
    ("delta", {}),
    slow_interpreted(("delta", {"phi": "dpfp", "nu": 1})),
]


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_triton_backend_matches_the_reference(config, seed):
    name, params = config
    reference = variants.create(name, 8, **params).double()
    kernel = variants.create(name, 8, backend="triton", **params).to(DEVICE)
    inputs = make_inputs(reference, 2, 3, 37, 6, dtype=torch.float64, seed=seed, requires_grad=True)
    cotangent = torch.randn(2, 3, 37, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    expected = reference.reference(**inputs)
    want = torch.autograd.grad((expected * cotangent).sum(), list(inputs.values()))
    low = {name: x.to(DEVICE) for name, x in to(inputs, torch.float32).items()}
    low = {name: x.requires_grad_() for name, x in low.items()}
    out = kernel(**low)
    got = torch.autograd.grad((out * cotangent.float().to(DEVICE)).sum(), list(low.values()))
    for label, actual, target in zip(["out", *(f"d{name}" for name in inputs)], [out, *got], [expected, *want], strict=True):
        scale = max(1.0, target.abs().max().item())
        torch.testing.assert_close(actual.double().cpu(), target, rtol=2e-4, atol=1e-4 * scale, msg=lambda m: f"{label} (seed {seed}): {m}")


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[4]], ids=config_id)
def test_triton_prefill_state_continues_into_steps(config, seed):
    name, params = config
    core = variants.create(name, 8, backend="triton", **params).to(DEVICE)
    inputs = {name: x.to(DEVICE) for name, x in make_inputs(core, 1, 2, 30, 8, dtype=torch.float32, seed=seed).items()}
    whole = core(**inputs)
    cut = 19
    head, state = core.prefill(**variants.time_slice(inputs, 0, cut))
    tail, _ = core.step_loop(variants.time_slice(inputs, cut), state)
    torch.testing.assert_close(torch.cat([head, tail], 2), whole, rtol=1e-4, atol=1e-5)


def test_triton_backend_refusals():
    with pytest.raises(variants.UnsupportedBackend, match="only the 'torch' backend"):
        variants.create("softmax", 8, backend="triton")
    with pytest.raises(variants.UnsupportedBackend, match="attention normalisation"):
        variants.create("delta", 8, backend="triton", normalize=True)
    with pytest.raises(variants.VariantError, match="backend must be one of"):
        variants.create("linear", 8, backend="cuda")
    with pytest.raises(variants.UnsupportedBackend, match="d_dot=384 exceeds the Triton kernels' limit of 256"):
        variants.create("dpfp", 64, nu=3, backend="triton")


# --- softmax's SDPA kernel: pinned by the backend option sdpa, recorded per cell ---------------------


class _OpLog(TorchDispatchMode):
    """The ATen ops that run within the block, by name (``_scaled_dot_product_flash_attention_for_cpu.default``, ...)."""

    def __enter__(self):
        self.names = []
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


#: The ATen op of each SDPA kernel on the CPU ('math' runs as plain matmuls and a softmax: none of these).
CPU_SDPA_OPS = {"flash": "_scaled_dot_product_flash_attention_for_cpu"}


def _sdpa_ops(core, inputs) -> set:
    """The fused SDPA ops a parallel call of ``core`` runs."""
    with _OpLog() as log:
        core(**inputs)
    return {name for name in log.names if "scaled_dot_product" in name}


@pytest.mark.parametrize(("sdpa", "d_value", "runs"), [("auto", 8, "flash"), ("auto", 6, "math"), ("math", 8, "math"), ("flash", 8, "flash")])
def test_the_pinned_sdpa_kernel_is_the_one_that_runs_and_the_one_recorded(sdpa, d_value, runs, seed):
    """On the CPU: 'math' runs no fused kernel, 'flash' the CPU flash kernel; 'auto' what PyTorch
    picks for the inputs (flash, which needs d_value = d_key, else math). ``implementation_choices``
    names what ran; the outputs agree with the float64 reference; the pin ends with the call."""
    core = variants.create("softmax", 8, backend_options={"sdpa": sdpa})
    inputs = make_inputs(core, 2, 3, 37, d_value, dtype=torch.float64, seed=seed)
    low = to(inputs, torch.float32)
    assert core.implementation_choices(**low) == {"sdpa_backend": runs}
    assert _sdpa_ops(core, low) == ({f"{CPU_SDPA_OPS[runs]}.default"} if runs in CPU_SDPA_OPS else set())
    assert_close(core(**low), core.reference(**inputs), torch.float32, f"softmax sdpa={sdpa}", seed)
    switches = torch.backends.cuda
    assert switches.flash_sdp_enabled() and switches.math_sdp_enabled() and switches.mem_efficient_sdp_enabled()


def test_an_sdpa_kernel_that_cannot_run_the_inputs_is_refused_in_one_line():
    core = variants.create("softmax", 8, backend_options={"sdpa": "efficient"})
    inputs = core.example_inputs(1, 2, 16, 8)
    with pytest.raises(variants.UnsupportedBackend) as info:
        core.implementation_choices(**inputs)
    assert str(info.value) == (
        "softmax: the SDPA kernel sdpa=efficient cannot run cpu float32 inputs [B, H, T, D] = 1x2x16x8 "
        "(PyTorch has no such kernel for them); pin another (auto, flash, efficient, cudnn, math)"
    )


@pytest.mark.parametrize(
    ("name", "backend", "options", "message"),
    [
        ("softmax", "torch", {"sdpa": "fastest"}, "backend 'torch': option sdpa must be one of auto | flash | efficient | cudnn | math, got 'fastest'"),
        ("softmax", "compile", {"sdpa": None}, "backend 'compile': option sdpa must be one of auto | flash | efficient | cudnn | math, got None"),
        ("linear", "torch", {"sdpa": "math"}, "linear: backend option sdpa is softmax's only, got sdpa='math'"),
        ("delta", "compile", {"sdpa": "flash"}, "delta: backend option sdpa is softmax's only, got sdpa='flash'"),
        ("softmax", "fla", {"sdpa": "math"}, "backend 'fla' takes no options, got sdpa"),
    ],
)
def test_the_sdpa_option_is_checked(name, backend, options, message):
    with pytest.raises(variants.VariantError) as info:
        variants.create(name, 8, backend=backend, backend_options=options)
    assert str(info.value) == message


def _scenario_cells(tmp_path, extra: str) -> dict:
    path = tmp_path / "s.yaml"
    path.write_text("variants: {softmax: {}, linear: {}}\naxes: {seq_len: 16, batch: 1, heads: 2, d_key: 8}\n" + extra)
    return {(cell.variant, cell.backend): cell for cell in load_scenario(str(path)).cells()}


def test_a_scenario_pins_the_sdpa_kernel_of_its_softmax_cells_only(tmp_path):
    """The option reaches softmax's torch and compile cells (and their ids), not the other variants'."""
    plain = _scenario_cells(tmp_path, "backends: [torch, compile]\n")
    pinned = _scenario_cells(tmp_path, "backends: [torch, compile]\nbackend_options: {sdpa: math, mode: default}\n")
    assert pinned["softmax", "torch"].backend_options == {"sdpa": "math"}
    assert pinned["softmax", "compile"].backend_options == {"sdpa": "math", "mode": "default"}
    assert pinned["linear", "torch"].backend_options == {} and pinned["linear", "compile"].backend_options == {"mode": "default"}
    assert pinned["linear", "torch"].cell_id == plain["linear", "torch"].cell_id
    assert pinned["softmax", "torch"].cell_id != plain["softmax", "torch"].cell_id
    with pytest.raises(ScenarioError, match=r"backend_options.sdpa: backend 'torch': option sdpa must be one of auto \| flash"):
        _scenario_cells(tmp_path, "backend_options: {sdpa: flash2}\n")


def _softmax_cell(tmp_path, extra: str, mode: str = "forward") -> dict:
    cells = _scenario_cells(tmp_path, f"modes: [{mode}]\nmeasure: {{warmup: 0, repeats: 1}}\n{extra}")
    return cells["softmax", "torch"]


@pytest.mark.parametrize(("sdpa", "mode", "recorded"), [(None, "forward", "flash"), ("math", "train", "math"), ("math", "decode", "math")])
def test_a_softmax_cell_records_its_sdpa_kernel(tmp_path, sdpa, mode, recorded):
    option = f"backend_options: {{sdpa: {sdpa}}}\n" if sdpa else ""
    result = workloads.measure_cell(_softmax_cell(tmp_path, option + "decode: {new_tokens: 2}\n", mode))
    assert result["status"] == "ok", result["error"]
    assert result["metrics"]["sdpa_backend"] == recorded


def test_a_softmax_cell_pinned_to_a_kernel_it_cannot_run_is_skipped_with_the_reason(tmp_path):
    result = workloads.measure_cell(_softmax_cell(tmp_path, "backend_options: {sdpa: cudnn}\n"))
    assert result["status"] == "skipped" and result["error"].startswith("softmax: the SDPA kernel sdpa=cudnn cannot run cpu float32 inputs")


@pytest.mark.slow
def test_a_compiled_softmax_pins_its_sdpa_kernel_in_one_graph(seed):
    """Under torch.compile the pin is ``sdpa_kernel``, which TorchDynamo traces: one frame, no graph
    break, the reference's values (about 30 s on the 2-core VM, most of it Inductor's compilation)."""
    from torch._dynamo.utils import counters

    core = variants.create("softmax", 8, backend="compile", backend_options={"sdpa": "math"})
    inputs = make_inputs(core, 1, 2, 16, 8, dtype=torch.float64, seed=seed)
    breaks = sum(counters["graph_break"].values())
    assert_close(core(**to(inputs, torch.float32)), core.reference(**inputs), torch.float32, "compiled softmax sdpa=math", seed)
    assert sum(counters["graph_break"].values()) == breaks, dict(counters["graph_break"])
